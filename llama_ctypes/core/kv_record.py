"""What sequence 0 of a context holds, kept equal to its KV cells: the one owner of ``ctx.tokens``.

Every change of a context's sequence 0 (a prefill, a decode run, one appended token, a cut, a
clear, a restore, a copy into it) goes through a :class:`KVRecord` method, called by the
context's lease (core/context.py) and its hidden-state operations (core/hidden_states.py).
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["KVRecord"]


class KVRecord:
    """The tokens whose KV sits in sequence 0, and how many trailing ones a cut may drop exactly.

    ``n_rs_seq``: the context's recurrent rollback snapshots (0: none, or not a recurrent memory). A
    snapshot is written only for the tokens of the last decode, and llama.cpp accepts any cut of up
    to ``n_rs_seq`` tokens without checking that: a cut reaching past the last decode would silently
    restore a stale state, so :meth:`can_cut` allows only cuts within it, once.

    Not thread-safe by itself: the context's lease (one holder at a time) serialises its use.
    """

    __slots__ = ("_exact_cut", "n_rs_seq", "tokens")

    def __init__(self, n_rs_seq: int = 0):
        self.tokens: list[int] = []
        """The live list (read it; change it only through these methods: its identity never changes)."""
        self._exact_cut = 0
        self.n_rs_seq = n_rs_seq

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Sequence 0 now holds ``tokens`` (nothing: cleared or overwritten; a restored state's tokens)."""
        self.tokens[:] = tokens
        self._exact_cut = 0

    def forget_snapshots(self) -> None:
        """No cut may rely on the rollback snapshots now: a decode is about to overwrite them, or a cut
        that used them was made."""
        self._exact_cut = 0

    def decoded(self, run: Sequence[int]) -> None:
        """``run`` was decoded at the end of sequence 0; a cut may now drop up to all but its first token."""
        self.tokens.extend(run)
        self._exact_cut = min(len(run) - 1, self.n_rs_seq)

    def appended(self, token: int) -> None:
        """One token was decoded at the end (a one-token decode leaves no snapshot to roll back to)."""
        self.tokens.append(token)
        self._exact_cut = 0

    def cut(self, n: int) -> None:
        """Sequence 0 was cut back to its first ``n`` tokens (a recurrent rollback is single-use)."""
        if n < len(self.tokens):
            del self.tokens[n:]
            self._exact_cut = 0

    def can_cut(self, n: int) -> bool:
        """Whether cutting back to ``n`` tokens leaves exactly the state of those tokens.

        Attention caches: always. Recurrent states with snapshots: only for cuts within the last
        decode (all but its first token), once. (Without snapshots llama.cpp itself refuses every
        partial cut of a recurrent state.)
        """
        drop = len(self.tokens) - n
        return self.n_rs_seq == 0 or drop <= 0 or n == 0 or drop <= self._exact_cut
