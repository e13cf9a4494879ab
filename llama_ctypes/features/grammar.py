"""Grammars for constrained generation: ``lc.grammar.from_json_schema(schema)``.

Pass the result as ``grammar=`` (or the schema itself as ``json_schema=``) to
any generate, stream or chat function.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..core.grammar import SUPPORTED_FORMATS, UNSUPPORTED_KEYWORDS, check_schema, json_schema_to_gbnf
from .schema import to_json_schema

__all__ = ["from_json_schema", "from_type", "check_schema", "SUPPORTED_FORMATS", "UNSUPPORTED_KEYWORDS"]


def from_json_schema(schema: Mapping[str, Any] | str) -> str:
    """GBNF text for a JSON Schema (a dict or JSON text): it generates only JSON the schema accepts.

    The schema is normalized and converted by llama.cpp's converter, with our
    own rules for bounded numbers, patterns and dates (docs/structured_output.md).
    Raises :class:`~llama_ctypes.SchemaError` for an invalid or unsatisfiable
    schema, or one using a keyword (or combination) the grammar cannot enforce;
    the message names it and where it is.
    """
    return json_schema_to_gbnf(schema)


def from_type(tp: Any) -> str:
    """GBNF text for a Pydantic model, dataclass or TypedDict."""
    return json_schema_to_gbnf(to_json_schema(tp))
