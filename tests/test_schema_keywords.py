"""Every JSON Schema keyword the grammar claims to enforce, enforced: generated output always validates.

The checks work at the grammar level. ``Gbnf`` below parses the GBNF text and
samples random strings from it (every alternative, repetition count and
character class gets exercised, far more than a model would); each string must
parse as JSON and validate against the schema (``jsonschema``, with the string
formats checked too). Hypothesis generates the schemas. ``accepts`` runs a
string byte by byte through llama.cpp's own grammar sampler, which checks
both that the sampler here agrees with llama.cpp and that boundary values
(``180``, ``180.0`` for ``maximum: 180``) are accepted or refused as they
should be. Last, the tiny random-weight model samples under a few schemas at
temperature 1 with the real sampling path.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import math
import os
import random
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import llama_ctypes as lc
from llama_ctypes.native import llama_h as L

# ---- a GBNF parser and random sampler ---------------------------------------------------------------

_ESC = {"t": "\t", "n": "\n", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
# characters tried for negated classes (a negated class matches almost anything)
_POOL = [chr(c) for c in range(0x20, 0x7F)] + ["\x00", "\x01", "\t", "\n", "\x1f", "\x7f", "é", "中", "\u2028", "😀"]


class Gbnf:
    """A parsed GBNF grammar (one rule per line, as llama.cpp's converter and ours write them)."""

    def __init__(self, text: str):
        self.rules = {}
        for line in text.splitlines():
            if line.strip():
                name, body = line.split(" ::= ", 1)
                self.s, self.i = body, 0
                self.rules[name] = self._alt()
                assert self.i == len(body), f"unparsed GBNF: {body[self.i:]!r}"
        self._heights()

    # parsing: ("alt", [seq]), ("seq", [node]), ("lit", str), ("cls", negated, [(lo, hi)]), ("ref", name),
    # ("rep", node, min, max|None)
    def _ws(self):
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def _alt(self):
        alts = [self._seq()]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            alts.append(self._seq())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def _seq(self):
        items = []
        self._ws()
        while self.i < len(self.s) and self.s[self.i] not in "|)":
            items.append(self._postfix(self._atom()))
            self._ws()
        return ("seq", items)

    def _char(self) -> str:
        c = self.s[self.i]
        if c != "\\":
            self.i += 1
            return c
        e = self.s[self.i + 1]
        if e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            self.i += 2 + n
            return chr(int(self.s[self.i - n:self.i], 16))
        self.i += 2
        return _ESC[e]

    def _atom(self):
        c = self.s[self.i]
        if c == '"':
            self.i += 1
            out = []
            while self.s[self.i] != '"':
                out.append(self._char())
            self.i += 1
            return ("lit", "".join(out))
        if c == "[":
            self.i += 1
            negated = self.s[self.i] == "^"
            self.i += negated
            ranges = []
            while self.s[self.i] != "]":
                a = self._char()
                if self.s[self.i] == "-" and self.s[self.i + 1] != "]":
                    self.i += 1
                    ranges.append((ord(a), ord(self._char())))
                else:
                    ranges.append((ord(a), ord(a)))
            self.i += 1
            return ("cls", negated, ranges)
        if c == "(":
            self.i += 1
            node = self._alt()
            assert self.s[self.i] == ")"
            self.i += 1
            return node
        m = re.compile(r"[a-zA-Z0-9-]+").match(self.s, self.i)
        self.i = m.end()
        return ("ref", m.group())

    def _postfix(self, node):
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in "*+?":
                self.i += 1
                node = ("rep", node, 0 if c != "+" else 1, 1 if c == "?" else None)
            elif c == "{":
                m = re.compile(r"\{(\d+)(,(\d*))?\}").match(self.s, self.i)
                self.i = m.end()
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                node = ("rep", node, lo, hi)
            else:
                return node
        return node

    # sampling
    def _height(self, node, h):
        kind = node[0]
        if kind in ("lit", "cls"):
            return 0
        if kind == "ref":
            return 1 + h[node[1]]
        if kind == "seq":
            return max((self._height(n, h) for n in node[1]), default=0)
        if kind == "alt":
            return min(self._height(n, h) for n in node[1])
        return 0 if node[2] == 0 else self._height(node[1], h)

    def _heights(self):
        h = dict.fromkeys(self.rules, math.inf)
        changed = True
        while changed:
            changed = False
            for name, body in self.rules.items():
                v = self._height(body, h)
                if v < h[name]:
                    h[name], changed = v, True
        self.h = h

    def sample(self, rng: random.Random, root: str = "root", depth: int = 12) -> str:
        out: list[str] = []
        self._gen(("ref", root), rng, depth, out)
        return "".join(out)

    def _gen(self, node, rng, depth, out):
        kind = node[0]
        if kind == "lit":
            out.append(node[1])
        elif kind == "cls":
            _, negated, ranges = node
            if negated:
                options = [c for c in _POOL if not any(a <= ord(c) <= b for a, b in ranges)]
                out.append(rng.choice(options))
            else:
                a, b = rng.choice(ranges)
                cp = rng.choice([a, b, rng.randint(a, b)])
                out.append(chr(cp))
        elif kind == "ref":
            self._gen(self.rules[node[1]], rng, depth - 1, out)
        elif kind == "seq":
            for n in node[1]:
                self._gen(n, rng, depth, out)
        elif kind == "alt":
            alts = node[1]
            if depth <= 0:  # deep enough: head for the shortest derivation
                best = min(self._height(a, self.h) for a in alts)
                alts = [a for a in alts if self._height(a, self.h) == best]
            self._gen(rng.choice(alts), rng, depth, out)
        else:
            _, inner, lo, hi = node
            if depth <= 0:
                n = lo
            else:
                top = hi if hi is not None else lo + 4
                n = rng.choice([lo, top, rng.randint(lo, top)])
            for _ in range(n):
                self._gen(inner, rng, depth, out)

    # bounds
    def max_bytes(self, root: str = "root") -> float:
        """The longest string the grammar generates, in UTF-8 bytes (inf when unbounded)."""
        return self._max(("ref", root), set())

    def _max(self, node, active):
        kind = node[0]
        if kind == "lit":
            return len(node[1].encode())
        if kind == "cls":
            return 4 if node[1] else max(len(chr(b).encode()) for _, b in node[2])
        if kind == "ref":
            if node[1] in active:
                return math.inf
            return self._max(self.rules[node[1]], active | {node[1]})
        if kind == "seq":
            return sum(self._max(n, active) for n in node[1])
        if kind == "alt":
            return max(self._max(n, active) for n in node[1])
        inner = self._max(node[1], active)
        return math.inf if node[3] is None and inner else (node[3] or 0) * inner


# ---- llama.cpp's grammar, fed a string ---------------------------------------------------------------

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Acceptor:
    """Runs strings through llama.cpp's grammar sampler, one byte token at a time."""

    def __init__(self, model):
        self.model = model
        self.byte_token = {}
        for tok in range(lc.Tokenizer.n_tokens(model)):
            piece = lc.Tokenizer.token_bytes(model, tok)
            if len(piece) == 1:
                self.byte_token.setdefault(piece[0], tok)
        self.eos = lc.Tokenizer.eos(model)
        self.one = np.zeros(1, dtype=_TOKEN_DATA)
        self.arr = L.llama_token_data_array(self.one.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), 1, -1,
                                            False)

    def __call__(self, gbnf: str, *texts: str) -> list[bool]:
        """For each text: does the grammar accept it, whole?"""
        sampler = lc.Sampler.create(self.model, grammar=gbnf)
        try:
            results = []
            for text in texts:
                sampler.reset()
                results.append(self._run(sampler, text))
            return results
        finally:
            sampler.close()

    def _allowed(self, sampler, tok: int) -> bool:
        self.one[0] = (tok, 0.0, 0.0)
        self.arr.size, self.arr.selected, self.arr.sorted = 1, -1, False
        sampler._lib.llama_sampler_apply(sampler._grammar, ctypes.byref(self.arr))
        return bool(np.isfinite(self.one[0]["logit"]))

    def _run(self, sampler, text: str) -> bool:
        for byte in text.encode():
            tok = self.byte_token[byte]
            if not self._allowed(sampler, tok):
                return False
            sampler._lib.llama_sampler_accept(sampler._grammar, tok)
        return self._allowed(sampler, self.eos)


