"""Checks on GBNF text before it reaches llama.cpp's parser.

llama.cpp parses grammars recursively: a grammar nested some ten thousand
groups deep overflows the C stack and kills the process, and an empty grammar
is silently taken as "no grammar". Both are refused here with a GrammarError.
"""

from __future__ import annotations

from ..errors import GrammarError

#: Deepest nesting of ( ) groups accepted; real grammars stay far below it.
MAX_GROUP_DEPTH = 1000
#: Most ( ) groups and most rules in one grammar. llama.cpp follows rule references
#: recursively too, so a chain of rules each nested deep adds up: bounding the totals
#: bounds the depth of any chain (10,000 levels were seen to be safe).
MAX_GROUPS = 4000
MAX_RULES = 4000


def check_gbnf(text: str) -> None:
    """Raise :class:`GrammarError` for an empty grammar or one nested beyond what llama.cpp parses safely."""
    depth = max_depth = rules = groups = 0
    has_content = False
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
        elif c == "(":
            depth += 1
            groups += 1
            if groups > MAX_GROUPS:
                raise GrammarError(f"grammar has more than {MAX_GROUPS} ( ) groups")
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
