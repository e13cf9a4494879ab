"""Lazy-grammar trigger patterns checked before llama.cpp compiles them with ``std::regex``.

llama.cpp matches every trigger against the end of the text generated so far at each token, in the
sampler (C++: nothing can interrupt it, and a Server's other requests wait): a pattern that backtracks
catastrophically there freezes a request for minutes. :func:`check_trigger_pattern` refuses those
shapes; docs/structured_output.md lists them.
"""

from __future__ import annotations

import re

from ..errors import InvalidArgumentError

__all__ = ["check_trigger_pattern", "normalize_trigger", "MAX_TRIGGER_CHARS", "MAX_TRIGGER_UNBOUNDED",
           "MAX_TRIGGER_WAYS"]

#: Longest lazy-grammar trigger pattern, and most unbounded quantifiers in one (characters, count): .*.*X is
#: already quadratic in the text searched at every token (llama.cpp's own triggers have at most one).
MAX_TRIGGER_CHARS = 1024
MAX_TRIGGER_UNBOUNDED = 2
#: Most ways the bounded quantifiers of one trigger can split a text: the product of (n - m + 1) over x{m,n}
#: (x? is 2). (.?){17}.{17} took 9 s per call, .{1,25} four times 20 s per 30 tokens.
MAX_TRIGGER_WAYS = 256
_RANGE = re.compile(r"\{(\d*)(,?)(\d*)\}")
#: A whole-output trigger's head and tail (llama.cpp's PATTERN_FULL form ^[\s\S]*?(X)[\s\S]*$): a search
#: for what is between them finds the same match.
_ANY_HEAD = re.compile(r"^\^(?:\[\\s\\S\]\*\??|\(\?:\[\\s\\S\]\*\??\))")
_ANY_TAIL = re.compile(r"(?:\[\\s\\S\]\*\??|\(\?:\[\\s\\S\]\*\??\))\$$")


def normalize_trigger(pattern: str) -> str:
    r"""``^[\s\S]*?X[\s\S]*$`` as the search for ``X`` it amounts to. llama.cpp (as patched here) looks for
    a trigger in the last 256 bytes of the output and tries one anchored with ``^`` only while the output
    is that short; this form means "X anywhere" and must keep working at any length."""
    head = _ANY_HEAD.match(pattern)
    if head:
        pattern = pattern[head.end():]
    tail = _ANY_TAIL.search(pattern)
    if tail and (tail.start() == 0 or pattern[tail.start() - 1] != "\\"):
        pattern = pattern[:tail.start()]
    return pattern


def _escape_end(pattern: str, i: int) -> int:
    r"""Where the escape at ``i`` ends: ``\xHH``, ``\uHHHH`` and ``\cX`` are one atom each."""
    kind = pattern[i + 1:i + 2]
    return i + {"x": 4, "u": 6, "c": 3}.get(kind, 2)


