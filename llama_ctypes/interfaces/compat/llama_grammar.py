"""llama-cpp-python's ``LlamaGrammar``: GBNF text, checked when made (not a native handle of its own)."""

from __future__ import annotations

import os
from typing import Any

from ...core.grammar_check import check_gbnf
from ...features.grammar import from_json_schema

__all__ = ["LlamaGrammar", "JSON_GBNF"]

#: Any JSON value (llama-cpp-python exports a constant of this name).
JSON_GBNF = r'''root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [1-9] [0-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
'''


class LlamaGrammar:
    """A GBNF grammar for ``grammar=`` of :class:`~.llama.Llama` calls.

    Made with :meth:`from_string`, :meth:`from_file` or :meth:`from_json_schema`; the text is checked
    (``lc.GrammarError``) before any generation sees it; llama.cpp parses it when a call samples with it.
    """

    def __init__(self, *args: Any, _grammar: str, **kwargs: Any) -> None:
        self._grammar = _grammar
        self._root = "root"

    @property
    def grammar(self) -> str:
        """The GBNF text."""
        return self._grammar

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        check_gbnf(grammar)
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | os.PathLike, verbose: bool = True) -> "LlamaGrammar":
        with open(file, encoding="utf-8") as f:
            return cls.from_string(f.read(), verbose=verbose)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        """A grammar for the JSON documents a schema (JSON text, as llama-cpp-python takes it) accepts."""
        return cls(_grammar=from_json_schema(json_schema))

    def __repr__(self) -> str:
        return f"LlamaGrammar({len(self._grammar)} characters)"
