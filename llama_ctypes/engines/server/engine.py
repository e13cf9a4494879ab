"""The scheduler thread: one ``llama_decode`` per tick for every active request.

A tick: drop cancelled requests → admit waiting ones into free slots → ask the
strategy how to spend the token budget → fill ONE batch (a token for each
decoding slot, prompt chunks for prefilling ones) → decode → sample every
output row with its request's own sampler → hand tokens to their channels.
Text, stop strings and UTF-8 handling happen in the consumers' threads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from ... import telemetry
from ...core.batch import Batch
from ...core.context import Context
from ...errors import CancelledError, DecodeError, LlamaError
from .prompt_cache import PromptCache
from .request import End, Request, Status
from .slots import Slot, SlotPool
from .strategies import BatchStrategy

logger = logging.getLogger(__name__)


class QueueFullError(LlamaError):
    """The server's wait queue is at ``max_queue``; retry later."""


class ServerClosedError(CancelledError):
    """The server was closed (or failed) before the request finished."""


class ContextKV:
    """The slot pool's KV operations, over the server's context (scheduler thread only)."""

    def __init__(self, ctx: Context):
        self._lib, self._ctx, self._mem = ctx._lib, ctx._ptr, ctx._mem

    def forget(self, seq: int) -> None:
        self._lib.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def truncate(self, seq: int, keep: int) -> bool:
        return bool(self._lib.llama_memory_seq_rm(self._mem, seq, keep, -1))

    def copy(self, src: int, dst: int, n: int) -> None:
        self._lib.llama_memory_seq_cp(self._mem, src, dst, 0, n)

    def save(self, seq: int) -> bytes:
        import ctypes

        size = self._lib.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = self._lib.llama_state_seq_get_data(self._ctx, buf, size, seq)
        return ctypes.string_at(buf, n)  # (a slice of a ctypes array would be a list of ints)

    def restore(self, seq: int, state: bytes) -> bool:
        import ctypes

        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return self._lib.llama_state_seq_set_data(self._ctx, buf, len(state), seq) > 0


