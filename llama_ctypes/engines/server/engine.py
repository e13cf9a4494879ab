"""The engine: the scheduler thread, which owns the context and runs one ``llama_decode`` per tick.

A tick (see ``scheduler.py`` for the bookkeeping):

1. under the scheduler's lock, only queue operations: take waiting requests for free slots;
2. without the lock: admission (prefix reuse may copy, save or restore KV state),
   calls routed to this thread (``call``), drafts for speculating slots (``speculation.py``),
   the plan (``Scheduler.schedule``);
3. :meth:`Engine.execute`: fill ONE batch from the plan, decode, sample every output row (a
   speculative step's rows in order, up to the first that rejects its draft; a grammar's rows on
   workers, ``detached.py``, those still running after a short wait delivered at a later tick; and,
   for requests that asked, compute each sampled token's log-probabilities from its row);
4. ``Scheduler.update_from_output``: end-of-generation, stop strings, lengths, text to the channels.

Clients (submit, cancel, the asyncio loop) therefore never wait for KV copies or decodes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ... import telemetry
from ...core.batch import Batch
from ...core.context import ContextLease
from ...core.decode_status import check_decode
from ...core.generation import in_graph_blocker, post_candidates
from ...core.logprobs import TokenLogprob, post_sampling_logprob, token_logprob
from ...core.params import default_threads
from ...errors import DecodeError, KVPoolFullError, LlamaError, RPCConnectionError
from .detached import Detached, DetachedDraws
from .prompt_cache import PromptCache
from .request import Request, handoff_batch
from .scheduler import PENDING, SKIPPED, QueueFullError, Scheduler, ServerClosedError, TickPlan
from .slots import BASE_TAG, SlotPool
from .speculation import SlotDrafter
from .strategies import BatchStrategy

__all__ = ["Engine", "ContextKV", "QueueFullError", "ServerClosedError"]

logger = logging.getLogger(__name__)

#: Rows x vocabulary below which a tick's native-chain rows are drawn one by one: handing rows to threads
#: costs tens of microseconds, a row of a 32k vocabulary about a hundred.
CONCURRENT_SAMPLING_WORK = 2**17

class ContextKV:
    """The slot pool's KV operations, over the server's leased context (scheduler thread only).

    ``mirror``: a drafter whose own sequences follow the slots' (an MTP head's cache), told of every
    forget, cut, copy and restore. (The pool passes positions; a speculative server refuses media, so
    for a mirror they are token counts.)"""

    def __init__(self, lease: ContextLease, mirror: Any = None):
        self._lease = lease
        self._mirror = mirror
        # A sliding-window cache (swa_full=False on an SWA model), whose prompts the pool checkpoints; not with
        # a drafter mirror (an MTP head's cache): it cannot follow a restored checkpoint, and would refuse it.
        self.windowed = lease.ctx.n_swa > 0 and mirror is None

    def cut_floor(self, seq: int) -> int:
        if not self.windowed:
            return 0
        # What a saved state holds (measured: llama.cpp writes only the window before the last position,
        # whatever older cells the live cache still has), then as prefix_complete: -1, nothing at all.
        n_swa, pos_max = self._lease.ctx.n_swa, self._lease.seq_pos_max(seq)
        pos_min = max(self._lease.seq_pos_min(seq), pos_max - n_swa + 1)
        return 0 if pos_min == 0 else pos_min + n_swa if pos_min > 0 else 2**31 - 1

    def forget(self, seq: int) -> None:
        self._lease.seq_rm(seq, -1, -1)
        if self._mirror is not None:
            self._mirror.kv_forget(seq)

    def truncate(self, seq: int, keep: int) -> bool:
        ok = self._lease.seq_rm(seq, keep, -1)
        if ok and self._mirror is not None:
            self._mirror.kv_truncate(seq, keep)
        return ok

    def copy(self, src: int, dst: int, n: int) -> None:
        self._lease.seq_cp(src, dst, 0, n)
        if self._mirror is not None:
            self._mirror.kv_copy(src, dst, n)

    def complete(self, seq: int, n: int) -> bool:
        return self._lease.prefix_complete(seq, n) and (self._mirror is None or self._mirror.kv_complete(seq, n))

    def save(self, seq: int) -> np.ndarray:
        return self._lease.state_seq_get(seq)

    def restore(self, seq: int, state: Any) -> bool:
        if self._mirror is not None:
            self._mirror.kv_restore(seq)
        return self._lease.state_seq_set(seq, state)

    def last_position(self, seq: int) -> int:
        return self._lease.seq_pos_max(seq)


class TickSplit:
    """Seconds the scheduler thread spent in each part of its ticks, summed (``Server.stats()``):
    ``admit`` (taking and admitting requests, prefix reuse), ``draft``, ``schedule`` (the plan),
    ``decode`` (filling the batch and ``llama_decode``), ``sample`` (sampling every output row,
    logprobs), ``update`` (end conditions, detokenizing, stop strings and handing pieces to the
    callers; the last two also apart, from the scheduler: ``text`` and ``handoff``)."""

    __slots__ = ("admit", "draft", "schedule", "decode", "sample", "update")

    def __init__(self) -> None:
        self.admit = self.draft = self.schedule = self.decode = self.sample = self.update = 0.0


class _Call:
    """A function to run on the scheduler thread, and its result."""

    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class Engine:
    """Owns the context; runs the tick loop on its own thread. All client calls are thread-safe."""

    def __init__(self, lease: ContextLease, strategy: BatchStrategy, max_queue: int = 0, *,
                 n_ctx_seq: int | None = None, prompt_cache_bytes: int = 0, prompt_cache_disk: Any = None,
                 drafter: SlotDrafter | None = None, n_draft: int = 0):
        self.lease = lease
        self.drafter = drafter
        self.ctx = ctx = lease.ctx
        self.batch = Batch(ctx.max_batch, 1)
        # The decode call, an attribute so that tests can slow it down.
        self._decode: Callable[[Batch], int] = lease.decode_rc
        # Logits rows for logprobs, read through the lease: unusable once the server releases it.
        self._logits_of = lease.logits_view_fn()
        self._logits_rows = lease.logits_rows_fn()
        token_bytes = ctx.vocab.token_bytes
        # Token pieces as a request's detokenizer renders them: [plain, special tokens as text].
        self._pieces: tuple[Callable[[int], bytes], Callable[[int], bytes]] = (
            lambda t: token_bytes(t, False), lambda t: token_bytes(t, True))
        model = ctx.model
        # A drafter that mirrors the slots' sequences (MTP) follows every tick and KV operation.
        self._observer = drafter if getattr(drafter, "needs_observe", False) else None
        self.pool = SlotPool(ctx.n_seq_max, ContextKV(lease, self._observer), unified=ctx.params.kv_unified,
                             partial_reuse=not (model.is_recurrent or model.is_hybrid),
                             ram_cache=PromptCache(prompt_cache_bytes, disk=prompt_cache_disk, disk_tag=BASE_TAG)
                             if prompt_cache_bytes or prompt_cache_disk is not None else None)
        self.scheduler = Scheduler(self.pool, strategy, ctx.max_batch, n_ctx_seq or ctx.n_ctx_seq,
                                   max_outputs=ctx.n_outputs_max,
                                   max_queue=max_queue, is_eog=ctx.vocab.is_eog,
                                   bind=self._bind,
                                   n_draft=n_draft if drafter is not None else 0)
        self._check_tokens = ctx.vocab.check_tokens
        self._calls: collections.deque[_Call] = collections.deque()
        self._on_exit: Callable[[], None] | None = None
        self._exited = False
        # Rows sampled by native chains, drawn on the decode's threads while it waits (_sample_concurrently).
        self._n_samplers = max(1, min(ctx.params.n_threads or default_threads(), os.cpu_count() or 1))
        self._samplers: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            self._n_samplers - 1, thread_name_prefix="llama_ctypes-sample") if self._n_samplers > 1 else None
        # Images and audio are encoded on a thread of their own, so the ticks go on meanwhile.
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        self._woken = 0  # background work finished so far: encodes, detached draws (guarded by the scheduler's cond)
        # Rows whose draw may take long (a grammar) are drawn off the tick (detached.py); a speculative step's
        # are not (verification draws them in order: see _sample_verified). Not with a drafter that mirrors
        # the slots (MTP): it follows each tick's tokens as the tick ends.
        self._detached: DetachedDraws | None = DetachedDraws(self._n_samplers, self._wake) \
            if self._observer is None else None
        self._encodes: dict[tuple[int, int], Any] = {}  # (id(prompt), span start) -> prompt, while queued or running
        # counters, read by stats()
        self.ticks = 0
        self.batch_tokens = 0
        self.max_batch_tokens = 0  # the largest decode so far, in tokens
        self.slot_steps = 0  # slots decoded, summed over ticks (busy slots per decode = this / ticks)
        # Requests that asked for in-graph sampling: sampled in the graph, or not (by reason).
        self.in_graph = 0
        self.concurrent_rows = 0  # rows drawn on several threads at once (_sample_concurrently)
        self.in_graph_fallbacks: collections.Counter[str] = collections.Counter()
        self.split = TickSplit()  # where the scheduler thread's time goes
        self.thread = threading.Thread(target=self._run, name="llama_ctypes-server", daemon=True)

    # ---- client side (any thread) ----------------------------------------------------------
    def _bind(self, request: Request) -> Any:
        """Claim a running request's sampler (on its slot's sequence, in the graph when it asks and can)."""
        blocker = in_graph_blocker(request.params) or ("speculative" if self.drafter is not None else None)
        binding = request.sampler.bind(self.lease, candidates=post_candidates(request.params),
                                       seq=request.seq_id, blocker=blocker)
        # (counted once: a request sent back to the queue is bound again when it runs)
        if request.sampler.params.backend_sampling and request.in_graph is None:
            request.in_graph = binding.in_graph
            if binding.in_graph:
                self.in_graph += 1
            else:
                self.in_graph_fallbacks[binding.fallback] += 1
        return binding

    def submit(self, request: Request) -> None:
        self.scheduler.submit(request)

    def cancel(self, request: Request) -> None:
        """End ``request``: at once while it waits, else at the next tick (freeing its slot and KV)."""
        self.scheduler.cancel(request)

    def queue_length(self) -> int:
        return self.scheduler.queue_length()

    @property
    def failure(self) -> BaseException | None:
        return self.scheduler.failure

    @property
    def prompt_tokens_evaluated(self) -> int:
        return self.scheduler.prompt_tokens_evaluated

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the scheduler thread between two ticks and return its result.

        Raises ServerClosedError once the server is closing.
        """
        if threading.current_thread() is self.thread:
            return fn()
        call = _Call(fn)
        with self.scheduler.cond:
            if self.scheduler.closing:
                raise ServerClosedError("the server is closed")
            self._calls.append(call)
            self.scheduler.cond.notify()
        call.done.wait()  # the scheduler thread runs it, or fails it when it ends
        if call.error is not None:
            raise call.error
        return call.result

    def close(self, timeout: float | None = None, on_exit: Callable[[], None] | None = None) -> bool:
        """Stop the scheduler thread (waiting up to ``timeout``); True when it has ended.

        ``on_exit`` runs once the thread has ended: here when it ended in time, else on that
        thread as it exits, so the context is freed when nothing can be decoding in it.
        """
        self.scheduler.close()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        if on_exit is not None:
            with self.scheduler.cond:
                if not self._exited:
                    self._on_exit = on_exit
                    return False
            on_exit()
        return not self.thread.is_alive()

    # ---- scheduler thread -------------------------------------------------------------------
    def _run(self) -> None:
        scheduler = self.scheduler
        cond = scheduler.cond
        clock = time.perf_counter
        error: BaseException = ServerClosedError("the server was closed before the request finished")
        try:
            while True:
                calls = None
                if not scheduler.has_work() and self.ctx.loras:
                    # (idle: apply none, so that an adapter nothing uses can be closed)
                    self.lease.apply_loras(())
                with cond:
                    while not scheduler.closing and not self._calls and not scheduler.has_work():
                        cond.wait()
                    if scheduler.closing:
                        break
                    if self._calls:
                        calls, self._calls = self._calls, collections.deque()
                    t0 = clock()
                    scheduler.take()
                if calls:
                    for call in calls:
                        call.run()
                    t0 = clock()  # (a caller's function is not the tick's work)
                scheduler.admit()
                t1 = clock()
                if self.drafter is not None:
                    self._draft()
                t2 = clock()
                woken = self._woken
                if self._detached is not None and self._detached.running:
                    self._deliver_detached()
                plan = scheduler.schedule()
                if plan.encode:
                    self._start_encodes(plan.encode)
                t3 = clock()
                split = self.split
                split.admit += t1 - t0
                split.draft += t2 - t1
                split.schedule += t3 - t2
                if plan.steps or plan.media:
                    outputs, logprobs, failure, row_errors = self.execute(plan)
                    if isinstance(failure, KVPoolFullError):
                        victim = scheduler.kv_full(plan, self.ctx.n_ctx)
                        if victim is not None:
                            logger.warning("the KV memory is full (%d tokens): request %d, the last to arrive, "
                                           "was stopped", self.ctx.n_ctx, victim.id)
                    else:
                        t4 = clock()
                        with handoff_batch():  # (each event loop woken once per tick, not per piece)
                            scheduler.update_from_output(plan, outputs, failure, logprobs=logprobs,
                                                         row_errors=row_errors)
                        split.update += clock() - t4
                elif plan.cancelled:
                    scheduler.update_from_output(plan, ())
                elif plan.blocked:  # nothing to decode until an image or clip is encoded, or a draw ends
                    with cond:
                        if self._woken == woken and not scheduler.closing and not self._calls:
                            cond.wait(1.0)
        except RPCConnectionError as exc:  # an RPC worker of the model was lost: the context is unusable
            logger.error("server stopped: %s", exc)
            scheduler.failure = exc
            error = exc  # every request gets it (with its endpoint); later submissions: "the server failed"
        except BaseException as exc:  # a bug or a native failure: no caller may hang
            logger.exception("server scheduler failed")
            scheduler.failure = exc
            error = ServerClosedError(f"the server's scheduler failed: {exc!r}")
            error.__cause__ = exc
        finally:
            self._exit(error)

    def _start_encodes(self, spans: list) -> None:
        """Encode these media spans (``(request, span)``) on the encoder thread; each result (or error)
        goes to the request's prompt (``MediaPrompt.encoded``) and wakes the scheduler."""
        if self._encoder is None:
            self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llama_ctypes-encode")
        cond = self.scheduler.cond
        for request, span in spans:
            prompt = request.prompt
            if span.start in prompt.encoding:  # (the choices of one request share their prompt)
                continue
            prompt.encoding.add(span.start)
            key = (id(prompt), span.start)
            with cond:
                self._encodes[key] = prompt

            def encode(prompt=prompt, span=span, key=key, request=request) -> None:
                try:
                    # Skipped for a request that ended while this waited (cancelled long before its
                    # image, say); another request sharing the prompt asks again.
                    if request.ended is None and not request.cancel_requested:
                        prompt.embeddings(span)  # (keeps the result, or the error, with the prompt)
                finally:
                    prompt.encoding.discard(span.start)
                    with cond:
                        self._encodes.pop(key, None)
                        self._woken += 1
                        cond.notify_all()

            self._encoder.submit(encode)

    def _decode_media(self, step) -> BaseException | None:
        """Decode a media step's embeddings into its slot's sequence; the error, if it failed (KVPoolFullError
        when the KV memory is full even with the idle slots' caches dropped). A failure leaves none of it."""
        slot, request = step.slot, step.request
        prompt = request.prompt
        span = prompt.next_span(request.n_prefilled)
        embd = prompt.encoded[span.start]
        pos, seq = slot.next_pos, slot.seq_id
        lease = self.lease
        try:
            rc = lease.decode_media_rc(prompt, span, embd, pos, seq)
            if rc == 1:
                lease.seq_rm(seq, pos, -1)
                if self.pool.evict_idle():
                    rc = lease.decode_media_rc(prompt, span, embd, pos, seq)
        except BaseException:
            lease.seq_rm(seq, pos, -1)
            raise
        if rc != 0:
            lease.seq_rm(seq, pos, -1)  # (chunks decoded before the failure must not linger)
        if rc == 1:
            return KVPoolFullError("the media do not fit in the KV memory", code=1)
        try:
            check_decode(rc, f"llama_decode ({span.kind})", span.n_tokens)
        except DecodeError as error:
            return error
        self.batch_tokens += span.n_tokens
        return None

    @property
    def late_rows(self) -> int:
        """Rows drawn on a worker whose draw outlasted its tick, delivered later (detached.py)."""
        return self._detached.late if self._detached is not None else 0

    def _wake(self) -> None:
        """Background work ended (a worker thread's call): the scheduler thread plans again."""
        with self.scheduler.cond:
            self._woken += 1
            self.scheduler.cond.notify_all()

    def _exit(self, error: BaseException) -> None:
        if self._samplers is not None:  # (idle: the scheduler thread waits for every draw it starts)
            self._samplers.shutdown(wait=True)
        if self._detached is not None:  # (a detached draw uses its request's sampler: the requests end after)
            self._detached.shutdown()
        if self._encoder is not None:
            self._encoder.shutdown(wait=False, cancel_futures=True)
            with self.scheduler.cond:  # (a cancelled encode never runs: its prompt must not wait for it)
                pending, self._encodes = self._encodes, {}
            for (_, start), prompt in pending.items():
                prompt.encoding.discard(start)
        scheduler = self.scheduler
        try:
            scheduler.fail_all(error)  # also refuses new requests and calls from now on
        except BaseException:  # pragma: no cover - keep going: the calls and on_exit below must run
            logger.exception("server scheduler could not fail its requests")
        if self.pool.ram is not None and self.pool.ram.disk is not None:
            try:
                self.pool.persist()  # (the slots' own prefixes, for the next server on this model)
            except Exception:
                logger.exception("the slots' prefixes could not be written to the disk prompt cache")
            self.pool.ram.close()
        with scheduler.cond:
            calls, self._calls = self._calls, collections.deque()
        for call in calls:
            call.fail(ServerClosedError("the server is closed"))
        with scheduler.cond:
            self._exited = True
            on_exit, self._on_exit = self._on_exit, None
        if on_exit is not None:
            try:
                on_exit()
            except Exception:  # pragma: no cover
                logger.exception("freeing the server's context failed")

    def drop_adapter(self, adapter: Any) -> None:
        """On the scheduler thread, once no request uses ``adapter``: stop applying it, and drop the
        prefixes computed under it (unloading)."""
        if any(a is adapter for a, _ in self.ctx.loras.items()):
            self.lease.apply_loras(())
        self.pool.forget_adapter(adapter)

    def _draft(self) -> None:
        """Ask the drafter for every speculating slot's next tokens (a failing drafter only costs speed)."""
        asks = self.scheduler.draft_asks()
        if not asks:
            return
        try:
            self.drafter.propose(asks)  # type: ignore[union-attr]
        except RPCConnectionError:
            # A worker of the server's model was lost (an MTP drafter shares them): the server stops.
            # A draft model's own worker: it costs speed only, as below.
            self.ctx.check_workers()
            logger.exception("the server's drafter lost an RPC worker; this tick decodes without drafts")
            return
        except Exception:  # a drafter's bug (or a draft decode aborted by close) costs speed only
            logger.exception("the server's drafter failed; this tick decodes without drafts")
            return
        check = self._check_tokens
        for ask in asks:
            draft = ask.draft[:ask.k] if isinstance(ask.draft, list) else None
            if draft:
                try:
                    ask.request.draft = check(draft).tolist()  # a drafter's bug must not reach llama.cpp
                except (LlamaError, TypeError, ValueError):
                    logger.warning("drafter proposed invalid token ids %r; ignored", draft)

    def execute(self, plan: TickPlan) -> tuple[Sequence[int] | None, list[TokenLogprob | None] | None,
                                               BaseException | None, dict[int, BaseException] | None]:
        """Decode the plan's batch and sample its output rows.

        Returns ``(None, None, KVPoolFullError, None)`` when the batch does not fit in the KV memory
        even with the idle slots' caches dropped (nothing was decoded), else
        ``(tokens, logprobs, None, row_errors)`` with the tokens in plan order, ``logprobs``
        parallel to them (None when no request of the plan asked for logprobs) and ``row_errors``
        (output index → the error of a request whose sampler refused, e.g. a grammar left with no
        allowed token; its token is -1), or ``(None, None, error, None)``.
        """
        try:
            self.lease.apply_loras(plan.loras)  # (nothing to do while the set stays the same)
        except LlamaError as error:
            return None, None, error, None
        t_fill = time.perf_counter()
        for step in list(plan.media):  # before the batch, on their own (embeddings, not tokens)
            try:
                failure = self._decode_media(step)
            except RPCConnectionError:
                raise
            except Exception as exc:  # (a closed prompt, say): this request fails, the others go on
                failure = exc
            if isinstance(failure, KVPoolFullError):
                for done in plan.media[:plan.media.index(step)]:  # (the slots' bookkeeping has none of it)
                    self.lease.seq_rm(done.slot.seq_id, done.slot.next_pos, -1)
                return None, None, failure, None
            if failure is not None:
                self.scheduler.media_failed(plan, step, failure)
        if not plan.steps:
            self.split.decode += time.perf_counter() - t_fill
            self.ticks += 1
            return [], None, None, None
        batch = self.batch
        batch.clear()
        for step in plan.steps:
            slot, tokens = step.slot, step.tokens
            if len(tokens) == 1:
                step.row = batch.add(tokens[0], slot.next_pos, slot.seq_id, bool(step.sample))
            else:
                row = step.row = batch.add_sequence(tokens, slot.next_pos, slot.seq_id, output_last=False) \
                    - len(tokens) + 1
                for i in step.sample:
                    batch.logits[row + i] = 1
        decode = self._decode
        t0 = time.perf_counter()
        rc = decode(batch)
        if rc == 1 and self.pool.evict_idle():  # KV full: idle slots' cached prefixes make room
            rc = decode(batch)
        t_decoded = time.perf_counter()
        decode_ms = (t_decoded - t0) * 1e3
        self.split.decode += t_decoded - t_fill
        if rc == 1:  # still full: the scheduler frees room (nothing of this batch went in; not counted)
            for step in plan.media:  # (nor of this tick's media: the slots' bookkeeping does not have it)
                self.lease.seq_rm(step.slot.seq_id, step.slot.next_pos, -1)
            return None, None, KVPoolFullError("the batch does not fit in the KV memory", code=1), None
        self.ticks += 1
        self.batch_tokens += batch.n_tokens
        self.max_batch_tokens = max(self.max_batch_tokens, batch.n_tokens)
        self.slot_steps += len(plan.steps)
        if rc != 0:
            try:
                check_decode(rc, "llama_decode", batch.n_tokens)
            except DecodeError as error:
                return None, None, error, None
        outputs: list[int] = []
        row_errors: dict[int, BaseException] | None = None
        best = self._argmax_rows(plan)
        t_sample = time.perf_counter()
        detached = self._detach_rows(plan) if self._detached is not None else None
        drawn = self._sample_concurrently(plan, best)
        for step in plan.steps:
            sample = step.slot.sample
            if step.n_draft:
                row_errors = self._sample_verified(step, outputs, row_errors)
                continue
            greedy = best is not None and getattr(step.request.binding, "argmax", False)
            budget = step.request.budget  # (a budgeted request never drafts: it has one row per step)
            for i in step.sample:
                if budget is not None:
                    forced = budget.forced()
                    if forced is not None:  # (not sampled: the sampler accepts it as emitted)
                        try:
                            step.request.binding.accept_forced(step.row + i, forced)
                        except LlamaError as error:  # a lazy grammar woken by the forced text refused it
                            if row_errors is None:
                                row_errors = {}
                            row_errors[len(outputs)] = error
                            outputs.append(-1)
                            continue
                        outputs.append(forced)
                        continue
                if greedy:
                    tok = best[len(outputs)]  # type: ignore[index]
                elif detached and step.row + i in detached:
                    outputs.append(PENDING)  # (settled below)
                    continue
                else:
                    try:
                        tok = drawn.pop(step.row + i) if drawn and step.row + i in drawn else sample(step.row + i)
                        if isinstance(tok, BaseException):
                            raise tok
                    except LlamaError as error:  # this request's sampler refused: it fails alone
                        if row_errors is None:
                            row_errors = {}
                        row_errors[len(outputs)] = error
                        outputs.append(-1)
                        continue
                if budget is not None:
                    budget.seen(tok)
                outputs.append(tok)
        if detached:
            row_errors = self._detached.settle(list(detached.values()), outputs, row_errors,  # type: ignore[union-attr]
                                               t_sample)
        if self._observer is not None:
            try:
                self._observer.observe(plan, outputs, self.lease, batch.n_tokens)
            except RPCConnectionError:
                self.ctx.check_workers()  # a worker of the server's model was lost: the server stops
                logger.exception("the drafter could not follow this tick")
                self._observer.reset()
            except Exception:  # drafts get worse (none until the slots start over), outputs do not change
                logger.exception("the drafter could not follow this tick")
                self._observer.reset()
        # One attribute test per step when no request asked: ticks without logprobs keep their speed.
        logprobs = self._logprobs(plan, outputs) \
            if any(step.request.logprobs is not None for step in plan.steps) else None
        self.split.sample += time.perf_counter() - t_decoded
        if telemetry.enabled("server.tick"):
            decode_tokens = sum(len(step.tokens) for step in plan.steps[:plan.n_decode])
            telemetry.emit("server.tick", {
                "batch_tokens": batch.n_tokens, "decode_tokens": decode_tokens,
                "draft_tokens": decode_tokens - plan.n_decode,
                "prefill_tokens": batch.n_tokens - decode_tokens, "decode_ms": decode_ms,
                "active_slots": self.pool.n_active})
        return outputs, logprobs, None, row_errors

    def _sample_concurrently(self, plan: TickPlan, best: list[int] | None) -> dict[int, Any] | None:
        """Row -> token (or the exception its sampler raised) for the rows whose bindings sample with a native
        chain alone (``binding.concurrent``), drawn on up to ``n_threads`` threads at once; None when too
        few for threads to pay. Each chain keeps its own state (RNG, penalties, candidate buffer), so the
        draws are those of sampling the rows one by one. llama-server samples its slots one after another:
        at many slots on a large vocabulary (Gemma: 262k candidates per row) that was a tenth of a tick."""
        if self._samplers is None:
            return None
        jobs: list[tuple[int, Callable[[int], int]]] = []
        for step in plan.steps:
            binding = step.request.binding
            if step.n_draft or step.request.budget is not None or not getattr(binding, "concurrent", False):
                continue
            jobs.extend((step.row + i, step.slot.sample) for i in step.sample)
        if len(jobs) < 2 or len(jobs) * self.ctx.n_vocab < CONCURRENT_SAMPLING_WORK:
            return None
        if not self.lease.has_logits(jobs[0][0]):  # (llama.cpp reorders output rows at their first read)
            return None
        n = min(self._n_samplers, len(jobs))
        chunks = [jobs[k::n] for k in range(n)]
        self.concurrent_rows += len(jobs)

        def draw(chunk: list[tuple[int, Callable[[int], int]]]) -> list[tuple[int, Any]]:
            out: list[tuple[int, Any]] = []
            for row, sample in chunk:
                try:
                    out.append((row, sample(row)))
                except BaseException as exc:  # (raised where the row is taken, as a sequential draw would)
                    out.append((row, exc))
            return out

        futures = [self._samplers.submit(draw, chunk) for chunk in chunks[1:]]
        drawn = dict(draw(chunks[0]))
        for future in futures:
            drawn.update(future.result())
        return drawn

    def _detach_rows(self, plan: TickPlan) -> dict[int, Detached] | None:
        """Batch row -> its draw, started on a worker (detached.py), for the rows of detachable bindings
        (a grammar: its check may take long); None when there is none. Not a speculative step's rows
        (drawn in order), nor a reasoning budget's (which may force the token instead)."""
        jobs: dict[int, Detached] | None = None
        logits_of = self._logits_of
        k = 0
        for step in plan.steps:
            request = step.request
            if step.n_draft or request.budget is not None or not getattr(request.binding, "detachable", False):
                k += len(step.sample)
                continue
            for i in step.sample:
                idx = step.row + i
                if jobs is None:
                    jobs = {}
                jobs[idx] = self._detached.submit(step.slot, request, idx,  # type: ignore[union-attr]
                                                  np.array(logits_of(idx)), k)
                k += 1
        return jobs

    def _deliver_detached(self) -> None:
        """Give the requests whose draws ended after their tick their token (or their sampler's error)."""
        t0 = time.perf_counter()
        scheduler = self.scheduler
        with handoff_batch():
            for job, result in self._detached.collect():  # type: ignore[union-attr]
                request = job.request
                if request.ended is not None:
                    continue
                if isinstance(result, BaseException):
                    if not isinstance(result, LlamaError):
                        raise result  # a bug: as if drawn on this thread
                    scheduler.deliver(job.slot, request, error=result, now=t0)
                    continue
                entry = self._entry(request, job.idx, job.row, result) if request.logprobs is not None else None
                if self._detached.outlasts(job.seconds):  # type: ignore[union-attr]
                    request.speculative = False  # (a slow sampler: drafts would draw its rows on the tick, in order)
                scheduler.deliver(job.slot, request, result, entry=entry, now=t0)
        self.split.update += time.perf_counter() - t0

    def _argmax_rows(self, plan: TickPlan) -> list[int] | None:
        """The argmax of every sampled row of the plan, in one numpy operation, when at least half of
        them are plain greedy (their bindings' ``argmax``); None otherwise (each row samples alone)."""
        n_rows = n_greedy = 0
        for step in plan.steps:
            if step.n_draft:  # (verification samples row by row, up to the first mismatch)
                return None
            n_rows += len(step.sample)
            if getattr(step.request.binding, "argmax", False):
                n_greedy += len(step.sample)
        if n_greedy < 2 or 2 * n_greedy < n_rows:
            return None
        block = self._logits_rows([step.row + i for step in plan.steps for i in step.sample])
        return None if block is None else block.argmax(axis=1).tolist()

    def _sample_verified(self, step, outputs: list[int],
                         row_errors: dict[int, BaseException] | None) -> dict[int, BaseException] | None:
        """A speculative step's rows, sampled in order with the request's own sampler until one
        differs from its draft (the match rule: every emitted token is the sampler's draw given
        exactly the tokens before it) or ends the generation; later rows are SKIPPED."""
        sample, drafts, row, n_draft = step.slot.sample, step.tokens, step.row, step.n_draft
        ignore_eos, is_eog = step.request.params.ignore_eos, self.scheduler.is_eog
        done = False
        clock = time.perf_counter
        for i in step.sample:
            if done:
                outputs.append(SKIPPED)
                continue
            try:
                t0 = clock()
                tok = sample(row + i)
                if self._detached is not None and self._detached.outlasts(clock() - t0) \
                        and getattr(step.request.binding, "detachable", False):
                    # (a slow grammar: no more drafts for it, so its next draws leave the tick: detached.py)
                    step.request.speculative = False
            except LlamaError as error:
                if row_errors is None:
                    row_errors = {}
                row_errors[len(outputs)] = error
                tok, done = -1, True
            outputs.append(tok)
            if i == n_draft or tok != drafts[i + 1] or (not ignore_eos and is_eog(tok)):
                done = True
        return row_errors

    def _logprobs(self, plan: TickPlan, outputs: Sequence[int]) -> list[TokenLogprob | None]:
        """The entry of each sampled token whose request asked for logprobs, parallel to ``outputs``.

        Computed after sampling: the rows are unchanged until the next decode (samplers copy them).
        """
        logits_of = self._logits_of
        entries: list[TokenLogprob | None] = []
        k = 0
        for step in plan.steps:
            request = step.request
            if request.logprobs is None:
                entries.extend([None] * len(step.sample))
                k += len(step.sample)
                continue
            for i in step.sample:
                tok = outputs[k]
                idx = step.row + i
                entries.append(None if tok < 0 else self._entry(request, idx, logits_of(idx), tok))
                k += 1
        return entries

    def _entry(self, request: Request, idx: int, row: np.ndarray, tok: int) -> TokenLogprob:
        """The logprobs entry of ``tok``, drawn from batch row ``idx`` (logits ``row``) for ``request``."""
        params = request.params
        piece = self._pieces[params.special]
        post = request.binding.post if params.post_sampling and request.binding is not None else None
        if post is not None:  # (what the chain left of the row, recorded as it sampled)
            return post_sampling_logprob(post.pop(idx), params.logprobs or 0, piece)
        return token_logprob(row, tok, params.logprobs or 0, piece)