@pytest.fixture(scope="session")
def accepts(tiny_model):
    return Acceptor(tiny_model)


# ---- validation ---------------------------------------------------------------------------------------

FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date", raises=ValueError)
def _date(value):
    return not isinstance(value, str) or bool(re.fullmatch(r"\d{4}-\d\d-\d\d", value) and dt.date.fromisoformat(value))


@FORMATS.checks("time", raises=ValueError)
def _time(value):
    ok = re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value) if isinstance(value, str) else True
    return not isinstance(value, str) or bool(ok and dt.time.fromisoformat(value.replace("Z", "+00:00")))


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value):
    if not isinstance(value, str):
        return True
    date, _, time = value.partition("T")
    return _date(date) and _time(time)


def validate(text: str, schema) -> None:
    value = json.loads(text)  # strict: raw control characters in strings are refused
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=FORMATS).validate(value)


def check_samples(schema, n: int = 25, seed: int = 0, accepts=None) -> Gbnf:
    """n random strings from the schema's grammar all validate; the first ones also pass llama.cpp's grammar."""
    text = lc.grammar.from_json_schema(schema)
    gbnf = Gbnf(text)
    rng = random.Random(seed)
    samples = [gbnf.sample(rng) for _ in range(n)]
    for s in samples:
        try:
            validate(s, schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"grammar generated invalid output {s!r} for {schema}: {exc}\n{text}") from None
    if accepts is not None:
        assert all(accepts(text, *samples[:3])), f"llama.cpp's grammar refuses a sample of {text}"
    return gbnf


