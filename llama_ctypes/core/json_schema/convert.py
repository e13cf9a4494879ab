"""JSON Schema → GBNF: the public entry points, llama.cpp's converter call and the final linking.

The guarantee is that the grammar only generates JSON documents the schema
accepts. llama.cpp's converter (reached through the C adapter) does the bulk:
objects, arrays, ``$ref``, ``anyOf``, ``enum``/``const``, string lengths. It
silently ignores much, though: bounds on ``number``, keywords beside ``$ref``,
``anyOf`` or ``enum``, most ``allOf``, ``required`` names missing from
``properties``, patterns it cannot translate (it falls back to any string).
So a schema is first

* checked against its meta-schema (``jsonschema``) and for keywords no grammar
  can enforce (:data:`UNSUPPORTED_KEYWORDS`, unknown formats): those raise
  :class:`SchemaError` naming the keyword (here);
* normalized into the forms the converter enforces exactly
  (:mod:`.normalize`): ``allOf`` and the keywords beside
  ``$ref``/``anyOf``/``oneOf`` are merged (intersected) into each alternative,
  ``enum``/``const`` are filtered by the rest of their schema, ``oneOf`` is
  accepted when its alternatives are provably exclusive;
* and the nodes the converter gets wrong are replaced by grammar written here:
  bounded ``number``/``integer`` (:mod:`.numbers`: exact decimal digit
  ranges, no exponent, at most 15 significant digits so the bound survives
  conversion to a float), ``pattern`` (:mod:`.strings`: a regular-expression
  subset, translated to produce the string's JSON encoding), and ``format``
  ``date``/``time``/``date-time`` (:mod:`.strings`: real calendar dates).
  They go in as unique ``const`` placeholders, and the placeholder's literal in
  the converter's output is swapped for the rule (:func:`_link`, here).

Where no grammar can enforce a combination exactly (two patterns, ``pattern``
with ``minLength``, overlapping ``oneOf`` ...), :class:`SchemaError` says so.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import json
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema

from ...errors import GrammarError, SchemaError, SchemaTooLargeError
from ..backend import init
from ..deep_stack import DeepStackThreads
from ..grammar_check import check_gbnf
from .limits import DEFAULT_SCHEMA_LIMITS, SchemaLimits, check_schema_size
from .normalize import Normalizer
from .numbers import NUMBER_DIGITS
from .strings import SUPPORTED_FORMATS, chars_gbnf, subtract_ranges

__all__ = ["NUMBER_DIGITS", "SUPPORTED_FORMATS", "UNSUPPORTED_KEYWORDS", "DEFAULT_SCHEMA_LIMITS", "SchemaLimits",
           "SchemaTooLargeError", "check_schema", "json_schema_to_gbnf"]

#: Constraint keywords no grammar here enforces; a schema using one is refused.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
    "minContains", "maxContains", "uniqueItems", "multipleOf", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    "$recursiveRef",
})

# Keywords whose value is a schema, a list of schemas, or a map of schemas.
_SCHEMA_VALUED = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")

_SUPPORTED_TEXT = ("type, properties, required, additionalProperties, items, prefixItems, min/maxItems, enum, "
                   "const, anyOf/oneOf/allOf, $ref, pattern, min/maxLength, minimum/maximum, "
                   "exclusiveMinimum/exclusiveMaximum, format {}")


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


#: How a Python caller raises the bounds (the HTTP server says its own).
_LIMITS_HINT = ("convert it with lc.grammar.from_json_schema(schema, limits=lc.grammar.SchemaLimits(...)) "
                "and pass grammar= to allow it")


def check_schema(schema: Mapping[str, Any] | bool, limits: SchemaLimits | None = None) -> None:
    """Raise SchemaError if ``schema`` is not a valid JSON Schema or uses an unenforceable keyword, and
    :class:`SchemaTooLargeError` (a SchemaError) if it exceeds ``limits`` (default :data:`DEFAULT_SCHEMA_LIMITS`),
    which is checked first."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise SchemaError(f"a JSON schema must be a dict (or a bool), not {type(schema).__name__}")
    check_schema_size([schema], limits, hint=_LIMITS_HINT)
    cls = jsonschema.validators.validator_for(schema)
    if cls is jsonschema.Draft3Validator:
        raise SchemaError("draft 3 JSON schemas are not supported; use draft 4 or later")
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SchemaError(f"invalid JSON schema at {where}: {exc.message}") from exc
    except RecursionError:  # (only with a raised SchemaLimits.max_depth: the default stays far from it)
        raise SchemaTooLargeError("the JSON schema is nested too deeply to check") from None
    for path, node in _walk(schema):
        bad = sorted(UNSUPPORTED_KEYWORDS & set(node))
        if bad:
            raise SchemaError(
                f"JSON schema keyword {bad[0]!r} at {path} cannot be enforced by grammar-constrained "
                f"generation; remove it (supported: {_SUPPORTED_TEXT.format(sorted(SUPPORTED_FORMATS))})")
        fmt = node.get("format")
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise SchemaError(f"JSON schema keyword 'format' at {path}: format {fmt!r} cannot be enforced "
                              f"(supported: {', '.join(sorted(SUPPORTED_FORMATS))}); use 'pattern' instead")


