"""Checks on GBNF text before it reaches llama.cpp's parser.

llama.cpp parses grammars recursively and follows rule references recursively
when it builds its parse stacks: a grammar nested some ten thousand levels deep
(in ( ) groups, or in a chain of rules each referring to the next) overflows the
C stack and kills the process, and an empty grammar is silently taken as "no
grammar". Both are refused here with a GrammarError. (The parse runs on a thread
with a large stack, core/deep_stack.py: 2000 levels overflowed a 256 KiB thread
stack. Where no such thread can start, the limit is that module's fallback.)

So is a repetition of something that can match nothing (``x{0,300}`` where
``x ::= "a"?``): llama.cpp expands a repetition into nested optional copies, and
where each copy may also be empty every way of spreading the input over them is a
parse stack of its own. 20 tokens took 8 s at ``{0,100}`` and minutes beyond, in
the sampler, where nothing can interrupt it: every request of the model waited.
``x*`` on a nullable ``x`` says nothing that ``x*`` on its non-empty part does not.

And the breadth of a grammar (:func:`check_breadth`): where the model's pick is refused, llama.cpp
tests every token of the vocabulary against every parse stack, and each stack's next character against
each range of its class. A rule of 10,000 alternatives took 1.5 to 2.5 s per token on a 32k vocabulary
(a class of 20,000 scattered characters about the same): every request of the server waited.
"""

from __future__ import annotations

import functools
import re
from typing import Iterator

from ..errors import GrammarError
from .deep_stack import DEEP_STACK

#: Deepest nesting accepted, counting ( ) groups and rule references along any chain of
#: rules (10,000 levels were seen to be safe in llama.cpp; real grammars stay far below).
MAX_DEPTH = 2000
#: Most rules in one grammar.
MAX_RULES = 20000
#: Most (parse stacks x class ranges at one position) x vocabulary size: a full-vocabulary grammar check then
#: costs at most what a JSON-schema enum of 1,000 values (json_schema.limits) costs on a 262k vocabulary,
#: about 1.5 s on a 2-core CPU. 10,000 alternatives on a 32k vocabulary are over it.
MAX_BREADTH_WORK = 1024 * 262144

_IDENT = re.compile(r"[A-Za-z0-9_-]+")


@functools.lru_cache(maxsize=32)  # (the same grammar comes with every request of a client)
def check_gbnf(text: str) -> None:
    """Raise :class:`GrammarError` for an empty grammar or one nested beyond what llama.cpp parses safely."""
    limit = min(MAX_DEPTH, DEEP_STACK.max_openers)
    rules: dict[str, tuple[int, list[str]]] = {}  # name -> (deepest group nesting, rules it refers to)
    current: str | None = None
    depth = 0
    has_content = False
    last_ident: str | None = None
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":  # a comment ends at \n or \r, as in llama.cpp's parser
            j = min((k for k in (text.find("\n", i), text.find("\r", i)) if k >= 0), default=-1)
            i = n if j < 0 else j + 1
            continue
        if c in "\"[":  # a string or a character class: skip it, escapes included
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
            has_content = True
            last_ident = None
        elif c == ":" and text.startswith("::=", i):
            if last_ident is None:
                raise GrammarError("'::=' without a rule name before it")
            if current is not None and rules[current][1] and rules[current][1][-1] == last_ident:
                rules[current][1].pop()  # the new rule's name, read as a reference of the previous rule
            current, depth = last_ident, 0
            if current not in rules:
                rules[current] = (0, [])
                if len(rules) > MAX_RULES:
                    raise GrammarError(f"grammar has more than {MAX_RULES} rules")
            last_ident = None
            i += 3
            continue
        elif c == "(":
            depth += 1
            if current is not None and depth > rules[current][0]:
                rules[current] = (depth, rules[current][1])
                if depth > limit:
                    raise GrammarError(f"grammar nests ( ) groups more than {limit} deep; "
                                       "flatten it into named rules")
            last_ident = None
        elif c == ")":
            depth -= 1
            last_ident = None
        else:
            m = _IDENT.match(text, i)
            if m:
                last_ident = m.group()
                if current is not None:
                    rules[current][1].append(last_ident)
                has_content = True
                i = m.end()
                continue
            if not c.isspace():
                has_content = True
                last_ident = None
        i += 1
    if not has_content:
        raise GrammarError("the grammar is empty; pass grammar=None for unconstrained output")
    _check_chains(rules, limit)
    _check_repetitions(text)


