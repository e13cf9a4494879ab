"""Reading what the last decode left on a ContextLease: logits rows (copies, views, a block of rows),
native sampling of a row, embeddings and the pooling type.

Part of :class:`~llama_ctypes.core.context.ContextLease` (a mixin: same object, same rules). Views are
valid until the next decode and refuse to outlive the lease; rows sampled inside the graph have no
logits (lease_sampling.py).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ClosedError, DecodeError, IndexOutOfRangeError

__all__ = ["OutputOps"]


class OutputOps:
    """The output-reading operations of a ContextLease."""

    ctx: Any
    _lib: Any
    _ptr: Any
    _held: bool
    _graph_used: bool

    def has_logits(self, i: int) -> bool:
        """Whether batch row ``i`` of the last decode has logits (not one sampled inside the graph)."""
        self._check()
        return not self._sampled_in_graph(i) and bool(self._lib.llama_get_logits_ith(self._ptr, i))

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits row ``i`` of the last decode (float32, n_vocab)."""
        self._check()
        self._refuse_in_graph_row(i)
        ptr = self._lib.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise IndexOutOfRangeError(f"no logits for batch row {i} (was it marked as an output?)")
        return np.ctypeslib.as_array(ptr, shape=(self.ctx.n_vocab,)).copy()

    def logits_view_fn(self) -> Callable[[int], np.ndarray]:
        """``idx -> float32 view`` of a logits row, rebuilt only when llama.cpp moves its buffer.

        A view is valid until the next decode; copy what must outlive it.
        """
        self._check()
        n_vocab = self.ctx.n_vocab
        # The same C function, returning the address as an int instead of a ctypes pointer.
        logits_addr = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
            ctypes.cast(self._lib.llama_get_logits_ith, ctypes.c_void_p).value)
        ctx_addr = ctypes.cast(self._ptr, ctypes.c_void_p).value
        cached: list = [None, None]  # address, view

        def view(idx: int) -> np.ndarray:
            if not self._held:
                raise ClosedError("this ContextLease was released")
            if self._graph_used:
                self._refuse_in_graph_row(idx)
            addr = logits_addr(ctx_addr, idx)
            if not addr:
                raise IndexOutOfRangeError(f"no logits for batch row {idx}")
            if addr != cached[0]:
                cached[0] = addr
                cached[1] = np.ctypeslib.as_array((ctypes.c_float * n_vocab).from_address(addr))
            return cached[1]

        return view

    def logits_rows_fn(self) -> Callable[[Sequence[int]], "np.ndarray | None"]:
        """``rows -> (len(rows), n_vocab) float32 view`` of the logits of batch rows ``rows`` (ascending,
        every row of the last batch with logits between the first and the last), for one numpy operation
        over them all; None when they are not stored as one block (rows sampled inside the graph, or
        rows missing from the list). A view is valid until the next decode.
        """
        self._check()
        n_vocab = self.ctx.n_vocab
        stride = n_vocab * ctypes.sizeof(ctypes.c_float)
        logits_addr = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
            ctypes.cast(self._lib.llama_get_logits_ith, ctypes.c_void_p).value)
        ctx_addr = ctypes.cast(self._ptr, ctypes.c_void_p).value

        def rows_view(rows: Sequence[int]) -> np.ndarray | None:
            if not self._held:
                raise ClosedError("this ContextLease was released")
            if self._graph_used or not rows:
                return None
            # (reading a row puts llama.cpp's outputs back in batch order: output k is the k-th row with
            # logits, so the first and the last address bound a packed block exactly when no row is missing)
            first, last = logits_addr(ctx_addr, rows[0]), logits_addr(ctx_addr, rows[-1])
            if not first or not last or last - first != (len(rows) - 1) * stride:
                return None
            return np.ctypeslib.as_array((ctypes.c_float * (n_vocab * len(rows))).from_address(first)) \
                .reshape(len(rows), n_vocab)

        return rows_view

    def sample_fn(self, chain, top_k: int = 0) -> Callable[[int], int]:
        """``idx -> token``: ``llama_sampler_sample`` of the native sampler ``chain`` on this context.

        ``top_k`` > 0: the chain starts with top_k(top_k) and nothing before it reads the logits, so the
        draw is made from the row's ``top_k`` largest logits alone (``lcx_sampler_sample_top_k``). The
        caller guarantees that row ``idx`` has logits (llama.cpp asserts otherwise).
        """
        self._check()
        sample, ptr = self._lib.llama_sampler_sample, self._ptr
        if top_k > 0:
            sample_top_k = self._lib.lcx_sampler_sample_top_k

            def fn_top_k(idx: int) -> int:
                if not self._held:
                    raise ClosedError("this ContextLease was released")
                token = sample_top_k(chain, ptr, idx, top_k)
                if token < 0:
                    raise DecodeError(f"the sampler chain drew no token from row {idx} (its logits are missing "
                                      "or not numbers)")
                return token

            return fn_top_k

        def fn(idx: int) -> int:
            if not self._held:
                raise ClosedError("this ContextLease was released")
            return sample(chain, ptr, idx)

        return fn

    def embeddings_ith(self, i: int, n: int) -> np.ndarray | None:
        """A copy of the embedding of batch row ``i`` (``n`` floats), or None."""
        self._check()
        ptr = self._lib.llama_get_embeddings_ith(self._ptr, i)
        return np.ctypeslib.as_array(ptr, shape=(n,)).copy() if ptr else None

    def embeddings_seq(self, seq: int, n: int) -> np.ndarray | None:
        """A copy of the pooled embedding of sequence ``seq`` (``n`` floats), or None."""
        self._check()
        ptr = self._lib.llama_get_embeddings_seq(self._ptr, self._check_seq(seq))
        return np.ctypeslib.as_array(ptr, shape=(n,)).copy() if ptr else None

    def pooling_type(self) -> int:
        """The context's pooling type (``LLAMA_POOLING_TYPE_*``)."""
        self._check()
        return int(self._lib.llama_pooling_type(self._ptr))
