"""A server request: its state, its options, its text, and the channel its pieces travel back on."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

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


class _Mailbox:
    """Items bound for the queues of one event loop, handed over in batches.

    The first item of a burst schedules one drain on the loop (one wake-up of its
    thread); items put before that drain runs join it. The scheduler puts one piece
    per stream per tick, so a tick of 64 streams wakes the loop once instead of 64
    times, and the loop's thread asks for the GIL once. Thread-safe.
    """

    __slots__ = ("_lock", "_items", "_scheduled", "wakeups", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False
        self.wakeups = 0  # drains scheduled so far (tests and curiosity)

    def put(self, loop: asyncio.AbstractEventLoop, target: asyncio.Queue, item: Any) -> bool:
        with self._lock:
            if loop.is_closed():  # nobody is listening any more (and a pending drain never runs)
                self._items.clear()
                return False
            self._items.append((target, item))
            if self._scheduled:  # a drain is on its way
                return True
            held = getattr(_held, "boxes", None)
            if held is not None:  # within handoff_batch(): sent at its end
                held[self] = loop
                return True
            self._scheduled = True
            self.wakeups += 1
        return self._schedule(loop)

    def flush(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Schedule the drain of what was held back (nothing to do if one is on its way)."""
        with self._lock:
            if self._scheduled or not self._items:
                return True
            self._scheduled = True
            self.wakeups += 1
        return self._schedule(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop was closed: nobody is listening any more
            with self._lock:
                self._scheduled = False
                self._items.clear()
            return False
        return True

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for target, item in items:
            target.put_nowait(item)


_held = threading.local()


@contextlib.contextmanager
def handoff_batch() -> Iterator[None]:
    """Within the block, asyncio hand-offs from this thread are held back; at its end each event loop
    gets what it was sent in one wake-up. (Without it, the socket write that wakes a loop lets the
    loop's thread take the GIL and drain one item, so a tick of N streams still woke it N times.)"""
    if getattr(_held, "boxes", None) is not None:  # (nested: the outer block sends)
        yield
        return
    boxes: dict[_Mailbox, asyncio.AbstractEventLoop] = {}
    _held.boxes = boxes
    try:
        yield
    finally:
        _held.boxes = None
        for box, loop in boxes.items():
            box.flush(loop)


_mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    """The one mailbox of ``loop`` (it holds no reference to the loop: the entry goes with it)."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _Mailbox()
        return box


class Channel:
    """Where the scheduler thread puts a request's items (text pieces, then End or an exception;
    with logprobs, each token's :class:`TokenLogprob` before the text it completes).

    Synchronous consumers block on a queue; asyncio consumers get items through
    their event loop, so waiting never blocks the loop. The channels of one loop
    share its mailbox: the items of a tick reach the loop in one hand-off.
    """

    __slots__ = ("loop", "sync", "aio", "_box")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop
        self.sync: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        self.aio: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._box = _mailbox(loop) if loop else None

    def put(self, item: Any) -> bool:
        """Deliver ``item``; False when nobody can receive it any more (its event loop was closed)."""
        if self.sync is not None:
            self.sync.put(item)
            return True
        return self._box.put(self.loop, self.aio, item)  # type: ignore[union-attr,arg-type]

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
    budget: Any = None  # its reasoning budget's BudgetState (core/budget.py): forced tokens replace sampled ones
    has_media: bool = False  # its prompt is a MediaPrompt: images or audio decoded from embeddings
    draft: list[int] = field(default_factory=list)  # the drafter's proposal for the next tick
    checkpoint: int | None = None  # the prompt length where its state goes to the RAM cache (SlotPool.checkpoint_at)
    pending: Any = None  # a draw still running after its tick (a Future; detached.py): not scheduled meanwhile
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
