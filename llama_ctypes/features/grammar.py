"""Grammars for constrained generation: ``lc.grammar.from_json_schema(schema)``.

Pass the result as ``grammar=`` (or the schema itself as ``json_schema=``) to
any generate, stream or chat function.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..core.json_schema.convert import (
    DEFAULT_SCHEMA_LIMITS,
    SUPPORTED_FORMATS,
    UNSUPPORTED_KEYWORDS,
    SchemaLimits,
    SchemaTooLargeError,
    check_schema,
    json_schema_to_gbnf,
)
from .schema import to_json_schema

__all__ = ["from_json_schema", "from_type", "check_schema", "SchemaLimits", "SchemaTooLargeError",
           "DEFAULT_SCHEMA_LIMITS", "SUPPORTED_FORMATS", "UNSUPPORTED_KEYWORDS"]


def from_json_schema(schema: Mapping[str, Any] | str, limits: SchemaLimits | None = None) -> str:
    """GBNF text for a JSON Schema (a dict or JSON text): it generates only JSON the schema accepts.

    The schema is normalized and converted by llama.cpp's converter, with our
    own rules for bounded numbers, patterns and dates (docs/structured_output.md).
    Raises :class:`~llama_ctypes.SchemaError` for an invalid or unsatisfiable
    schema, or one using a keyword (or combination) the grammar cannot enforce;
    the message names it and where it is. A schema larger than ``limits`` (default
    :data:`DEFAULT_SCHEMA_LIMITS`: what compiles in well under a second) raises
    :class:`SchemaTooLargeError` before any work; pass larger :class:`SchemaLimits` to allow it.
    """
    return json_schema_to_gbnf(schema, limits)


def from_type(tp: Any, limits: SchemaLimits | None = None) -> str:
    """GBNF text for a Pydantic model, dataclass or TypedDict (``limits`` as in :func:`from_json_schema`)."""
    return json_schema_to_gbnf(to_json_schema(tp), limits)
