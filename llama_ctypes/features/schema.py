"""Python types → JSON Schema, and generated JSON → validated Python objects.

Supported: Pydantic v2 models (optional dependency), dataclasses and
TypedDicts, nested in each other, with ``list``/``tuple``/``dict``,
``Optional``/``Union``, ``Literal``, ``Enum``, ``datetime``/``date``/``time``,
``UUID``, ``Decimal``, ``Annotated`` and the scalar types. Every object schema
lists its required fields and has ``additionalProperties: false``, which keeps
the grammar tight.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import types
import typing
import uuid
from typing import Any, Mapping

import jsonschema

from ..errors import LlamaError, SchemaError


class ResponseValidationError(LlamaError, ValueError):
    """Generated text did not parse or validate as the requested response model; ``text`` holds it."""

    def __init__(self, message: str, text: str):
        super().__init__(f"{message}\n--- generated text ---\n{text[:2000]}")
        self.text = text


def _is_pydantic(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_json_schema") and hasattr(tp, "model_validate_json")


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__total__")


def to_json_schema(obj: Any) -> dict[str, Any]:
    """JSON Schema for a Pydantic model, dataclass, TypedDict or type annotation."""
    if _is_pydantic(obj):
        return _tighten(obj.model_json_schema())
    defs: dict[str, Any] = {}
    schema = _Builder(defs).schema(obj)
    if "$ref" in schema:  # inline the top-level model, keep the rest as $defs
        name = schema["$ref"].split("/")[-1]
        schema = defs.pop(name) if not _refers_to(defs, name) else schema
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def _refers_to(defs: Mapping[str, Any], name: str) -> bool:
    return f'"#/$defs/{name}"' in json.dumps(defs)


def _tighten(schema: Any) -> Any:
    """additionalProperties: false on every object schema that lists its properties."""
    if isinstance(schema, dict):
        out = {k: _tighten(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_tighten(v) for v in schema]
    return schema


_SCALARS = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    decimal.Decimal: {"type": "number"},
    dt.datetime: {"type": "string", "format": "date-time"},
    dt.date: {"type": "string", "format": "date"},
    dt.time: {"type": "string", "format": "time"},
    uuid.UUID: {"type": "string", "format": "uuid"},
}


class _Builder:
    def __init__(self, defs: dict[str, Any]):
        self.defs = defs

    def schema(self, tp: Any) -> dict[str, Any]:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is typing.Annotated:
            return self.schema(args[0])
        if tp in _SCALARS:
            return dict(_SCALARS[tp])
        if tp is Any or tp is object:
            return {}
        if origin is typing.Literal:
            return {"enum": list(args)}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return {"enum": [m.value for m in tp]}
        if origin in (typing.Union, types.UnionType):
            options = [self.schema(a) for a in args]
            return options[0] if len(options) == 1 else {"anyOf": options}
        if origin in (list, set, frozenset, typing.Sequence, typing.MutableSequence) or tp in (list, set):
            item = self.schema(args[0]) if args else {}
            return {"type": "array", "items": item}
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return {"type": "array", "items": self.schema(args[0])}
            items = [self.schema(a) for a in args]
            return {"type": "array", "prefixItems": items, "items": False, "minItems": len(items),
                    "maxItems": len(items)}
        if origin in (dict, typing.Mapping, typing.MutableMapping) or tp is dict:
            if args and args[0] is not str:
                raise SchemaError(f"{tp}: JSON object keys are strings; use dict[str, ...]")
            value = self.schema(args[1]) if args else {}
            return {"type": "object", "additionalProperties": value}
        if _is_pydantic(tp) or dataclasses.is_dataclass(tp) or _is_typeddict(tp):
            return self._ref(tp)
        raise SchemaError(f"cannot express {tp!r} as a JSON schema")

    def _ref(self, tp: type) -> dict[str, Any]:
        name = tp.__name__
        if name not in self.defs:
            self.defs[name] = {}  # placeholder: recursive models refer to themselves
            self.defs[name] = self._object(tp)
        return {"$ref": f"#/$defs/{name}"}

    def _object(self, tp: type) -> dict[str, Any]:
        if _is_pydantic(tp):
            schema = _tighten(tp.model_json_schema(ref_template="#/$defs/{model}"))
            self.defs.update(schema.pop("$defs", {}))
            return schema
        hints = typing.get_type_hints(tp, include_extras=True)
        props: dict[str, Any] = {}
        required: list[str] = []
        if dataclasses.is_dataclass(tp):
            for f in dataclasses.fields(tp):
                props[f.name] = self.schema(hints[f.name])
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    required.append(f.name)
        else:  # TypedDict
            required_keys = getattr(tp, "__required_keys__", set(hints))
            for key, hint in hints.items():
                if typing.get_origin(hint) in (typing.Required, typing.NotRequired):
                    hint = typing.get_args(hint)[0]
                props[key] = self.schema(hint)
                if key in required_keys:
                    required.append(key)
        schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            schema["required"] = required
        schema["title"] = tp.__name__
        return schema


# ---- parsing generated JSON into Python objects ---------------------------------------------------

def parse_response(text: str, response_model: Any) -> Any:
    """Parse and validate generated JSON as ``response_model``; raise ResponseValidationError with the text."""
    if _is_pydantic(response_model):
        try:
            return response_model.model_validate_json(text)
        except Exception as exc:  # pydantic.ValidationError, without importing pydantic
            raise ResponseValidationError(f"output does not validate as {response_model.__name__}: {exc}", text) from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ResponseValidationError(f"output is not valid JSON: {exc}", text) from exc
    try:
        jsonschema.validate(data, to_json_schema(response_model))
    except jsonschema.ValidationError as exc:
        raise ResponseValidationError(f"output does not match the schema: {exc.message}", text) from exc
    try:
        return _build(response_model, data)
    except (TypeError, ValueError) as exc:
        raise ResponseValidationError(f"output does not convert to {response_model!r}: {exc}", text) from exc


def _build(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _build(args[0], value)
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _build(hints[f.name], value[f.name]) for f in dataclasses.fields(tp) if f.name in value})
    if _is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        return {k: _build(hints.get(k, Any), v) for k, v in value.items()}
    if _is_pydantic(tp):
        return tp.model_validate(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if tp is dt.datetime:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if tp is dt.date:
        return dt.date.fromisoformat(value)
    if tp is dt.time:
        return dt.time.fromisoformat(value.replace("Z", "+00:00"))
    if tp is uuid.UUID:
        return uuid.UUID(value)
    if tp is decimal.Decimal:
        return decimal.Decimal(str(value))
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                jsonschema.validate(value, to_json_schema(option))
                return _build(option, value)
            except (jsonschema.ValidationError, SchemaError, TypeError, ValueError):
                continue
        return value
    if origin in (list, set, frozenset, typing.Sequence) and args:
        items = [_build(args[0], v) for v in value]
        return origin(items) if origin in (set, frozenset) else items
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin in (dict, typing.Mapping) and len(args) == 2:
        return {k: _build(args[1], v) for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    return value
