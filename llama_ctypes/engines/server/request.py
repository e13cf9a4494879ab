"""A server request: its state, its options, its text, and the channel its pieces travel back on."""

from __future__ import annotations

import asyncio
import enum
import itertools
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from ...core.generation import GenerationParams, Timings
from ...core.logprobs import TokenLogprob
from ...core.text import TextAssembler


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
class Progress:
    """Sent on a request's channel while its prompt is read (when asked): prompt tokens in all, read
    from the cache, read so far (cache included), and milliseconds since it got its slot."""

    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass(frozen=True)
class End:
    """Sentinel put on a request's channel when it ends normally."""

    finish_reason: str


_ids = itertools.count(1)


class Channel:
    """Where the scheduler thread puts a request's items (text pieces, then End or an exception;
    with logprobs, each token's :class:`TokenLogprob` before the text it completes).

    Synchronous consumers block on a queue; asyncio consumers get items through
    their event loop, so waiting never blocks the loop.
    """

    __slots__ = ("loop", "sync", "aio")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop
        self.sync: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        self.aio: asyncio.Queue | None = asyncio.Queue() if loop else None

    def put(self, item: Any) -> bool:
        """Deliver ``item``; False when nobody can receive it any more (its event loop was closed)."""
        if self.sync is not None:
            self.sync.put(item)
            return True
        try:
            self.loop.call_soon_threadsafe(self.aio.put_nowait, item)  # type: ignore[union-attr]
        except RuntimeError:  # the loop was closed: nobody is listening any more
            return False
        return True

    def get(self) -> Any:
        return self.sync.get()  # type: ignore[union-attr]

    async def aget(self) -> Any:
        return await self.aio.get()  # type: ignore[union-attr]


class _Unset:
    """Placeholder sampler for requests built without one (scheduler tests)."""

    def close(self) -> None:
        pass


@dataclass(eq=False)
class Request:
    """One generation request, from submission to its end. Owned by the scheduler once admitted.

    ``generated`` and :meth:`timings` are frozen when the request ends. With
    ``params.logprobs`` set, ``logprobs`` holds one entry per token of ``generated``
    (the scheduler appends both together), else it is None.
    """

    prompt: list[int]
    params: GenerationParams
    sampler: Any  # a core Sampler (closed by the scheduler when the request ends)
    channel: Channel
    session: Any = None
    text: TextAssembler | None = None  # None: no text (token-only consumers, scheduler tests)
    binding: Any = None  # the sampler's claim while running (a SamplerBinding), released at the end
    in_graph: bool | None = None  # backend_sampling asked: sampled in the graph or not (None: not asked)
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None  # admitted into a slot
    first_token: float | None = None
    ended: float | None = None
    n_prefilled: int = 0  # prompt tokens already in the KV cache
    cached_tokens: int = 0  # of those, tokens reused from a cache instead of computed
    seq_id: int | None = None  # the slot that served it
    generated: list[int] = field(default_factory=list)
    piece_ends: list[int] = field(default_factory=list)  # len(generated) when each text piece was sent
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    cancel_requested: bool = False
    queued: bool = False  # in the scheduler's wait queue (guarded by the scheduler's lock)
    pin: int | None = None  # the slot it must run in (llama-server's id_slot); None: any
    progress: bool = False  # send Progress items while the prompt is read (llama-server's return_progress)
    loras: Any = ()  # the LoRA set it runs under (core/lora.py LoraSet); a tick decodes one set
    alora_start: int | None = None  # an activated LoRA's start: the prompt before it is read without adapters
    speculative: bool = True  # draft for it when the server speculates
    has_media: bool = False  # its prompt is a MediaPrompt: images or audio decoded from embeddings
    draft: list[int] = field(default_factory=list)  # the drafter's proposal for the next tick
    drafted: int = 0  # draft tokens verified so far
    accepted: int = 0  # of those, tokens kept

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = _Unset()
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    @property
    def kv_tag(self) -> tuple:
        """Which adapters compute which of its tokens: ``((start, LoraSet), ...)`` by position."""
        if self.alora_start is None:
            return ((0, self.loras),)
        return ((0, ()), (self.alora_start, self.loras))

    @property
    def tick_loras(self) -> Any:
        """The LoRA set its next tokens are decoded under (an activated LoRA's prompt start: none)."""
        start = self.alora_start
        return () if start is not None and self.n_prefilled < start else self.loras

    @property
    def prefill_remaining(self) -> int:
        return len(self.prompt) - self.n_prefilled

    def timings(self) -> Timings:
        """Timings so far; fixed once the request has ended."""
        t = Timings(prompt_tokens=len(self.prompt), generated_tokens=len(self.generated),
                    cached_tokens=self.cached_tokens, draft_tokens=self.drafted, draft_accepted=self.accepted)
        now = self.ended if self.ended is not None else time.perf_counter()
        if self.first_token is not None:
            t.ttft_ms = (self.first_token - self.arrived) * 1e3
            t.generation_ms = (now - self.first_token) * 1e3
        if self.started is not None:
            t.prompt_ms = ((self.first_token or now) - self.started) * 1e3
        return t
