"""The slot pool: which sequence of the shared context serves which request, and what its KV holds.

Bookkeeping only, plus the two KV calls that go with it (forget a sequence).
The scheduler asks for a slot, the engine frees it; a freed slot's KV is
removed at once so the cells serve the next request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from .request import Request


@dataclass(eq=False)
class Slot:
    """One sequence (``seq_id``) of the server's context."""

    seq_id: int
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    last_used: int = 0
    session: Any = None
    sample: Callable[[int], int] | None = None  # the request's sampler, bound to the context

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def n_past(self) -> int:
        return len(self.tokens)


class SlotPool:
    """``n_parallel`` slots; allocation picks the least recently used free slot."""

    def __init__(self, n_parallel: int, forget: Callable[[int], None]):
        self.slots = [Slot(i) for i in range(n_parallel)]
        self._forget = forget  # removes a sequence's KV
        self._clock = itertools.count(1)

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if not s.free]

    @property
    def n_free(self) -> int:
        return sum(1 for s in self.slots if s.free)

    def acquire(self, request: Request) -> Slot | None:
        free = [s for s in self.slots if s.free]
        if not free:
            return None
        slot = min(free, key=lambda s: s.last_used)
        slot.request = request
        slot.session = request.session
        slot.last_used = next(self._clock)
        if slot.tokens:  # no prefix reuse yet: start the sequence empty
            self._forget(slot.seq_id)
            slot.tokens = []
        return slot

    def release(self, slot: Slot) -> None:
        """Free a slot and its KV at once."""
        slot.request = None
        slot.sample = None
        slot.last_used = next(self._clock)
        self._forget(slot.seq_id)
        slot.tokens = []