def check_trigger_pattern(pattern: str) -> None:
    """Refuse a trigger regex that can backtrack catastrophically in llama.cpp's ``std::regex``.

    llama.cpp matches every trigger against the text generated so far at each token, in the sampler (C++:
    nothing can interrupt it, and a Server's other requests wait): ``(.*.*)*x`` ran for minutes. A quantified
    group whose content is itself quantified or holds alternatives (``(a+)+``, ``(a|aa)*``) is the classic
    exponential case; llama.cpp's own triggers (``<tool_call>``, ``<\\|start\\|>assistant(\\s+to)``) have none.
    """
    if len(pattern) > MAX_TRIGGER_CHARS:
        raise InvalidArgumentError(f"a grammar_lazy_triggers pattern of {len(pattern)} characters (at most "
                                   f"{MAX_TRIGGER_CHARS})")
    groups: list[bool] = []  # per open group: whether it holds a quantifier or an alternative
    starts: list[int] = []  # per open group: where its content starts
    # Per item read, in order: [the bytes it matches, its group depth, "unbounded"/"bounded"/"" for its
    # quantifier, for a group the index of its first item (None: not a group)]
    items: list[list] = []
    item_starts: list[int] = []  # per open group: the index in items of its first item
    top_alternatives = False
    i, n = 0, len(pattern)
    closed_risky = False  # the item just before i is a group with a quantifier or an alternative inside
    ways = 1  # the product of (n - m + 1) over the bounded quantifiers read so far
    previous = ""  # the last thing read: "(", "quantifier" or ""
    while i < n:
        c = pattern[i]
        if c == "?":
            if previous == "":  # x? (after "(" it opens (?: (?= (?!, after a quantifier it makes it lazy)
                ways *= 2
                if items:
                    items[-1][2] = "bounded"
                if groups:
                    groups[-1] = True
            previous = "quantifier" if previous == "" else ""
            closed_risky = False
            i += 1
            continue
        braces = _RANGE.match(pattern, i) if c == "{" else None
        if c in "*+" or braces:
            low, comma, high = braces.groups() if braces else ("", "", "")
            if c in "*+" or (comma and not high):
                if items:
                    items[-1][2] = "unbounded"
                repeats = True
            else:
                top = int((high if comma else low) or 0)
                ways *= max(top - int(low or 0), 0) + 1
                repeats = top > 1
                if items:
                    items[-1][2] = "bounded"
            if closed_risky and repeats:
                raise InvalidArgumentError(
                    f"grammar_lazy_triggers pattern {pattern!r} repeats a group that holds a repetition or "
                    "alternatives ((a+)+, (a|aa)*): llama.cpp's std::regex can take minutes on it at every token")
            if groups:
                groups[-1] = True
            i = braces.end() if braces else i + 1
            closed_risky = False
            previous = "quantifier"
            continue
        closed_risky = False
        previous = "(" if c == "(" else ""
        if c not in "()|^$[":
            items.append([_bytes_of(pattern[i:_escape_end(pattern, i)] if c == "\\" else c), len(groups), "", None])
        if c == "\\":
            if pattern[i + 1:i + 2] in tuple("123456789k"):
                raise InvalidArgumentError(f"grammar_lazy_triggers pattern {pattern!r} has a back-reference, which "
                                           "makes a regex search exponential; llama.cpp's triggers use none")
            i = _escape_end(pattern, i)
            continue
        if c == "[":  # a class ends at its first unescaped ] (ECMAScript: [] matches nothing, [^] anything)
            j = i + 1
            if pattern.startswith("]", j) or pattern.startswith("^]", j):
                raise InvalidArgumentError(f"grammar_lazy_triggers pattern {pattern!r} has an empty class [] or "
                                           "[^], which regex dialects read differently; write (?!) or [\\s\\S]")
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            items.append([_bytes_of(pattern[i:j + 1]), len(groups), "", None])
            i = j + 1
            continue
        if c == "(":
            groups.append(False)
            starts.append(i + 1)
            item_starts.append(len(items))
        elif c == ")" and groups:
            closed_risky = groups.pop()
            inner = item_starts.pop()
            item = _ALL_BYTES
            if _delimited(pattern[starts.pop():i]):
                # its repetitions split a text one way only; as one item it matches what its content does
                closed_risky = False
                item = frozenset().union(*(x[0] for x in items[inner:]))
            items.append([item, len(groups), "", inner])
            if groups:
                groups[-1] = groups[-1] or closed_risky
        elif c == "|":
            if groups:
                groups[-1] = True
            else:
                top_alternatives = True
        i += 1
    if pattern.startswith("^") and top_alternatives:
        raise InvalidArgumentError(f"grammar_lazy_triggers pattern {pattern!r} starts with ^ and has alternatives at "
                                   "its top level: a trigger anchored with ^ is only looked for in the first 256 "
                                   "bytes of the output; write ^(?:a|b), or (?:^a|b) for b anywhere")
    if ways > MAX_TRIGGER_WAYS:
        raise InvalidArgumentError(
            f"grammar_lazy_triggers pattern {pattern!r} has optional parts with more than {MAX_TRIGGER_WAYS} ways to "
            "split a text between them (x? counts 2, x{m,n} n-m+1, multiplied): std::regex tries each, at every token")
    unbounded = [k for k, (_, _, quantifier, _) in enumerate(items) if quantifier == "unbounded"]
    if len(unbounded) > MAX_TRIGGER_UNBOUNDED:
        raise InvalidArgumentError(f"grammar_lazy_triggers pattern {pattern!r} has {len(unbounded)} unbounded "
                                   f"repetitions (at most {MAX_TRIGGER_UNBOUNDED}): each multiplies std::regex's work "
                                   "per token")
    first, second = (items[k] for k in unbounded) if len(unbounded) == 2 else (None, None)
    nested = second is not None and second[3] is not None and second[3] <= unbounded[0]  # ([a-z]+_)+: delimited
    if first is not None and second is not None and not nested and not pattern.startswith("^") \
            and first[0] & second[0] \
            and not any(not quantifier and depth == 0 and not matched & first[0]
                        for matched, depth, quantifier, _ in items[unbounded[0] + 1:unbounded[1]]):
        # (something required between them that the first cannot match bounds the first's extent: \s*\{\s*)
        raise InvalidArgumentError(f"grammar_lazy_triggers pattern {pattern!r} has two unbounded repetitions that can "
                                   "match the same character (.*a.*X): cubic in the text searched at every token "
                                   "(anchor it with ^, or make their characters distinct)")


_ATOM = re.compile(r"(\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|c[A-Za-z]|.)|\[\^?\]?(?:\\.|[^\]\\])*\]|[^\\\[])((?:[*+?]|\{\d*,?\d*\})\??)?", re.S)
#: The bytes a trigger is matched over (std::regex on a std::string), as Latin-1 characters.
_BYTES = [chr(b) for b in range(256)]


_ALL_BYTES = frozenset(_BYTES)


def _bytes_of(atom: str) -> frozenset[str]:
    """The bytes one regex atom (a character, an escape, a class, ``.``) matches; all where unsure."""
    try:
        one = re.compile(atom, re.ASCII if atom == "." else re.ASCII | re.DOTALL)
    except re.error:
        return _ALL_BYTES
    return frozenset(b for b in _BYTES if one.fullmatch(b))


def _delimited(content: str) -> bool:
    r"""Whether a group's content starts or ends with a single character that nothing else in it can match:
    ``\r?\n``, ``\.\d{1,3}``, ``[a-z]+_``. Repeating such a group splits a text in one way only, so it
    does not backtrack the way ``(a+)+`` does."""
    content = content[2:] if content.startswith("?:") else content
    atoms: list[tuple[frozenset[str], bool]] = []  # (the bytes it matches, quantified)
    pos = 0
    while pos < len(content):
        m = _ATOM.match(content, pos)
        if not m or m.group(1) in ("(", ")", "|", "^", "$"):
            return False  # nested groups, alternatives and anchors: not analysed
        atoms.append((_bytes_of(m.group(1)), bool(m.group(2))))
        pos = m.end()
    for edge, rest in ((atoms[:1], atoms[1:]), (atoms[-1:], atoms[:-1])):
        if edge and not edge[0][1] and edge[0][0] and rest and not any(edge[0][0] & other for other, _ in rest):
            return True
    return False
