"""Batch: a ``llama_batch`` whose arrays are numpy buffers, filled in bulk."""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..errors import IndexOutOfRangeError, InvalidArgumentError
from ..native import llama_h as L


class Batch:
    """Input for one ``llama_decode`` call: tokens, positions, sequence ids, output flags.

    The arrays are numpy-owned, so filling a prompt chunk is a slice copy, not
    a Python loop. ``capacity`` is the most tokens the batch holds; each token
    belongs to up to ``n_seq_max`` sequences. Not thread-safe.
    """

    def __init__(self, capacity: int, n_seq_max: int = 1):
        if capacity < 1 or n_seq_max < 1:
            raise InvalidArgumentError("Batch capacity and n_seq_max must be >= 1")
        self.capacity = capacity
        self.n_seq_max = n_seq_max
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq_ids = np.zeros((capacity, n_seq_max), dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        # seq_id is int32 ** : one pointer per token into its row of seq_ids.
        row_bytes = self.seq_ids.strides[0]
        self._seq_ptrs = (ctypes.POINTER(L.llama_seq_id) * capacity)(
            *[ctypes.cast(self.seq_ids.ctypes.data + i * row_bytes, ctypes.POINTER(L.llama_seq_id))
              for i in range(capacity)]
        )
        self.n_tokens = 0
        self.native = L.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(ctypes.POINTER(L.llama_token)),
            embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def clear(self) -> None:
        self.n_tokens = 0

    @property
    def free(self) -> int:
        """Room left, in tokens."""
        return self.capacity - self.n_tokens

    def add(self, token: int, pos: int, seq_id: int = 0, output: bool = False) -> int:
        """Append one token; return its index in the batch (its logits row when output)."""
        i = self.n_tokens
        if i >= self.capacity:
            raise IndexOutOfRangeError(f"batch is full ({self.capacity} tokens)")
        self.token[i] = token
        self.pos[i] = pos
        self.n_seq_id[i] = 1
        self.seq_ids[i, 0] = seq_id
        self.logits[i] = output
        self.n_tokens = i + 1
        return i

    def add_sequence(self, tokens: Sequence[int] | np.ndarray, start_pos: int, seq_id: int = 0,
                     output_last: bool = True) -> int:
        """Append a run of tokens of one sequence at consecutive positions.

        Returns the batch index of the last token (its logits row when output_last).
        """
        n = len(tokens)
        i = self.n_tokens
        if n == 0:
            raise InvalidArgumentError("add_sequence needs at least one token")
        if i + n > self.capacity:
            raise IndexOutOfRangeError(f"{n} tokens do not fit: {self.free} of {self.capacity} free")
        end = i + n
        self.token[i:end] = tokens
        self.pos[i:end] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self.n_seq_id[i:end] = 1
        self.seq_ids[i:end, 0] = seq_id
        self.logits[i:end] = 0
        if output_last:
            self.logits[end - 1] = 1
        self.n_tokens = end
        return end - 1

    def as_native(self) -> L.llama_batch:
        self.native.n_tokens = self.n_tokens
        return self.native