# SCHEMA_EXAMPLES=2000 for a longer hunt
SETTINGS = settings(max_examples=int(os.environ.get("SCHEMA_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.filter_too_much])

# ---- numbers --------------------------------------------------------------------------------------------


def test_number_bounds_are_enforced(accepts):
    # The issue: minimum/maximum on a number were dropped, and -1000000000000000 came out.
    schema = {"type": "number", "minimum": -180, "maximum": 180}
    gbnf = lc.grammar.from_json_schema(schema)
    good = ["180", "180.0", "180.00", "-180", "-180.0", "0", "-0.5", "179.999", "12.25", "-179.9999999999"]
    bad = ["-1000000000000000", "180.5", "181", "-180.001", "1e3", "1.8e2", "200", "1000", "-181", "180.0000001"]
    assert accepts(gbnf, *good) == [True] * len(good)
    assert accepts(gbnf, *bad) == [False] * len(bad)
    check_samples(schema, n=300)


def test_exclusive_and_fractional_bounds_at_the_boundary(accepts):
    cases = [
        ({"type": "number", "exclusiveMaximum": 180}, ["179.999", "179", "-3", "0"], ["180", "180.0", "180.000"]),
        ({"type": "number", "exclusiveMinimum": 0}, ["0.001", "1", "3.5"], ["0", "0.0", "-0", "-0.0", "-1"]),
        ({"type": "number", "minimum": 0.5}, ["0.5", "0.50", "0.6", "7"], ["0.49999", "0.4", "0", "-0.5"]),
        ({"type": "number", "minimum": -5.5, "maximum": -2}, ["-5.5", "-2", "-2.0", "-3.25"],
         ["-5.51", "-1.9", "2", "-0", "0", "-6"]),
        ({"type": "number", "exclusiveMinimum": 0.1, "exclusiveMaximum": 0.2}, ["0.15", "0.1000001", "0.19999"],
         ["0.1", "0.10", "0.2", "0.2000", "0.25", "0.05"]),
        ({"type": "integer", "minimum": 1, "maximum": 6}, ["1", "6", "3"], ["0", "7", "1.0", "-1", "10"]),
        ({"type": "integer", "exclusiveMinimum": -3.5, "exclusiveMaximum": 2}, ["-3", "1", "0"],
         ["-4", "2", "-0"]),
        ({"type": "integer", "minimum": 3, "exclusiveMinimum": 5}, ["6", "100"], ["5", "4", "3"]),  # both apply
    ]
    for schema, good, bad in cases:
        gbnf = lc.grammar.from_json_schema(schema)
        assert accepts(gbnf, *good) == [True] * len(good), (schema, good)
        assert accepts(gbnf, *bad) == [False] * len(bad), (schema, bad)
        check_samples(schema, n=100)


def _bound_values():
    return st.one_of(st.integers(-1000, 1000), st.integers(-10 ** 12, 10 ** 12),
                     st.decimals(-1000, 1000, places=3).map(float),
                     st.sampled_from([0, 0.1, 0.2, 0.3, 1e-7, -0.001, 179.99999999999997, 1e9, 2 ** 40 + 0.5, 1e-14,
                                      123456789.123456, 999999999999999, -1e15]))


@st.composite
def numeric_schemas(draw):
    schema = {"type": draw(st.sampled_from(["number", "integer"]))}
    for key in draw(st.sets(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
                            min_size=1)):
        schema[key] = draw(_bound_values())
    return schema


def _representable(value) -> str | None:
    """``value`` as a plain decimal of at most 15 digits (what bounded numbers use), or None."""
    text = repr(value) if isinstance(value, float) else str(value)
    if "e" in text or "inf" in text:
        return None
    return text if len(text.lstrip("-").replace(".", "")) <= 15 else None


@SETTINGS
@given(schema=numeric_schemas())
def test_random_numeric_bounds_are_enforced_and_reach_the_bounds(schema, accepts):
    try:
        gbnf = check_samples(schema, n=30, accepts=accepts)
    except lc.SchemaError as exc:
        assert re.search(r"no (JSON value|number|integer)", str(exc)), exc
        assume(False)
    text = lc.grammar.from_json_schema(schema)
    lo = max([schema[k] for k in ("minimum", "exclusiveMinimum") if k in schema], default=None)
    hi = min([schema[k] for k in ("maximum", "exclusiveMaximum") if k in schema], default=None)
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = schema.get(key)
        literal = _representable(bound) if bound is not None else None
        if literal is None or bound not in (lo, hi):
            continue
        is_int = float(bound).is_integer()
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(literal))
        if schema["type"] == "integer" and not is_int:
            continue
        if schema["type"] == "integer":
            literal = str(int(bound))
        # an inclusive bound is generated (if no other bound excludes it); an exclusive one never is
        assert accepts(text, literal) == [valid], (schema, literal)
        padded = literal + (".0" if "." not in literal else "0")
        if schema["type"] == "number" and len(padded.lstrip("-").replace(".", "")) <= 15:
            assert accepts(text, padded) == [valid], (schema, padded)
    assert gbnf.max_bytes() < math.inf  # no exponent, no unbounded digit strings


def test_unsatisfiable_or_unrepresentable_bounds_are_refused():
    with pytest.raises(lc.SchemaError, match="no JSON value satisfies"):
        lc.grammar.from_json_schema({"type": "integer", "minimum": 5, "maximum": 4})
    with pytest.raises(lc.SchemaError, match="no JSON value satisfies"):
        lc.grammar.from_json_schema({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2})
    with pytest.raises(lc.SchemaError, match="exclusiveMaximum, exclusiveMinimum.* at most 15 digits"):
        lc.grammar.from_json_schema({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-16})
    with pytest.raises(lc.SchemaError, match="minimum.* at most 15 digits"):
        lc.grammar.from_json_schema({"type": "number", "minimum": 1e16})


# ---- strings --------------------------------------------------------------------------------------------

def test_patterns_are_enforced_and_json_escaped(accepts):
    zip5 = {"type": "string", "pattern": r"^\d{5}$"}
    gbnf = lc.grammar.from_json_schema(zip5)
    assert accepts(gbnf, '"12345"', '"1234"', '"123456"', '"abcde"') == [True, False, False, False]
    check_samples(zip5)
    # quotes, backslashes and control characters in the value are written as JSON escapes
    odd = {"type": "string", "pattern": '^a"b\\\\c\\td[^x]{2}$'}
    check_samples(odd, n=100, accepts=accepts)
    assert accepts(lc.grammar.from_json_schema(odd), '"a\\"b\\\\c\\tdyz"') == [True]
    # unanchored: the match may sit anywhere
    check_samples({"type": "string", "pattern": "ab+c"}, n=100)
    check_samples({"type": "string", "pattern": "^(?:[A-Z][a-z]*|_)( [A-Z]\\.)?$"}, n=100)


def test_unenforceable_patterns_are_refused():
    for pattern, why in [(r"^(a)\1$", "escape"), (r"^(?=a)a$", "lookaround"), (r"^\bx$", "escape"),
                         (r"^a$|^b$", "anchor"), (r"^(?i:a)$", "flags")]:
        with pytest.raises(lc.SchemaError, match=f"'pattern'.*{why}"):
            lc.grammar.from_json_schema({"type": "string", "pattern": pattern})
    with pytest.raises(lc.SchemaError, match="'pattern' and 'minLength'/'maxLength'"):
        lc.grammar.from_json_schema({"type": "string", "pattern": "^a+$", "maxLength": 5})
    # lengths the pattern implies anyway are fine
    check_samples({"type": "string", "pattern": "^[a-z]{2,4}$", "minLength": 1, "maxLength": 4})
    with pytest.raises(lc.SchemaError, match="two patterns"):
        lc.grammar.from_json_schema({"allOf": [{"pattern": "^a+$"}, {"pattern": "^a{1,3}$"}]})


def test_formats_generate_real_dates(accepts):
    schema = {"type": "string", "format": "date"}
    gbnf = lc.grammar.from_json_schema(schema)
    assert accepts(gbnf, '"2024-02-29"', '"2023-02-29"', '"2023-04-31"', '"0000-01-01"', '"2023-12-31"') == [
        True, False, False, False, True]
    for fmt in ("date", "time", "date-time", "uuid"):
        check_samples({"type": "string", "format": fmt}, n=200, accepts=accepts)


def test_string_lengths_count_characters(accepts):
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    gbnf = lc.grammar.from_json_schema(schema)
    # a \u escape of a surrogate pair is one character in two escapes: not generated
    assert accepts(gbnf, '"\\ud83d\\ude00"', '"ab"', '"\\u00e9\\n"') == [False, True, True]
    check_samples(schema, n=200, accepts=accepts)


# ---- hypothesis: random schemas for each keyword --------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "name", "x y", "ü", "id_2", "$x"])
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-50, 50) | st.sampled_from([0.5, -2.25])
                           | st.text(alphabet='ab"\\é\n', max_size=4),
                           lambda inner: st.lists(inner, max_size=2) | st.dictionaries(NAMES, inner, max_size=2),
                           max_leaves=4)

