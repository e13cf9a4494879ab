"""The scheduler: the wait queue, admission, each tick's plan, and what a tick's outputs mean.

It never calls llama.cpp itself (KV work goes through the pool's ``KVOps``,
sampling and decoding are the engine's), so it is tested with a fake KV and
synthetic outputs. One engine step, after vLLM's v1 engine::

    with scheduler.cond: scheduler.take()    # pop waiting requests for the free slots (lock held briefly)
    scheduler.admit()                        # prefix reuse: KV copies/saves/restores, without the lock
    plan = scheduler.schedule()              # pure: which slots decode, which prompt chunks go in
    out, lps, err = engine.execute(plan)     # one llama_decode, then sample every output row
    scheduler.update_from_output(plan, out, err, logprobs=lps)   # eog/stop/length/cancel, text out, releases

A plan is a list of :class:`Step`: one per slot, the tokens it puts in the
batch and which of them are sampled. Decoding is one token with one sampled
row, a prompt chunk samples only its last row when it completes the prompt;
a speculative step carries the last token plus the request's drafts, all rows
sampled in order until the first that disagrees with its draft (the engine
marks the rows after it :data:`SKIPPED`); ``update_from_output`` keeps the
agreeing drafts and cuts the others off the sequence's KV. A row whose draw
was still running when its tick ended (detached.py) is :data:`PENDING`: its
request (``Request.pending`` set) sits out the plans until :meth:`Scheduler.deliver`.
"""

from __future__ import annotations

import collections
import copy
import itertools
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from ... import telemetry
from ...core.logprobs import TokenLogprob
from ...errors import CancelledError, ClosedError, KVPoolFullError, LlamaError
from .request import End, Progress, Request, Status
from .slots import Slot, SlotPool
from .strategies import BatchStrategy


class QueueFullError(LlamaError):
    """The server's wait queue is at ``max_queue``; retry later."""


class ServerClosedError(CancelledError, ClosedError):
    """The server was closed (or failed) before the request finished, or is used after ``close()``."""


_FIRST = (0,)
_clock = time.perf_counter
_NONE = ()

#: An output row of a speculative step the engine did not sample (after the first rejected draft).
SKIPPED = -2
#: An output row whose draw goes on after its tick (its request's ``pending``; :meth:`Scheduler.deliver`).
PENDING = -3


class DraftAsk:
    """A request to draft for one decoding slot: up to ``k`` tokens after ``context``; the drafter sets
    ``draft``."""

    __slots__ = ("seq_id", "context", "k", "draft", "request")

    def __init__(self, seq_id: int, context: list[int], k: int, request: Request):
        self.seq_id = seq_id
        self.context = context
        self.k = k
        self.draft: list[int] = []
        self.request = request

    def __repr__(self) -> str:
        return f"DraftAsk(seq={self.seq_id}, context={len(self.context)}, k={self.k}, draft={self.draft})"


class Step:
    """One slot's share of a tick: ``tokens`` go in the batch at the slot's next positions;
    ``sample`` lists the indices (into ``tokens``) whose logits are sampled, in order.
    ``n_draft``: a speculative step's drafted tokens (``tokens[1:]``; every row sampled).
    The engine sets ``row``, the batch row of ``tokens[0]``."""

    __slots__ = ("slot", "request", "tokens", "sample", "row", "n_draft")

    def __init__(self, slot: Slot, tokens: list[int], sample: tuple[int, ...], n_draft: int = 0):
        self.slot = slot
        self.request = slot.request
        self.tokens = tokens
        self.sample = sample
        self.row = -1
        self.n_draft = n_draft

    def __repr__(self) -> str:
        draft = f", draft={self.n_draft}" if self.n_draft else ""
        return f"Step(seq={self.slot.seq_id}, tokens={len(self.tokens)}, sample={self.sample}{draft})"


