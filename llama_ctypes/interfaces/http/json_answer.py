"""Large JSON answers encoded off the event loop, a part at a time.

``json.dumps`` is one C call that holds the GIL until it returns: a non-streamed ``/completion`` with ``n_probs``
over thousands of tokens (a 31 MB answer) held the event loop, and so every client and ``/health``, 0.74 s in the
encoder alone. :func:`json_response` encodes on a worker thread, in parts of at most :data:`PART_ITEMS` items each,
so the GIL passes to the other threads between parts; the bytes are those of starlette's ``JSONResponse``.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.responses import Response

__all__ = ["PART_ITEMS", "encode_json", "json_response"]

#: A container of more items than this is encoded a part at a time (a part: one C call of a few tens of us).
PART_ITEMS = 64
# (starlette's JSONResponse: compact, UTF-8, no NaN)
_ENCODE = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
_CONTAINERS = (dict, list, tuple)


def _large(value: Any) -> bool:
    """Whether ``value`` holds a container of more than PART_ITEMS items, at any depth."""
    if len(value) > PART_ITEMS:
        return True
    children = value.values() if isinstance(value, dict) else value
    return any(isinstance(c, _CONTAINERS) and _large(c) for c in children)


def _parts(value: Any, out: list[str]) -> None:
    if not isinstance(value, _CONTAINERS) or not _large(value):
        out.append(_ENCODE(value))
        return
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):  # (json converts other keys: let it, whole)
            out.append(_ENCODE(value))
            return
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _ENCODE(key) + ":")
            _parts(item, out)
        out.append("}")
        return
    out.append("[")
    for start in range(0, len(value), PART_ITEMS):
        part = value[start:start + PART_ITEMS]
        if start:
            out.append(",")
        if any(isinstance(x, _CONTAINERS) and _large(x) for x in part):
            for j, item in enumerate(part):
                if j:
                    out.append(",")
                _parts(item, out)
        else:
            out.append(_ENCODE(list(part))[1:-1])
    out.append("]")


def encode_json(value: Any) -> bytes:
    """``value`` as starlette's JSONResponse encodes it, a part at a time."""
    out: list[str] = []
    _parts(value, out)
    return "".join(out).encode("utf-8")


async def json_response(value: Any, status_code: int = 200) -> Response:
    """A JSON response whose body is encoded on a worker thread (:func:`encode_json`)."""
    body = await anyio.to_thread.run_sync(encode_json, value)
    return Response(body, status_code=status_code, media_type="application/json")