REGEX_ATOMS = st.sampled_from(["a", "b", "\\d", "\\w", "\\s", ".", "[a-c]", "[^a]", "[0-9A-F]", "\\.", "\\\\", '"',
                               "é", "\\t", "-", " ", "[\\]x-]", "\\D", "\\S", "[^\\d\\s]", "(?:ab|c)", "(x|)"])


@st.composite
def patterns(draw):
    pieces = []
    for atom in draw(st.lists(REGEX_ATOMS, min_size=1, max_size=5)):
        pieces.append(atom + draw(st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,3}", "{2,}", "*?"])))
    body = "".join(pieces)
    if draw(st.booleans()):
        body = f"(?:{body})|{draw(REGEX_ATOMS)}"
    return ("^" if draw(st.booleans()) else "") + body + ("$" if draw(st.booleans()) else "")


def leaves():
    strings = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 3), "maxLength": st.integers(3, 8)})
    return st.one_of(
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "integer"}, {"type": "number"}, {}]),
        numeric_schemas(), strings,
        st.builds(lambda p: {"type": "string", "pattern": p}, patterns()),
        st.sampled_from([{"type": "string", "format": f} for f in ("date", "time", "date-time", "uuid")]),
        st.builds(lambda v: {"enum": v}, st.lists(JSON_VALUES, min_size=1, max_size=4)),
        st.builds(lambda v: {"const": v}, JSON_VALUES),
    )


