"""A bound on what parsing a request body costs, checked before it is parsed.

Parsing builds a Python object per JSON value with the GIL held (pydantic's parser is native code, but
every list, dict and string it makes is a Python object): an 8 MiB body of 2.8 million ``[1]`` arrays
took 1.1-2.6 s, and one of 4 million integers 1.4 s, stalling the event loop (every client, ``/health``)
and the scheduler thread's streams as long. The size limit (``--max-body-mb``) bounds bytes, not values;
this bounds the arrays and objects (~0.4 us each in a free field, ~4 us as a chat message) and the values.
"""

from __future__ import annotations

import re

from .errors import BodyTooLarge

__all__ = ["MAX_JSON_CONTAINERS", "MAX_JSON_VALUES", "check_json_cost"]

#: Most JSON arrays and objects one request body may hold (parsing 50,000 chat messages: ~0.2 s; OpenAI takes
#: at most 2,048 inputs in one embeddings request).
MAX_JSON_CONTAINERS = 50_000
#: Most values (counted by their separating commas) one body may hold: a million token ids parse in ~0.35 s,
#: and take 5-7 MB.
MAX_JSON_VALUES = 1_000_000
#: Below this many bytes a body cannot hold more than MAX_JSON_CONTAINERS (each takes 2 bytes at least).
_SMALL = 2 * MAX_JSON_CONTAINERS
#: Most strings scanned to tell brackets and commas in text from the others (the scan costs ~1 us each).
_MAX_SCANNED_STRINGS = 200_000
# A string, or the rest of the body from a quote never closed: the match never fails, so no quote inside a
# string is tried again as a start (failing matches made a body of escaped quotes quadratic: 16 s for 100 KB).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?')


def _counts(raw: bytes) -> tuple[int, int]:
    return raw.count(b"[") + raw.count(b"{"), raw.count(b",")


def check_json_cost(raw: bytes) -> None:
    """Refuse (413) a body holding more than :data:`MAX_JSON_CONTAINERS` arrays and objects or more than
    :data:`MAX_JSON_VALUES` values, in a few ms: brackets and commas are counted in the raw bytes, and only
    where there are too many, again outside strings."""
    if len(raw) < _SMALL:
        return
    containers, values = _counts(raw)
    if containers <= MAX_JSON_CONTAINERS and values <= MAX_JSON_VALUES:
        return
    if raw.count(b'"') // 2 <= _MAX_SCANNED_STRINGS:  # (text full of brackets or commas: count those outside)
        containers, values = _counts(_STRING.sub(b"", raw))
        if containers <= MAX_JSON_CONTAINERS and values <= MAX_JSON_VALUES:
            return
    if containers > MAX_JSON_CONTAINERS:
        raise BodyTooLarge(f"the request body holds more than {MAX_JSON_CONTAINERS} JSON arrays and objects "
                           f"(about {containers}); send fewer per request")
    raise BodyTooLarge(f"the request body holds more than {MAX_JSON_VALUES} JSON values (about {values}); "
                       "send fewer per request")
