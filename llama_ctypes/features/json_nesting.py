"""How deep a chat request's JSON goes, checked before anything recurses through it (llama.cpp's chat code,
a template, Python's own ``json``)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..errors import InvalidArgumentError

__all__ = ["MAX_JSON_DEPTH", "check_nesting", "json_depth"]


#: Deepest JSON nesting a chat request may hand to llama.cpp's chat code. It recurses through what it
#: reads (and some templates render each level with the indentation of all the levels above it:
#: quadratic in time and size), so a request must not choose the depth freely. Real tool schemas
#: and arguments are a few levels deep.
MAX_JSON_DEPTH = 256


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON-like value (0 for a scalar), counted up to ``limit + 1`` (no recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_nesting(inputs: Mapping[str, Any]) -> None:
    """Refuse a chat request with JSON nested deeper than :data:`MAX_JSON_DEPTH` where llama.cpp reads it.

    What it reads as JSON counts: tool schemas, template variables, message fields, and the arguments
    of earlier tool calls (a string of JSON, parsed and converted for the template one level at a
    time); the messages' text does not.
    """
    limit = MAX_JSON_DEPTH
    values: list[Any] = [{k: v for k, v in inputs.items() if k != "messages"}]
    too_deep = False
    for m in inputs.get("messages") or ():
        if not isinstance(m, Mapping):
            values.append(m)  # (refused later, but not before something recursed through it)
            continue
        values.append({k: v for k, v in m.items() if not (k in ("content", "reasoning_content") and isinstance(v, str))})
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, (list, tuple)) else ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            args = fn.get("arguments") if isinstance(fn, Mapping) else None
            if isinstance(args, str) and args.count("[") + args.count("{") > limit:  # (else it cannot be deeper)
                try:
                    values.append(json.loads(args))
                except RecursionError:  # (deeper than Python's own parser goes)
                    too_deep = True
                except ValueError:
                    pass  # not JSON: llama.cpp refuses it
    if too_deep or any(json_depth(value, limit) > limit for value in values):
        raise InvalidArgumentError(f"the request holds JSON nested deeper than {limit} levels (in its tools, "
                                   "tool call arguments or template variables)")
