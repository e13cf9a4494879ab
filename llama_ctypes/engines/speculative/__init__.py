"""Speculative decoding of one sequence: a drafter proposes tokens, the target verifies them in one decode.

``drafters`` (DraftModel, NgramDraft: the per-sequence ``draft``/``accept``/``reset``
interface), ``mtp`` (MTPDraft: the model's own multi-token-prediction head, and MTP),
``verify`` (the exact acceptance rules), ``loop`` (draft, verify, roll back, emit), ``stats``
(counters and events), ``session`` (SpeculativeSession and its streams).
"""

from .drafters import DraftModel, Drafter, NgramDraft
from .mtp import MTP, MTPDraft
from .session import MAX_DRAFT, SpeculativeEventStream, SpeculativeSession, SpeculativeStream
from .stats import SpeculativeEvent, SpeculativeStats

__all__ = ["SpeculativeSession", "SpeculativeStream", "SpeculativeEventStream", "SpeculativeEvent",
           "SpeculativeStats", "Drafter", "DraftModel", "NgramDraft", "MTP", "MTPDraft", "MAX_DRAFT"]
