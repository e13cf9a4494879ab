"""Context: a model's KV memory and decode calls. One caller at a time.

Every native operation on a context goes through a :class:`ContextLease`, the
proof of sole use: ``ctx.lease()`` claims the context (``BusyError`` if someone
else holds it) and keeps it open until released. The lease is also the one
owner of the invariant "``ctx.tokens`` is what sequence 0 of the KV cache
holds": ``prefill`` and ``append`` change both together.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import (
    ArgumentTypeError,
    ClosedError,
    ContextCreationError,
    ContextOverflowError,
    DecodeError,
    InvalidArgumentError,
    LlamaError,
    RPCConnectionError,
)
from ..native import ggml_h
from ..native import llama_h as L
from .backend import clear_native_error, native_error
from .batch import Batch
from .control_vector import ControlVector
from .decode_status import check_decode
from .generation import GenerationParams, TextStream
from .handle import NativeHandle
from .hidden_states import HiddenStates
from .kv_record import KVRecord
from .lease_adapters import AdapterOps
from .lease_media import MediaOps
from .lease_outputs import OutputOps
from .lease_sampling import InGraphSampling
from .lora import LoraAdapter, LoraSet
from .params import ContextParams, split_options
from .prompt import common_prefix
from .rpc.watch import ConnectionWatch

if TYPE_CHECKING:
    from .memory import MemoryUsage
    from .model import Model
    from .sampler import Sampler


_P_U8 = ctypes.POINTER(ctypes.c_uint8)

_NO_WORKERS = ConnectionWatch(None, ())  # the watch of a context whose creation failed early


class Context(NativeHandle):
    """An inference context over a :class:`Model` (``llama_context``).

    Thread safety: a Context serves one caller at a time. A call made while
    another is running (from another thread, or while a ``stream`` of this
    context is still open) raises :class:`~llama_ctypes.BusyError` instead of
    waiting, because interleaving two generations in one KV cache would
    corrupt both. Use one Context per thread, or a Server. :meth:`abort` is the
    exception: any thread may call it to stop a decode in flight.

    The Context keeps its Model alive: closing the Model first is safe.
    """

    _kind = "Context"

    def __init__(self, model: "Model", params: ContextParams | None = None, *, mtp_of: "Context | None" = None):
        """``mtp_of``: make a draft context over the model's multi-token-prediction head
        (``LLAMA_CONTEXT_TYPE_MTP``) beside that target context of the same model (speculative MTP)."""
        super().__init__()
        self._ptr = None
        self.model = model
        self.params = params or ContextParams()
        self._lib = model._lib
        self._rpc = _NO_WORKERS
        if model.params.vocab_only:
            self._mark_dead()
            raise ContextCreationError(f"{model.path.name} was loaded with vocab_only=True: it has no weights to run")
        n_rs, n_ub = self.params.n_rs_seq, self.params.n_ubatch
        if n_rs > 0 and n_ub and n_ub <= n_rs + 1 and (model.is_recurrent or model.is_hybrid):
            # llama.cpp keeps each sequence's last n_rs_seq + 1 tokens in one micro-batch and
            # asserts (aborting the process) when n_ubatch cannot hold them.
            self._mark_dead()
            raise InvalidArgumentError(f"n_rs_seq={n_rs} needs n_ubatch > n_rs_seq + 1 on {model.path.name} "
                                       f"(a recurrent memory), got n_ubatch={n_ub}")
        model._acquire()
        try:
            model.check_workers()  # a model whose RPC worker was lost makes no new context
            # The context's own connections to the model's workers (the same ones, unless none
            # was open): a decode that finds one failed raises, and the context refuses use.
            self._rpc = model._rpc.watch.child(self._lib)
            native = self.params.to_native()
            if mtp_of is not None:
                native.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
                native.ctx_other = mtp_of._ptr
            clear_native_error()
            with model.adapter_lock:  # (it reserves its graph over the model's adapters)
                ptr = self._lib.llama_init_from_model(model._ptr, native)
            if not ptr:
                reason = native_error("out of memory, or options the model or backend does not support")
                error = ContextCreationError(
                    f"could not create a context with n_ctx={self.params.n_ctx}, n_batch={self.params.n_batch}, "
                    f"type_k={self.params.type_k}, type_v={self.params.type_v}: {reason}"
                )
                lost = self._rpc.attach()
                if lost is not None:
                    raise lost from error
                raise error
            lost = self._rpc.attach()
            if lost is not None:
                self._lib.llama_free(ptr)
                raise lost
        except BaseException:
            self._mark_dead()
            model._release()
            raise
        self._ptr = ptr
        self._loras: LoraSet = ()  # the adapters applied now (each one held while applied)
        self._cvec: ControlVector | None = None  # the control vector applied now
        self._reserve_pending = False  # adapters changed: the next decode re-sizes the graph
        self._mem = self._lib.llama_get_memory(ptr)
        self.n_ctx = int(self._lib.llama_n_ctx(ptr))
        self.n_ctx_seq = int(self._lib.llama_n_ctx_seq(ptr))
        self.n_batch = int(self._lib.llama_n_batch(ptr))
        self.n_ubatch = int(self._lib.llama_n_ubatch(ptr))
        self.n_seq_max = int(self._lib.llama_n_seq_max(ptr))
        # Sliding window whose old cells the cache drops (0: none, or kept whole by swa_full).
        self.n_swa = 0 if self.params.swa_full else model.n_swa
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd
        self.n_layer = model.n_layer
        self.vocab = model.vocab.for_holder()
        """The model's vocabulary, usable for as long as this context lives."""
        # Rows of logits one decode may ask for (llama.cpp asserts on more; encoders get n_batch).
        self.n_outputs_max = self.n_batch if model.has_encoder else (self.params.n_outputs_max or self.n_batch)
        # An embeddings context outputs a row for every token, asked for or not.
        self.outputs_all = self.params.embeddings
        # Non-causal attention (and an encoder) computes a batch in one micro-batch: llama.cpp asserts
        # n_tokens <= n_ubatch there instead of splitting.
        attention = self.params.attention.lower()
        causal = model.causal_attention if attention == "unspecified" else attention == "causal"
        self.max_batch = self.n_ubatch if (not causal or model.has_encoder) else self.n_batch
        self.encoder_only = model.has_encoder and not model.has_decoder
        # A BERT-like model (non-causal by its own metadata, no attention option given) cannot generate.
        self.embedding_only = not model.causal_attention and attention == "unspecified"
        # Recurrent-state rollback snapshots per sequence (ContextParams.n_rs_seq; llama.cpp sets 0
        # for models that cannot roll back).
        self.n_rs_seq = int(self._lib.llama_n_rs_seq(ptr))
        # What sequence 0 holds (for prefix reuse across generate() calls): changed only by the lease.
        self._record = KVRecord(self.n_rs_seq)
        self._nextn_all = False  # hidden rows of every decoded token kept (set_embeddings_nextn)
        self._last_decoded = 0  # tokens of the last decode (rows nextn_rows may read)
        self._batch = Batch(self.n_batch, 1)
        # Cancellation: ggml asks the C callback before each graph node whether to stop; the
        # callback reads this flag, which abort() sets from any thread.
        self._abort_flag = ctypes.c_int32(0)
        self._abort_lock = threading.Lock()
        self._abort_cb = _abort_callback(self._lib)  # referenced here for as long as C may call it
        if self._abort_cb is not None:
            self._lib.llama_set_abort_callback(ptr, self._abort_cb, ctypes.addressof(self._abort_flag))

    @classmethod
    def create(cls, model: "Model", **opts: Any) -> "Context":
        """Create a context; options are the fields of :class:`ContextParams` (n_ctx=4096, ...)."""
        (cparams,) = split_options(opts, ContextParams, where="Context.create: unknown")
        return cls(model, ContextParams(**cparams))

    def _free(self) -> None:
        if self._ptr:
            self._lib.llama_free(self._ptr)
            self._ptr = None
        loras, self._loras = getattr(self, "_loras", ()), ()
        for adapter, _ in loras:
            adapter.released_by_context()
        self.model._release()

    @property
    def loras(self) -> dict[LoraAdapter, float]:
        """The LoRA adapters this context applies, with their scales (set them on a lease)."""
        return dict(self._loras)

    @property
    def control_vector(self) -> ControlVector | None:
        """The control vector this context applies (set it on a lease)."""
        return self._cvec

    def _adapter_key(self) -> object:
        # what the KV computed from now on depends on, beside the tokens (KVRecord keeps it per token run)
        return self._loras if self._cvec is None else (self._loras, self._cvec)

    def __repr__(self) -> str:
        return f"<Context n_ctx={self.n_ctx} {'closed' if self._closed else 'open'}>"

    @property
    def tokens(self) -> list[int]:
        """A copy of the tokens whose KV sequence 0 holds (what ``cache_prompt`` reuses)."""
        return list(self._record.tokens)

    # ---- sole use -------------------------------------------------------------------------
    def lease(self, held: bool = False) -> "ContextLease":
        """Claim the context for one caller (``with ctx.lease() as lease: ...``).

        Raises :class:`BusyError` when another caller holds it, :class:`ClosedError` once closed
        (unless ``held``: the caller keeps the context alive with :meth:`hold`), and
        :class:`~llama_ctypes.RPCConnectionError` once an RPC worker it uses was lost.
        """
        return ContextLease(self, held)

    def check_workers(self) -> None:
        """Raise :class:`~llama_ctypes.RPCConnectionError` if an RPC worker this context uses was lost.

        Such a context refuses every further use (closing it is fine, and frees what the
        surviving workers hold). Never raises for a context of a model without ``rpc_servers``.
        """
        self._rpc.check()

    def abort(self) -> None:
        """Stop the decode in flight, if any, from any thread (it raises DecodeError code 2)."""
        with self._abort_lock:
            self._abort_flag.value = 1

    # ---- one-shot operations (each takes a lease for its duration) ---------------------------------
    def decode(self, batch: Batch) -> None:
        """Run the model over ``batch``; raises :class:`DecodeError` on failure."""
        with self.lease() as lease:
            lease.decode(batch)

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits row ``i`` of the last decode (float32, n_vocab)."""
        with self.lease() as lease:
            return lease.logits(i)

    def clear(self) -> None:
        """Forget every sequence in the KV cache."""
        with self.lease() as lease:
            lease.clear()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence (-1 = open end); False if the memory cannot."""
        with self.lease() as lease:
            return lease.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Share positions [p0, p1) of sequence ``src`` with sequence ``dst`` (no copy of data)."""
        with self.lease() as lease:
            lease.seq_cp(src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for a sequence, or -1 when empty."""
        with self.lease() as lease:
            return lease.seq_pos_max(seq_id)

    def memory(self) -> "MemoryUsage":
        """The memory this context and its model hold, per device (bytes; see ``lc.estimate_memory``)."""
        from .memory import DEVICE_ROWS, lcx_device_memory, usage_from_rows

        with self.lease():
            rows = (lcx_device_memory * DEVICE_ROWS)()
            n = self._lib.lcx_context_memory(self._ptr, rows, DEVICE_ROWS)
        if n < 0:
            raise LlamaError("llama.cpp could not report the context's memory")
        return usage_from_rows(rows, min(n, DEVICE_ROWS))

    def state_size(self) -> int:
        """Bytes needed to save the whole context state."""
        with self.lease() as lease:
            return lease.state_size()

    def save_state(self) -> bytes:
        """Snapshot of the context (KV cache, logits) with the tokens it holds; see ``load_state``."""
        with self.lease() as lease:
            return lease.state_get()

    def load_state(self, data: bytes, tokens: Sequence[int]) -> None:
        """Restore a snapshot from ``save_state``; ``tokens`` are the tokens it holds."""
        with self.lease() as lease:
            lease.state_set(data, tokens)

    # ---- generation (see generation.py) ---------------------------------------------------
    def generate(self, sampler: "Sampler", tokens: Sequence[int], **opts: Any):
        """Generate from pre-tokenized input with a given sampler; returns a :class:`Completion`.

        Options: the fields of :class:`GenerationParams` (max_tokens, stop, ...).
        With ``cache_prompt=True`` the KV cache of the longest common prefix with
        the previous call is reused instead of recomputed.
        """
        return self.stream(sampler, tokens, **opts).completion()

    def stream(self, sampler: "Sampler", tokens: Sequence[int], **opts: Any):
        """Like :meth:`generate`, but a lazy :class:`TextStream` of text pieces.

        The stream holds this context and ``sampler`` from its first ``next()`` to its end.
        """
        (gen,) = split_options(opts, GenerationParams, where="Context.stream: unknown")
        return TextStream(self, sampler, self.vocab.check_tokens(tokens).tolist(), GenerationParams(**gen))


