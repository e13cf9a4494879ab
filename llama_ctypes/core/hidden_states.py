"""The hidden-state operations of a ContextLease, for multi-token prediction (MTP) heads.

An MTP head reads, beside each token, the target model's last hidden row of the position before
it. These methods keep those rows (``set_embeddings_nextn``), read them (``nextn_rows``,
``nextn_row``) and decode tokens paired with state rows (``decode_with_states`` for sequence 0,
``decode_states`` for any sequences) through ``llama_batch_ext`` + ``llama_process``. They are
part of :class:`~llama_ctypes.core.context.ContextLease` (a mixin: same object, same rules).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..errors import ContextOverflowError, IndexOutOfRangeError, InvalidArgumentError, LlamaError
from ..native import llama_h as L
from .decode_status import check_decode

__all__ = ["HiddenStates"]


class HiddenStates:
    """ContextLease's MTP methods (see the module docs); the lease supplies ``ctx``, ``_lib``, ``_ptr``,
    ``_max_outputs``, ``_check``, ``_check_seq``, ``_check_workers`` and ``clear``."""

    def set_embeddings_nextn(self, value: bool, masked: bool) -> None:
        """Keep the hidden state that feeds an MTP head (``n_embd_out`` floats per token) of every
        decoded token (``masked=False``: a target) or of the output rows only (``masked=True``: an MTP context)."""
        self._check()
        self._lib.lcx_set_embeddings_nextn(self._ptr, bool(value), bool(masked))
        self.ctx._nextn_all = bool(value) and not masked

    def n_embd_out(self) -> int:
        """Width of a hidden row (and of a state row), in floats."""
        self._check()
        # (through the context: its model may be closed meanwhile, and stays alive while the context does)
        return int(self._lib.llama_model_n_embd_out(self._lib.llama_get_model(self._ptr)))

    def nextn_rows(self, n: int) -> np.ndarray:
        """A float32 view ``(n, n_embd_out)`` of the hidden rows of the last decode's first ``n`` tokens
        (unmasked, see :meth:`set_embeddings_nextn`); valid until the next decode."""
        self._check()
        ctx = self.ctx
        if not ctx._nextn_all:
            raise InvalidArgumentError("nextn_rows needs a row per token: set_embeddings_nextn(True, masked=False)")
        if not 0 < n <= ctx._last_decoded:
            raise InvalidArgumentError(f"nextn_rows({n}): expected 1..{ctx._last_decoded} (the last decode's tokens)")
        ptr = self._lib.lcx_get_embeddings_nextn(self._ptr)
        if not ptr:
            raise IndexOutOfRangeError("no nextn hidden rows: set_embeddings_nextn(True, ...) before the decode")
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_embd_out()))

    def nextn_row(self, i: int = -1) -> np.ndarray:
        """A float32 view of the hidden row of batch row ``i`` of the last decode (negative: counted
        from the last output row, for a masked context); valid until the next decode."""
        self._check()
        ptr = self._lib.lcx_get_embeddings_nextn_ith(self._ptr, i)
        if not ptr:
            raise IndexOutOfRangeError(f"no nextn hidden row for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd_out(),))

    def decode_with_states(self, tokens: Sequence[int], states: Sequence[int], output_last: bool) -> None:
        """Decode ``tokens`` at the end of sequence 0, token ``i`` with the state row at address ``states[i]``
        (``n_embd_out`` float32s, copied during the call), through ``llama_process``: the input of an MTP
        context. ``output_last``: logits (and the hidden row) of the last token.

        Unknown ids or too many tokens raise with nothing changed; if the decode fails, the sequence is cleared
        (RPCConnectionError when an RPC worker was lost during it).
        """
        self._check()
        ctx = self.ctx
        run = ctx.vocab.check_tokens(tokens).tolist()
        n = len(run)
        if len(states) != n or not 0 < n <= ctx.n_batch:
            raise InvalidArgumentError(f"{n} tokens with {len(states)} state rows: expected as many, "
                                       f"1..n_batch={ctx.n_batch}")
        held = ctx._record.tokens
        if len(held) + n > ctx.n_ctx_seq:
            raise ContextOverflowError(f"a run of {n} tokens after {len(held)} does not fit the context window "
                                       f"of {ctx.n_ctx_seq} tokens", n_tokens=len(held) + n, n_ctx=ctx.n_ctx_seq)
        base = ctx._record.next_pos
        ctx._record.forget_snapshots()
        try:
            rc = self._process_states([0] * n, range(base, base + n), run, states, [n - 1] if output_last else [])
        except BaseException:  # interrupted: the cache state is uncertain
            self.clear()
            raise
        if rc != 0:
            self.clear()
            check_decode(rc, "llama_process", n)
        ctx._record.decoded(run)

    def decode_states(self, seq_ids: Sequence[int], positions: Sequence[int], tokens: Sequence[int],
                      states: Sequence[int], outputs: Sequence[int]) -> int:
        """One ``llama_process`` decode of tokens of any sequences, token ``i`` of ``seq_ids[i]`` at
        ``positions[i]`` with the state row at address ``states[i]`` (``n_embd_out`` float32s, copied
        during the call); ``outputs``: the batch indices with logits and hidden rows. Returns llama.cpp's
        code. Sequence bookkeeping is the caller's (a multi-sequence MTP context of a server): the
        tokens of sequence 0 (:attr:`tokens`) are forgotten. Raises RPCConnectionError (whatever the
        code) when an RPC worker was lost during it.
        """
        self._check()
        ctx = self.ctx
        run = ctx.vocab.check_tokens(tokens).tolist()
        n = len(run)
        if not (len(seq_ids) == len(positions) == len(states) == n) or not 0 < n <= ctx.n_batch:
            raise InvalidArgumentError(f"{n} tokens with {len(seq_ids)} sequence ids, {len(positions)} positions "
                                       f"and {len(states)} state rows: expected as many, 1..n_batch={ctx.n_batch}")
        if len(outputs) > self._max_outputs or any(not 0 <= i < n for i in outputs):
            raise InvalidArgumentError(f"outputs {list(outputs)[:8]}: expected at most {self._max_outputs} "
                                       f"batch indices in 0..{n - 1}")
        for s in seq_ids:
            self._check_seq(s)
        ctx._record.reset()
        return self._process_states(seq_ids, positions, run, states, outputs)

    def _process_states(self, seq_ids, positions, run: list[int], states, outputs) -> int:
        lib, ptr, width = self._lib, self._ptr, self.n_embd_out()
        self.ctx._record.forget_logits()
        batch = lib.llama_batch_ext_init(ptr)
        if not batch:
            raise LlamaError("llama_batch_ext_init failed")
        try:
            add, set_pos = lib.llama_batch_ext_add_token, lib.llama_batch_ext_set_pos
            set_embd, embd = lib.llama_batch_ext_set_embd_token, L.llama_embd
            pos = ctypes.c_int32()
            pos_ref = ctypes.byref(pos)
            for i, (seq, p, tok, state) in enumerate(zip(seq_ids, positions, run, states)):
                idx = add(batch, int(seq), tok)
                pos.value = int(p)
                if idx != i or not set_pos(batch, idx, pos_ref) or not set_embd(batch, idx, embd(state, 1, width)):
                    raise InvalidArgumentError(f"llama.cpp refused token {i} of a batch with state rows (code {idx})")
            for i in outputs:
                lib.llama_batch_ext_set_output_logits(batch, int(i), True)
            self.ctx._last_decoded = len(run)
            rc = self.guarded(lambda: int(lib.llama_process(ptr, L.LLAMA_PROCESS_TYPE_DECODE, batch)))
        finally:
            lib.llama_batch_ext_free(batch)
        self._check_workers()
        return rc
