"""Context: a model's KV memory and decode calls. One caller at a time."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import ContextCreationError, DecodeError
from .backend import clear_native_error, native_error
from .batch import Batch
from .handle import NativeHandle
from .params import ContextParams, split_options

if TYPE_CHECKING:
    from .model import Model
    from .sampler import Sampler

_DECODE_ERRORS = {
    1: "no KV-cache slot for the batch (the context is full; use a larger n_ctx or a shorter prompt)",
    2: "aborted",
    -1: "invalid batch",
}


class Context(NativeHandle):
    """An inference context over a :class:`Model` (``llama_context``).

    Thread safety: a Context serves one caller at a time. A call made while
    another is running (from another thread, or while a ``stream`` of this
    context is still open) raises :class:`~llama_ctypes.BusyError` instead of
    waiting, because interleaving two generations in one KV cache would
    corrupt both. Use one Context per thread, or a Server.

    The Context keeps its Model alive: closing the Model first is safe.
    """

    _kind = "Context"

    def __init__(self, model: "Model", params: ContextParams | None = None):
        super().__init__()
        self._ptr = None
        self.model = model
        self.params = params or ContextParams()
        self._lib = model._lib
        if model.params.vocab_only:
            self._mark_dead()
            raise ContextCreationError(f"{model.path.name} was loaded with vocab_only=True: it has no weights to run")
        model._acquire()
        try:
            native = self.params.to_native()
            clear_native_error()
            ptr = self._lib.llama_init_from_model(model._ptr, native)
            if not ptr:
                reason = native_error("out of memory, or options the model or backend does not support")
                raise ContextCreationError(
                    f"could not create a context with n_ctx={self.params.n_ctx}, n_batch={self.params.n_batch}, "
                    f"type_k={self.params.type_k}, type_v={self.params.type_v}: {reason}"
                )
        except BaseException:
            self._mark_dead()
            model._release()
            raise
        self._ptr = ptr
        self._mem = self._lib.llama_get_memory(ptr)
        self.n_ctx = int(self._lib.llama_n_ctx(ptr))
        self.n_ctx_seq = int(self._lib.llama_n_ctx_seq(ptr))
        self.n_batch = int(self._lib.llama_n_batch(ptr))
        self.n_seq_max = int(self._lib.llama_n_seq_max(ptr))
        self.n_vocab = model.n_vocab
        self.encoder_only = model.has_encoder and not model.has_decoder
        # Tokens whose KV sits in sequence 0, for prefix reuse across generate() calls.
        self.tokens: list[int] = []
        self._batch = Batch(self.n_batch, 1)
        model._contexts.add(self)

    @classmethod
    def create(cls, model: "Model", **opts: Any) -> "Context":
        """Create a context; options are the fields of :class:`ContextParams` (n_ctx=4096, ...)."""
        (cparams,) = split_options(opts, ContextParams, where="Context.create: unknown")
        return cls(model, ContextParams(**cparams))

    def _free(self) -> None:
        if self._ptr:
            self._lib.llama_free(self._ptr)
            self._ptr = None
        self.model._release()

    def __repr__(self) -> str:
        return f"<Context n_ctx={self.n_ctx} {'closed' if self._closed else 'open'}>"

    # ---- decoding --------------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        """Run the model over ``batch``; raises :class:`DecodeError` on failure."""
        with self._exclusively():
            self._decode(batch)

    def _decode(self, batch: Batch) -> None:
        # Caller holds the context exclusively.
        rc = self._lib.llama_decode(self._ptr, batch.as_native())
        if rc != 0:
            reason = _DECODE_ERRORS.get(rc, "error")
            raise DecodeError(f"llama_decode failed with {rc}: {reason}", code=rc)

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits row ``i`` of the last decode (float32, n_vocab)."""
        with self._exclusively():
            ptr = self._lib.llama_get_logits_ith(self._ptr, i)
            if not ptr:
                raise IndexError(f"no logits for batch row {i} (was it marked as an output?)")
            return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # ---- memory (KV cache) -------------------------------------------------------------
    def clear(self) -> None:
        """Forget every sequence in the KV cache."""
        with self._exclusively():
            self._clear()

    def _clear(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)
        self.tokens = []

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence (-1 = open end); False if the memory cannot."""
        with self._exclusively():
            return bool(self._lib.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Share positions [p0, p1) of sequence ``src`` with sequence ``dst`` (no copy of data)."""
        with self._exclusively():
            self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for a sequence, or -1 when empty."""
        with self._exclusively():
            return int(self._lib.llama_memory_seq_pos_max(self._mem, seq_id))

    def state_size(self) -> int:
        """Bytes needed to save the whole context state."""
        with self._exclusively():
            return int(self._lib.llama_state_get_size(self._ptr))

    def save_state(self) -> bytes:
        """Snapshot of the context (KV cache, logits) with the tokens it holds; see ``load_state``."""
        with self._exclusively():
            size = self._lib.llama_state_get_size(self._ptr)
            buf = (ctypes.c_uint8 * size)()
            n = self._lib.llama_state_get_data(self._ptr, buf, size)
            return ctypes.string_at(buf, n)  # (a slice of a ctypes array would be a list of ints)

    def load_state(self, data: bytes, tokens: Sequence[int]) -> None:
        """Restore a snapshot from ``save_state``; ``tokens`` are the tokens it holds."""
        with self._exclusively():
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            if self._lib.llama_state_set_data(self._ptr, buf, len(data)) == 0:
                raise DecodeError("llama_state_set_data rejected the state")
            self.tokens = list(tokens)

    # ---- generation (see generation.py) ---------------------------------------------------
    def generate(self, sampler: "Sampler", tokens: Sequence[int], **opts: Any):
        """Generate from pre-tokenized input with a given sampler; returns a :class:`Completion`.

        Options: the fields of :class:`GenerationParams` (max_tokens, stop, ...).
        With ``cache_prompt=True`` the KV cache of the longest common prefix with
        the previous call is reused instead of recomputed.
        """
        from .generation import GenerationParams, generate_with

        (gen,) = split_options(opts, GenerationParams, where="Context.generate: unknown")
        return generate_with(self, sampler, list(tokens), GenerationParams(**gen))

    def stream(self, sampler: "Sampler", tokens: Sequence[int], **opts: Any):
        """Like :meth:`generate`, but a lazy :class:`TextStream` of text pieces."""
        from .generation import GenerationParams, TextStream

        (gen,) = split_options(opts, GenerationParams, where="Context.stream: unknown")
        return TextStream(self, sampler, list(tokens), GenerationParams(**gen))