def _position(value: Any, name: str) -> int:
    """A KV position argument (-1: open end) as the C ``llama_pos`` (int32) it becomes."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -1 <= int(value) <= 2 ** 31 - 1:
        raise InvalidArgumentError(f"{name}={value!r}: expected a position (an integer >= 0, or -1)")
    return int(value)


def _abort_callback(lib):
    """The adapter's flag-reading abort callback as a ggml_abort_callback (None if the library lacks it)."""
    fn = getattr(lib, "lcx_abort_requested", None)
    if fn is None:
        return None
    return ggml_h.ggml_abort_callback(ctypes.cast(fn, ctypes.c_void_p).value)


def _synchronized_check(lib, ptr, watch: ConnectionWatch) -> Callable[[], RPCConnectionError | None]:
    """The check after a decode of a context whose model uses RPC workers: the error of a lost one, else None.

    ``llama_decode`` returns before its work is done: the graph runs, and its outputs come
    back from the workers, asynchronously (llama.cpp synchronizes only when the outputs are
    read). A worker lost meanwhile would go unnoticed by a check made right away, and the
    outputs then read as the zeros a failed connection answers. So wait for the decode to
    finish (``llama_synchronize``) before asking. (Contexts of local models skip all of this.)
    """
    synchronize, failure = lib.llama_synchronize, watch.failure

    def lost() -> RPCConnectionError | None:
        synchronize(ptr)
        return failure()

    return lost