def objects(children):
    return st.builds(
        lambda props, required, additional, extra: {
            "type": "object", "properties": props, "required": [n for n in required if n in props or extra],
            **({"additionalProperties": additional} if additional is not None else {})},
        st.dictionaries(NAMES, children, max_size=3), st.lists(NAMES, max_size=2, unique=True),
        st.one_of(st.none(), st.booleans(), children), st.booleans())


def arrays(children):
    return st.one_of(
        st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
                  children, st.integers(0, 2), st.integers(0, 3)),
        st.builds(lambda prefix, rest, bounds: {"type": "array", "prefixItems": prefix, **rest, **bounds},
                  st.lists(children, min_size=1, max_size=3),
                  st.sampled_from([{}, {"items": False}, {"items": {"type": "integer", "maximum": 3}}]),
                  st.sampled_from([{}, {"minItems": 1}, {"maxItems": 1}, {"minItems": 4}, {"minItems": 2,
                                                                                           "maxItems": 2}])))


def composites(children):
    fragments = st.sampled_from([{"minimum": 0}, {"maxLength": 4}, {"type": ["string", "number"]}, {"required": ["a"]},
                                 {"maxItems": 1}, {"properties": {"a": {"type": "integer"}}}, {"exclusiveMaximum": 7},
                                 {"type": "integer"}, {"minLength": 1}])
    return st.one_of(
        objects(children), arrays(children),
        st.lists(children, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
        st.builds(lambda child, frags: {"allOf": [child, *frags]}, children, st.lists(fragments, max_size=2)),
        st.builds(lambda child, frag: {**child, **frag} if "$ref" not in child else child, children, fragments),
        st.builds(lambda child, types: {**child, "type": types}, numeric_schemas() | leaves(),
                  st.sampled_from([["number", "null"], ["string", "integer"], ["boolean", "string", "null"]])),
    )


def schemas():
    return st.recursive(leaves(), composites, max_leaves=6)


@st.composite
def with_refs(draw):
    """A schema whose definitions are used through $ref, with siblings, and recursively."""
    defs = draw(st.dictionaries(st.sampled_from(["A", "B", "C"]), schemas(), min_size=1, max_size=2))
    names = sorted(defs)
    use = st.sampled_from(names).map(lambda n: {"$ref": f"#/$defs/{n}"})
    sibling = st.sampled_from([{}, {"description": "x"}, {"maximum": 3}, {"maxLength": 2}, {"type": "string"}])
    props = draw(st.dictionaries(NAMES, st.builds(lambda r, s: {**r, **s}, use, sibling), min_size=1, max_size=3))
    schema = {"$defs": defs, "type": "object", "properties": props, "required": sorted(props)[:1],
              "additionalProperties": False}
    if draw(st.booleans()):  # a recursive definition: a list of itself
        defs["Tree"] = {"type": "object", "properties": {"v": {"$ref": f"#/$defs/{names[0]}"},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"},
                                                                  "maxItems": 2}},
                        "required": ["v"], "additionalProperties": False}
        schema["properties"]["tree"] = {"$ref": "#/$defs/Tree"}
    return schema


