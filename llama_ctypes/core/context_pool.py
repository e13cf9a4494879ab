"""Idle contexts kept between one-call API calls (``generate``, ``stream``, ``embed``).

Creating a context allocates its KV cache, so the one-call functions check one
out of the pool and back in when done. An idle context keeps the tokens (and the
KV) of its last call: :meth:`ContextPool.checkout` hands out the one whose tokens
share the longest prefix with the new prompt, so that a call extending an earlier
prompt (a chat loop's growing history) decodes only its new tokens.

The pool is attached to its model and closed with it; a context checked in after
that is closed instead of kept, so a closed model's weights are never held by an
idle context.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from .prompt import common_prefix

if TYPE_CHECKING:
    from .context import Context
    from .model import Model
    from .params import ContextParams

_KEY = "llama_ctypes.context_pool"

#: Most idle contexts kept per parameter set, and in all (each holds its KV cache): a caller that varies its
#: context options from call to call (n_ctx=256, 288, ...) would otherwise keep one per value until the model
#: closes.
MAX_IDLE_PER_PARAMS = 4
MAX_IDLE = 8


class ContextPool:
    """Idle Contexts by parameter set, each with the history of its last call. Thread-safe.

    Per parameter set it keeps as many idle contexts as were ever in use at once (threads that call
    concurrently keep one history each; a single-threaded caller keeps one context, as before), at
    most :data:`MAX_IDLE_PER_PARAMS`, and :data:`MAX_IDLE` over all parameter sets; beyond that the least
    recently used is closed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[Any, list["Context"]] = {}  # per params, the most recently used last
        self._busy: Counter[Any] = Counter()  # checked out now, per params
        self._peak: Counter[Any] = Counter()  # most ever checked out at once, per params
        self._used: dict[int, int] = {}  # id(idle context) -> when it was checked in (a counter)
        self._clock = 0
        self._closed = False

    @staticmethod
    def of(model: "Model") -> "ContextPool":
        """The pool of ``model`` (created on first use; ClosedError once the model is closed)."""
        return model.attachment(_KEY, ContextPool)

    def checkout(self, model: "Model", params: "ContextParams", prompt: Sequence[int] | None = None) -> "Context":
        """An idle context with these params, or a new one. The caller owns it until ``checkin``.

        With ``prompt`` (token ids, or a MediaPrompt), the idle context whose tokens share the longest
        prefix with it; ties (and no ``prompt``) go to the most recently used.
        """
        from .context import Context

        ctx = None
        with self._lock:
            idle = None if self._closed else self._idle.get(params)
            if idle:
                best = len(idle) - 1
                if prompt is not None and len(idle) > 1:
                    shared = [common_prefix(c.tokens, prompt) if not c.closed else -1 for c in idle]
                    best = max(range(len(idle)), key=lambda i: (shared[i], i))
                ctx = idle.pop(best)
                self._used.pop(id(ctx), None)
            self._busy[params] += 1
            self._peak[params] = max(self._peak[params], self._busy[params])
        if ctx is not None and not ctx.closed:
            return ctx
        try:
            return Context(model, params)
        except BaseException:
            with self._lock:
                self._busy[params] -= 1
            raise

    def checkin(self, ctx: "Context") -> None:
        """Keep ``ctx`` for a later call, or close it (pool closed, or enough kept for its params)."""
        params = ctx.params
        evicted: list["Context"] = []
        with self._lock:
            if self._busy[params] > 0:
                self._busy[params] -= 1
            if self._closed or ctx.closed:
                evicted.append(ctx)
            else:
                idle = self._idle.setdefault(params, [])
                if ctx not in idle:
                    idle.append(ctx)
                self._clock += 1
                self._used[id(ctx)] = self._clock
                keep = min(MAX_IDLE_PER_PARAMS, max(1, self._peak[params]))
                while len(idle) > keep:
                    evicted.append(idle.pop(0))
                while sum(map(len, self._idle.values())) > MAX_IDLE:
                    key = min((k for k, cs in self._idle.items() if cs), key=lambda k: self._used[id(self._idle[k][0])])
                    evicted.append(self._idle[key].pop(0))
                for old in evicted:
                    self._used.pop(id(old), None)
                for key in [k for k, cs in self._idle.items() if not cs and not self._busy[k]]:
                    del self._idle[key]  # (and its counts: a key used once is not kept forever)
                    self._busy.pop(key, None)
                    self._peak.pop(key, None)
        for old in evicted:
            old.close()

    @property
    def n_idle(self) -> int:
        """Idle contexts kept now."""
        with self._lock:
            return sum(map(len, self._idle.values()))

    def close_idle(self) -> None:
        """Close the idle contexts (their KV memory) but keep the pool open."""
        with self._lock:
            idle = [c for cs in self._idle.values() for c in cs]
            self._idle, self._used = {}, {}
        for ctx in idle:
            ctx.close()

    def close(self) -> None:
        """Close every idle context; later check-ins close theirs."""
        with self._lock:
            self._closed = True
            idle = [c for cs in self._idle.values() for c in cs]
            self._idle, self._used = {}, {}
        for ctx in idle:
            ctx.close()
