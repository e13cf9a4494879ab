"""GBNF for bounded ``number``/``integer``: exact decimal digit ranges between two bounds.

No exponent and at most :data:`NUMBER_DIGITS` significant digits, so a generated
value compares with its bounds the same before and after parsing to a float
(llama.cpp's converter ignores number bounds).
"""

from __future__ import annotations

import math
from fractions import Fraction

#: Digits (integer and fraction) of a generated bounded ``number``: any decimal this short converts to a
#: distinct float, so comparing it with a bound gives the same answer before and after parsing.
NUMBER_DIGITS = 15
#: Digits of a bounded ``integer`` with an open side, as llama.cpp's unbounded integers.
OPEN_INTEGER_DIGITS = 16


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


def int_range(lo: int, hi: int) -> str:
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


def decimal_magnitudes(low: tuple[Fraction, bool], high: tuple[Fraction, bool] | None) -> str:
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