@st.composite
def one_ofs(draw):
    kind = draw(st.sampled_from(["types", "tagged", "any"]))
    if kind == "types":
        alts = draw(st.lists(st.sampled_from([{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0},
                                              {"type": "null"}, {"type": "array", "items": {"type": "boolean"}}]),
                             min_size=2, max_size=3, unique_by=lambda s: s["type"]))
    elif kind == "tagged":
        alts = [{"type": "object", "properties": {"kind": {"const": tag}, "v": draw(schemas())},
                 "required": ["kind", "v"], "additionalProperties": False} for tag in ("cat", "dog")]
    else:
        alts = draw(st.lists(schemas(), min_size=2, max_size=3))
    return {"oneOf": alts}


KEYWORD_SCHEMAS = {
    "bounds": numeric_schemas(),
    "enum and const with other keywords": st.builds(
        lambda values, other: {**other, "enum": values}, st.lists(JSON_VALUES, min_size=1, max_size=6),
        st.sampled_from([{}, {"type": "string"}, {"type": "integer", "minimum": 0}, {"maxLength": 2},
                         {"type": ["number", "null"]}, {"type": "object", "required": ["a"]}])),
    "properties, required, additionalProperties": objects(schemas()),
    "items, prefixItems, minItems, maxItems": arrays(schemas()),
    "anyOf and type lists": st.builds(lambda alts: {"anyOf": alts}, st.lists(schemas(), min_size=1, max_size=3)),
    "allOf": st.builds(lambda a, b: {"allOf": [a, b]}, schemas(), schemas()),
    "oneOf": one_ofs(),
    "$ref and $defs": with_refs(),
    "pattern": st.builds(lambda p: {"type": "string", "pattern": p}, patterns()),
    "everything": schemas(),
}