def _check_chains(rules: dict[str, tuple[int, list[str]]], limit: int) -> None:
    """The deepest chain of rule references (plus the groups along it) must stay under ``limit``."""
    cost: dict[str, int] = {}
    for root in rules:
        if root in cost:
            continue
        # Iterative depth-first search; a rule on the current path (recursion) adds nothing more.
        stack: list[tuple[str, list[str]]] = [(root, sorted({r for r in rules[root][1] if r in rules}))]
        on_path = {root}
        best: dict[str, int] = {root: 0}
        while stack:
            name, todo = stack[-1]
            if todo:
                ref = todo.pop()
                if ref in cost:
                    best[name] = max(best[name], cost[ref])
                elif ref not in on_path:
                    on_path.add(ref)
                    best[ref] = 0
                    stack.append((ref, sorted({r for r in rules[ref][1] if r in rules})))
                continue
            stack.pop()
            on_path.discard(name)
            total = rules[name][0] + 1 + best[name]
            if total > limit:
                raise GrammarError(f"grammar rules refer to each other (with their groups) more than {limit} "
                                   f"levels deep (from rule {name!r}); flatten the chain")
            cost[name] = total
            if stack:
                parent = stack[-1][0]
                best[parent] = max(best[parent], total)


_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\r\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<tok>!?<[^>]*>)
  | (?P<define>::=)
  | (?P<ident>[A-Za-z0-9_-]+)
  | (?P<rep>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?.])
""", re.VERBOSE | re.DOTALL)
_INF = float("inf")
#: Most copies of something that can match nothing, side by side (``x{0,n}``, ``(x{0,a}){0,b}`` counts a*b,
#: ``x? x? x?`` counts 3): 20 tokens took 0.2 s at 24 copies, 3 s at 60, 5 s at 8*8 nested, minutes at 200.
MAX_EMPTY_COPIES = 24

# An item of a sequence: [kind, key, postfix operators as (min, max) in order]. kind: "empty" (""), "ref" (key:
# a rule, or a ( ) group made a rule), "char" (key: its text; it consumes a character or a token).
_Item = tuple[str, str, tuple[tuple[int, float], ...]]


def _postfix(op: str) -> tuple[int, float]:
    if op == "*":
        return 0, _INF
    if op == "+":
        return 1, _INF
    if op == "?":
        return 0, 1
    lo, sep, hi = op.strip("{} \t").partition(",")
    low = int(lo.strip() or 0)
    return low, (_INF if not hi.strip() else int(hi)) if sep else low


def _parse_rules(text: str) -> dict[str, list[list[_Item]]]:
    """Rules as alternatives of item sequences; each ( ) group becomes a rule of its own (no recursion here:
    groups may nest MAX_DEPTH deep)."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(text) if m.lastgroup != "space"]
    rules: dict[str, list[list[list]]] = {}
    stack: list[list[list[list]]] = []  # the alternatives being read: the rule's, then each open group's
    n_groups = 0
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "ident" and i + 1 < len(tokens) and tokens[i + 1][0] == "define":
            stack = [rules.setdefault(value, [])]
            stack[0].append([])
            i += 2
            continue
        i += 1
        if not stack:
            continue
        seq = stack[-1][-1]
        if kind == "string":
            seq.append(["empty" if value == '""' else "char", value, ()])
        elif kind in ("cls", "tok") or value == ".":
            seq.append(["char", value, ()])
        elif kind == "ident":
            seq.append(["ref", value, ()])
        elif value == "(":
            n_groups += 1
            name = f" group {n_groups}"  # (a space: no rule of the grammar can have this name)
            seq.append(["ref", name, ()])
            rules[name] = [[]]
            stack.append(rules[name])
        elif value == ")":
            if len(stack) > 1:
                stack.pop()
        elif value == "|":
            stack[-1].append([])
        elif (kind == "rep" or value in "*+?") and seq:
            seq[-1][2] += (_postfix(value),)
    return {name: [[tuple(item) for item in seq] for seq in alts] for name, alts in rules.items()}  # type: ignore


_MAX_CHAR = 0x10FFFF
_ESCAPES = {"n": 10, "r": 13, "t": 9}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
# What an item can match as one unit: ("c", ranges) for one character out of inclusive code-point ranges,
# ("s", text) for anything longer (its normalized text: two units with the same text are copies).
_Key = tuple[str, object]
_Profile = dict[_Key, int]  # unit -> how many parse paths can take it here


