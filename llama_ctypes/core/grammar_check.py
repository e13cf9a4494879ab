"""Checks on GBNF text before it reaches llama.cpp's parser.

llama.cpp parses grammars recursively: a grammar nested some ten thousand
groups deep overflows the C stack and kills the process, and an empty grammar
is silently taken as "no grammar". Both are refused here with a GrammarError.
"""

from __future__ import annotations

from ..errors import GrammarError

#: Deepest nesting of ( ) groups accepted; real grammars stay far below it.
MAX_GROUP_DEPTH = 1000
#: Most rules accepted (rule references are followed recursively too).
MAX_RULES = 20000


def check_gbnf(text: str) -> None:
    """Raise :class:`GrammarError` for an empty grammar or one nested beyond what llama.cpp parses safely."""
    depth = max_depth = rules = 0
    has_content = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":  # comment to the end of the line
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if c in "\"[":  # a string or a character class: skip it, escapes included
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
            has_content = True
        elif c == "(":
            depth += 1
            if depth > max_depth:
                max_depth = depth
                if max_depth > MAX_GROUP_DEPTH:
                    raise GrammarError(f"grammar nests ( ) groups more than {MAX_GROUP_DEPTH} deep; "
                                       "flatten it into named rules")
        elif c == ")":
            depth -= 1
        elif c == ":" and text.startswith("::=", i):
            rules += 1
            if rules > MAX_RULES:
                raise GrammarError(f"grammar has more than {MAX_RULES} rules")
            i += 3
            continue
        elif not c.isspace():
            has_content = True
        i += 1
    if not has_content:
        raise GrammarError("the grammar is empty; pass grammar=None for unconstrained output")
