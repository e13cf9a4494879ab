"""Schema normalization: rewrite a JSON schema into the forms llama.cpp's converter enforces exactly.

Merges ``allOf`` and the keywords beside ``$ref``/``anyOf``/``oneOf`` into each
alternative, filters ``enum``/``const`` by the rest of their schema, checks that
``oneOf`` alternatives are exclusive, and swaps the nodes the converter gets
wrong (bounded numbers, patterns, formats) for ``const`` placeholders whose
rules :func:`.grammar._link` puts in afterwards.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

import jsonschema

from ...errors import SchemaError, SchemaTooLargeError
from ..regex_worker import RegexSyntaxError, RegexTimeout, RegexWorker, RegexWorkerError, RegexWorkerUnavailable
from .numbers import NUMBER_DIGITS, OPEN_INTEGER_DIGITS, decimal_magnitudes, int_range
from .strings import FORMAT_CHECKER, FORMAT_LENGTHS, FORMAT_RULES, Regex

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
#: Seconds all of a schema's ``enum``/``const`` values may spend being matched against its ``pattern``\ s.
PATTERN_CHECK_SECONDS = 2.0

log = logging.getLogger(__name__)


class _PatternKeyword:
    """jsonschema's ``pattern`` keyword, matched in a :class:`~..regex_worker.RegexWorker`.

    jsonschema calls ``re.search``: a request's ``{"pattern": "^(a+)+$", "enum": ["aaaa…a!"]}`` would hold the
    GIL (every thread of a server with it) for as long as Python's backtracking takes, which doubles with each
    ``a``. In a child process it ends at :data:`PATTERN_CHECK_SECONDS` with a :class:`SchemaError`.
    """

    def __init__(self) -> None:
        self.worker: RegexWorker | None = None
        self.deadline = 0.0
        self.in_process = False

    def matches(self, pattern: str, value: str) -> bool:
        if self.in_process:
            return re.search(pattern, value) is not None
        if self.worker is None:
            self.worker = RegexWorker()
            self.deadline = time.monotonic() + PATTERN_CHECK_SECONDS
        try:
            return bool(self.worker.search(pattern, [value], limit=1, deadline=self.deadline))
        except RegexTimeout:
            raise SchemaError(f"JSON schema keyword 'pattern': matching the enum/const values against {pattern!r} "
                              f"took longer than {PATTERN_CHECK_SECONDS:g} s (a pattern that backtracks "
                              "catastrophically, such as (a+)+$, can take forever); simplify the pattern") from None
        except RegexSyntaxError as exc:
            raise SchemaError(f"JSON schema keyword 'pattern': {pattern!r} is not a regular expression ({exc})") \
                from None
        except RegexWorkerUnavailable as exc:  # (an embedded interpreter with no python to start)
            log.warning("matching JSON schema patterns in this process: %s", exc)
            self.in_process = True
            return re.search(pattern, value) is not None
        except RegexWorkerError as exc:
            raise SchemaError(f"JSON schema keyword 'pattern': {pattern!r} could not be checked ({exc})") from None

    def __call__(self, validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not self.matches(pattern, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")

    def close(self) -> None:
        worker, self.worker = self.worker, None  # (a later use starts a worker, and a deadline, of its own)
        if worker is not None:
            worker.close()


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


class Normalizer:
    def __init__(self, root: Any, max_steps: int = 0):
        self.root = root
        # Subschemas normalized so far, and the most allowed (0: no bound). A $ref with keywords beside it
        # is inlined at each use, so a schema of a few dozen nodes can expand exponentially (a 2.6 KB one
        # took 17 s and 337 MB): its size as written (schema_limits) does not bound the work.
        self.steps = 0
        self.max_steps = max_steps
        cls = jsonschema.validators.validator_for(root if isinstance(root, Mapping) else {})
        self.draft4 = cls is jsonschema.Draft4Validator
        self.legacy_items = cls is not jsonschema.Draft202012Validator  # items: [...] is a tuple
        self.patterns = _PatternKeyword()
        cls = jsonschema.validators.extend(cls, {"pattern": self.patterns})
        self.validator = cls(root if isinstance(root, Mapping) else {}, format_checker=FORMAT_CHECKER)
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
        finally:
            self.patterns.close()
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
        self.steps += 1
        if self.max_steps and self.steps > self.max_steps:
            raise SchemaTooLargeError(
                f"the JSON schema expands to more than {self.max_steps} subschemas once its $refs are inlined "
                f"(at {path}; SchemaLimits.max_nodes={self.max_steps})")
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
            return {json_type(v) for v in ([node["const"]] if "const" in node else node["enum"])}
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
            types &= {json_type(node["const"])}
        if "enum" in node:
            types &= {json_type(v) for v in node["enum"]}
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
        limit = 10 ** max([OPEN_INTEGER_DIGITS] + [len(str(abs(b))) for b in (lo, hi) if b is not None]) - 1
        lo = -limit if lo is None else lo
        hi = limit if hi is None else hi
        if lo > hi:
            raise _Unsatisfiable(path, "no integer between the bounds")
        return self.rule("integer-range", int_range(lo, hi), "number")

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
            body = decimal_magnitudes(low, None if lo is None else (-lo[0], lo[1]))
            if body:
                alts.append(f'"-" ({body})')
        if hi is None or hi[0] >= 0:
            body = decimal_magnitudes((Fraction(0), False) if lo is None or lo[0] < 0 else lo, hi)
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
            shortest, longest = FORMAT_LENGTHS[formats[0]]
            if min_len > shortest or (max_len is not None and max_len < longest):
                raise SchemaError(f"JSON schema keywords 'format' and 'minLength'/'maxLength' at {path} cannot be "
                                  f"enforced together ({formats[0]} strings have {shortest} to {longest} characters)")
            if formats[0] == "uuid":
                return {"type": "string", "format": "uuid"}
            return self.rule(formats[0] + "-string", f'"\\"" {FORMAT_RULES[formats[0]]} "\\""', "string")
        if patterns:
            body, shortest, longest = Regex(patterns[0], path).gbnf()
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


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value (``"null"``, ``"boolean"``, ``"number"``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
