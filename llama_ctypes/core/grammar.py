"""JSON Schema → GBNF: a schema is normalized here, then converted by llama.cpp's own converter.

The guarantee is that the grammar only generates JSON documents the schema
accepts. llama.cpp's converter (reached through the C adapter) does the bulk:
objects, arrays, ``$ref``, ``anyOf``, ``enum``/``const``, string lengths. It
silently ignores much, though: bounds on ``number``, keywords beside ``$ref``,
``anyOf`` or ``enum``, most ``allOf``, ``required`` names missing from
``properties``, patterns it cannot translate (it falls back to any string).
So a schema is first

* checked against its meta-schema (``jsonschema``) and for keywords no grammar
  can enforce (:data:`UNSUPPORTED_KEYWORDS`, unknown formats): those raise
  :class:`SchemaError` naming the keyword;
* normalized into the forms the converter enforces exactly: ``allOf`` and the
  keywords beside ``$ref``/``anyOf``/``oneOf`` are merged (intersected) into
  each alternative, ``enum``/``const`` are filtered by the rest of their
  schema, ``oneOf`` is accepted when its alternatives are provably exclusive;
* and the nodes the converter gets wrong are replaced by grammar written here:
  bounded ``number``/``integer`` (exact decimal digit ranges, no exponent, at
  most 15 significant digits so the bound survives conversion to a float),
  ``pattern`` (a regular-expression subset, translated to produce the string's
  JSON encoding), and ``format`` ``date``/``time``/``date-time`` (real calendar
  dates). They go in as unique ``const`` placeholders, and the placeholder's
  literal in the converter's output is swapped for the rule.

Where no grammar can enforce a combination exactly (two patterns, ``pattern``
with ``minLength``, overlapping ``oneOf`` ...), :class:`SchemaError` says so.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from fractions import Fraction
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import jsonschema

from ..errors import InvalidArgumentError, SchemaError
from .backend import init

#: Constraint keywords no grammar here enforces; a schema using one is refused.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
    "minContains", "maxContains", "uniqueItems", "multipleOf", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    "$recursiveRef",
})
#: String formats the grammar enforces.
SUPPORTED_FORMATS = frozenset({"date", "time", "date-time", "uuid"})

#: Digits (integer and fraction) of a generated bounded ``number``: any decimal this short converts to a
#: distinct float, so comparing it with a bound gives the same answer before and after parsing.
NUMBER_DIGITS = 15
#: Digits of a bounded ``integer`` with an open side, as llama.cpp's unbounded integers.
_OPEN_INTEGER_DIGITS = 16

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


def check_schema(schema: Mapping[str, Any] | bool) -> None:
    """Raise SchemaError if ``schema`` is not a valid JSON Schema or uses an unenforceable keyword."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise SchemaError(f"a JSON schema must be a dict (or a bool), not {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema)
    if cls is jsonschema.Draft3Validator:
        raise SchemaError("draft 3 JSON schemas are not supported; use draft 4 or later")
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SchemaError(f"invalid JSON schema at {where}: {exc.message}") from exc
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


def json_schema_to_gbnf(schema: Mapping[str, Any] | str | bool) -> str:
    """GBNF grammar text generating only JSON documents ``schema`` accepts."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise SchemaError(f"the JSON schema is not valid JSON: {exc}") from exc
    check_schema(schema)
    return _schema_to_gbnf(json.dumps(schema))  # property order matters: the grammar keeps it


@lru_cache(maxsize=256)
def _schema_to_gbnf(schema_json: str) -> str:
    prepared = _Normalizer(json.loads(schema_json)).document()
    return _link(_convert(json.dumps(prepared.schema)), prepared.rules, prepared.key_sets)


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
    extra = []
    for marker, (base, body) in rules.items():
        literal = '"\\"' + marker + '\\""'
        if literal not in text:
            continue  # in an unused definition
        name = base
        for i in itertools.count():
            if name not in taken:
                break
            name = f"{base}{i}"
        taken.add(name)
        text = text.replace(literal, name)
        extra.append(f"{name} ::= {body}")
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
            out.append(_chars_gbnf([(ord(c), ord(c))]) + (f" ({visit(child)})" if any(k for k in child) else " char+"))
        if rejects:
            other = _subtract([(0x20, 0x10FFFF)], rejects + [(0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)])
            out.append(_chars_gbnf(other) + " char*")
        return " | ".join(out)

    trie = _trie(names)
    return f"{_SAFE_KEY_START}{visit(trie)} )" + ("" if "" in trie else "?") + ') ["]'


# ---- normalization ---------------------------------------------------------------------------------

_APPLICATORS = ("$ref", "allOf", "anyOf", "oneOf")
_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_ARRAY_KEYS = ("items", "prefixItems", "additionalItems", "minItems", "maxItems")
_OBJECT_KEYS = ("properties", "required", "additionalProperties")
_FAMILY_KEYS = {"string": _STRING_KEYS, "number": _NUMBER_KEYS, "array": _ARRAY_KEYS, "object": _OBJECT_KEYS}
#: Keywords that constrain a value; any other keyword (title, description, default, $defs ...) does not.
_CONSTRAINING = frozenset({"type", "const", "enum", *_APPLICATORS, *_STRING_KEYS, *_NUMBER_KEYS, *_ARRAY_KEYS,
                           *_OBJECT_KEYS})
_MAX_ALTERNATIVES = 64
_MAX_INLINE_DEPTH = 3


class _Unsatisfiable(Exception):
    """No JSON value satisfies the schema at ``path``."""

    def __init__(self, path: str, why: str = ""):
        super().__init__(path)
        self.path, self.why = path, why


class _Prepared:
    def __init__(self, schema: dict, rules: dict[str, tuple[str, str]], key_sets: list[list[str]]):
        self.schema, self.rules, self.key_sets = schema, rules, key_sets


def _essential(node: Any) -> Any:
    """``node`` without its non-constraining keywords, through single-element ``allOf`` wrappers."""
    while isinstance(node, Mapping):
        kept = {k: v for k, v in node.items() if k in _CONSTRAINING}
        if set(kept) == {"allOf"} and len(kept["allOf"]) == 1:
            node = kept["allOf"][0]
            continue
        return kept
    return node


def _canon(value: Any) -> str:
    """A key equal for JSON-equal values (1 == 1.0, but true != 1)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"n:{Fraction(value)}" if math.isfinite(value) else f"n:{value}"
    if isinstance(value, list):
        return "[" + ",".join(_canon(v) for v in value) + "]"
    return "{" + ",".join(f"{json.dumps(k)}:{_canon(v)}" for k, v in sorted(value.items())) + "}"


