"""A server request: its state, its options, and the channel its tokens travel back on."""

from __future__ import annotations

import asyncio
import enum
import itertools
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from ...core.generation import GenerationParams, Timings
from ...core.sampler import Sampler


class Status(enum.IntEnum):
    """Ordered: every status from FINISHED on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2  # ended by itself (eog, length) or by a stop string
    CANCELLED = 3
    FAILED = 4

    @property
    def done(self) -> bool:
        return self >= Status.FINISHED


@dataclass(frozen=True)
class End:
    """Sentinel put on a request's channel when it ends normally."""

    finish_reason: str


_ids = itertools.count(1)


class Channel:
    """Where the scheduler thread puts a request's items (token ids, then End or an exception).

    Synchronous consumers block on a queue; asyncio consumers get items through
    their event loop, so waiting never blocks the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop
        self.sync: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        self.aio: asyncio.Queue | None = asyncio.Queue() if loop else None

    def put(self, item: Any) -> None:
        if self.sync is not None:
            self.sync.put(item)
        else:
            try:
                self.loop.call_soon_threadsafe(self.aio.put_nowait, item)  # type: ignore[union-attr]
            except RuntimeError:  # the loop was closed: nobody is listening any more
                pass

    def get(self) -> Any:
        return self.sync.get()  # type: ignore[union-attr]

    async def aget(self) -> Any:
        return await self.aio.get()  # type: ignore[union-attr]


@dataclass(eq=False)
class Request:
    """One generation request, from submission to its end. Owned by the scheduler once admitted."""

    prompt: list[int]
    params: GenerationParams
    sampler: Sampler
    channel: Channel
    session: Any = None
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None  # admitted into a slot
    first_token: float | None = None
    n_prefilled: int = 0  # prompt tokens already in the KV cache
    cached_tokens: int = 0  # of those, tokens reused from a cache instead of computed
    seq_id: int | None = None  # the slot that served it
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancel_requested: bool = False
    stop_reason: str | None = None  # set when the consumer ends it normally (a stop string)

    @property
    def prefill_remaining(self) -> int:
        return len(self.prompt) - self.n_prefilled

    def timings(self) -> Timings:
        t = Timings(prompt_tokens=len(self.prompt), generated_tokens=len(self.generated),
                    cached_tokens=self.cached_tokens)
        if self.first_token is not None:
            t.ttft_ms = (self.first_token - self.arrived) * 1e3
            t.generation_ms = (time.perf_counter() - self.first_token) * 1e3
        if self.started is not None:
            t.prompt_ms = ((self.first_token or time.perf_counter()) - self.started) * 1e3
        return t
