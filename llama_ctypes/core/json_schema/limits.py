"""Size bounds of a JSON schema, checked before it is compiled into a grammar.

Compiling a schema costs more than its size suggests: the meta-schema check takes
about half a millisecond per property, llama.cpp's converter writes a rule per
optional property that lists the properties after it (quadratic in their number:
2,000 optional properties take 22 s), and filtering an ``enum`` by the rest of its
schema is quadratic in its values (10,000 values take 8 s). Nested too deep, the
meta-schema check itself overflows Python's stack. A request must not be able to
buy seconds of a server's CPU with a few kilobytes of JSON, so a schema is measured
first (one pass, no recursion: about a microsecond per JSON value) and refused with
:class:`SchemaTooLargeError` naming the bound it exceeds.

The defaults keep a schema's compilation well under a second on one core; pass
other :class:`SchemaLimits` where larger schemas are expected (``lc.grammar.from_json_schema(schema,
limits=...)``; over HTTP ``create_app(limits=RequestLimits(schema=...))``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping

from ...errors import InvalidArgumentError, SchemaTooLargeError
from ..params import check_positive

__all__ = ["SchemaLimits", "SchemaSize", "DEFAULT_SCHEMA_LIMITS", "check_schema_size",
           "measure_schema"]


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds on a JSON schema's size (all counts over the whole schema, ``$defs`` included)."""

    max_depth: int = 64
    """Nesting of JSON objects and arrays in the schema document (a nested property is two levels:
    its schema and the ``properties`` object holding it)."""
    max_nodes: int = 10_000
    """JSON objects and arrays in the schema document (its subschemas and their keyword values)."""
    max_properties: int = 1_000
    """Entries of every ``properties`` object together."""
    max_optional_properties: int = 250
    """Properties of one object that are not ``required`` (the converter's cost grows with their square)."""
    max_enum_values: int = 1_000
    """Values of every ``enum`` (and ``const``) together."""
    max_text_chars: int = 100_000
    """Characters of the property names, ``enum``/``const`` strings and ``pattern``\\ s together."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self)))


DEFAULT_SCHEMA_LIMITS = SchemaLimits()


@dataclass
class SchemaSize:
    """What :func:`measure_schema` counted (each stops counting just past its limit)."""

    depth: int = 0
    nodes: int = 0
    properties: int = 0
    optional_properties: int = 0  # in the object with the most
    enum_values: int = 0
    text_chars: int = 0


_WHAT = {
    "depth": ("max_depth", "levels of nesting"),
    "nodes": ("max_nodes", "JSON objects and arrays"),
    "properties": ("max_properties", "properties"),
    "optional_properties": ("max_optional_properties", "optional properties in one object"),
    "enum_values": ("max_enum_values", "enum/const values"),
    "text_chars": ("max_text_chars", "characters of property names, enum/const strings and patterns"),
}


def measure_schema(schemas: Iterable[Any], limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS) -> SchemaSize:
    """Count what :class:`SchemaLimits` bounds over ``schemas`` together, without recursion; stops as soon as
    one count exceeds its limit (the other counts are then partial)."""
    size = SchemaSize()
    stack: list[tuple[Any, int]] = [(s, 1) for s in schemas]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Iterable[Any] = node.values()
            props = node.get("properties")
            if isinstance(props, Mapping):
                size.properties += len(props)
                size.text_chars += sum(len(name) for name in props if isinstance(name, str))
                required = node.get("required")
                named = set(required) & set(props) if isinstance(required, list) and all(
                    isinstance(r, str) for r in required) else set()
                size.optional_properties = max(size.optional_properties, len(props) - len(named))
            enum = node.get("enum")
            if isinstance(enum, (list, tuple)):
                size.enum_values += len(enum)
                size.text_chars += sum(len(v) for v in enum if isinstance(v, str))
            if "const" in node:
                size.enum_values += 1
                if isinstance(node["const"], str):
                    size.text_chars += len(node["const"])
            if isinstance(node.get("pattern"), str):
                size.text_chars += len(node["pattern"])
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        size.nodes += 1
        size.depth = max(size.depth, depth)
        if _exceeded(size, limits):
            return size
        stack.extend((child, depth + 1) for child in children if isinstance(child, (Mapping, list, tuple)))
    return size


def _exceeded(size: SchemaSize, limits: SchemaLimits) -> str | None:
    for name, (limit_name, _) in _WHAT.items():
        if getattr(size, name) > getattr(limits, limit_name):
            return name
    return None


def check_schema_size(schemas: Iterable[Any], limits: SchemaLimits | None = None, *, what: str = "the JSON schema",
                      hint: str = "") -> None:
    """Raise :class:`SchemaTooLargeError` when ``schemas`` together exceed ``limits`` (default:
    :data:`DEFAULT_SCHEMA_LIMITS`). ``what`` names them in the message; ``hint`` says how to raise the bound."""
    limits = DEFAULT_SCHEMA_LIMITS if limits is None else limits
    if not isinstance(limits, SchemaLimits):
        raise InvalidArgumentError(f"limits={limits!r}: expected a SchemaLimits")
    size = measure_schema(schemas, limits)
    over = _exceeded(size, limits)
    if over is None:
        return
    limit_name, text = _WHAT[over]
    bound = getattr(limits, limit_name)
    raise SchemaTooLargeError(
        f"{what} is too large to compile: more than {bound} {text} (SchemaLimits.{limit_name}={bound})"
        + (f"; {hint}" if hint else ""))
