"""Batching strategies: how one tick's token budget is split between decoding and prefilling.

Every tick the engine builds one batch of at most ``n_batch`` tokens. Decoding
slots need one token each; prefilling slots can take any number of their
remaining prompt tokens. A strategy only decides the split; it never touches
the model, so it is tested with plain numbers.

* :class:`DecodeMaximal` (default) — every decoding slot gets its token first;
  prompts fill what is left. Lowest inter-token latency for running requests.
* :class:`PrefillPriority` — prompts first, decoding with what is left. Highest
  throughput for batch jobs; running streams may pause while long prompts load.
* :class:`Balanced` — half the budget is reserved for prompts when they need it,
  decoding gets the rest, and leftovers go to whoever still wants them. A fair
  middle for mixed interactive and bulk traffic.
"""

from __future__ import annotations

from ...errors import ArgumentTypeError, InvalidArgumentError

from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """Which slots decode this tick, and how many prompt tokens each prefilling slot gets."""

    decode: list
    prefill: list  # (slot, n_tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class BatchStrategy(Protocol):
    def plan(self, decoding: Sequence[T], prefilling: Sequence[tuple[T, int]], budget: int) -> Plan:
        """Split ``budget`` tokens: ``decoding`` slots want 1 each, ``prefilling`` (slot, remaining) pairs
        want up to ``remaining``; both lists are in priority order."""
        ...


def _fill(prefilling: Sequence[tuple[T, int]], budget: int) -> tuple[list[tuple[T, int]], int]:
    out = []
    for slot, remaining in prefilling:
        if budget <= 0:
            break
        n = min(remaining, budget)
        if n > 0:
            out.append((slot, n))
            budget -= n
    return out, budget


class DecodeMaximal:
    """Decode tokens first; prompt chunks fill the rest of the budget."""

    def plan(self, decoding, prefilling, budget):
        decode = list(decoding[:budget])
        prefill, _ = _fill(prefilling, budget - len(decode))
        return Plan(decode, prefill)

    def __repr__(self) -> str:
        return "DecodeMaximal()"


class PrefillPriority:
    """Prompt chunks first; decode tokens get what is left."""

    def plan(self, decoding, prefilling, budget):
        prefill, left = _fill(prefilling, budget)
        return Plan(list(decoding[:left]), prefill)

    def __repr__(self) -> str:
        return "PrefillPriority()"


class Balanced:
    """Reserve ``prefill_share`` of the budget for prompts when they need it; the rest to decoding."""

    def __init__(self, prefill_share: float = 0.5):
        if not 0.0 < prefill_share < 1.0:
            raise InvalidArgumentError(f"prefill_share={prefill_share}: expected a value in (0, 1)")
        self.prefill_share = prefill_share

    def plan(self, decoding, prefilling, budget):
        want_prefill = sum(r for _, r in prefilling)
        reserve = min(want_prefill, int(budget * self.prefill_share))
        decode = list(decoding[: budget - reserve])
        prefill, _ = _fill(prefilling, budget - len(decode))
        return Plan(decode, prefill)

    def __repr__(self) -> str:
        return f"Balanced(prefill_share={self.prefill_share})"


def resolve(strategy) -> BatchStrategy:
    """Accept a strategy instance or class."""
    if isinstance(strategy, type):
        strategy = strategy()
    if not callable(getattr(strategy, "plan", None)):
        raise ArgumentTypeError(f"batch_strategy must be DecodeMaximal, PrefillPriority, Balanced or have plan(); "
                        f"got {strategy!r}")
    return strategy