class ContextLease(HiddenStates, AdapterOps, MediaOps, InGraphSampling, OutputOps):
    """Sole use of a :class:`Context` until :meth:`release` (idempotent; also ``with``).

    Created by :meth:`Context.lease`. While it is held the context cannot be
    freed, and no other caller can decode into it. After ``release()`` every
    method (and every function it handed out) raises :class:`ClosedError`.
    """

    def __init__(self, ctx: Context, held: bool = False):
        ctx._begin_exclusive(held)
        lost = ctx._rpc.failure()
        if lost is not None:  # a context whose RPC worker was lost refuses any further use
            ctx._end_exclusive()
            raise lost
        self.ctx = ctx
        self._lib = ctx._lib
        self._ptr = ctx._ptr
        self._mem = ctx._mem
        self._in_graph: dict[int, int] = {}
        self._graph_used = False
        self._held = True
        # Checked after every decode when the model uses RPC workers (None: nothing to watch).
        self._lost = _synchronized_check(self._lib, ctx._ptr, ctx._rpc) if ctx._rpc.active else None
        self._max_outputs = ctx.n_outputs_max
        # Called as ``after_decode(lease, tokens, pos)`` after each decode of prefill() and decode_run()
        # (``tokens`` now sit at positions pos.. of sequence 0; the decode's outputs are readable): a
        # speculative drafter that follows the target's hidden state (MTP). An exception it raises
        # fails the decode (the sequence is cleared).
        self.after_decode: Callable[["ContextLease", Sequence[int], int], None] | None = None
        # A cancel meant for an earlier user of the context must not stop this one.
        with ctx._abort_lock:
            ctx._abort_flag.value = 0

    def release(self) -> None:
        if self._held:
            self._detach_all_samplers()  # (the context must not keep chains its next holder cannot see)
            self._held = False
            self.ctx._end_exclusive()

    def __enter__(self) -> "ContextLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def _check(self) -> None:
        if not self._held:
            raise ClosedError("this ContextLease was released")

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise ArgumentTypeError(f"sequence ids are integers, not {type(seq_id).__name__}")
        seq_id = int(seq_id)
        if not (0 <= seq_id < self.ctx.n_seq_max or (allow_all and seq_id == -1)):
            raise InvalidArgumentError(
                f"sequence id {seq_id} is outside [0, {self.ctx.n_seq_max})" + (" (or -1: all)" if allow_all else ""))
        return seq_id

    @property
    def tokens(self) -> list[int]:
        """The live list of tokens sequence 0 holds (read it; change it only through this lease)."""
        return self.ctx._record.tokens

    # ---- decoding ------------------------------------------------------------------------------
    def _check_batch(self, batch: Batch) -> None:
        self._check()
        n, ctx = batch.check(), self.ctx
        if not 0 < n <= ctx.max_batch:
            what = "n_batch" if ctx.max_batch == ctx.n_batch else "n_ubatch (non-causal attention: one micro-batch)"
            raise InvalidArgumentError(f"a batch of {n} tokens: expected 1..{what}={ctx.max_batch}")
        outputs = n if ctx.outputs_all else int(np.count_nonzero(batch.logits[:n]))
        if outputs > self._max_outputs:
            raise InvalidArgumentError(f"a batch asking for {outputs} output rows"
                                       + (" (an embeddings context outputs every token)" if ctx.outputs_all else "")
                                       + f"; this context reserves {self._max_outputs} (ContextParams.n_outputs_max)")

    def decode(self, batch: Batch) -> None:
        """``llama_decode`` of ``batch``; DecodeError on failure (the caller fixes its token bookkeeping)."""
        check_decode(self.decode_rc(batch), "llama_decode", batch.n_tokens)

    def decode_rc(self, batch: Batch) -> int:
        """``llama_decode`` of ``batch``, returning llama.cpp's code (for callers that can retry).

        Raises RPCConnectionError (whatever the code) when an RPC worker was lost during it.
        """
        self._check_batch(batch)
        ctx = self.ctx
        ctx._record.forget_snapshots()
        ctx._record.forget_logits()
        ctx._last_decoded = batch.n_tokens
        if ctx._reserve_pending:
            rc = self._reserving_decode(batch)
        else:
            rc = int(self._lib.llama_decode(self._ptr, batch.as_native()))
        self._check_workers()
        return rc

    def _reserving_decode(self, batch: Batch) -> int:
        return self.guarded(lambda: int(self._lib.llama_decode(self._ptr, batch.as_native())))

    def _check_workers(self) -> None:
        """After a native call that may have used RPC workers: raise if one was lost meanwhile.

        Waits for the call's asynchronous work first (see _synchronized_check). (A lost worker's
        results read as zeros and its work is skipped: what the call computed is void.)
        """
        if self._lost is not None and (error := self._lost()) is not None:
            raise error

    def encode(self, batch: Batch) -> None:
        """``llama_encode`` of ``batch`` (encoder models); DecodeError on failure."""
        self._check_batch(batch)
        self.ctx._record.forget_logits()  # (llama_encode overwrites the output rows too)
        rc = self.guarded(lambda: int(self._lib.llama_encode(self._ptr, batch.as_native())))
        self._check_workers()
        check_decode(rc, "llama_encode", batch.n_tokens)

    def prefill(self, prompt: Sequence[int], reuse: bool) -> int:
        """Bring sequence 0 to ``prompt`` and compute the logits of its last token.

        With ``reuse`` the longest common prefix with what the sequence holds is kept
        (at least the last prompt token is decoded again). Returns the number of
        reused tokens. On failure the sequence is cleared, so tokens and KV agree.
        """
        self._check()
        ctx, lib, mem = self.ctx, self._lib, self._mem
        record = ctx._record
        held = record.tokens
        spans = getattr(prompt, "spans", None)  # a MediaPrompt (core/projector.py): images, audio
        if spans is not None:
            self.check_media_prompt(prompt)
        common = record.reusable(common_prefix(held, prompt)) if reuse else 0
        if common == len(prompt):
            if not spans and not self._in_graph and record.has_logits_of(prompt) \
                    and record.reusable(len(prompt)) == len(prompt):
                # The context's output row is this very prompt's (the previous call stopped right after
                # it: max_tokens=1, a stream left after its first token): sample from it, decode nothing,
                # as llama-cpp-python does.
                return common
            common -= 1  # the last prompt token must be decoded again to get its logits
        if spans:
            common = prompt.cut_point(common)  # a media chunk is decoded whole or not at all
        if record.positions.splits(common):
            common = 0  # (the same placeholders, other chunks: never with one projector, but cheap to rule out)
        if common and not self.prefix_complete(0, record.pos(common)):
            common = 0  # a sliding-window cache already dropped cells this prefix needs
        # Always cut from `common` on, even when `held` is shorter: cells a caller put there
        # behind the token list's back (seq_cp, a state restore) must not linger.
        if not record.can_cut(common) or not lib.llama_memory_seq_rm(mem, 0, record.pos(common), -1):
            # Recurrent and hybrid memories cannot drop a tail (or not that much): start over.
            self.clear()
            common = 0
        record.cut(common)
        self._decode_prompt(prompt, common)
        return common

    def extend(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` at the end of sequence 0 (any number, in ``n_batch`` chunks) and compute
        the logits of the last one: the rest of a prompt whose first part :meth:`prefill` read under
        other adapters (an activated LoRA applies from its invocation tokens on). On failure the
        sequence is cleared."""
        self._check()
        held = self.ctx._record.tokens
        self._decode_prompt([*held, *tokens], len(held))

    def _decode_prompt(self, prompt: Sequence[int], pos: int) -> None:
        if getattr(prompt, "spans", None):
            self._decode_media_prompt(prompt, pos)
            return
        ctx, record = self.ctx, self.ctx._record
        batch = ctx._batch
        try:
            while pos < len(prompt):
                chunk = prompt[pos:pos + ctx.max_batch]
                batch.clear()
                at = record.next_pos  # (the entry's index, unless an M-RoPE image before it took fewer positions)
                last = pos + len(chunk) == len(prompt)
                batch.add_sequence(chunk, at, 0, output_last=last)
                self.decode(batch)
                if self.after_decode is not None:
                    self.after_decode(self, chunk, at)
                record.decoded(chunk, logits=last and not self._in_graph)
                pos += len(chunk)
        except BaseException:
            # A failed or interrupted decode leaves the cache state uncertain.
            self.clear()
            raise

    def prefix_complete(self, seq_id: int, n: int) -> bool:
        """Whether sequence ``seq_id`` still holds every cell a token at position ``n`` needs (after a prefix
        of ``n`` tokens, unless media before took other positions: ``KVRecord.pos``).

        A sliding-window cache (``swa_full=False``) drops cells that fell out of the window
        while the sequence grew; keeping only a prefix of it is then valid only if the
        window before position ``n`` is still there (llama-server checks the same).
        """
        n_swa = self.ctx.n_swa
        if n <= 0 or n_swa <= 0:
            return True
        pos_min = self.seq_pos_min(seq_id)
        # -1: the window part holds nothing at all (every cell it had is gone).
        return 0 <= pos_min <= max(0, n - n_swa)

    def append_fn(self) -> Callable[[int], None]:
        """A function ``token -> None`` that decodes one token at the end of sequence 0 (hot loops).

        It raises DecodeError (clearing the sequence) when the decode fails or is aborted.
        """
        self._check()
        ctx = self.ctx
        batch = ctx._batch
        native_batch, tok_arr, pos_arr, out_arr = batch.native, batch.token, batch.pos, batch.logits
        decode, ptr, record = self._lib.llama_decode, self._ptr, ctx._record
        held, positions = record.tokens, record.positions
        lost = self._lost

        def append(tok: int) -> None:
            if not self._held:
                raise ClosedError("this ContextLease was released")
            tok_arr[0] = tok
            pos_arr[0] = len(held) + positions.shift
            out_arr[0] = 1
            native_batch.n_tokens = 1
            batch.n_tokens = 1
            ctx._last_decoded = 1
            try:
                rc = self._reserving_decode(batch) if ctx._reserve_pending else decode(ptr, native_batch)
                if lost is not None and (error := lost()) is not None:
                    raise error
                if rc == 0:
                    record.appended(tok, logits=not self._in_graph)
                    return
            except BaseException:  # interrupted between the decode and the bookkeeping
                self.clear()
                raise
            self.clear()
            check_decode(rc, "llama_decode", 1)

        return append

    def decode_run(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` at the end of sequence 0 with logits for every row (row i: after ``tokens[i]``).

        For speculative verification: one decode scores a whole draft. At most
        ``n_batch`` tokens and ``n_outputs_max`` rows, within the context window; unknown ids or
        too many tokens raise with nothing changed. If the decode fails, the sequence is cleared.
        """
        self._check()
        ctx = self.ctx
        # (checked here: llama.cpp refuses a bad id only inside the decode, and the sequence is lost then)
        run = ctx.vocab.check_tokens(tokens).tolist()
        n = len(run)
        if not 0 < n <= min(ctx.max_batch, self._max_outputs):
            raise InvalidArgumentError(f"a run of {n} tokens: expected 1..{min(ctx.max_batch, self._max_outputs)} "
                                       "(n_batch, and ContextParams.n_outputs_max rows)")
        held = ctx._record.tokens
        if len(held) + n > ctx.n_ctx_seq:
            raise ContextOverflowError(f"a run of {n} tokens after {len(held)} does not fit the context window "
                                       f"of {ctx.n_ctx_seq} tokens", n_tokens=len(held) + n, n_ctx=ctx.n_ctx_seq)
        batch = ctx._batch
        batch.clear()
        at = ctx._record.next_pos
        batch.add_sequence(run, at, 0, output_last=False)
        batch.logits[:n] = 1
        try:
            self.decode(batch)
            if self.after_decode is not None:
                self.after_decode(self, run, at)
        except BaseException:  # a failed or interrupted decode leaves the cache state uncertain
            self.clear()
            raise
        ctx._record.decoded(run)

    def truncate(self, n: int) -> bool:
        """Cut sequence 0 back to its first ``n`` tokens, KV and ``tokens`` together (a rollback).

        Returns False, with nothing changed, when the memory cannot drop that tail: a
        recurrent state with fewer rollback snapshots than tokens to drop
        (``ContextParams.n_rs_seq``). A sliding-window cache may have dropped cells the
        kept prefix needs: check :meth:`prefix_complete` (at ``KVRecord.pos(n)``) after cutting.
        """
        self._check()
        record = self.ctx._record
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(record):
            raise InvalidArgumentError(f"truncate({n!r}): expected 0..{len(record)} (the tokens sequence 0 holds)")
        if n == len(record):
            return True
        if record.positions.splits(n):
            raise InvalidArgumentError(f"truncate({n}): that cut would split an image or audio chunk")
        if not record.can_cut(n) or not self._lib.llama_memory_seq_rm(self._mem, 0, record.pos(n), -1):
            return False
        record.cut(n)
        return True

    # ---- memory (KV cache) -------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every sequence."""
        self._check()
        self._lib.llama_memory_clear(self._mem, True)
        self.ctx._record.reset()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence (-1: every sequence; -1 bounds: open end)."""
        self._check()
        seq_id = self._check_seq(seq_id, allow_all=True)
        p0, p1 = _position(p0, "p0"), _position(p1, "p1")
        record = self.ctx._record
        # (the tokens a tail cut keeps: those before position p0, which M-RoPE images make differ)
        keep = min(record.positions.entries_before(int(p0)), len(record)) if p0 > 0 and p1 < 0 else 0
        if seq_id == 0 and p0 > 0 and p1 < 0 and not record.can_cut(keep):
            return False  # a recurrent state would be restored from a stale snapshot (see truncate)
        ok = bool(self._lib.llama_memory_seq_rm(self._mem, seq_id, int(p0), int(p1)))
        if ok and seq_id in (0, -1):
            if p0 > 0 and p1 < 0:
                record.cut(keep)
                record.forget_snapshots()  # (even a cut of nothing: as before, any cut spends them)
            else:  # everything, a hole, or the head cut: the token list no longer describes the sequence
                record.reset()
        return ok

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Share positions [p0, p1) of sequence ``src`` with sequence ``dst`` (metadata only)."""
        self._check()
        src, dst = self._check_seq(src), self._check_seq(dst)
        p0, p1 = _position(p0, "p0"), _position(p1, "p1")
        if src != dst and not self.ctx.params.kv_unified and (p0 > 0 or p1 > 0):
            # each sequence has a KV stream of its own then, and llama.cpp copies streams only whole
            # (GGML_ASSERT in llama_kv_cache::seq_cp)
            raise InvalidArgumentError(f"seq_cp({src}, {dst}, {p0}, {p1}): a context without kv_unified=True copies "
                                       "a sequence into another only whole (p0 = p1 = -1)")
        self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)
        if dst == 0:
            self.ctx._record.reset()  # sequence 0 now holds something this lease did not decode

    def seq_pos_max(self, seq_id: int) -> int:
        self._check()
        return int(self._lib.llama_memory_seq_pos_max(self._mem, self._check_seq(seq_id)))

    def seq_pos_min(self, seq_id: int) -> int:
        self._check()
        return int(self._lib.llama_memory_seq_pos_min(self._mem, self._check_seq(seq_id)))

    def state_size(self) -> int:
        """Bytes needed to save the whole context state."""
        self._check()
        return int(self._lib.llama_state_get_size(self._ptr))

    def state_get(self) -> bytes:
        """The whole context state (KV cache, logits); see :meth:`state_set`."""
        self._check()
        size = self._lib.llama_state_get_size(self._ptr)
        buf = (ctypes.c_uint8 * size)()
        n = self._lib.llama_state_get_data(self._ptr, buf, size)
        self.ctx._rpc.check()  # (a lost worker's share of the state reads as zeros)
        return ctypes.string_at(buf, n)  # (a slice of a ctypes array would be a list of ints)

    def state_set(self, data: bytes, tokens: Sequence[int]) -> None:
        """Restore a state from :meth:`state_get`; ``tokens``: the tokens its sequence 0 holds.
        DecodeError (sequence 0 then holds nothing) when llama.cpp rejects it."""
        self._check()
        tokens = self.ctx.vocab.check_tokens(tokens).tolist()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        record = self.ctx._record
        record.reset()
        ok = self._lib.llama_state_set_data(self._ptr, buf, len(data)) != 0
        if not ok or self.ctx._rpc.failure() is not None:
            self.ctx._rpc.check()
            raise DecodeError("llama_state_set_data rejected the state")
        record.reset(tokens)

    def state_seq_get(self, seq_id: int) -> np.ndarray:
        """The KV state of one sequence, as a uint8 array (bytes-like).

        llama.cpp writes straight into a numpy buffer: no zero-fill and no copy while
        holding the GIL (a state can be tens of MB; the ctypes call releases the GIL).
        """
        self._check()
        seq_id = self._check_seq(seq_id)
        size = self._lib.llama_state_seq_get_size(self._ptr, seq_id)
        buf = np.empty(size, dtype=np.uint8)
        n = self._lib.llama_state_seq_get_data(self._ptr, buf.ctypes.data_as(_P_U8), size, seq_id)
        self._check_workers()  # (a lost worker's share reads as zeros)
        return buf if n == size else buf[:n].copy()

    def state_seq_set(self, seq_id: int, state) -> bool:
        """Restore one sequence's KV state from ``state_seq_get`` (bytes-like); False if llama.cpp refused it."""
        self._check()
        seq_id = self._check_seq(seq_id)
        arr = state if isinstance(state, np.ndarray) else np.frombuffer(state, dtype=np.uint8)
        ok = self._lib.llama_state_seq_set_data(self._ptr, arr.ctypes.data_as(_P_U8), arr.size, seq_id) > 0
        if seq_id == 0:
            self.ctx._record.reset()
        self._check_workers()
        return ok
