"""JSON Schema → GBNF, with llama.cpp's own converter (through the C adapter).

The schema is first checked against its JSON Schema meta-schema (jsonschema),
then for constraint keywords llama.cpp's converter does not enforce: such a
keyword raises :class:`SchemaError` naming it, rather than producing output
that silently ignores the constraint.
"""

from __future__ import annotations

import ctypes
import json
from functools import lru_cache
from typing import Any, Iterator, Mapping

import jsonschema

from ..errors import SchemaError
from .backend import init

#: Constraint keywords the converter ignores; a schema using one is refused.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
    "minContains", "maxContains", "uniqueItems", "multipleOf", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    "$recursiveRef",
})
#: String formats the converter enforces.
SUPPORTED_FORMATS = frozenset({"date", "time", "date-time", "uuid"})

# Keywords whose value is a schema, a list of schemas, or a map of schemas.
_SCHEMA_VALUED = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _walk(schema: Any, path: str = "#") -> Iterator[tuple[str, Mapping[str, Any]]]:
    if not isinstance(schema, Mapping):
        return
    yield path, schema
    for key in _SCHEMA_VALUED:
        if isinstance(schema.get(key), Mapping):
            yield from _walk(schema[key], f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _walk(sub, f"{path}/{key}/{i}")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), Mapping):
            for name, sub in schema[key].items():
                yield from _walk(sub, f"{path}/{key}/{name}")


def check_schema(schema: Mapping[str, Any] | bool) -> None:
    """Raise SchemaError if ``schema`` is not a valid JSON Schema or uses an unenforceable keyword."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise SchemaError(f"a JSON schema must be a dict (or a bool), not {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SchemaError(f"invalid JSON schema at {where}: {exc.message}") from exc
    for path, node in _walk(schema):
        bad = sorted(UNSUPPORTED_KEYWORDS & set(node))
        if bad:
            raise SchemaError(
                f"JSON schema keyword {bad[0]!r} at {path} cannot be enforced by grammar-constrained "
                f"generation; remove it (supported: type, properties, required, additionalProperties, items, "
                f"prefixItems, min/maxItems, enum, const, anyOf/oneOf/allOf, $ref, pattern, min/maxLength, "
                f"minimum/maximum, format {sorted(SUPPORTED_FORMATS)})")
        fmt = node.get("format")
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise SchemaError(f"JSON schema keyword 'format' at {path}: format {fmt!r} cannot be enforced "
                              f"(supported: {', '.join(sorted(SUPPORTED_FORMATS))}); use 'pattern' instead")


def json_schema_to_gbnf(schema: Mapping[str, Any] | str | bool) -> str:
    """GBNF grammar text generating exactly the JSON documents ``schema`` accepts."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise SchemaError(f"the JSON schema is not valid JSON: {exc}") from exc
    check_schema(schema)
    return _convert(json.dumps(_for_converter(schema)))  # property order matters: the grammar keeps it


def _for_converter(schema: Any) -> Any:
    """Rewrite the one common form the converter rejects: ``items: false`` after ``prefixItems`` (a closed tuple)."""
    if isinstance(schema, list):
        return [_for_converter(v) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _for_converter(v) for k, v in schema.items()}
    if out.get("items") is False:
        del out["items"]
        out.setdefault("maxItems", len(out.get("prefixItems", ())))
    return out


@lru_cache(maxsize=256)
def _convert(schema_json: str) -> str:
    lib = init()
    error = ctypes.c_void_p()
    out = lib.lcx_json_schema_to_grammar(schema_json.encode(), False, ctypes.byref(error))
    if not out:
        message = ctypes.string_at(error.value).decode("utf-8", "replace") if error.value else "unknown error"
        if error.value:
            lib.lcx_string_free(error.value)
        raise SchemaError(f"llama.cpp could not convert the JSON schema: {message}")
    try:
        return ctypes.string_at(out).decode("utf-8")
    finally:
        lib.lcx_string_free(out)