class _Normalizer:
    def __init__(self, root: Any):
        self.root = root
        cls = jsonschema.validators.validator_for(root if isinstance(root, Mapping) else {})
        self.draft4 = cls is jsonschema.Draft4Validator
        self.legacy_items = cls is not jsonschema.Draft202012Validator  # items: [...] is a tuple
        self.validator = cls(root if isinstance(root, Mapping) else {}, format_checker=_FORMAT_CHECKER)
        self.defs: dict[str, Any] = {}
        self.ref_names: dict[str, str] = {}
        self.rules: dict[str, tuple[str, str]] = {}
        self.rule_markers: dict[tuple[str, str], str] = {}
        self.nonce = next(f"lcx{i}" for i in itertools.count() if f"lcx{i}" not in json.dumps(root))
        self.inlining: Counter[str] = Counter()  # $refs merged into the schemas being normalized
        self.placeholder_types: dict[str, str] = {}

    def document(self) -> _Prepared:
        try:
            schema = self.norm(self.root, "#")
        except _Unsatisfiable as exc:
            raise SchemaError(f"no JSON value satisfies the schema at {exc.path}"
                              + (f" ({exc.why})" if exc.why else "")) from None
        if any(v is None for v in self.defs.values()):
            raise SchemaError("a recursive $ref points to a schema no JSON value satisfies")
        if self.defs:
            schema = {**schema, "$defs": self.defs}
        key_sets = [list(node["properties"]) for node in _objects(schema)
                     if node["properties"] and node.get("additionalProperties", False) is not False]
        return _Prepared(schema, self.rules, key_sets)

    # ---- helpers -----------------------------------------------------------------------------------
    def valid(self, value: Any, schema: Any) -> bool:
        return self.validator.evolve(schema=schema).is_valid(value)

    def rule(self, base: str, body: str, json_type: str) -> dict:
        """A placeholder node the converter passes through as a literal; _link swaps in ``body``."""
        key = (base, body)
        if key not in self.rule_markers:
            marker = f"{self.nonce}-{len(self.rules)}"
            self.rule_markers[key] = marker
            self.rules[marker] = (base, body)
            self.placeholder_types[marker] = json_type
        return {"const": self.rule_markers[key]}

    def placeholder_type(self, node: dict) -> str | None:
        """The JSON type of a placeholder node, None for any other node."""
        value = node.get("const")
        return self.placeholder_types.get(value) if isinstance(value, str) else None

    def is_finite(self, node: dict | None) -> bool:
        """Whether ``node`` is an enum or a const (a placeholder is neither)."""
        return node is not None and ("enum" in node or ("const" in node and self.placeholder_type(node) is None))

    def resolve(self, ref: str, path: str) -> Any:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"cannot resolve $ref {ref!r} at {path}: only references within the schema "
                              f"('#/...') are supported")
        target = self.root
        for token in [t for t in unquote(ref[1:]).split("/")][1:] if ref != "#" else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, Mapping) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise SchemaError(f"cannot resolve $ref {ref!r} at {path}: {token!r} not found")
        return target

    def ref(self, ref: str, path: str) -> dict:
        if ref not in self.ref_names:
            target = self.resolve(ref, path)
            base = re.sub(r"[^A-Za-z0-9_-]+", "-", ref.rsplit("/", 1)[-1]).strip("-") or "root"
            name = base
            for i in itertools.count(2):
                if name not in self.defs:
                    break
                name = f"{base}-{i}"
            self.ref_names[ref] = name
            self.defs[name] = None  # in progress: a recursive $ref finds the name
            try:
                self.defs[name] = self.norm(target, ref)
            except _Unsatisfiable:
                del self.defs[name], self.ref_names[ref]
                raise
        return {"$ref": f"#/$defs/{self.ref_names[ref]}"}

    # ---- the walk ----------------------------------------------------------------------------------
    def norm(self, node: Any, path: str) -> dict:
        """An equivalent schema (or a stricter one, never looser) in forms the converter enforces."""
        node = _essential(node)
        if node is True:
            return {}
        if node is False:
            raise _Unsatisfiable(path, "false")
        if set(node) == {"$ref"}:
            return self.ref(node["$ref"], path)
        if set(node) in ({"anyOf"}, {"oneOf"}):
            key = next(iter(node))
            return self.union(self.alternatives(node[key], f"{path}/{key}", key == "oneOf"), path)
        parts: list[tuple[dict, str]] = []
        choices: list[list[tuple[Any, str]]] = []
        inlined: list[str] = []
        self.flatten(node, path, parts, choices, (), inlined)
        again = sorted(r for r in inlined if self.inlining[r] >= _MAX_INLINE_DEPTH)
        if again:  # merging a definition into itself, without end
            raise SchemaError(f"$ref {again[0]!r} at {path} is merged with other keywords inside its own definition; "
                              f"such a recursive combination cannot be converted")
        self.inlining.update(inlined)
        try:
            if any("const" in p or "enum" in p for p, _ in parts):
                return self.finite(node, parts, path)
            if not choices:
                return self.merge(parts, path)
            base = {"allOf": [p for p, _ in parts]}
            combos = list(itertools.islice(itertools.product(*choices), _MAX_ALTERNATIVES + 1))
            if len(combos) > _MAX_ALTERNATIVES:
                raise SchemaError(f"the schema at {path} combines anyOf/oneOf into more than {_MAX_ALTERNATIVES} "
                                  f"alternatives; simplify it")
            out = []
            for combo in combos:
                try:
                    out.append(self.norm({"allOf": [base, *(alt for alt, _ in combo)]}, path))
                except _Unsatisfiable:
                    continue
            return self.union(out, path)
        finally:
            self.inlining.subtract(inlined)

    def flatten(self, node: Any, path: str, parts: list, choices: list, refs: tuple[str, ...],
                inlined: list[str]) -> None:
        """Collect the conjunction under ``node``: keyword dicts into ``parts``, anyOf/oneOf into ``choices``."""
        if node is True:
            return
        if node is False:
            raise _Unsatisfiable(path, "false")
        parts.append(({k: v for k, v in node.items() if k in _CONSTRAINING and k not in _APPLICATORS}, path))
        if "$ref" in node:
            ref = node["$ref"]
            if ref in refs:
                raise SchemaError(f"$ref {ref!r} at {path} refers back to itself")
            inlined.append(ref)
            self.flatten(self.resolve(ref, path), ref, parts, choices, (*refs, ref), inlined)
        for i, sub in enumerate(node.get("allOf", ())):
            self.flatten(sub, f"{path}/allOf/{i}", parts, choices, refs, inlined)
        if "anyOf" in node:
            choices.append([(alt, f"{path}/anyOf/{i}") for i, alt in enumerate(node["anyOf"])])
        if "oneOf" in node:
            self.alternatives(node["oneOf"], f"{path}/oneOf", True)  # checks they exclude each other
            choices.append([(alt, f"{path}/oneOf/{i}") for i, alt in enumerate(node["oneOf"])])

    def alternatives(self, alts: list, path: str, exclusive: bool) -> list[dict]:
        out: list[tuple[int, dict]] = []
        for i, alt in enumerate(alts):
            try:
                out.append((i, self.norm(alt, f"{path}/{i}")))
            except _Unsatisfiable:
                continue
        if exclusive:
            for (i, a), (j, b) in itertools.combinations(out, 2):
                if not self.exclusive(a, b, alts[i], alts[j]):
                    raise SchemaError(
                        f"'oneOf' at {path}: alternatives {i} and {j} may both match a value, and such a value "
                        f"would be invalid; use 'anyOf', or make them exclusive (different types, or an object "
                        f"property with a different const in each)")
        return [n for _, n in out]

    def union(self, alts: list[dict], path: str) -> dict:
        if not alts:
            raise _Unsatisfiable(path, "no alternative is satisfiable")
        unique = list({json.dumps(a, sort_keys=True): a for a in alts}.values())
        return unique[0] if len(unique) == 1 else {"anyOf": unique}

    # ---- oneOf: proving alternatives exclusive -------------------------------------------------------
    def deref(self, node: dict) -> dict | None:
        seen = set()
        while "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name in seen or self.defs.get(name) is None:
                return None
            seen.add(name)
            node = self.defs[name]
        return node

    def types_of(self, node: dict | None) -> set[str]:
        node = self.deref(node) if node is not None else None
        if node is None:
            return {"null", "boolean", "number", "string", "array", "object"}
        if "anyOf" in node:
            return set().union(*(self.types_of(a) for a in node["anyOf"]))
        if self.placeholder_type(node):
            return {self.placeholder_type(node)}
        if "const" in node or "enum" in node:
            return {_json_type(v) for v in ([node["const"]] if "const" in node else node["enum"])}
        if "type" in node:
            return {"number" if node["type"] == "integer" else node["type"]}
        return {"null", "boolean", "number", "string", "array", "object"}

    def raw_types(self, node: Any, refs: tuple[str, ...] = ()) -> set[str]:
        """The JSON types a schema as written accepts (a superset; integer counts as number)."""
        everything = {"null", "boolean", "number", "string", "array", "object"}
        node = _essential(node)
        if not isinstance(node, Mapping):
            return everything if node is not False else set()
        types = set(everything)
        if "type" in node:
            named = [node["type"]] if isinstance(node["type"], str) else node["type"]
            types &= {"number" if t == "integer" else t for t in named}
        if "const" in node:
            types &= {_json_type(node["const"])}
        if "enum" in node:
            types &= {_json_type(v) for v in node["enum"]}
        if "$ref" in node and node["$ref"] not in refs:
            types &= self.raw_types(self.resolve(node["$ref"], "#"), (*refs, node["$ref"]))
        for sub in node.get("allOf", ()):
            types &= self.raw_types(sub, refs)
        for key in ("anyOf", "oneOf"):
            if key in node:
                types &= set().union(*(self.raw_types(sub, refs) for sub in node[key]))
        return types

    def exclusive(self, a: dict, b: dict, raw_a: Any, raw_b: Any) -> bool:
        """Whether no value generated from ``a`` (from ``b``) also matches ``raw_b`` (``raw_a``).

        ``a`` and ``b`` are the normalized alternatives, which may generate fewer values than the
        alternatives as written: a value from one must not match the other *as written*.
        """
        if not self.types_of(a) & self.raw_types(raw_b) and not self.types_of(b) & self.raw_types(raw_a):
            return True
        for finite, other in ((self.deref(a), raw_b), (self.deref(b), raw_a)):
            if self.is_finite(finite):
                values = [finite["const"]] if "const" in finite else finite["enum"]
                return not any(self.valid(v, other) for v in values)
        da, db = self.deref(a), self.deref(b)
        if da is None or db is None or da.get("type") != "object" or db.get("type") != "object":
            return False
        for name in set(da.get("required", ())) & set(db.get("required", ())):
            va, vb = (self.deref(d["properties"][name]) for d in (da, db))
            if self.is_finite(va) and self.is_finite(vb):
                keys = [{_canon(x) for x in ([v["const"]] if "const" in v else v["enum"])} for v in (va, vb)]
                if not keys[0] & keys[1]:
                    return True
        return False

    # ---- enum / const --------------------------------------------------------------------------------
    def finite(self, node: Any, parts: list[tuple[dict, str]], path: str) -> dict:
        """The enum/const values that satisfy the whole schema: exact, whatever else it says."""
        candidates = next([p["const"]] if "const" in p else list(p["enum"]) for p, _ in parts
                          if "const" in p or "enum" in p)
        kept = {}
        for value in candidates:
            if self.valid(value, node):
                kept.setdefault(_canon(value), value)
        if not kept:
            raise _Unsatisfiable(path, "no enum/const value satisfies the other keywords")
        values = list(kept.values())
        return {"const": values[0]} if len(values) == 1 else {"enum": values}

    # ---- merging a conjunction of plain keyword dicts ------------------------------------------------
    def merge(self, parts: list[tuple[dict, str]], path: str) -> dict:
        types: set[str] | None = None
        for part, _ in parts:
            if "type" in part:
                named = {part["type"]} if isinstance(part["type"], str) else set(part["type"])
                if "number" in named:
                    named.add("integer")
                types = named if types is None else types & named
        if types is None:
            present = [family for family, keys in _FAMILY_KEYS.items() if any(k in p for p, _ in parts for k in keys)]
            if not present:
                return {}
            # No type: only values of the constrained kinds are generated (a subset of what is valid).
            types = {*present, "integer"} if "number" in present else set(present)
        elif not types:
            raise _Unsatisfiable(path, "the types do not overlap")
        out = []
        for t in ("null", "boolean", "integer", "number", "string", "array", "object"):
            if t not in types or (t == "integer" and "number" in types):
                continue
            try:
                out.append(getattr(self, f"typed_{t}")(parts, path))
            except _Unsatisfiable:
                continue
        return self.union(out, path)

    def typed_null(self, parts, path) -> dict:
        return {"type": "null"}

    def typed_boolean(self, parts, path) -> dict:
        return {"type": "boolean"}

    def bounds(self, parts) -> tuple[list, list]:
        """Lower and upper bounds as (value, exclusive) pairs, draft-4 boolean exclusives included."""
        lower, upper = [], []
        for part, _ in parts:
            for key, side, excl in (("minimum", lower, False), ("exclusiveMinimum", lower, True),
                                    ("maximum", upper, False), ("exclusiveMaximum", upper, True)):
                value = part.get(key)
                if isinstance(value, bool) or value is None:
                    continue
                if self.draft4 and not excl:
                    excl = part.get("exclusive" + key[0].upper() + key[1:]) is True
                side.append((value, excl))
        return lower, upper

    def typed_integer(self, parts, path) -> dict:
        lower, upper = self.bounds(parts)
        if not lower and not upper:
            return {"type": "integer"}
        lo = max((math.floor(Fraction(v)) + 1 if x else math.ceil(Fraction(v)) for v, x in lower), default=None)
        hi = min((math.ceil(Fraction(v)) - 1 if x else math.floor(Fraction(v)) for v, x in upper), default=None)
        limit = 10 ** max([_OPEN_INTEGER_DIGITS] + [len(str(abs(b))) for b in (lo, hi) if b is not None]) - 1
        lo = -limit if lo is None else lo
        hi = limit if hi is None else hi
        if lo > hi:
            raise _Unsatisfiable(path, "no integer between the bounds")
        return self.rule("integer-range", _int_range(lo, hi), "number")

    def typed_number(self, parts, path) -> dict:
        lower, upper = self.bounds(parts)
        if not lower and not upper:
            return {"type": "number"}

        def exact(v):  # the shortest decimal of a float converts back to that float
            return Fraction(repr(v)) if isinstance(v, float) else Fraction(v)

        lo = max(((exact(v), x) for v, x in lower), key=lambda b: (b[0], b[1]), default=None)
        hi = min(((exact(v), x) for v, x in upper), key=lambda b: (b[0], not b[1]), default=None)
        if lo is not None and hi is not None and (lo[0] > hi[0] or (lo[0] == hi[0] and (lo[1] or hi[1]))):
            raise _Unsatisfiable(path, "no number between the bounds")
        alts = []
        if lo is None or lo[0] < 0:  # negative values, by magnitude: above 0 (no "-0") or -hi, up to -lo
            low = (Fraction(0), True) if hi is None or hi[0] >= 0 else (-hi[0], hi[1])
            body = _decimal_magnitudes(low, None if lo is None else (-lo[0], lo[1]))
            if body:
                alts.append(f'"-" ({body})')
        if hi is None or hi[0] >= 0:
            body = _decimal_magnitudes((Fraction(0), False) if lo is None or lo[0] < 0 else lo, hi)
            if body:
                alts.append(f"({body})")
        if not alts:
            keys = ", ".join(sorted({k for p, _ in parts for k in _NUMBER_KEYS if k in p}))
            raise SchemaError(f"JSON schema keywords {keys} at {path}: no number of at most {NUMBER_DIGITS} "
                              f"digits (below 1e{NUMBER_DIGITS}) lies between the bounds")
        return self.rule("number-range", " | ".join(alts), "number")

    def typed_string(self, parts, path) -> dict:
        min_len = max((p["minLength"] for p, _ in parts if "minLength" in p), default=0)
        max_len = min((p["maxLength"] for p, _ in parts if "maxLength" in p), default=None)
        patterns = list(dict.fromkeys(p["pattern"] for p, _ in parts if "pattern" in p))
        formats = list(dict.fromkeys(p["format"] for p, _ in parts if "format" in p))
        if max_len is not None and min_len > max_len:
            raise _Unsatisfiable(path, "minLength is above maxLength")
        if len(patterns) > 1:
            raise SchemaError(f"JSON schema keyword 'pattern' at {path}: two patterns apply to one string "
                              f"({patterns[0]!r} and {patterns[1]!r}); combine them into one")
        if len(formats) > 1:
            raise _Unsatisfiable(path, f"formats {formats[0]!r} and {formats[1]!r}")
        if patterns and formats:
            raise SchemaError(f"JSON schema keywords 'pattern' and 'format' at {path} cannot be enforced together; "
                              f"keep one")
        if formats:
            shortest, longest = _FORMAT_LENGTHS[formats[0]]
            if min_len > shortest or (max_len is not None and max_len < longest):
                raise SchemaError(f"JSON schema keywords 'format' and 'minLength'/'maxLength' at {path} cannot be "
                                  f"enforced together ({formats[0]} strings have {shortest} to {longest} characters)")
            if formats[0] == "uuid":
                return {"type": "string", "format": "uuid"}
            return self.rule(formats[0] + "-string", f'"\\"" {_FORMAT_RULES[formats[0]]} "\\""', "string")
        if patterns:
            body, shortest, longest = _Regex(patterns[0], path).gbnf()
            if min_len > shortest or (max_len is not None and (longest is None or max_len < longest)):
                raise SchemaError(f"JSON schema keywords 'pattern' and 'minLength'/'maxLength' at {path} cannot be "
                                  f"enforced together; put the length into the pattern (e.g. {{3,8}})")
            return self.rule("pattern", f'"\\"" {body} "\\""', "string")
        out: dict[str, Any] = {"type": "string"}
        if min_len:
            out["minLength"] = min_len
        if max_len is not None:
            out["maxLength"] = max_len
        return out

    def typed_array(self, parts, path) -> dict:
        min_items = max((p["minItems"] for p, _ in parts if "minItems" in p), default=0)
        max_items = min((p["maxItems"] for p, _ in parts if "maxItems" in p), default=None)
        if max_items is not None and min_items > max_items:
            raise _Unsatisfiable(path, "minItems is above maxItems")
        split = []  # per part: (prefix schemas, schema of the items after them)
        for part, _ in parts:
            items = part.get("items", True)
            if "prefixItems" in part:
                split.append((part["prefixItems"], items))
            elif self.legacy_items and isinstance(items, list):
                split.append((items, part.get("additionalItems", True)))
            else:
                split.append(([], items))
        n_prefix = max(len(p) for p, _ in split)
        rest = [r for _, r in split if r is not True]
        if n_prefix == 0:
            try:
                items = self.norm({"allOf": rest}, f"{path}/items") if rest else {}
            except _Unsatisfiable:
                if min_items:
                    raise
                return {"type": "array", "maxItems": 0}
            out: dict[str, Any] = {"type": "array", "items": items}
            if min_items:
                out["minItems"] = min_items
            if max_items is not None:
                out["maxItems"] = max_items
            return out
        # A tuple: the converter generates exactly len(prefixItems) items, one length the schema allows.
        length = min(n_prefix, max_items) if max_items is not None else n_prefix
        length = max(length, min_items)
        tuple_items = []
        for i in range(length):
            schemas = [p[i] if i < len(p) else r for p, r in split]
            schemas = [s for s in schemas if s is not True]
            try:
                tuple_items.append(self.norm({"allOf": schemas}, f"{path}/prefixItems/{i}") if schemas else {})
            except _Unsatisfiable:
                if i < min_items:
                    raise
                break
        if not tuple_items:
            return {"type": "array", "maxItems": 0}
        return {"type": "array", "prefixItems": tuple_items}

    def typed_object(self, parts, path) -> dict:
        required = list(dict.fromkeys(name for p, _ in parts for name in p.get("required", ())))
        names = list(dict.fromkeys([n for p, _ in parts for n in p.get("properties", {})] + required))
        properties: dict[str, Any] = {}
        forbidden = False
        for name in names:
            schemas = []
            for part, _ in parts:
                if name in part.get("properties", {}):
                    schemas.append(part["properties"][name])
                elif "additionalProperties" in part:
                    schemas.append(part["additionalProperties"])
            schemas = [s for s in schemas if s is not True]
            try:
                properties[name] = self.norm({"allOf": schemas}, f"{path}/properties/{name}") if schemas else {}
            except _Unsatisfiable:
                if name in required:
                    raise
                forbidden = True  # the name may not appear at all
        extra = [p["additionalProperties"] for p, _ in parts if "additionalProperties" in p]
        extra = [s for s in extra if s is not True]
        out: dict[str, Any] = {"type": "object", "properties": properties,
                               "required": [n for n in required if n in properties]}
        if extra:
            try:
                out["additionalProperties"] = self.norm({"allOf": extra}, f"{path}/additionalProperties")
            except _Unsatisfiable:
                out["additionalProperties"] = False
        elif not forbidden and (not properties or any(p.get("additionalProperties") is True for p, _ in parts)):
            out["additionalProperties"] = True  # any further property
        if forbidden:
            out["additionalProperties"] = False
        if out.get("additionalProperties") == {}:
            out["additionalProperties"] = True
        return out