EXPECTED_REFUSALS = re.compile(r"no JSON value satisfies|no number of at most|cannot be enforced together|two patterns|"
                               r"'oneOf'.*may both match|cannot be enforced \(|more than \d+ alternatives")


@pytest.mark.parametrize("keyword", sorted(KEYWORD_SCHEMAS))
def test_generated_output_validates(keyword, accepts):
    @SETTINGS
    @given(schema=KEYWORD_SCHEMAS[keyword], seed=st.integers(0, 2 ** 16))
    def run(schema, seed):
        try:
            check_samples(schema, n=15, seed=seed, accepts=accepts)
        except lc.SchemaError as exc:
            assert EXPECTED_REFUSALS.search(str(exc)), exc
            assume(False)

    run()


def test_combinations_the_converter_ignored_are_enforced(accepts):
    cases = [
        # keywords beside $ref, anyOf and enum used to be dropped
        {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
        {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]},
        {"type": "string", "enum": ["a", "bb", 3, "cccc"], "maxLength": 2},
        # allOf of non-objects used to produce {}
        {"allOf": [{"type": "string"}, {"maxLength": 3}]},
        {"allOf": [{"type": "number", "minimum": 0}, {"maximum": 1}]},
        # required names outside properties, and merged objects
        {"type": "object", "required": ["a"]},
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                   {"properties": {"a": {"minimum": 10}}, "additionalProperties": False}]},
        # tuples: prefixItems with items, and maxItems below the prefix
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "maxItems": 1},
        {"type": "array", "prefixItems": [{"const": 1}], "items": {"type": "boolean"}, "minItems": 3},
        # a draft-4 boolean exclusiveMinimum, and draft-7 tuple items
        {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0,
         "exclusiveMinimum": True, "maximum": 1},
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "null"}],
         "additionalItems": False},
        # no type: numeric keywords constrain numbers
        {"minimum": 2, "maximum": 3},
    ]
    for schema in cases:
        check_samples(schema, n=200, accepts=accepts)
    with pytest.raises(lc.SchemaError, match="no JSON value satisfies"):
        lc.grammar.from_json_schema({"type": "string", "const": "abc", "maxLength": 2})
    with pytest.raises(lc.SchemaError, match="'oneOf'.*may both match"):
        lc.grammar.from_json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    tagged = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "v": {"type": "integer"}},
                         "required": ["k", "v"]},
                        {"type": "object", "properties": {"k": {"const": "b"}, "v": {"type": "string"}},
                         "required": ["k", "v"]}]}
    check_samples(tagged, n=100, accepts=accepts)