def _code_points(body: str) -> list[int]:
    """The characters of a string or class body, escapes decoded as llama.cpp's parse_char reads them."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            e = body[i + 1]
            width = _HEX_WIDTH.get(e, 0)
            digits = body[i + 2:i + 2 + width]
            if width and len(digits) == width and all(d in "0123456789abcdefABCDEF" for d in digits):
                out.append(min(int(digits, 16), _MAX_CHAR))
                i += 2 + width
                continue
            out.append(_ESCAPES.get(e, ord(e)))
            i += 2
            continue
        out.append(ord(c))
        i += 1
    return out


def _class_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """A [...] class as code-point ranges ([^...] complemented); it ends at its first unescaped ]."""
    body, negated = text[1:-1], False
    if body.startswith("^"):
        body, negated = body[1:], True
    # decode with positions kept so that a - between two characters makes a range
    points: list[tuple[int, bool]] = []  # (code point, is an unescaped "-")
    i = 0
    while i < len(body):
        j = i + 1
        if body[i] == "\\" and i + 1 < len(body):
            j = i + 2 + (_HEX_WIDTH.get(body[i + 1], 0))
        chunk = body[i:j]
        points.append((_code_points(chunk)[0] if chunk else 0, chunk == "-"))
        i = j
    ranges: list[tuple[int, int]] = []
    k = 0
    while k < len(points):
        lo = points[k][0]
        if k + 2 < len(points) and points[k + 1][1]:
            ranges.append((min(lo, points[k + 2][0]), max(lo, points[k + 2][0])))
            k += 3
        else:
            ranges.append((lo, lo))
            k += 1
    if negated:
        flipped, nxt = [], 0
        for lo, hi in sorted(ranges):
            if lo > nxt:
                flipped.append((nxt, lo - 1))
            nxt = max(nxt, hi + 1)
        if nxt <= _MAX_CHAR:
            flipped.append((nxt, _MAX_CHAR))
        ranges = flipped
    merged: list[tuple[int, int]] = []  # [aa] and [a-ca] take an "a" by one path, not two
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _unit(kind: str, key: str) -> _Key:
    """The unit a string, class, token or . matches ("a", "\\x61" and [a] alike)."""
    if key == ".":
        return "c", ((0, _MAX_CHAR),)
    if key.startswith("["):
        return "c", _class_ranges(key)
    if key.startswith('"'):
        chars = _code_points(key[1:-1])
        if len(chars) == 1:
            return "c", ((chars[0], chars[0]),)
        return "s", "".join(map(chr, chars))
    return "s", key  # a token <...> or !<...>


def _coverage(profile: _Profile) -> int:
    """The most paths that can take one same piece of text: per character for one-character units (their
    ranges overlap), per text for longer ones."""
    events: list[tuple[int, int]] = []
    most = 0
    for (kind, what), n in profile.items():
        if kind == "c":
            for lo, hi in what:  # type: ignore[union-attr]
                events.append((lo, n))
                events.append((hi + 1, -n))
        else:
            most = max(most, n)
    level = 0
    for _, n in sorted(events, key=lambda e: (e[0], e[1])):
        level += n
        most = max(most, level)
    return most


def _check_repetitions(text: str) -> None:
    """Refuse more than MAX_EMPTY_COPIES parse paths that can take one same piece of text side by side, from
    neighbouring items that can match nothing ("a"? [a-b]? "\\x61"? ("a")? all take an "a").

    ``*`` and ``+`` are not copies (llama.cpp reads them as recursion, which costs nothing here); ``{m,n}`` of
    something empty-able is n copies (m when unbounded), nested ones multiply; a rule's alternatives add up.
    Longer units count together only when their text is the same: ambiguity in general is undecidable, and
    this bounds the shapes that were seen to take seconds to minutes per token."""
    rules = _parse_rules(text)
    nullable = _nullable_rules(rules)

    units: dict[str, _Profile] = {}  # per rule: what it takes as one item, and by how many paths
    signature: dict[str, str] = {}  # per rule: its normalized body (what makes two rules copies)

    def item_key(item: _Item) -> str:
        kind, key, ops = item
        base = signature.get(key, key) if kind == "ref" else repr(_unit(kind, key))
        return base + "".join(f"{{{lo},{hi}}}" for lo, hi in ops)

    def item_profile(item: _Item) -> tuple[bool, _Profile]:
        """Whether the item can match nothing, and its units weighted by the copies its operators make."""
        kind, key, ops = item
        if kind == "ref":
            profile = units.get(key, {})  # (a reference back up a cycle: recursion, not copies)
        elif kind == "empty":
            profile = {}
        else:
            profile = {_unit(kind, key): 1}
        empty = kind == "empty" or (kind == "ref" and key in nullable)
        times = 1
        for lo, hi in ops:
            if empty:  # copies of something empty-able: each way of spreading the text over them is a stack
                times *= int(hi) if hi != _INF else max(lo, 1)
            elif lo == 0:  # x? or x{0,k} of an x that consumes: one empty-able item (its copies each consume)
                empty = True
        return empty, (profile if times == 1 else {k: n * times for k, n in profile.items()})

    def analyse(name: str) -> int:
        most, unit = 0, {}
        for seq in rules[name]:
            seq = [item for item in seq if not (item[0] == "empty" and not item[2])]  # "" changes nothing
            run: _Profile = {}
            all_empty = True
            for item in seq:
                empty, profile = item_profile(item)
                if not empty:  # a run only grows until here: its coverage at its end is its most
                    most = max(most, _coverage(run))
                    run, all_empty = {}, False
                    continue
                for k, n in profile.items():
                    run[k] = run.get(k, 0) + n
            most = max(most, _coverage(run))
            if all_empty:  # the whole alternative is one run: that is what it offers where it is used
                alt = run
            elif len(seq) == 1:
                alt = item_profile(seq[0])[1]
            elif all(_literal(item) is not None for item in seq):
                alt = {("s", "".join(_literal(item) for item in seq)): 1}  # "a" "b" is "ab"
            else:
                alt = {("s", " ".join(map(item_key, seq))): 1}
            for k, n in alt.items():
                unit[k] = unit.get(k, 0) + n
        units[name] = unit
        body = " | ".join(" ".join(map(item_key, seq)) for seq in rules[name])
        signature[name] = body if len(body) <= 200 else name
        return most

    # rules after the rules they refer to (a reference back up a cycle counts 0: recursion is not copies)
    for name in _dependency_order(rules):
        n = analyse(name)
        if n > MAX_EMPTY_COPIES:
            where = "a ( ) group" if name.startswith(" ") else f"rule {name!r}"
            raise GrammarError(
                f"grammar puts {n} copies of something that can match nothing side by side (in {where}; at most "
                f"{MAX_EMPTY_COPIES}): llama.cpp would follow every way of spreading the text over them (minutes "
                "per token); repeat its non-empty part, or use * or + (x{0,100} with x ::= \"a\"? is \"a\"*)")


def _nullable_rules(rules: dict[str, list[list[_Item]]]) -> set[str]:
    """The rules (and groups) that can match nothing (a worklist: linear in the grammar's size; a fixed
    point over all rules took one pass per rule of a chain, seconds on a 100 KB grammar)."""
    nullable: set[str] = set()
    pending: dict[tuple[str, int], int] = {}  # (rule, alternative) -> references not yet known nullable
    waiting: dict[str, list[tuple[str, int]]] = {}  # rule -> the alternatives that wait for it (per reference)
    ready: list[str] = []
    for name, alts in rules.items():
        for k, seq in enumerate(alts):
            refs = []
            possible = True
            for kind, key, ops in seq:
                if kind == "empty" or any(lo == 0 for lo, _ in ops):
                    continue
                if kind == "ref" and key in rules:
                    refs.append(key)
                else:
                    possible = False  # (a character, or a rule that does not exist)
                    break
            if not possible:
                continue
            if not refs:
                ready.append(name)
                continue
            pending[(name, k)] = len(refs)
            for ref in refs:
                waiting.setdefault(ref, []).append((name, k))
    while ready:
        name = ready.pop()
        if name in nullable:
            continue
        nullable.add(name)
        for alt in waiting.get(name, ()):
            pending[alt] -= 1
            if pending[alt] == 0:
                ready.append(alt[0])
    return nullable


def _item_nullable(item: _Item, nullable: set[str]) -> bool:
    kind, key, ops = item
    return kind == "empty" or (kind == "ref" and key in nullable) or any(lo == 0 for lo, _ in ops)


def _dependency_order(rules: dict[str, list[list[_Item]]]) -> list[str]:
    """Every rule after the rules it refers to, but for references back up a cycle (without recursion:
    rules may nest MAX_DEPTH deep)."""
    def refs(name: str) -> Iterator[str]:
        return iter({k for seq in rules[name] for kind, k, _ in seq if kind == "ref" and k in rules})

    order: list[str] = []
    done: set[str] = set()
    for root in rules:
        if root in done:
            continue
        stack = [(root, refs(root))]
        on_path = {root}
        while stack:
            name, pending = stack[-1]
            ref = next(pending, None)
            if ref is not None:
                if ref not in done and ref not in on_path:
                    on_path.add(ref)
                    stack.append((ref, refs(ref)))
                continue
            stack.pop()
            on_path.discard(name)
            done.add(name)
            order.append(name)
    return order


def _class_width(text: str) -> int:
    """The elements llama.cpp's parser makes of a [...] class, which it matches one by one: a character
    counts 1, a range 2, as written (neither merged nor complemented: ``[aaaa]`` is 4)."""
    body = text[1:-1]
    if body.startswith("^"):
        body = body[1:]
    n, i = 0, 0
    while i < len(body):
        j = i + 1
        if body[i] == "\\" and i + 1 < len(body):
            j = i + 2 + _HEX_WIDTH.get(body[i + 1], 0)
        n += 1
        if body[j:j + 1] == "-" and j + 1 < len(body):  # a range: its upper end is an element of its own
            k = j + 1
            j = k + 1
            if body[k] == "\\" and k + 1 < len(body):
                j = k + 2 + _HEX_WIDTH.get(body[k + 1], 0)
            n += 1
        i = j
    return max(n, 1)


@functools.lru_cache(maxsize=32)
def check_breadth(text: str, n_vocab: int) -> None:
    """Raise :class:`GrammarError` when a grammar is too broad for a vocabulary of ``n_vocab`` tokens: more
    than ``MAX_BREADTH_WORK / n_vocab`` parse stacks (a class counting one per element as written) can
    start at one place. That is what llama.cpp's check of the whole vocabulary costs, per token, where the
    model's pick is refused: on the thread that samples every request of a server. A quick look at the text,
    with a clear message; the bound that holds for every shape (stacks that multiply as text is read, a
    breadth reached behind a literal) is in llama.cpp itself, where the stacks are made
    (build_scripts/patches/llama-grammar-work-bound.patch)."""
    rules = _parse_rules(text)
    nullable = _nullable_rules(rules)
    breadth: dict[str, int] = {}

    def item_breadth(item: _Item) -> int:
        kind, key, _ = item
        if kind == "ref":
            return breadth.get(key, 1)  # (a reference back up a cycle: its stacks are counted where it starts)
        if kind == "empty":
            return 0
        return _class_width(key) if key.startswith("[") else 1

    limit = max(1, MAX_BREADTH_WORK // max(1, n_vocab))
    for name in _dependency_order(rules):
        total = 0
        for seq in rules[name]:
            for item in seq:  # the items that can come first: up to the first that must match something
                total += item_breadth(item)
                if not _item_nullable(item, nullable):
                    break
        breadth[name] = total
        if total > limit:
            where = "a ( ) group" if name.startswith(" ") else f"rule {name!r}"
            raise GrammarError(
                f"grammar is too broad for this model's vocabulary of {n_vocab} tokens: {total} alternatives (a "
                f"character class counts one per element) can start at one place in {where}; at most {limit}. "
                "llama.cpp tests every token against each of them where the model's pick is refused (seconds per "
                "token for every request); split the choice into a prefix tree of rules, or shorten the list")


def _literal(item: _Item) -> str | None:
    """The text an item stands for when it is a plain string or a one-character class, else None."""
    kind, key, ops = item
    if kind != "char" or ops:
        return None
    unit, what = _unit(kind, key)
    if unit == "s":
        return None if key.startswith("<") or key.startswith("!") else what  # type: ignore[return-value]
    if len(what) != 1:  # type: ignore[arg-type]
        return None  # several ranges, or none at all ([] and [^\x00-\U0010FFFF] match nothing)
    (lo, hi), = what  # type: ignore[misc]
    return chr(lo) if lo == hi else None
