"""Telemetry: named events with measurements, delivered to attached handlers.

    lc.telemetry.attach("my-handler", ["server.request.stop"], fn)
    # fn(event: str, measurements: dict, metadata: dict)

Handlers run synchronously in the emitting thread (the server's scheduler
thread for server events), so they should be quick. A handler that raises is
logged and otherwise ignored: it never breaks the emitter.

Events emitted by the server:

* ``server.request.start``  — {queue_wait_ms, prompt_tokens}
* ``server.request.stop``   — {queue_wait_ms, ttft_ms, duration_ms, prompt_tokens, generated_tokens},
  metadata {finish_reason}
* ``server.request.cancelled`` — {generated_tokens}
* ``server.queue_full``     — {queue_length}, metadata {max_queue}
* ``server.kv_full``        — {generated_tokens, running} of the request stopped for KV room (``share_kv``)
* ``server.tick``           — {batch_tokens, decode_tokens, prefill_tokens, decode_ms, active_slots}
"""

from __future__ import annotations

from .errors import ArgumentTypeError, InvalidArgumentError

import logging
import threading
from typing import Any, Callable, Iterable, Mapping

logger = logging.getLogger(__name__)

Handler = Callable[[str, Mapping[str, Any], Mapping[str, Any]], None]

_lock = threading.Lock()
# event -> {handler_id: fn}; replaced wholesale on change so emit() reads it without a lock
_handlers: dict[str, dict[str, Handler]] = {}


def attach(handler_id: str, events: str | Iterable[str], fn: Handler) -> None:
    """Call ``fn(event, measurements, metadata)`` for each of ``events``; ids are unique."""
    if not callable(fn):
        raise ArgumentTypeError("telemetry handler must be callable")
    names = [events] if isinstance(events, str) else list(events)
    global _handlers
    with _lock:
        if any(handler_id in hs for hs in _handlers.values()):
            raise InvalidArgumentError(f"telemetry handler {handler_id!r} is already attached")
        new = {event: dict(hs) for event, hs in _handlers.items()}
        for name in names:
            new.setdefault(name, {})[handler_id] = fn
        _handlers = new


def detach(handler_id: str) -> bool:
    """Remove a handler from every event; False if it was not attached."""
    global _handlers
    with _lock:
        found = any(handler_id in hs for hs in _handlers.values())
        _handlers = {event: {h: f for h, f in hs.items() if h != handler_id} for event, hs in _handlers.items()}
    return found


def handlers(event: str) -> list[str]:
    """Ids of the handlers attached to ``event``."""
    return list(_handlers.get(event, {}))


def enabled(event: str) -> bool:
    """Whether any handler listens to ``event`` (lets emitters skip building measurements)."""
    return bool(_handlers.get(event))


def emit(event: str, measurements: Mapping[str, Any], metadata: Mapping[str, Any] | None = None) -> None:
    """Deliver an event to its handlers; handler errors are logged, never raised."""
    for handler_id, fn in _handlers.get(event, {}).items():
        try:
            fn(event, measurements, metadata or {})
        except Exception:
            logger.exception("telemetry handler %r failed on %s", handler_id, event)