def test_pydantic_field_constraints_are_enforced(accepts):
    pydantic = pytest.importorskip("pydantic")
    from typing import Annotated, Literal

    class Point(pydantic.BaseModel):
        lat: float = pydantic.Field(ge=-90, le=90)
        lon: float = pydantic.Field(gt=-180, lt=180)
        label: Annotated[str, pydantic.StringConstraints(max_length=8, pattern=r"^[A-Z][a-z]*$")] = "X"

    class Cat(pydantic.BaseModel):
        pet: Literal["cat"]
        lives: int = pydantic.Field(ge=1, le=9)

    class Dog(pydantic.BaseModel):
        pet: Literal["dog"]
        good: bool

    class Walk(pydantic.BaseModel):
        where: list[Point] = pydantic.Field(max_length=3)
        who: Cat | Dog = pydantic.Field(discriminator="pet")
        note: str | None = pydantic.Field(default=None, max_length=10)

    schema = lc.schema.to_json_schema(Walk)
    with pytest.raises(lc.SchemaError, match="'pattern' and 'minLength'/'maxLength'"):
        lc.grammar.from_json_schema(schema)  # a pattern with a maxLength it does not imply
    schema["$defs"]["Point"]["properties"]["label"]["pattern"] = "^[A-Z][a-z]{0,7}$"
    check_samples(schema, n=100, accepts=accepts)
    rng = random.Random(1)
    gbnf = Gbnf(lc.grammar.from_json_schema(schema))
    for _ in range(50):
        Walk.model_validate_json(gbnf.sample(rng))


# ---- the real sampler, on random weights --------------------------------------------------------------

def test_tiny_model_output_validates_at_high_temperature(tiny_model):
    # Random weights spread probability over the whole vocabulary: only the grammar makes these valid.
    schemas = [
        {"type": "number", "minimum": -180, "maximum": 180},
        {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "minItems": 1,
         "maxItems": 3},
        {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                          "z": {"type": "string", "pattern": r"^\d{3}-[a-z]{2}$"},
                                          "n": {"type": "integer", "minimum": -5, "maximum": 1234}},
         "required": ["d", "z", "n"], "additionalProperties": False},
    ]
    finished = 0
    for schema in schemas:
        for seed in range(3):
            done = lc.generate(tiny_model, "x", json_schema=schema, temp=1.5, seed=seed, max_tokens=80,
                               top_k=0, top_p=1.0, min_p=0.0)
            if done.finish_reason == "eog":
                validate(done.text, schema)
                finished += 1
            else:
                assert done.finish_reason == "length"
    assert finished >= 5


def test_draft7_tuples_are_read_as_prefix_items(accepts):
    # llama-server reads {"items": [...]} (drafts 4 to 7) as a tuple; the 2020-12 check refused it.
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
              "items": [{"type": "integer"}, {"type": "string", "maxLength": 3}], "additionalItems": False}
    check_samples(draft7, accepts=accepts)
    modern = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}],
              "items": False}
    assert lc.grammar.from_json_schema(draft7) == lc.grammar.from_json_schema(modern)
    # without $schema too (the form says which draft it is)
    assert lc.grammar.from_json_schema({k: v for k, v in draft7.items() if k != "$schema"}) == \
        lc.grammar.from_json_schema(modern)
    with pytest.raises(lc.SchemaError):  # a 2020-12 schema keeps 2020-12's meaning: items must be a schema
        lc.grammar.from_json_schema({**draft7, "$schema": "https://json-schema.org/draft/2020-12/schema"})


def test_the_tuple_rewrite_leaves_data_and_property_names_alone():
    schema = {"type": "object", "required": ["t", "c", "$schema"], "properties": {
        "t": {"type": "array", "items": [{"type": "string"}]},
        "c": {"const": {"items": [1]}},
        "$schema": {"type": "integer"}}}
    gbnf = Gbnf(lc.grammar.from_json_schema(schema))
    rng = random.Random(0)
    for _ in range(20):
        value = json.loads(gbnf.sample(rng))
        assert value["c"] == {"items": [1]} and isinstance(value["$schema"], int)
        assert len(value["t"]) == 1 and isinstance(value["t"][0], str)
