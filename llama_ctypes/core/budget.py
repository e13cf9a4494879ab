"""A token budget for a thinking model's reasoning block (llama.cpp's reasoning-budget sampler).

Counting starts when the model writes one of the block's start markers (or at the first token, when the
prompt leaves the block open). Once ``tokens`` tokens were generated inside the block, the next tokens are
not sampled but forced: an optional message, then the end marker of the block that opened; the model
answers after it. A block that ends by itself before the budget stops the count. Markers are matched as
token sequences, as llama.cpp does (a marker written in other pieces than its tokenization is not seen).

``ReasoningBudget`` is the immutable description (part of ``GenerationParams``); each generation runs its
own :class:`BudgetState`, which every runner (the single-sequence loop, the Server's ticks) asks before
each token (:meth:`BudgetState.forced`) and tells what it sampled (:meth:`BudgetState.seen`). A forced
token is not sampled: the runner has the sampler accept it (its history, penalties, a grammar that
allows it), so the sampler's state follows the text. As in llama.cpp, the end waits for an unfinished
UTF-8 character to complete, and a later block opens with a fresh budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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

    def start(self, vocab: Any = None) -> BudgetState:
        """A fresh state for one generation. With ``vocab`` (the model's :class:`~llama_ctypes.core.vocab.Vocab`)
        the ids are checked against it (TokenizationError) and the end is held back while a character is
        incomplete."""
        if vocab is not None:
            for start, end in self.markers:
                vocab.check_tokens(start)
                vocab.check_tokens(end)
            vocab.check_tokens(self.message)
            if self.open_end is not None:
                vocab.check_tokens(self.open_end)
        return BudgetState(self, None if vocab is None else (lambda t: vocab.token_bytes(t, True)))


_IDLE, _COUNTING, _FORCING = range(3)


def _unfinished(data: bytes) -> bytes:
    """The bytes at the end of ``data`` that begin a UTF-8 character not complete yet (b"" if none)."""
    for k in range(1, min(4, len(data)) + 1):
        b = data[-k]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        return data[-k:] if need > k else b""
    return b""


class BudgetState:
    """One generation's progress through its budget, asked by the runner for every token:
    :meth:`forced` first (a token to emit without sampling, which the runner then gives the sampler to
    accept), else the runner samples and reports the token with :meth:`seen`. Not thread-safe: one per
    generation, used by the thread that samples it (a Server's control goes through its scheduler thread).
    """

    __slots__ = ("budget", "_state", "_count", "_recent", "_end", "_queue", "_piece", "_tail", "n_forced")

    def __init__(self, budget: ReasoningBudget, token_bytes: Callable[[int], bytes] | None = None):
        self.budget = budget
        self._state = _COUNTING if budget.open_end is not None else _IDLE
        self._count = 0
        self._recent: list[int] = []  # the last tokens, for marker matching
        self._end = budget.open_end  # the end marker of the open block
        self._queue: list[int] = []
        self._piece = token_bytes
        self._tail = b""  # an unfinished character at the end of the output: the end waits for it
        self.n_forced = 0  # tokens forced so far

    @property
    def in_block(self) -> bool:
        """Inside a reasoning block (counting), or forcing its end."""
        return self._state != _IDLE

    def force_end(self) -> bool:
        """End the open block at the next token (llama-server's ``reasoning_end`` control): True when a
        block was open."""
        if self._state != _COUNTING:
            return False
        self._begin_forcing()
        return True

    def forced(self) -> int | None:
        """The token to emit next without sampling, or None (sample, then :meth:`seen`)."""
        if self._state == _COUNTING and self._count >= self.budget.tokens and not self._tail:
            self._begin_forcing()
        if self._state != _FORCING:
            return None
        tok = self._queue.pop(0)
        self.n_forced += 1
        if not self._queue:  # (the block is over; a later start marker opens a new one, with a new budget)
            self._state, self._recent, self._tail = _IDLE, [], b""
        return tok

    def seen(self, token: int) -> None:
        """A token the sampler drew and the runner emitted."""
        if self._piece is not None:
            self._tail = _unfinished(self._tail + self._piece(token))
        recent = self._recent
        recent.append(token)
        if len(recent) > 64:
            del recent[:-64]
        if self._state == _IDLE:
            for start, end in self.budget.markers:
                if self._ends_with(start):
                    self._state, self._end, self._count, self._recent = _COUNTING, end, 0, []
                    break
            return
        self._count += 1
        if self._end is not None and self._ends_with(self._end):
            self._state, self._recent = _IDLE, []  # (it ended by itself)

    def _ends_with(self, seq: tuple[int, ...]) -> bool:
        recent = self._recent
        return len(recent) >= len(seq) and tuple(recent[-len(seq):]) == seq

    def _begin_forcing(self) -> None:
        end = self._end if self._end is not None else self.budget.markers[0][1]
        self._queue = [*self.budget.message, *end]
        self._state = _FORCING