def _objects(schema: Any) -> Iterator[dict]:
    """The object schemas in a normalized schema (enum and const values are not schemas)."""
    if isinstance(schema, dict) and not ("const" in schema or "enum" in schema):
        if schema.get("type") == "object":
            yield schema
        for key, value in schema.items():
            if key in ("properties", "$defs"):
                for sub in value.values():
                    yield from _objects(sub)
            elif key in ("anyOf", "prefixItems"):
                for sub in value:
                    yield from _objects(sub)
            elif key in ("items", "additionalProperties"):
                yield from _objects(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


# ---- numbers ---------------------------------------------------------------------------------------

def _fixed_range(lo: str, hi: str) -> str:
    """Digit strings of one length between ``lo`` and ``hi`` (inclusive)."""
    if not lo:
        return ""
    i = 0
    while i < len(lo) and lo[i] == hi[i]:
        i += 1
    if i == len(lo):
        return f'"{lo}"'
    prefix = f'"{lo[:i]}" ' if i else ""
    a, b, lo_rest, hi_rest = int(lo[i]), int(hi[i]), lo[i + 1:], hi[i + 1:]
    n = len(lo_rest)
    tail = f" [0-9]{{{n}}}" if n > 1 else " [0-9]" if n == 1 else ""
    lo_full, hi_full = lo_rest == "0" * n, hi_rest == "9" * n
    alts = []
    if not lo_full:
        alts.append(f'"{a}" ({_fixed_range(lo_rest, "9" * n)})')
    first, last = (a if lo_full else a + 1), (b if hi_full else b - 1)
    if first <= last:
        alts.append((f"[{first}]" if first == last else f"[{first}-{last}]") + tail)
    if not hi_full:
        alts.append(f'"{b}" ({_fixed_range("0" * n, hi_rest)})')
    return prefix + (alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")")


def _nat_range(lo: int, hi: int) -> str:
    """Canonical non-negative integers (no leading zeros) from ``lo`` to ``hi``."""
    alts, full = [], []  # full: lengths whose every integer is in range, merged into one alternative
    for n in range(len(str(lo)), len(str(hi)) + 1):
        first = 10 ** (n - 1) if n > 1 else 0
        a, b = max(lo, first), min(hi, 10 ** n - 1)
        if (a, b) == (first, 10 ** n - 1):
            full.append(n)
        elif a <= b:
            alts.append(_fixed_range(str(a), str(b)))
    if full:
        n1, n2 = full[0], full[-1]
        more = f" [0-9]{{{max(n1 - 1, 0)},{n2 - 1}}}" if n2 > 1 else ""
        merged = ('"0" | ' if n1 == 1 else "") + "[1-9]" + more
        alts.append(merged if not alts else f"({merged})")
    return " | ".join(alts)


def _int_range(lo: int, hi: int) -> str:
    """Integers from ``lo`` to ``hi`` as JSON writes them (no "-0")."""
    alts = []
    if lo < 0:
        alts.append(f'"-" ({_nat_range(max(1, -hi), -lo)})')
    if hi >= 0:
        alts.append(f"({_nat_range(max(0, lo), hi)})")
    return " | ".join(alts)


def _fraction_digits(lo: str, hi: str, pos: int, lo_tight: bool, hi_tight: bool) -> str:
    """Fraction digits from ``pos`` on (none, or more, up to len(lo)) whose zero-padded value lies in [lo, hi].

    ``lo_tight``/``hi_tight``: the digits so far equal ``lo``/``hi``'s, so theirs still bind.
    """
    width = len(lo)
    left = width - pos
    if left == 0:
        return ""
    may_end = not lo_tight or lo[pos:] == "0" * left
    lo_tight = lo_tight and lo[pos:] != "0" * left  # 0…0 and 9…9 bind nothing
    hi_tight = hi_tight and hi[pos:] != "9" * left
    if not lo_tight and not hi_tight:
        return f"[0-9]{{0,{left}}}"
    a = int(lo[pos]) if lo_tight else 0
    b = int(hi[pos]) if hi_tight else 9
    alts = []
    free = f" [0-9]{{0,{left - 1}}}" if left > 1 else ""
    if lo_tight and hi_tight and a == b:
        rest = _fraction_digits(lo, hi, pos + 1, True, True)
        alts.append(f'"{a}"' + (f" ({rest})" if rest else ""))
    else:
        first, last = a, b
        if lo_tight:
            rest = _fraction_digits(lo, hi, pos + 1, True, False)
            alts.append(f'"{a}"' + (f" ({rest})" if rest else ""))
            first = a + 1
        if hi_tight:
            rest = _fraction_digits(lo, hi, pos + 1, False, True)
            alts.append(f'"{b}"' + (f" ({rest})" if rest else ""))
            last = b - 1
        if first <= last:
            alts.append((f"[{first}]" if first == last else f"[{first}-{last}]") + free)
    body = " | ".join(alts)
    return f"({body})?" if may_end else f"({body})"


def _fraction(lo: int, hi: int, digits: int) -> str:
    """An optional "." and fraction whose value, in units of 10**-digits, lies in [lo, hi]."""
    if digits == 0:
        return ""
    lo_s, hi_s = str(lo).zfill(digits), str(hi).zfill(digits)
    if lo == 0 and hi == 10 ** digits - 1:
        return f' ("." [0-9]{{1,{digits}}})?'
    if lo == 0 and hi == 0:
        return f' ("." "0"{{1,{digits}}})?'
    # at least one digit after the point: the first position may not be skipped
    a, b = int(lo_s[0]), int(hi_s[0])
    alts = []
    if a == b:
        rest = _fraction_digits(lo_s, hi_s, 1, True, True)
        alts.append(f'"{a}"' + (f" {rest}" if rest else ""))
    else:
        rest = _fraction_digits(lo_s, hi_s, 1, True, False)
        alts.append(f'"{a}"' + (f" {rest}" if rest else ""))
        if a + 1 <= b - 1:
            alts.append((f"[{a + 1}]" if a + 1 == b - 1 else f"[{a + 1}-{b - 1}]")
                        + (f" [0-9]{{0,{digits - 1}}}" if digits > 1 else ""))
        rest = _fraction_digits(lo_s, hi_s, 1, False, True)
        alts.append(f'"{b}"' + (f" {rest}" if rest else ""))
    part = f'"." ({" | ".join(alts)})'
    return f" ({part})?" if lo == 0 else f" {part}"


def _magnitude_range(lo: int, hi: int, digits: int) -> str:
    """Non-negative decimals (integer part, optional fraction) from lo to hi, in units of 10**-digits."""
    if digits == 0:
        return _nat_range(lo, hi)
    scale = 10 ** digits
    (q_lo, r_lo), (q_hi, r_hi) = divmod(lo, scale), divmod(hi, scale)
    if q_lo == q_hi:
        return f'"{q_lo}"' + _fraction(r_lo, r_hi, digits)
    alts = []
    first, last = q_lo + (r_lo != 0), q_hi - (r_hi != scale - 1)  # integer parts with any fraction
    if r_lo != 0:
        alts.append(f'"{q_lo}"' + _fraction(r_lo, scale - 1, digits))
    if first <= last:
        alts.append(f"({_nat_range(first, last)})" + _fraction(0, scale - 1, digits))
    if r_hi != scale - 1:
        alts.append(f'"{q_hi}"' + _fraction(0, r_hi, digits))
    return " | ".join(f"({a})" for a in alts)


def _decimal_magnitudes(low: tuple[Fraction, bool], high: tuple[Fraction, bool] | None) -> str:
    """Plain non-negative decimals of at most NUMBER_DIGITS digits between two (value, exclusive) bounds.

    Each count n of integer digits gets NUMBER_DIGITS - n decimals: 0.001 fits beside 123456789012.5.
    """
    alts, full = [], []  # full: lengths whose every number is in range, merged into one alternative
    for n in range(1, NUMBER_DIGITS + 1):
        decimals = NUMBER_DIGITS - n
        scale = 10 ** decimals
        first, last = (0 if n == 1 else 10 ** (n - 1)) * scale, 10 ** n * scale - 1  # n integer digits
        a, b = first, last
        v, excl = low
        a = max(a, math.floor(v * scale) + 1 if excl else math.ceil(v * scale))
        if high is not None:
            v, excl = high
            b = min(b, math.ceil(v * scale) - 1 if excl else math.floor(v * scale))
        if (a, b) == (first, last):
            full.append(n)
        elif a <= b:
            alts.append(_magnitude_range(a, b, decimals))
    if full:  # full lengths are consecutive: those between the bounds' lengths
        alts.append(_full_lengths(full[0], full[-1]))
    return " | ".join(f"({a})" for a in alts)


def _full_lengths(n1: int, n2: int) -> str:
    """Every plain decimal with n1 to n2 integer digits and up to NUMBER_DIGITS digits in all.

    One digit at a time, so only one way to read a number is alive (cheap for llama.cpp's grammar):
    after k integer digits comes another digit, or a fraction of up to NUMBER_DIGITS - k digits, or
    the end.
    """
    def fraction(k: int) -> str:
        m = NUMBER_DIGITS - k
        return f'"." [0-9]{{1,{m}}}' if m > 1 else '"." [0-9]' if m == 1 else ""

    def after(k: int) -> str:  # k integer digits read
        if k < n1:
            return f"[0-9] {after(k + 1)}"
        options = [o for o in (fraction(k), f"[0-9] {after(k + 1)}" if k < n2 else "") if o]
        return f"({' | '.join(options)})?" if options else ""

    tail = after(1)
    nonzero = "[1-9]" + (f" {tail}" if tail else "")
    if n1 > 1:
        return nonzero
    return f'"0" ({fraction(1)})? | {nonzero}' if fraction(1) else f'"0" | {nonzero}'



# ---- string formats ----------------------------------------------------------------------------------

_LEAP = '("0" [48] | [2468] [048] | [13579] [26])'
_DATE = ('(([1-9] [0-9]{3} | "0" ([1-9] [0-9]{2} | "0" ([1-9] [0-9] | "0" [1-9]))) "-" ('
         '("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | '
         '("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | '
         '"02-" ("0" [1-9] | "1" [0-9] | "2" [0-8])) | '
         f'([0-9] [0-9] {_LEAP} | {_LEAP} "00") "-02-29")')
_TIME = ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})? '
         '("Z" | [+\\-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])')
