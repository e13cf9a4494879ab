"""What sequence 0 of a context holds, kept equal to its KV cells: the one owner of ``ctx.tokens``.

Every change of a context's sequence 0 (a prefill, a decode run, one appended token, a cut, a
clear, a restore, a copy into it) goes through a :class:`KVRecord` method, called by the
context's lease (core/context.py) and its hidden-state operations (core/hidden_states.py).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .positions import PositionMap

__all__ = ["KVRecord"]


class KVRecord:
    """The tokens whose KV sits in sequence 0, and how many trailing ones a cut may drop exactly.

    ``n_rs_seq``: the context's recurrent rollback snapshots (0: none, or not a recurrent memory). A
    snapshot is written only for the tokens of the last decode, and llama.cpp accepts any cut of up
    to ``n_rs_seq`` tokens without checking that: a cut reaching past the last decode would silently
    restore a stale state, so :meth:`can_cut` allows only cuts within it, once.

    Not thread-safe by itself: the context's lease (one holder at a time) serialises its use.
    """

    __slots__ = ("_exact_cut", "n_rs_seq", "tokens", "adapters", "_segments", "positions", "logits_at")

    def __init__(self, n_rs_seq: int = 0):
        self.tokens: list[int] = []
        """The live list (read it; change it only through these methods: its identity never changes)."""
        self._exact_cut = 0
        self.n_rs_seq = n_rs_seq
        self.positions = PositionMap()
        """Where media chunks put later tokens at other positions than their index (M-RoPE models)."""
        self.adapters: object = ()
        """The LoRA set (core/lora.py ``LoraSet``) the context applies now: later tokens are computed under it."""
        # (start position, adapter set) of each run of tokens computed under one set, in order
        self._segments: list[tuple[int, object]] = [(0, ())]
        self.logits_at = -1
        """``len(tokens)`` when the context's last output row holds the plain logits after the last of them
        (no in-graph sampler took that row, nothing decoded since); -1 when unknown."""

    def set_adapters(self, adapters: object) -> None:
        """The context applies ``adapters`` from the next decode on."""
        self.adapters = adapters
        n = len(self.tokens)
        start, last = self._segments[-1]
        if last == adapters:
            return
        if start >= n:
            self._segments[-1] = (n, adapters)
            if len(self._segments) > 1 and self._segments[-2][1] == adapters:
                self._segments.pop()
        else:
            self._segments.append((n, adapters))

    def reusable(self, n: int) -> int:
        """How many of the first ``n`` tokens were computed under the adapters applied now."""
        for start, adapters in self._segments:
            if adapters != self.adapters:
                return min(n, start)
        return n

    def _trim_segments(self, n: int) -> None:
        kept = [seg for seg in self._segments if seg[0] < n] or [(0, self.adapters)]
        if kept[-1][1] != self.adapters:
            kept.append((n, self.adapters))  # (what is decoded after the cut is computed under the set of now)
        self._segments = kept

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def next_pos(self) -> int:
        """The position of the next token decoded at the end (its index, unless media took other positions)."""
        return len(self.tokens) + self.positions.shift

    def pos(self, n: int) -> int:
        """The position where the first ``n`` tokens end (InvalidArgumentError inside a media chunk)."""
        return self.positions.pos(n)

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Sequence 0 now holds ``tokens`` (nothing: cleared or overwritten; a restored state's tokens)."""
        self.tokens[:] = tokens
        self.positions.clear()
        self._exact_cut = 0
        self.logits_at = -1
        self._segments = [(0, self.adapters)]  # (a restored state: taken as computed under the set applied now)

    def forget_snapshots(self) -> None:
        """No cut may rely on the rollback snapshots now: a decode is about to overwrite them, or a cut
        that used them was made."""
        self._exact_cut = 0

    def forget_logits(self) -> None:
        """A decode is about to overwrite the context's output rows."""
        self.logits_at = -1

    def has_logits_of(self, prompt: Sequence[int]) -> bool:
        """Whether sequence 0 holds exactly ``prompt`` and the context's last output row is its logits."""
        return self.logits_at == len(self.tokens) == len(prompt) and not self.positions.shift \
            and self.tokens == list(prompt)

    def decoded(self, run: Sequence[int], logits: bool = False) -> None:
        """``run`` was decoded at the end of sequence 0; a cut may now drop up to all but its first token.
        ``logits``: the decode's last output row is the plain logits after its last token."""
        self.tokens.extend(run)
        self._exact_cut = min(len(run) - 1, self.n_rs_seq)
        self.logits_at = len(self.tokens) if logits else -1

    def decoded_media(self, run: Sequence[int], n_pos: int) -> None:
        """A media chunk's placeholders ``run`` were decoded at the end, taking ``n_pos`` positions."""
        self.positions.add(len(self.tokens), len(run), n_pos)
        self.decoded(run)

    def appended(self, token: int, logits: bool = False) -> None:
        """One token was decoded at the end (a one-token decode leaves no snapshot to roll back to)."""
        self.tokens.append(token)
        self._exact_cut = 0
        self.logits_at = len(self.tokens) if logits else -1

    def cut(self, n: int) -> None:
        """Sequence 0 was cut back to its first ``n`` tokens (a recurrent rollback is single-use)."""
        if n < len(self.tokens):
            self.positions.cut(n)
            del self.tokens[n:]
            self._exact_cut = 0
            self.logits_at = -1
            self._trim_segments(n)

    def can_cut(self, n: int) -> bool:
        """Whether cutting back to ``n`` tokens leaves exactly the state of those tokens.

        Attention caches: always. Recurrent states with snapshots: only for cuts within the last
        decode (all but its first token), once. (Without snapshots llama.cpp itself refuses every
        partial cut of a recurrent state.)
        """
        drop = len(self.tokens) - n
        return self.n_rs_seq == 0 or drop <= 0 or n == 0 or drop <= self._exact_cut
