"""Counters of a speculative session, and the events of ``stream_events``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["SpeculativeStats", "SpeculativeEvent", "StatsRecorder"]


@dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """Cumulative counters of a :class:`SpeculativeSession` (every call since its creation).

    Times are seconds. An immutable snapshot: ``session.stats()`` is safe to read from
    any thread while a stream runs.
    """

    calls: int = 0
    """Generations started."""
    iterations: int = 0
    """Draft-and-verify steps (one target decode each)."""
    drafted: int = 0
    """Tokens the drafter proposed."""
    accepted: int = 0
    """Proposed tokens the target kept."""
    tokens_emitted: int = 0
    """Tokens generated (what the streams yielded, end-of-generation tokens excluded)."""
    prefill_s: float = 0.0
    """Prompt processing time of the target."""
    decode_s: float = 0.0
    """Generation time after the prefill: drafting, verifying, sampling."""
    draft_s: float = 0.0
    """Part of ``decode_s`` spent in the drafter."""

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0.0 before the first draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation (prefill excluded)."""
        return self.tokens_emitted / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_decode(self) -> float:
        """Generated tokens per target decode, the prefill counted as one (plain decoding: about 1.0)."""
        decodes = self.iterations + self.calls
        return self.tokens_emitted / decodes if decodes else 0.0


class StatsRecorder:
    """The one writer of a session's counters; readers take :attr:`snapshot` (a reference swap, no lock)."""

    def __init__(self) -> None:
        self.snapshot = SpeculativeStats()

    def add(self, **deltas: float) -> None:
        s = self.snapshot
        self.snapshot = dataclasses.replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})


EventKind = Literal["token", "stats", "eog", "done"]


@dataclass(frozen=True, slots=True)
class SpeculativeEvent:
    """One item of ``session.stream_events(...)``; ``kind`` says which fields matter.

    * ``"token"``: ``token`` was generated; ``text`` is the text it released (possibly
      empty: a partial UTF-8 character or a possible stop-string prefix is held back).
    * ``"stats"``: every ``emit_stats_every`` tokens, ``stats`` is the session's snapshot.
    * ``"eog"``: generation ended at end-of-generation token ``token`` (not in the output).
    * ``"done"``: the last event: ``finish_reason``, final ``stats``, and in ``text`` whatever
      text was still held back. The ``text`` of all events, in order, is the completion.
    """

    kind: EventKind
    token: int | None = None
    text: str = ""
    stats: SpeculativeStats | None = None
    finish_reason: str | None = None
