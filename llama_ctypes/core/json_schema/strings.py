"""GBNF for strings: the ``format`` rules (real calendar dates, uuid) and ``pattern`` translation.

A pattern (a regular-expression subset) becomes grammar producing the string's
JSON encoding; the format rules and checks agree on exactly which strings pass.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import jsonschema

from ...errors import InvalidArgumentError, SchemaError

#: String formats the grammar enforces.
SUPPORTED_FORMATS = frozenset({"date", "time", "date-time", "uuid"})


# ---- string formats ----------------------------------------------------------------------------------

_LEAP = '("0" [48] | [2468] [048] | [13579] [26])'
_DATE = ('(([1-9] [0-9]{3} | "0" ([1-9] [0-9]{2} | "0" ([1-9] [0-9] | "0" [1-9]))) "-" ('
         '("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | '
         '("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | '
         '"02-" ("0" [1-9] | "1" [0-9] | "2" [0-8])) | '
         f'([0-9] [0-9] {_LEAP} | {_LEAP} "00") "-02-29")')
_TIME = ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})? '
         '("Z" | [+\\-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])')
FORMAT_RULES = {"date": _DATE, "time": f"({_TIME})", "date-time": f'{_DATE} "T" {_TIME}'}
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
FORMAT_CHECKER = jsonschema.FormatChecker(formats=())
for _fmt in SUPPORTED_FORMATS:
    FORMAT_CHECKER.checks(_fmt)(_format_check(_fmt))

FORMAT_LENGTHS = {"date": (10, 10), "time": (9, 18), "date-time": (20, 29), "uuid": (36, 36)}


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


def subtract_ranges(universe: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
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


def chars_gbnf(ranges: list[tuple[int, int]]) -> str:
    """GBNF for one character from ``ranges``, as it appears inside a JSON string (escaped where JSON needs)."""
    ranges = _normalize_ranges(ranges)
    special = [cp for a, b in ranges for cp in range(a, min(b, 0x5C) + 1) if cp < 0x20 or cp in (0x22, 0x5C)]
    raw = subtract_ranges(ranges, [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)])
    alts = []
    if raw:
        alts.append("[" + "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}"
                                  for a, b in raw) + "]")
    for cp in special:
        alts.append('"' + _JSON_ESCAPES.get(cp, f"\\\\u{cp:04x}") + '"')
    if not alts:
        raise InvalidArgumentError("empty character class")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


class Regex:
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
            return chars_gbnf(_PRINTABLE), 1, 1
        if c == "\\":
            return chars_gbnf(self.escape(in_class=False)), 1, 1
        if c in ("]", "}"):
            self.fail(f"an unescaped {c!r}")
        self.i += 1
        cp = ord(c)
        return chars_gbnf([(cp, cp)]), 1, 1

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
            return subtract_ranges(_PRINTABLE, classes[c.lower()])
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
            ranges = subtract_ranges(_PRINTABLE, ranges)
        try:
            return chars_gbnf(ranges)
        except ValueError:
            self.fail("a character class that matches nothing generable")


def _escaped(text: str, index: int) -> bool:
    """Whether the character at ``index`` is escaped by an odd number of backslashes before it."""
    n = 0
    while index - n - 1 >= 0 and text[index - n - 1] == "\\":
        n += 1
    return n % 2 == 1