_FORMAT_RULES = {"date": _DATE, "time": f"({_TIME})", "date-time": f'{_DATE} "T" {_TIME}'}
_TIME_RE = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{3})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_FORMAT_RES = {"date": r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "time": _TIME_RE, "date-time": rf"[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}T{_TIME_RE}",
               "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}


def _format_check(fmt: str):
    def check(value: Any) -> bool:
        if not isinstance(value, str):
            return True
        if not re.fullmatch(_FORMAT_RES[fmt], value):
            return False
        if fmt in ("date", "date-time"):
            try:
                dt.date.fromisoformat(value[:10])
            except ValueError:
                return False
        return True
    return check


#: What enum and const values are checked with: exactly the strings the format rules generate
#: (jsonschema's own time and date-time checks need optional packages, and pass anything without them).
_FORMAT_CHECKER = jsonschema.FormatChecker(formats=())
for _fmt in SUPPORTED_FORMATS:
    _FORMAT_CHECKER.checks(_fmt)(_format_check(_fmt))

_FORMAT_LENGTHS = {"date": (10, 10), "time": (9, 18), "date-time": (20, 29), "uuid": (36, 36)}


# ---- pattern → GBNF ----------------------------------------------------------------------------------

# Characters a negated set, "." or \D, \W, \S stand for: printable ASCII. Values using other characters
# match too, but are not generated (a subset); it keeps Python's and ECMAScript's classes in agreement.
_PRINTABLE = [(0x20, 0x7E)]
_DIGIT, _WORD = [(0x30, 0x39)], [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_SIMPLE_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
_JSON_ESCAPES = {0x22: '\\\\\\"', 0x5C: "\\\\\\\\", 0x08: "\\\\b", 0x09: "\\\\t", 0x0A: "\\\\n", 0x0C: "\\\\f",
                 0x0D: "\\\\r"}


def _normalize_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(universe: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in universe:
        for c, d in _normalize_ranges(ranges):
            if d < a or c > b:
                continue
            if c > a:
                out.append((a, c - 1))
            a = max(a, d + 1)
            if a > b:
                break
        if a <= b:
            out.append((a, b))
    return out


def _class_char(cp: int) -> str:
    return chr(cp) if chr(cp).isalnum() and cp < 0x80 else f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}" \
        if cp < 0x10000 else f"\\U{cp:08X}"


def _chars_gbnf(ranges: list[tuple[int, int]]) -> str:
    """GBNF for one character from ``ranges``, as it appears inside a JSON string (escaped where JSON needs)."""
    ranges = _normalize_ranges(ranges)
    special = [cp for a, b in ranges for cp in range(a, min(b, 0x5C) + 1) if cp < 0x20 or cp in (0x22, 0x5C)]
    raw = _subtract(ranges, [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)])
    alts = []
    if raw:
        alts.append("[" + "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}"
                                  for a, b in raw) + "]")
    for cp in special:
        alts.append('"' + _JSON_ESCAPES.get(cp, f"\\\\u{cp:04x}") + '"')
    if not alts:
        raise InvalidArgumentError("empty character class")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