def json_schema_to_gbnf(schema: Mapping[str, Any] | str | bool, limits: SchemaLimits | None = None) -> str:
    """GBNF grammar text generating only JSON documents ``schema`` accepts (within ``limits``, see
    :mod:`.limits`)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise SchemaError(f"the JSON schema is not valid JSON: {exc}") from exc
    if isinstance(schema, Mapping) and _tuple_form(schema):
        check_schema_size([schema], limits, hint=_LIMITS_HINT)  # (before the rewrite walks it)
        try:
            schema = _prefix_items(schema)
        except RecursionError:
            raise SchemaTooLargeError("the JSON schema is nested too deeply to convert") from None
    check_schema(schema, limits)
    limits = DEFAULT_SCHEMA_LIMITS if limits is None else limits
    key = (json.dumps(schema), limits.max_nodes)  # property order matters: the grammar keeps it
    cached = _GRAMMARS.get(key)
    if cached is not None:
        return cached
    try:
        prepared = Normalizer(json.loads(key[0]), max_steps=limits.max_nodes).document()
    except RecursionError:
        raise SchemaTooLargeError("the JSON schema is nested too deeply to convert") from None
    gbnf = _link(_convert(json.dumps(prepared.schema)), prepared.rules, prepared.key_sets)
    try:
        check_gbnf(gbnf)  # (a pattern such as ^(a?){120}$ becomes copies of the empty: minutes per token)
    except GrammarError as exc:
        raise SchemaError(f"the JSON schema's grammar is refused: {exc}") from None
    _GRAMMARS.put(key, gbnf)
    return gbnf


def _tuple_form(schema: Mapping[str, Any]) -> bool:
    """The schema writes tuples as drafts 4 to 7 did (``"items": [...]``), and names no later draft."""
    draft = schema.get("$schema")
    if draft is not None and not any(d in str(draft) for d in ("draft-04", "draft-06", "draft-07")):
        return False
    return '"items": [' in json.dumps(schema)


#: Where a schema holds subschemas: one, a map of them, a list of them (only these are rewritten: a const,
#: an enum or a default may hold "items" of its own, which are data).
_ONE = ("items", "additionalItems", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def _prefix_items(node: Any, root: bool = True) -> Any:
    """Drafts 4-7's tuples in today's words: ``items: [A, B]`` and ``additionalItems: S`` become
    ``prefixItems: [A, B]`` and ``items: S`` (llama.cpp's converter reads both forms the same way).
    Only subschema positions are visited; the root's ``$schema`` goes (the result is 2020-12)."""
    if not isinstance(node, Mapping):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = _prefix_items(out[key], False)
    for key in _MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _prefix_items(sub, False) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_prefix_items(sub, False) for sub in out[key]]
    if isinstance(out.get("items"), list):
        out["prefixItems"] = [_prefix_items(sub, False) for sub in out.pop("items")]
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    if root:
        out.pop("$schema", None)
    return out


