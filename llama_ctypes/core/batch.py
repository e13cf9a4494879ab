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
        for name, value in (("capacity", capacity), ("n_seq_max", n_seq_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"Batch {name}={value!r}: expected an integer >= 1")
        self._capacity = capacity
        self._n_seq_max = n_seq_max
        # The arrays are read-only attributes (their contents are not): llama.cpp reads the buffers
        # whose addresses ``native`` holds, so a rebound array would be silently ignored.
        self._token = np.zeros(capacity, dtype=np.int32)
        self._pos = np.zeros(capacity, dtype=np.int32)
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        self._seq_ids = np.zeros((capacity, n_seq_max), dtype=np.int32)
        self._logits = np.zeros(capacity, dtype=np.int8)
        # seq_id is int32 ** : one pointer per token into its row of seq_ids.
        row_bytes = self._seq_ids.strides[0]
        self._seq_ptrs = (ctypes.POINTER(L.llama_seq_id) * capacity)(
            *[ctypes.cast(self._seq_ids.ctypes.data + i * row_bytes, ctypes.POINTER(L.llama_seq_id))
              for i in range(capacity)]
        )
        self.n_tokens = 0
        self.native = L.llama_batch(
            n_tokens=0,
            token=self._token.ctypes.data_as(ctypes.POINTER(L.llama_token)),
            embd=None,
            pos=self._pos.ctypes.data_as(ctypes.POINTER(L.llama_pos)),
            n_seq_id=self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_ptrs,
            logits=self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    capacity = property(lambda self: self._capacity, doc="Most tokens the batch holds.")
    n_seq_max = property(lambda self: self._n_seq_max, doc="Most sequences one token may belong to.")
    token = property(lambda self: self._token, doc="Token ids (int32, ``capacity`` entries).")
    pos = property(lambda self: self._pos, doc="Positions (int32).")
    n_seq_id = property(lambda self: self._n_seq_id, doc="Sequences each token belongs to (1..n_seq_max).")
    seq_ids = property(lambda self: self._seq_ids, doc="Sequence ids, ``(capacity, n_seq_max)`` int32.")
    logits = property(lambda self: self._logits, doc="Output flags (int8: 1 = compute this token's row).")

    def check(self) -> int:
        """Raise InvalidArgumentError unless the fields agree with the arrays (C would read past them);
        return ``n_tokens``."""
        n = self.n_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self._capacity:
            raise InvalidArgumentError(f"batch n_tokens={n!r}: expected 0..{self._capacity} (its capacity)")
        n = int(n)
        if n:
            counts = self._n_seq_id[:n]
            if int(counts.min()) < 1 or int(counts.max()) > self._n_seq_max:
                raise InvalidArgumentError(f"batch n_seq_id: every token belongs to 1..{self._n_seq_max} sequences "
                                           "(the batch's n_seq_max)")
        return n

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