class Engine:
    """Owns the context; runs the tick loop on its own thread. All client calls are thread-safe."""

    def __init__(self, ctx: Context, strategy: BatchStrategy, max_queue: int = 0, *, n_ctx_seq: int | None = None,
                 prompt_cache_bytes: int = 0):
        self.ctx = ctx
        self.strategy = strategy
        self.max_queue = max_queue
        self.n_ctx_seq = n_ctx_seq or ctx.n_ctx_seq
        self.budget = ctx.n_batch
        self.batch = Batch(ctx.n_batch, 1)
        self._lib = ctx._lib
        model = ctx.model
        self.pool = SlotPool(ctx.n_seq_max, ContextKV(ctx), unified=ctx.params.kv_unified,
                             partial_reuse=not (model.is_recurrent or model.is_hybrid),
                             ram_cache=PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._closing = False
        self.failure: BaseException | None = None
        self._eog = ctx.model._eog_cache
        self._vocab = ctx.model._vocab
        # counters, read by stats()
        self.ticks = 0
        self.batch_tokens = 0
        self.prompt_tokens_evaluated = 0
        self.thread = threading.Thread(target=self._run, name="llama_ctypes-server", daemon=True)

    # ---- client side (any thread) ----------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closing or self.failure is not None:
                raise ServerClosedError("the server is closed" if self.failure is None
                                        else f"the server failed: {self.failure!r}")
            if self.max_queue and len(self._waiting) >= self.max_queue:
                telemetry.emit("server.queue_full", {"queue_length": len(self._waiting)},
                               {"max_queue": self.max_queue})
                request.sampler.close()
                raise QueueFullError(f"the server queue is full ({self.max_queue} waiting requests)")
            self._waiting.append(request)
            self._cond.notify()

    def cancel(self, request: Request, finish_reason: str | None = None) -> None:
        """Ask the scheduler to end ``request`` at its next tick (freeing its slot and KV)."""
        if request.status.done:
            return
        request.stop_reason = finish_reason
        request.cancel_requested = True
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def queue_length(self) -> int:
        return len(self._waiting)

    # ---- scheduler thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closing and not self._waiting and not self.pool.active:
                        self._cond.wait()
                    if self._closing:
                        break
                    admitted = self._admit()
                for slot in admitted:
                    self._start(slot)
                self._tick()
        except BaseException as exc:  # a bug or a native failure: no caller may hang
            logger.exception("server scheduler failed")
            self.failure = exc
            self._fail_all(ServerClosedError(f"the server's scheduler failed: {exc!r}"), cause=exc)
            return
        self._fail_all(ServerClosedError("the server was closed before the request finished"))

    def _admit(self) -> list[Slot]:
        admitted = []
        while self._waiting and self.pool.n_free:
            request = self._waiting.popleft()
            if request.cancel_requested:
                self._finish(None, request, Status.CANCELLED)
                continue
            slot = self.pool.acquire(request)
            admitted.append(slot)
        return admitted

    def _start(self, slot: Slot) -> None:
        request = slot.request
        request.status = Status.RUNNING
        request.started = time.perf_counter()
        request.seq_id = slot.seq_id
        slot.sample = request.sampler.sample_fn(self.ctx)
        if telemetry.enabled("server.request.start"):
            telemetry.emit("server.request.start", {"queue_wait_ms": (request.started - request.arrived) * 1e3,
                                                    "prompt_tokens": len(request.prompt)}, {"id": request.id})

    def _tick(self) -> None:
        for slot in self.pool.active:
            if slot.request.cancel_requested:
                reason = slot.request.stop_reason
                self._finish(slot, slot.request, Status.FINISHED if reason else Status.CANCELLED, reason)
        active = self.pool.active
        if not active:
            return
        decoding = [s for s in active if s.request.prefill_remaining == 0]
        prefilling = sorted(((s, s.request.prefill_remaining) for s in active if s.request.prefill_remaining),
                            key=lambda sr: sr[0].request.arrived)
        plan = self.strategy.plan(decoding, prefilling, self.budget)
        batch = self.batch
        batch.clear()
        outputs: list[tuple[Slot, int]] = []
        for slot in plan.decode:
            outputs.append((slot, batch.add(slot.request.generated[-1], slot.n_past, slot.seq_id, True)))
        prefill_done = []
        for slot, n in plan.prefill:
            request = slot.request
            chunk = request.prompt[request.n_prefilled:request.n_prefilled + n]
            completes = request.n_prefilled + n == len(request.prompt)
            row = batch.add_sequence(chunk, slot.n_past, slot.seq_id, output_last=completes)
            prefill_done.append((slot, chunk))
            if completes:
                outputs.append((slot, row))
        if batch.n_tokens == 0:
            return
        t0 = time.perf_counter()
        rc = self._lib.llama_decode(self.ctx._ptr, batch.as_native())
        if rc == 1 and self.pool.evict_idle():  # KV full: idle slots' cached prefixes make room
            rc = self._lib.llama_decode(self.ctx._ptr, batch.as_native())
        decode_ms = (time.perf_counter() - t0) * 1e3
        self.ticks += 1
        self.batch_tokens += batch.n_tokens
        if rc != 0:
            error = DecodeError(f"llama_decode failed with {rc} for a batch of {batch.n_tokens} tokens", code=rc)
            for slot in {id(s): s for s in plan.decode + [s for s, _ in plan.prefill]}.values():
                self._finish(slot, slot.request, Status.FAILED, error=error)
            return
        for slot in plan.decode:
            slot.tokens.append(slot.request.generated[-1])
        for slot, chunk in prefill_done:
            slot.tokens.extend(chunk)
            slot.request.n_prefilled += len(chunk)
            self.prompt_tokens_evaluated += len(chunk)
        now = time.perf_counter()
        for slot, row in outputs:
            self._emit_token(slot, slot.sample(row), now)
        if telemetry.enabled("server.tick"):
            telemetry.emit("server.tick", {
                "batch_tokens": batch.n_tokens, "decode_tokens": len(plan.decode),
                "prefill_tokens": batch.n_tokens - len(plan.decode), "decode_ms": decode_ms,
                "active_slots": len(active)})

    def _emit_token(self, slot: Slot, tok: int, now: float) -> None:
        request = slot.request
        params = request.params
        if request.first_token is None:
            request.first_token = now
        if not params.ignore_eos:
            eog = self._eog.get(tok)
            if eog is None:
                eog = self._eog[tok] = bool(self._lib.llama_vocab_is_eog(self._vocab, tok))
            if eog:
                self._finish(slot, request, Status.FINISHED, "eog")
                return
        request.generated.append(tok)
        request.channel.put(tok)
        if len(request.generated) == params.max_tokens or slot.n_past + 1 >= self.n_ctx_seq:
            self._finish(slot, request, Status.FINISHED, "length")

    def _finish(self, slot: Slot | None, request: Request, status: Status, reason: str | None = None,
                error: BaseException | None = None) -> None:
        request.status = status
        request.finish_reason = reason
        if slot is not None:
            # A finished request's KV is a valid prefix cache; a cancelled or failed one is dropped.
            self.pool.release(slot, keep=status is Status.FINISHED and request.params.cache_prompt)
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
                "queue_wait_ms": ((request.started or time.perf_counter()) - request.arrived) * 1e3,
                "ttft_ms": t.ttft_ms, "duration_ms": (time.perf_counter() - request.arrived) * 1e3,
                "prompt_tokens": len(request.prompt), "generated_tokens": len(request.generated)},
                {"id": request.id, "finish_reason": reason if status is Status.FINISHED else "error"})

    def _fail_all(self, error: BaseException, cause: BaseException | None = None) -> None:
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        if cause is not None:
            error.__cause__ = cause
        for request in waiting:
            self._finish(None, request, Status.FAILED, error=error)
        for slot in self.pool.active:
            try:
                self._finish(slot, slot.request, Status.FAILED, error=error)
            except Exception:  # the context may be unusable; the caller must still be told
                slot.request.channel.put(error)
                slot.request = None

