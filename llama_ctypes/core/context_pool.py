"""Idle contexts kept between one-call API calls (``generate``, ``stream``, ``embed``).

Creating a context allocates its KV cache, so the one-call functions check one
out of the pool and back in when done. The pool is attached to its model and
closed with it; a context checked in after that is closed instead of kept, so a
closed model's weights are never held by an idle context.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import Context
    from .model import Model
    from .params import ContextParams

_KEY = "llama_ctypes.context_pool"


class ContextPool:
    """At most one idle Context per parameter set. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[Any, "Context"] = {}
        self._closed = False

    @staticmethod
    def of(model: "Model") -> "ContextPool":
        """The pool of ``model`` (created on first use; ClosedError once the model is closed)."""
        return model.attachment(_KEY, ContextPool)

    def checkout(self, model: "Model", params: "ContextParams") -> "Context":
        """An idle context with these params, or a new one. The caller owns it until ``checkin``."""
        from .context import Context

        with self._lock:
            ctx = None if self._closed else self._idle.pop(params, None)
        if ctx is not None and not ctx.closed:
            return ctx
        return Context(model, params)

    def checkin(self, ctx: "Context") -> None:
        """Keep ``ctx`` for the next call, or close it (pool closed, or one already kept)."""
        with self._lock:
            if not self._closed and not ctx.closed and ctx.params not in self._idle:
                self._idle[ctx.params] = ctx
                return
        ctx.close()

    @property
    def n_idle(self) -> int:
        """Idle contexts kept now."""
        with self._lock:
            return len(self._idle)

    def close_idle(self) -> None:
        """Close the idle contexts (their KV memory) but keep the pool open."""
        with self._lock:
            idle, self._idle = list(self._idle.values()), {}
        for ctx in idle:
            ctx.close()

    def close(self) -> None:
        """Close every idle context; later check-ins close theirs."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
        for ctx in idle:
            ctx.close()