class TickPlan:
    """A tick: the steps to decode (decoding slots first), slots whose requests were cancelled, and the
    LoRA set the decode runs under (every step's request asked for it).

    Images and audio (a request whose prompt is a MediaPrompt): ``media`` holds at most one step whose
    ``tokens`` are a media span's placeholders, decoded from its embeddings before the batch, on its
    own; ``encode`` lists the spans whose embeddings the engine should start encoding (off the
    scheduler thread): each running request's next span, from its admission on, so that it encodes
    while the text before it is read; ``blocked`` counts requests at a span whose encode is not done."""

    __slots__ = ("steps", "cancelled", "n_decode", "loras", "media", "encode", "blocked")

    def __init__(self, steps: list[Step], cancelled: list[Slot], n_decode: int, loras: Any = (),
                 media: list[Step] | None = None, encode: list[tuple[Request, Any]] | None = None,
                 blocked: int = 0):
        self.steps = steps
        self.cancelled = cancelled
        self.n_decode = n_decode
        self.loras = loras
        self.media = media or []
        self.encode = encode or []
        self.blocked = blocked

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.steps)

    @property
    def n_outputs(self) -> int:
        return sum(len(s.sample) for s in self.steps)


def _progress(request: Request, now: float) -> None:
    request.channel.put(Progress(len(request.prompt), request.cached_tokens, request.n_prefilled,
                                 (now - (request.started or now)) * 1e3))


