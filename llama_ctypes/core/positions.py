"""Where the entries of a token list sit in their sequence, when media chunks take other positions.

Entry ``i`` of a sequence's token list normally sits at position ``i``. M-RoPE models (the Qwen-VL
family) place an image of ``nx × ny`` embeddings on a grid that advances the position by
``max(nx, ny)`` only (libmtmd's ``n_pos``), so every entry after it sits at an earlier position than
its index. A :class:`PositionMap` records those chunks for a list that grows at its end and is cut back
between chunks, never through one; it is empty (and free) for every other model.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import InvalidArgumentError

__all__ = ["PositionMap"]


class PositionMap:
    """The media chunks of a token list whose positions differ from their entries (see the module docs)."""

    __slots__ = ("_marks", "shift")

    def __init__(self) -> None:
        # (start, end, shift): entries start..end are a chunk; entries from end on sit at index + shift
        self._marks: list[tuple[int, int, int]] = []
        self.shift = 0
        """Position minus index of the entries after the last chunk (0 when there is none): a plain
        attribute, read per decoded token."""

    @classmethod
    def of(cls, prompt: Sequence[int], n: int) -> "PositionMap":
        """The map of ``prompt[:n]`` (a MediaPrompt's spans; empty for a plain list)."""
        out = cls()
        for span in getattr(prompt, "spans", ()):
            if span.end > n:
                if span.start < n:
                    raise InvalidArgumentError(f"entry {n} lies inside an {span.kind} chunk of the prompt")
                break
            out.add(span.start, span.n_tokens, span.n_pos)
        return out

    def __bool__(self) -> bool:
        return bool(self._marks)

    def __repr__(self) -> str:
        return f"PositionMap({self._marks})"

    def splits(self, n: int) -> bool:
        """Whether ``n`` lies strictly inside a chunk (no position marks the end of a first-``n`` prefix)."""
        return any(start < n < end for start, end, _ in self._marks)

    def pos(self, n: int) -> int:
        """The position of entry ``n`` (where a prefix of ``n`` entries ends); ``n`` must not split a chunk."""
        shift = 0
        for start, end, after in self._marks:
            if n < end:
                if n > start:
                    raise InvalidArgumentError(f"entry {n} lies inside a media chunk (entries {start}..{end})")
                break
            shift = after
        return n + shift

    def entries_before(self, p: int) -> int:
        """How many entries sit at positions before ``p``: what a removal of positions ``p..`` keeps (the
        cells of an M-RoPE image all sit at its first position, so it is kept or removed whole); may
        exceed the list's length. llama-server's ``size_up_to_pos``."""
        shift = 0
        for start, end, after in self._marks:
            if p <= start + shift:
                return max(p - shift, 0)
            if p <= end + after:  # (before the entries after the chunk)
                return end
            shift = after
        return p - shift

    def add(self, start: int, n_tokens: int, n_pos: int) -> None:
        """A chunk of ``n_tokens`` entries taking ``n_pos`` positions was appended at entry ``start``."""
        if n_pos != n_tokens:
            self.shift += n_pos - n_tokens
            self._marks.append((start, start + n_tokens, self.shift))

    def cut(self, n: int) -> None:
        """The list was cut back to its first ``n`` entries (never inside a chunk)."""
        if self.splits(n):
            raise InvalidArgumentError(f"entry {n} lies inside a media chunk")
        while self._marks and self._marks[-1][1] > n:
            self._marks.pop()
        self.shift = self._marks[-1][2] if self._marks else 0

    def clear(self) -> None:
        self._marks.clear()
        self.shift = 0

