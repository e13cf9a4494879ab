"""A token budget for a thinking model's reasoning block (llama.cpp's reasoning-budget sampler).

Counting starts when the model writes one of the block's start markers (or at the first token, when the
prompt leaves the block open). Once ``tokens`` tokens were generated inside the block, the next tokens are
not sampled but forced: an optional message, then the end marker of the block that opened; the model
answers after it. A block that ends by itself before the budget stops the count. Markers are matched as
token sequences, as llama.cpp does (a marker written in other pieces than its tokenization is not seen).

``ReasoningBudget`` is the immutable description (part of ``GenerationParams``); each generation runs its
own :class:`BudgetState`, which every runner (the single-sequence loop, the Server's ticks) asks for
each token with :meth:`BudgetState.next`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ReasoningBudget", "BudgetState"]


def _seq(value: object, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ArgumentTypeError(f"{what}: expected a sequence of token ids")
    seq = tuple(value)  # type: ignore[call-overload]
    if not seq or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq):
        raise InvalidArgumentError(f"{what}: expected a non-empty sequence of token ids")
    return seq


@dataclass(frozen=True)
class ReasoningBudget:
    """At most ``tokens`` tokens inside a reasoning block (0: end it at once)."""

    tokens: int
    """The budget: tokens generated inside the block before its end is forced."""
    markers: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """(start, end) token sequences of each reasoning format the template may use."""
    message: tuple[int, ...] = ()
    """Tokens forced before the end marker when the budget is spent (llama-server's ``reasoning_budget_message``)."""
    open_end: tuple[int, ...] | None = None
    """The end marker of the block the prompt leaves open (counting starts at the first token), else None."""

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise InvalidArgumentError(f"reasoning budget tokens={self.tokens!r}: expected an integer >= 0")
        if not self.markers:
            raise InvalidArgumentError("a reasoning budget needs the start and end markers of at least one format")
        markers = tuple((_seq(s, "reasoning start marker"), _seq(e, "reasoning end marker")) for s, e in self.markers)
        object.__setattr__(self, "markers", markers)
        object.__setattr__(self, "message", tuple(self.message) and _seq(self.message, "reasoning budget message"))
        if self.open_end is not None:
            object.__setattr__(self, "open_end", _seq(self.open_end, "reasoning end marker"))

    def start(self) -> BudgetState:
        """A fresh state for one generation."""
        return BudgetState(self)


_IDLE, _COUNTING, _FORCING, _DONE = range(4)


class BudgetState:
    """One generation's progress through its budget. Not thread-safe: one per generation, used by the
    thread that samples it."""

    __slots__ = ("budget", "_state", "_count", "_recent", "_end", "_queue", "forced")

    def __init__(self, budget: ReasoningBudget):
        self.budget = budget
        self._state = _COUNTING if budget.open_end is not None else _IDLE
        self._count = 0
        self._recent: list[int] = []  # the last tokens, for marker matching
        self._end = budget.open_end  # the end marker of the open block
        self._queue: list[int] = []
        self.forced = 0  # tokens forced so far

    @property
    def done(self) -> bool:
        """The block ended (by itself or forced): every later token passes unchanged."""
        return self._state == _DONE

    def force_end(self) -> bool:
        """End the open block now (llama-server's ``reasoning_end`` control): True when a block was open."""
        if self._state != _COUNTING:
            return False
        self._begin_forcing()
        return True

    def next(self, sampled: int) -> int:
        """The token to emit in place of ``sampled`` (itself, unless the end is being forced)."""
        state = self._state
        if state == _DONE:
            return sampled
        if state == _FORCING:
            return self._pop()
        if state == _COUNTING and self._count >= self.budget.tokens:
            self._begin_forcing()
            return self._pop()
        self._recent.append(sampled)
        if len(self._recent) > 64:
            del self._recent[:-64]
        if state == _IDLE:
            for start, end in self.budget.markers:
                if self._ends_with(start):
                    self._state, self._end, self._count, self._recent = _COUNTING, end, 0, []
                    break
            return sampled
        self._count += 1
        if self._end is not None and self._ends_with(self._end):
            self._state = _DONE  # (it ended by itself)
        return sampled

    def _ends_with(self, seq: tuple[int, ...]) -> bool:
        recent = self._recent
        return len(recent) >= len(seq) and tuple(recent[-len(seq):]) == seq

    def _begin_forcing(self) -> None:
        end = self._end if self._end is not None else self.budget.markers[0][1]
        self._queue = [*self.budget.message, *end]
        self._state = _FORCING

    def _pop(self) -> int:
        tok = self._queue.pop(0)
        self.forced += 1
        if not self._queue:
            self._state = _DONE
        return tok
