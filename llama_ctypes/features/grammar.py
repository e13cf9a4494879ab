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
    """GBNF text for a JSON Schema (a dict or JSON text), by llama.cpp's converter.

    Raises :class:`~llama_ctypes.SchemaError` for an invalid schema or one using
    a keyword the grammar cannot enforce (the message names it).
    """
    return json_schema_to_gbnf(schema)


def from_type(tp: Any) -> str:
    """GBNF text for a Pydantic model, dataclass or TypedDict."""
    return json_schema_to_gbnf(to_json_schema(tp))