class _Regex:
    """A regular expression subset → GBNF generating the JSON strings (without quotes) it fully matches.

    Supported: literals, ".", classes (ranges, negation, \\d \\w \\s and their negations), escapes
    (\\t \\n \\r \\f \\v \\0 \\xHH \\uHHHH, escaped punctuation), groups ``(...)``/``(?:...)``,
    alternation, ``* + ? {n} {n,} {n,m}`` (lazy or not), and ``^``/``$`` at the ends; without them the
    match may sit anywhere in the string. Not supported (SchemaError): backreferences, lookaround, \\b,
    \\p{...}, named groups, flags.
    """

    def __init__(self, pattern: str, path: str):
        self.pattern, self.path, self.i = pattern, path, 0

    def fail(self, why: str):
        raise SchemaError(f"JSON schema keyword 'pattern' at {self.path}: {self.pattern!r} cannot be enforced "
                          f"({why})")

    def gbnf(self) -> tuple[str, int, int | None]:
        """(GBNF body, shortest and longest match in characters, None for unbounded)."""
        p = self.pattern
        start = p.startswith("^")
        end = len(p) > int(start) and p.endswith("$") and not _escaped(p, len(p) - 1)
        self.text = p[1 if start else 0: len(p) - 1 if end else len(p)]
        body, lo, hi = self.alternation()
        if self.i != len(self.text):
            self.fail("unbalanced parenthesis")
        anywhere = '[^"\\\\\\x00-\\x1F]*'
        seq = ([] if start else [anywhere]) + [f"({body})" if body else '""'] + ([] if end else [anywhere])
        return " ".join(seq), lo, (hi if start and end else None)

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def alternation(self) -> tuple[str, int, int | None]:
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        body = " | ".join(b if b else '""' for b, _, _ in alts)
        hi = None if any(h is None for _, _, h in alts) else max(h for _, _, h in alts)
        return body, min(lo for _, lo, _ in alts), hi

    def sequence(self) -> tuple[str, int, int | None]:
        items, lo, hi = [], 0, 0
        while self.peek() not in ("", "|", ")"):
            body, a, b = self.quantified()
            items.append(body)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return " ".join(items), lo, hi

    def quantified(self) -> tuple[str, int, int | None]:
        body, lo, hi = self.atom()
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            n, m = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and re.match(r"\{\d+(,\d*)?\}", self.text[self.i:]):
            spec = re.match(r"\{(\d+)(,(\d*))?\}", self.text[self.i:])
            self.i += spec.end()
            n = int(spec.group(1))
            m = n if spec.group(2) is None else (int(spec.group(3)) if spec.group(3) else None)
            if m is not None and m < n:
                self.fail("a {n,m} quantifier with m < n")
        else:
            return body, lo, hi
        if self.peek() == "?":
            self.i += 1  # lazy: the same set of strings
        elif self.peek() in ("+", "*", "{"):
            self.fail("a possessive or repeated quantifier")
        if m is None:
            suffix = "*" if n == 0 else "+" if n == 1 else f"{{{n},}}"
        else:
            suffix = "?" if (n, m) == (0, 1) else f"{{{n}}}" if n == m else f"{{{n},{m}}}"
        return f"({body}){suffix}", lo * n, (None if m is None or hi is None else hi * m)

    def atom(self) -> tuple[str, int, int | None]:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.fail("lookaround, named groups and flags are not supported")
            body, lo, hi = self.alternation()
            if self.peek() != ")":
                self.fail("unbalanced parenthesis")
            self.i += 1
            return (f"({body})" if body else '""'), lo, hi
        if c == "[":
            return self.char_class(), 1, 1
        if c in ("*", "+", "?") or (c == "{" and re.match(r"\{\d*(,\d*)?\}", self.text[self.i:])):
            self.fail("nothing to repeat, or an ambiguous '{'")
        if c in ("^", "$"):
            self.fail("an anchor inside the pattern")
        if c == ".":
            self.i += 1
            return _chars_gbnf(_PRINTABLE), 1, 1
        if c == "\\":
            return _chars_gbnf(self.escape(in_class=False)), 1, 1
        if c in ("]", "}"):
            self.fail(f"an unescaped {c!r}")
        self.i += 1
        cp = ord(c)
        return _chars_gbnf([(cp, cp)]), 1, 1

    def escape(self, in_class: bool) -> list[tuple[int, int]]:
        self.i += 1
        c = self.peek()
        if not c:
            self.fail("a trailing backslash")
        self.i += 1
        classes = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c in classes:
            return classes[c]
        if c in ("D", "W", "S"):
            return _subtract(_PRINTABLE, classes[c.lower()])
        if c in _SIMPLE_ESCAPES and not (c == "0" and self.peek().isdigit()):
            cp = _SIMPLE_ESCAPES[c]
            return [(cp, cp)]
        if c in ("x", "u"):
            n = 2 if c == "x" else 4
            digits = self.text[self.i:self.i + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"a malformed \\{c} escape")
            self.i += n
            cp = int(digits, 16)
            if 0xD800 <= cp <= 0xDFFF:
                self.fail("a surrogate \\u escape")
            return [(cp, cp)]
        if not c.isalnum() and ord(c) < 0x80:
            return [(ord(c), ord(c))]
        self.fail(f"the escape \\{c}")

    def char_class(self) -> str:
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        if self.peek() == "]":
            self.fail("a class starting with ']'")
        ranges: list[tuple[int, int]] = []
        while True:
            c = self.peek()
            if not c:
                self.fail("an unterminated character class")
            if c == "]":
                self.i += 1
                break
            if c == "[" and self.text[self.i:self.i + 2] in ("[:", "[=", "[."):
                self.fail("POSIX classes")
            first = self.escape(True) if c == "\\" else [(ord(c), ord(c))]
            if c != "\\":
                self.i += 1
            single = len(first) == 1 and first[0][0] == first[0][1]
            if single and self.peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                d = self.peek()
                last = self.escape(True) if d == "\\" else [(ord(d), ord(d))]
                if d != "\\":
                    self.i += 1
                if len(last) != 1 or last[0][0] != last[0][1] or last[0][0] < first[0][0]:
                    self.fail("a bad range in a character class")
                ranges.append((first[0][0], last[0][0]))
            else:
                ranges.extend(first)
        if negate:
            ranges = _subtract(_PRINTABLE, ranges)
        try:
            return _chars_gbnf(ranges)
        except ValueError:
            self.fail("a character class that matches nothing generable")


def _escaped(text: str, index: int) -> bool:
    """Whether the character at ``index`` is escaped by an odd number of backslashes before it."""
    n = 0
    while index - n - 1 >= 0 and text[index - n - 1] == "\\":
        n += 1
    return n % 2 == 1