class _GrammarCache:
    """Recently converted schemas' grammars, bounded in bytes as well as in entries (a grammar can be
    megabytes): the least recently used go first."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 32 << 20):
        self._items: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self._bytes = 0
        self._max_entries, self._max_bytes = max_entries, max_bytes
        self._lock = threading.Lock()

    def get(self, key: Any) -> str | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: str) -> None:
        size = len(key[0]) + len(value)
        if size > self._max_bytes // 8:
            return  # (one entry may not crowd out the rest)
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._bytes += size
            while len(self._items) > self._max_entries or self._bytes > self._max_bytes:
                old_key, old = self._items.popitem(last=False)
                self._bytes -= len(old_key[0]) + len(old)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


_GRAMMARS = _GrammarCache()
#: Threads with a large stack of the converter's own (so that conversions never wait behind chat parses).
_CONVERTER = DeepStackThreads(size=2, name="schema")


def _convert(schema_json: str) -> str:
    lib = init()
    error = ctypes.c_void_p()
    # (on a thread with a large stack: the converter recurses once per nesting level and per optional
    # property of an object, and 20,000 of them overflowed an 8 MiB stack: the process died)
    out = _CONVERTER.submit(lib.lcx_json_schema_to_grammar, schema_json.encode(), False,
                            ctypes.byref(error)).result()
    if not out:
        message = ctypes.string_at(error.value).decode("utf-8", "replace") if error.value else "unknown error"
        if error.value:
            lib.lcx_string_free(error.value)
        raise SchemaError(f"llama.cpp could not convert the JSON schema: {message}")
    try:
        return ctypes.string_at(out).decode("utf-8")
    finally:
        lib.lcx_string_free(out)


# llama.cpp's string character: any character or escape. A \u escape of a UTF-16 surrogate is
# left out: a pair decodes to one character (so minLength could fail) and a lone one is no text.
_CHAR_RULE = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})'
_CHAR_RULE_NO_SURROGATES = ('char ::= [^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" '
                            '([0-9a-cA-CeEfF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}))')


def _link(gbnf: str, rules: dict[str, tuple[str, str]], key_sets: list[list[str]]) -> str:
    """Swap each placeholder literal in the converter's output for its rule, and add the rules.

    Also replaces two rules of the converter's: its string character (see _CHAR_RULE_NO_SURROGATES)
    and the keys of additional properties (see _safe_not_strings).
    """
    lines = [_CHAR_RULE_NO_SURROGATES if line == _CHAR_RULE else line for line in gbnf.splitlines()]
    keys = {_not_strings(names): _safe_not_strings(names) for names in key_sets}
    for i, line in enumerate(lines):
        name, _, body = line.partition(" ::= ")
        if body in keys:
            lines[i] = f"{name} ::= {keys[body]}"
        elif body.startswith('["] ( ') and not body.startswith(_SAFE_KEY_START):
            raise SchemaError(f"internal error: unexpected rule for the keys of additional properties: {line}")
    taken = {line.split(" ::= ", 1)[0] for line in lines}
    text = "\n".join(lines)
    if not rules:
        return text + "\n"
    extra = []
    names: dict[str, str] = {}

    def name_of(match: re.Match) -> str:
        marker = match.group(1)
        if marker not in names:  # (a marker only in an unused definition gets no rule)
            base, body = rules[marker]
            name = base
            for i in itertools.count():
                if name not in taken:
                    break
                name = f"{base}{i}"
            taken.add(name)
            names[marker] = name
            extra.append(f"{name} ::= {body}")
        return names[marker]

    # (one pass over the text: a replace() per rule was quadratic for schemas with many bounded fields)
    alternatives = "|".join(re.escape(m) for m in sorted(rules, key=len, reverse=True))
    text = re.sub('"\\\\"(' + alternatives + ')\\\\""', name_of, text)
    return "\n".join([text, *extra]) + "\n"


def _trie(words: list[str]) -> dict:
    root: dict = {}
    for word in words:
        node = root
        for c in word:
            node = node.setdefault(c, {})
        node[""] = True  # a word ends here
    return root


def _not_strings(names: list[str]) -> str:
    """The converter's rule for a JSON string none of ``names`` (common_chat_schema_converter::_not_strings)."""
    def visit(node: dict) -> str:
        out, rejects = [], ""
        for c in sorted(k for k in node if k):
            rejects += c
            child = node[c]
            out.append(f"[{c}]" + (f" ({visit(child)})" if any(k for k in child) else " char+"))
        text = " | ".join(out)
        if rejects:
            text += f' | [^"{rejects}] char*'
        return text

    trie = _trie(names)
    return f'["] ( {visit(trie)} )' + ("" if "" in trie else "?") + ' ["]'


_SAFE_KEY_START = '["] (( '


def _safe_not_strings(names: list[str]) -> str:
    """The same, as valid JSON: a name's characters JSON-escaped where needed, and the first character
    that differs from every name a plain one (not an escape, which could spell a name's character)."""
    def visit(node: dict) -> str:
        out, rejects = [], []
        for c in sorted(k for k in node if k):
            rejects.append((ord(c), ord(c)))
            child = node[c]
            out.append(chars_gbnf([(ord(c), ord(c))]) + (f" ({visit(child)})" if any(k for k in child) else " char+"))
        if rejects:
            other = subtract_ranges([(0x20, 0x10FFFF)], rejects + [(0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)])
            out.append(chars_gbnf(other) + " char*")
        return " | ".join(out)

    trie = _trie(names)
    return f"{_SAFE_KEY_START}{visit(trie)} )" + ("" if "" in trie else "?") + ') ["]'