def _own_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` for one consumer: each thread raises its own object (tracebacks don't mix)."""
    try:
        own = copy.copy(error)
    except Exception:  # pragma: no cover - an exception type that cannot be copied
        return error
    own.__cause__, own.__traceback__ = error.__cause__, None
    return own


class Scheduler:
    """Bookkeeping of a server's requests and slots.

    Thread safety: :meth:`submit`, :meth:`cancel`, :meth:`queue_length` and
    :meth:`close` may be called from any thread; everything else belongs to the
    scheduler thread. ``cond`` guards only the wait queue and the closing flag,
    and is never held during KV work.

    ``is_eog(token)`` tells end-of-generation tokens; ``bind(request)`` returns
    the request's ``row -> token`` sampling function (the engine binds it to its
    context); ``n_ctx_seq`` is the most tokens a slot holds. ``n_draft`` (0: no speculation): most
    tokens drafted per decoding slot and tick.
    """

    def __init__(self, pool: SlotPool, strategy: BatchStrategy, budget: int, n_ctx_seq: int, *,
                 max_queue: int = 0, is_eog: Callable[[int], bool] = lambda t: False,
                 bind: Callable[[Request], Callable[[int], int] | None] = lambda r: None,
                 n_draft: int = 0, max_outputs: int = 0, lora_quantum: int = 4):
        self.n_draft = n_draft
        # llama.cpp applies adapters per context, so one decode serves one LoRA set. A set keeps the
        # batch for up to ``lora_quantum`` ticks while another set waits (each switch re-sizes the
        # graph), then the set that has waited longest since its last turn takes it.
        self.lora_quantum = lora_quantum
        self._lora_set: Any = ()
        self._lora_ticks = 0
        self._lora_clock = 0  # ticks that ran a set
        self._lora_served: dict[Any, int] = {}  # the last tick of each set
        self.lora_switches = 0
        self.max_outputs = max_outputs  # logits rows one decode may have (0: no limit)
        self.drafted = 0  # draft tokens verified, all requests
        self.drafts = 0  # speculative steps (a draft verified in one slot's tick)
        self.generated = 0  # tokens accepted, all requests
        self.text_s = 0.0  # seconds detokenizing and matching stop strings (TextAssembler.push)
        self.handoff_s = 0.0  # seconds handing text pieces to their consumers (Channel.put)
        self.accepted = 0
        self.pool = pool
        self.strategy = strategy
        self.budget = budget
        self.n_ctx_seq = n_ctx_seq
        self.max_queue = max_queue
        self.is_eog = is_eog
        self.bind = bind
        self.cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._admitting: collections.deque[Request] = collections.deque()  # taken, not yet in a slot
        self._pinned = 0  # waiting requests pinned to a slot (the plain take() runs while there are none)
        self.closing = False
        # After the KV memory was found full: admit nothing and draft nothing until a request ends.
        self.kv_hold = False
        self.failure: BaseException | None = None
        self.prompt_tokens_evaluated = 0

    # ---- client side (any thread) ----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue ``request``; raises ServerClosedError or QueueFullError (closing its sampler) if refused."""
        self.submit_all([request])

    def submit_all(self, requests: Sequence[Request], abort: Callable[[], bool] | None = None) -> None:
        """Queue ``requests`` as one unit: all of them, or none (closing every sampler) with
        ServerClosedError, QueueFullError when they do not all fit in the queue, or CancelledError when
        ``abort()`` (asked under the queue's lock, so nothing is queued after it turns true) says so."""
        full_at = None
        with self.cond:
            if self.closing or self.failure is not None:
                error: LlamaError = ServerClosedError(
                    "the server is closed" if self.failure is None else f"the server failed: {self.failure!r}")
            elif abort is not None and abort():
                error = CancelledError("the submission was cancelled before it was queued")
            elif self.max_queue and len(self._waiting) + len(requests) > self.max_queue:
                full_at = len(self._waiting)
                error = QueueFullError(self.queue_full_message(len(requests), full_at))
            else:
                for request in requests:
                    request.queued = True
                    if request.pin is not None:
                        self._pinned += 1
                self._waiting.extend(requests)
                self.cond.notify()
                return
        for request in requests:
            request.sampler.close()
        if full_at is not None:  # outside the lock: a handler may call back into the server
            telemetry.emit("server.queue_full", {"queue_length": full_at}, {"max_queue": self.max_queue})
        raise error

    def queue_full_message(self, n: int, waiting: int) -> str:
        if n == 1:
            return f"the server queue is full ({self.max_queue} waiting requests, max_queue)"
        return (f"{n} requests do not fit in the server queue ({waiting} of max_queue={self.max_queue} places "
                f"taken); they are queued together or not at all")

    def room(self) -> int | None:
        """Places left in the wait queue (None: unbounded); a hint, the queue may change at once."""
        return None if not self.max_queue else max(0, self.max_queue - len(self._waiting))

    def cancel(self, request: Request) -> None:
        """End ``request``: at once if it still waits (it leaves the queue), else at the next tick."""
        if request.status.done:
            return
        request.cancel_requested = True
        with self.cond:
            queued = request.queued
            if queued:
                request.queued = False
                self._waiting.remove(request)
                if request.pin is not None:
                    self._pinned -= 1
            else:
                self.cond.notify()
        if queued:  # no longer reachable by the scheduler thread: end it here
            self.finish(None, request, Status.CANCELLED)

    def queue_length(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Refuse new requests and wake the scheduler thread so it ends."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    # ---- scheduler thread -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._waiting or self._admitting or self.pool.n_active)

    def take(self) -> None:
        """Move waiting requests into admission, one per free slot. The caller holds ``cond``.

        A request pinned to a slot (``Request.pin``) is taken only when that slot is free and not
        promised to another; it waits meanwhile, without holding up the requests behind it."""
        n = self.pool.n_free - len(self._admitting)
        waiting = self._waiting
        if n <= 0 or not waiting or (self.kv_hold and self.pool.n_active):
            return
        if not self._pinned and not any(r.pin is not None for r in self._admitting):
            while n > 0 and waiting:
                request = waiting.popleft()
                request.queued = False
                self._admitting.append(request)
                n -= 1
            return
        promised = {r.pin for r in self._admitting if r.pin is not None}
        free = {s.seq_id for s in self.pool.slots if s.free} - promised
        kept: collections.deque[Request] = collections.deque()
        for request in waiting:
            if n > 0 and (request.pin is None or request.pin in free):
                if request.pin is not None:
                    free.discard(request.pin)
                    self._pinned -= 1
                request.queued = False
                self._admitting.append(request)
                n -= 1
            else:
                kept.append(request)
        self._waiting = kept

    def admit(self) -> list[Slot]:
        """Give each taken request its slot (prefix reuse may copy, save or restore KV state)."""
        admitted = []
        queue = self._admitting
        while queue:
            request = queue[0]
            if request.cancel_requested:
                queue.popleft()
                self.finish(None, request, Status.CANCELLED)
                continue
            promised = frozenset(r.pin for r in queue if r is not request and r.pin is not None) \
                if self._pinned_admitting(queue) else frozenset()
            slot = self.pool.acquire(request, promised)
            request.checkpoint = self.pool.checkpoint_at(request)
            queue.popleft()
            request.status = Status.RUNNING
            request.started = time.perf_counter()
            request.seq_id = slot.seq_id
            binding = request.binding = self.bind(request)
            slot.sample = getattr(binding, "sample", binding)
            admitted.append(slot)
            if request.progress:  # (first: what the cache holds, before any prompt is computed)
                _progress(request, request.started)
            if telemetry.enabled("server.request.start"):
                telemetry.emit("server.request.start", {
                    "queue_wait_ms": (request.started - request.arrived) * 1e3,
                    "prompt_tokens": len(request.prompt)}, {"id": request.id})
        return admitted

    @staticmethod
    def _pinned_admitting(queue: collections.deque[Request]) -> bool:
        return any(r.pin is not None for r in queue)

    def draft_asks(self) -> list[DraftAsk]:
        """What to draft before this tick's :meth:`schedule`: one ask per decoding slot whose request
        speculates, with as many tokens as could still be emitted (max_tokens, the slot's context)."""
        if not self.n_draft or self.kv_hold:
            return []
        asks = []
        n_ctx = self.n_ctx_seq
        for slot in self.pool.slots:
            request = slot.request
            if request is None:
                continue
            request.draft = []
            if not request.speculative or request.cancel_requested or not request.generated or request.pending \
                    or request.n_prefilled != len(request.prompt):
                continue
            # The step decodes the pending token and k drafts at positions n_past .. n_past + k.
            k = min(self.n_draft, n_ctx - len(slot.tokens) - 1)
            if request.params.max_tokens > 0:
                k = min(k, request.params.max_tokens - len(request.generated) - 1)
            if k > 0:
                asks.append(DraftAsk(slot.seq_id, slot.tokens + [request.generated[-1]], k, request))
        return asks

    def schedule(self) -> TickPlan:
        """This tick's plan: cancelled slots to end, then the strategy's split of the token budget.

        A decoding request's ``draft`` (set from :meth:`draft_asks`) rides along in its step; drafts
        come out of the budget first and are cut to fit it."""
        cancelled: list[Slot] = []
        decoding: list[Slot] = []
        prefilling: list[tuple[Slot, int]] = []
        at_media: list[tuple[Slot, Any]] = []  # (slot, span): the request's next entries are a media span
        encode: list[tuple[Request, Any]] = []
        failed: list[tuple[Slot, BaseException]] = []
        blocked = 0
        for slot in self.pool.slots:
            request = slot.request
            if request is None:
                continue
            if request.pending is not None:  # its draw still runs (and uses its sampler): nothing until it ends
                blocked += 1
                continue
            if request.cancel_requested:
                cancelled.append(slot)
            elif request.n_prefilled == len(request.prompt):
                decoding.append(slot)
            else:
                end = len(request.prompt)
                if request.alora_start is not None and request.n_prefilled < request.alora_start:
                    end = request.alora_start  # (a chunk never spans the activated LoRA's start)
                if request.checkpoint is not None and request.n_prefilled < request.checkpoint < end:
                    end = request.checkpoint  # (a chunk ends where the prompt's state is kept)
                span = request.prompt.next_span(request.n_prefilled) if request.has_media else None
                if span is not None:
                    done = request.prompt.encoded.get(span.start)
                    if isinstance(done, BaseException):
                        failed.append((slot, done))
                        continue
                    if done is None and span.start not in request.prompt.encoding:
                        # asked for as soon as the request runs: it encodes while the text before it is read
                        encode.append((request, span))
                    if span.start == request.n_prefilled:
                        if done is None:
                            blocked += 1
                        else:
                            at_media.append((slot, span))
                        continue
                    end = min(end, span.start)  # (a text chunk stops where a media span starts)
                prefilling.append((slot, end - request.n_prefilled))
        for slot, error in failed:
            self.finish(slot, slot.request, Status.FAILED, error=_own_copy(error))
        loras = self._lora_turn(decoding, prefilling + [(slot, span.n_tokens) for slot, span in at_media])
        if loras is not None:
            decoding = [s for s in decoding if s.request.tick_loras == loras]
            prefilling = [sr for sr in prefilling if sr[0].request.tick_loras == loras]
            at_media = [sm for sm in at_media if sm[0].request.tick_loras == loras]
        else:
            loras = self._lora_set
        media = []
        if at_media:  # one media span per tick: its decode adds to one tick only
            slot, span = min(at_media, key=lambda sm: sm[0].request.arrived)
            media.append(Step(slot, slot.request.prompt[span.start:span.end], _NONE))
        if len(prefilling) > 1:
            prefilling.sort(key=lambda sr: sr[0].request.arrived)
        budget = self.budget
        if self.n_draft:
            room = budget - len(decoding)
            if self.max_outputs:  # every decoding row, and the last row of each prompt that may complete
                room = min(room, self.max_outputs - len(decoding) - len(prefilling))
            for slot in decoding:
                draft = slot.request.draft
                if len(draft) > room:
                    del draft[max(room, 0):]
                room -= len(draft)
                budget -= len(draft)
        split = self.strategy.plan(decoding, prefilling, budget)
        steps = []
        for slot in split.decode:
            request = slot.request
            draft = request.draft
            if draft:
                request.draft = []
                steps.append(Step(slot, [request.generated[-1], *draft], tuple(range(len(draft) + 1)), len(draft)))
            else:
                steps.append(Step(slot, [request.generated[-1]], _FIRST))
        n_decode = len(steps)
        for slot, n in split.prefill:
            request = slot.request
            start, end = request.n_prefilled, request.n_prefilled + n
            steps.append(Step(slot, request.prompt[start:end], (n - 1,) if end == len(request.prompt) else _NONE))
        return TickPlan(steps, cancelled, n_decode, loras, media, encode, blocked)

    def _lora_turn(self, decoding: list[Slot], prefilling: list[tuple[Slot, int]]) -> Any:
        """The LoRA set this tick decodes (None: every running request shares the set of the last tick,
        or nothing runs)."""
        oldest: dict[Any, float] = {}
        for slot in itertools.chain(decoding, (sr[0] for sr in prefilling)):
            request = slot.request
            loras = request.tick_loras
            if loras not in oldest or request.arrived < oldest[loras]:
                oldest[loras] = request.arrived
        if not oldest:
            return None
        current = self._lora_set
        self._lora_clock += 1
        if current in oldest and (len(oldest) == 1 or self._lora_ticks < self.lora_quantum):
            chosen = current
        else:
            # the set that has waited longest since its last turn (never served: by its oldest request)
            served = self._lora_served
            chosen = min((s for s in oldest if s != current), key=lambda s: (served.get(s, -1), oldest[s]))
        if len(self._lora_served) > 4 * len(oldest) + 16:  # (sets that no longer run are forgotten)
            self._lora_served = {s: t for s, t in self._lora_served.items() if s in oldest}
        self._lora_served[chosen] = self._lora_clock
        if chosen == current:
            self._lora_ticks += 1
        else:
            self._lora_set, self._lora_ticks = chosen, 1
            self.lora_switches += 1
        return None if len(oldest) == 1 and chosen == current else chosen

    def uses_adapter(self, adapter: Any) -> bool:
        """Whether a waiting, admitted or running request applies ``adapter``."""
        def uses(request: Request) -> bool:
            return any(a is adapter for a, _ in request.loras)

        with self.cond:
            if any(uses(r) for r in self._waiting):
                return True
        return any(uses(r) for r in self._admitting) or \
            any(s.request is not None and uses(s.request) for s in self.pool.slots)

    def update_from_output(self, plan: TickPlan, outputs: Sequence[int] | None,
                           error: BaseException | None = None, now: float | None = None, *,
                           logprobs: Sequence[TokenLogprob | None] | None = None,
                           row_errors: Mapping[int, BaseException] | None = None) -> None:
        """Apply a tick: ``outputs`` holds the sampled tokens of every step's ``sample`` rows, in plan
        order; ``error`` (outputs None) fails the plan's requests, e.g. when the decode failed.
        ``logprobs``, parallel to ``outputs`` (None: no request of the tick asked), holds the entry
        of each sampled token of a request with logprobs. ``row_errors`` (output index → error)
        fails only the requests whose sampling failed; the others go on."""
        for slot in plan.cancelled:
            self.finish(slot, slot.request, Status.CANCELLED)
        if error is not None:
            for step in (*plan.media, *plan.steps):
                if step.request.ended is None:
                    self.finish(step.slot, step.request, Status.FAILED, error=_own_copy(error))
            return
        if now is None:
            now = time.perf_counter()
        for step in plan.media:  # (its embeddings were decoded before the batch)
            slot, request = step.slot, step.request
            slot.add_media(step.tokens, request.prompt.span_at(request.n_prefilled).n_pos)
            request.n_prefilled += len(step.tokens)
            self.prompt_tokens_evaluated += len(step.tokens)
            if request.progress:
                _progress(request, now)
        k = 0
        for step in plan.steps:
            if step.n_draft:
                k = self._verified(step, outputs, k, now, logprobs, row_errors)  # type: ignore[arg-type]
                continue
            slot, request, tokens = step.slot, step.request, step.tokens
            slot.tokens += tokens  # their KV is in the sequence now
            n_prompt = len(request.prompt) - request.n_prefilled
            if n_prompt:
                n_prompt = min(n_prompt, len(tokens))
                request.n_prefilled += n_prompt
                self.prompt_tokens_evaluated += n_prompt
                if request.progress:
                    _progress(request, now)
                if request.n_prefilled == request.checkpoint:
                    self.pool.checkpoint(slot)  # (its KV holds the prompt up to there)
            for _ in step.sample:
                tok = outputs[k]  # type: ignore[index]
                if tok == PENDING:  # (delivered later)
                    k += 1
                    continue
                entry = logprobs[k] if logprobs is not None else None
                if row_errors and k in row_errors:
                    self.finish(slot, request, Status.FAILED, error=_own_copy(row_errors[k]))
                k += 1
                if request.ended is None:  # not finished by an earlier token of this step
                    self._accept(slot, request, tok, now, entry)

    def deliver(self, slot: Slot, request: Request, tok: int = -1, *, entry: TokenLogprob | None = None,
                error: BaseException | None = None, now: float | None = None) -> None:
        """The token (or the sampler's ``error``) of a draw that ended after its tick (a :data:`PENDING` row),
        counted as ``update_from_output`` counts a sampled row."""
        request.pending = None
        if request.ended is not None:
            return
        if request.cancel_requested:  # (its consumer is gone, or asked to stop: nothing more goes out)
            self.finish(slot, request, Status.CANCELLED)
            return
        if error is not None:
            self.finish(slot, request, Status.FAILED, error=error)
            return
        self._accept(slot, request, tok, time.perf_counter() if now is None else now, entry)

    def media_failed(self, plan: TickPlan, step: Step, error: BaseException) -> None:
        """A media step of ``plan`` could not be decoded (nothing of it is in its sequence): its request
        fails alone and leaves the plan; the rest of the tick goes on."""
        plan.media.remove(step)
        self.finish(step.slot, step.request, Status.FAILED, error=_own_copy(error))

    def kv_full(self, plan: TickPlan, capacity: int) -> Request | None:
        """The plan's batch did not fit in the KV memory (``capacity`` cells), idle slots' caches
        already dropped, and nothing of it was decoded: make room, the least costly way first, and
        let the next tick plan again. Until a request ends, no request is admitted and nothing is
        drafted (``kv_hold``), so the running ones can finish.

        1. Requests cancelled by now end (their cells are freed).
        2. A plan with drafts: the next ticks decode without them.
        3. A request that has generated nothing yet and holds cells or was in the plan (a prompt
           being read) goes back to the head of the queue, its cells freed: it starts again later.
        4. Else the request that arrived last among those holding cells fails with
           :class:`KVPoolFullError` (llama-server fails every running request here).

        Returns the request that failed, if one did."""
        was_held, self.kv_hold = self.kv_hold, True
        # (one whose draw still runs ends when it is delivered)
        cancelled = [slot for slot in self.pool.slots if slot.request is not None and slot.request.cancel_requested
                     and slot.request.pending is None]
        for slot in cancelled:
            self.finish(slot, slot.request, Status.CANCELLED)
        if cancelled:
            self.kv_hold = True  # (finish() lifted it: the room is not there yet)
            return None
        if not was_held and any(step.n_draft for step in plan.steps):
            return None
        planned = {id(step.request) for step in (*plan.steps, *plan.media)}
        running = [slot for slot in self.pool.slots if slot.request is not None]
        # (not one whose draw runs: its sampler will have taken a token, so it cannot start over unchanged;
        # it fails below if it is the last to arrive, once the draw has ended)
        fresh = [slot for slot in running if not slot.request.generated and slot.request.pending is None
                 and (slot.tokens or id(slot.request) in planned)]
        if fresh:
            slot = max(fresh, key=lambda s: (s.request.arrived, s.request.id))
            self._requeue(slot, slot.request)
            return None
        holding = [slot for slot in running if slot.tokens]
        if not holding:  # pragma: no cover - a full memory is held by someone
            return None
        slot = max(holding, key=lambda s: (s.request.arrived, s.request.id))
        request = slot.request
        self.finish(slot, request, Status.FAILED, error=KVPoolFullError(
            f"Context size has been exceeded: the KV memory the slots share ({capacity} tokens) is full; "
            f"this request, the last to arrive, was stopped after {len(request.generated)} tokens so "
            f"that the others could go on", code=1))
        self.kv_hold = True
        if telemetry.enabled("server.kv_full"):
            telemetry.emit("server.kv_full", {"generated_tokens": len(request.generated),
                                              "running": len(running)}, {"id": request.id})
        return request

    def _requeue(self, slot: Slot, request: Request) -> None:
        """Put a running request that has generated nothing back at the head of the wait queue, its
        slot and cells freed (its sampler has accepted nothing: it starts over unchanged)."""
        release = getattr(request.binding, "release", None)
        if release is not None:
            release()
        request.binding = None
        self.pool.release(slot, keep=False)
        request.status = Status.WAITING
        request.n_prefilled = request.cached_tokens = 0
        request.started = request.seq_id = None
        with self.cond:
            request.queued = True
            self._waiting.appendleft(request)
            if request.pin is not None:
                self._pinned += 1

    def _verified(self, step: Step, outputs: Sequence[int], k: int, now: float,
                  logprobs: Sequence[TokenLogprob | None] | None,
                  row_errors: Mapping[int, BaseException] | None) -> int:
        """Apply a speculative step whose rows start at ``outputs[k]``; returns the index after them.

        Rows were sampled in order until the first that differs from its draft: the drafts before
        it stay in the sequence, the rest are cut off the KV, and every sampled token is accepted
        as plain decoding would have produced it, one by one."""
        slot, request, tokens, n_draft = step.slot, step.request, step.tokens, step.n_draft
        n = len(step.sample)
        rows = outputs[k:k + n]
        m = 0
        while m < n_draft and rows[m] == tokens[1 + m]:
            m += 1
        n_past = len(slot.tokens)
        slot.tokens += tokens  # their KV is in the sequence now, rejected drafts included
        request.drafted += n_draft
        request.accepted += m
        self.drafted += n_draft
        self.accepted += m
        self.drafts += 1
        if not self.pool.rollback(slot, n_past + 1 + m):
            self.finish(slot, request, Status.FAILED, error=LlamaError(
                "the server could not cut rejected draft tokens off its memory (a recurrent state "
                "without enough rollback snapshots: raise n_rs_seq)"))
            return k + n
        for j in range(n):
            tok = rows[j]
            if tok == SKIPPED:
                break
            if row_errors and k + j in row_errors:
                self.finish(slot, request, Status.FAILED, error=_own_copy(row_errors[k + j]))
            if request.ended is not None:
                break
            # (as plain decoding: the sequence held n_past + 1 + j tokens when this one was sampled)
            self._accept(slot, request, tok, now, logprobs[k + j] if logprobs is not None else None,
                         n_past + 1 + j)
        return k + n

    def _accept(self, slot: Slot, request: Request, tok: int, now: float,
                entry: TokenLogprob | None = None, held: int | None = None) -> None:
        """One sampled token, counted exactly as the single-sequence token loop counts it
        (``held``: the tokens the sequence held when it was sampled; default: all of them)."""
        if request.first_token is None:
            request.first_token = now
        params = request.params
        if not params.ignore_eos and self.is_eog(tok):
            self._end(slot, request, "eog")
            return
        request.generated.append(tok)
        self.generated += 1
        if entry is not None and request.logprobs is not None:
            # Kept in step with ``generated``, and sent ahead of the text the token completes so a
            # consumer holds the entries of every token behind the text it has read.
            request.logprobs.append(entry)
            if not request.channel.put(entry):
                request.cancel_requested = True
        text = request.text
        if text is not None:
            t0 = _clock()
            piece = text.push(tok)
            t1 = _clock()
            self.text_s += t1 - t0
            if piece:
                request.piece_ends.append(len(request.generated))  # (before the piece is seen)
                delivered = request.channel.put(piece)
                self.handoff_s += _clock() - t1
                if not delivered:
                    request.cancel_requested = True  # its consumer is gone (its event loop was closed)
            if text.stopped:
                self.finish(slot, request, Status.FINISHED, "stop")
                return
        if len(request.generated) == params.max_tokens \
                or (len(slot.tokens) if held is None else held) >= self.n_ctx_seq:
            self._end(slot, request, "length")

    def _end(self, slot: Slot, request: Request, reason: str) -> None:
        """A natural end (eog, length): the held-back text goes out first, and may complete a stop."""
        text = request.text
        if text is not None:
            piece = text.flush()
            if text.stopped:
                reason = "stop"
            if piece:
                request.piece_ends.append(len(request.generated))
                request.channel.put(piece)
        self.finish(slot, request, Status.FINISHED, reason)

    def finish(self, slot: Slot | None, request: Request, status: Status, reason: str | None = None,
               error: BaseException | None = None) -> None:
        """End ``request`` (idempotent): freeze it, free its slot, close its sampler, tell its consumer."""
        if request.status.done:
            return
        pending, request.pending = request.pending, None
        if pending is not None:  # (a draw on a worker uses its sampler: bounded by the grammar work bound)
            try:
                pending.exception()
            except BaseException:  # pragma: no cover - a cancelled future
                pass
        request.ended = time.perf_counter()
        request.finish_reason = reason
        request.status = status
        release = getattr(request.binding, "release", None)
        if release is not None:  # the sampler claim of a running request (before the sampler closes)
            release()
        request.binding = None
        if slot is not None:
            slot.sample = None
            # A finished request's KV is a valid prefix cache; a cancelled or failed one is dropped.
            self.pool.release(slot, keep=status is Status.FINISHED and request.params.cache_prompt)
            self.kv_hold = False  # (its cells are free, or idle: they can be evicted)
        request.sampler.close()
        if status is Status.FINISHED:
            request.channel.put(End(reason or "stop"))
        elif status is Status.CANCELLED:
            request.channel.put(CancelledError("the request was cancelled"))
            if telemetry.enabled("server.request.cancelled"):
                telemetry.emit("server.request.cancelled", {"generated_tokens": len(request.generated)},
                               {"id": request.id})
            return
        else:
            request.channel.put(error or ServerClosedError("the request failed"))
        if telemetry.enabled("server.request.stop"):
            t = request.timings()
            telemetry.emit("server.request.stop", {
                "queue_wait_ms": ((request.started or request.ended) - request.arrived) * 1e3,
                "ttft_ms": t.ttft_ms, "duration_ms": (request.ended - request.arrived) * 1e3,
                "prompt_tokens": len(request.prompt), "generated_tokens": len(request.generated),
                "draft_tokens": request.drafted, "draft_accepted": request.accepted},
                {"id": request.id, "finish_reason": reason if status is Status.FINISHED else "error"})

    def fail_all(self, error: BaseException) -> None:
        """End every waiting, admitting and running request with ``error``; refuse new ones."""
        with self.cond:
            self.closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._pinned = 0
            for request in waiting:
                request.queued = False
        waiting += self._admitting
        self._admitting.clear()
        for request in waiting:
            self.finish(None, request, Status.FAILED, error=_own_copy(error))
        for slot in self.pool.slots:
            request = slot.request
            if request is None:
                continue
            own = _own_copy(error)
            try:
                self.finish(slot, request, Status.FAILED, error=own)
            except Exception:  # the context may be unusable; the caller must still be told
                request.status = Status.FAILED
                request.channel.put(own)
                slot.request = None
