"""Checks on GBNF text before it reaches llama.cpp's parser.

llama.cpp parses grammars recursively and follows rule references recursively
when it builds its parse stacks: a grammar nested some ten thousand levels deep
(in ( ) groups, or in a chain of rules each referring to the next) overflows the
C stack and kills the process, and an empty grammar is silently taken as "no
grammar". Both are refused here with a GrammarError.
"""

from __future__ import annotations

import re

from ..errors import GrammarError

#: Deepest nesting accepted, counting ( ) groups and rule references along any chain of
#: rules (10,000 levels were seen to be safe in llama.cpp; real grammars stay far below).
MAX_DEPTH = 2000
#: Most rules in one grammar.
MAX_RULES = 20000

_IDENT = re.compile(r"[A-Za-z0-9_-]+")


def check_gbnf(text: str) -> None:
    """Raise :class:`GrammarError` for an empty grammar or one nested beyond what llama.cpp parses safely."""
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
                if depth > MAX_DEPTH:
                    raise GrammarError(f"grammar nests ( ) groups more than {MAX_DEPTH} deep; "
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
    _check_chains(rules)


def _check_chains(rules: dict[str, tuple[int, list[str]]]) -> None:
    """The deepest chain of rule references (plus the groups along it) must stay under MAX_DEPTH."""
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
            if total > MAX_DEPTH:
                raise GrammarError(f"grammar rules refer to each other (with their groups) more than {MAX_DEPTH} "
                                   f"levels deep (from rule {name!r}); flatten the chain")
            cost[name] = total
            if stack:
                parent = stack[-1][0]
                best[parent] = max(best[parent], total)
