"""``Llama(draft_model=...)``: llama-cpp-python's draft-model protocol as one of our drafters.

llama-cpp-python calls ``draft_model(input_ids)`` (every token held so far, a numpy array) and verifies
what it returns against the model in one decode. Here the callable becomes a :class:`Drafter` of a
:class:`SpeculativeSession`, whose verification keeps greedy output equal to the model's own.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from ...core.model import Model
from ...engines.speculative.drafters import Drafter
from ...engines.speculative.session import MAX_DRAFT
from ...errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["CallableDraft", "draft_length"]

logger = logging.getLogger(__name__)

#: llama-cpp-python's LlamaPromptLookupDecoding default (num_pred_tokens): drafted tokens per step.
DEFAULT_DRAFT = 10


def draft_length(draft_model: Any, n_ubatch: int) -> int:
    """Tokens drafted per step: the draft model's ``num_pred_tokens`` (10 if it has none), at most what one
    verification micro-batch holds (``n_ubatch - 1``) and :data:`MAX_DRAFT`."""
    n = getattr(draft_model, "num_pred_tokens", DEFAULT_DRAFT)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        n = DEFAULT_DRAFT
    n = min(n, MAX_DRAFT, n_ubatch - 1)
    if n < 1:
        raise InvalidArgumentError(f"draft_model needs n_ubatch >= 2 (a verification batch holds the drafts "
                                   f"and one more token); got n_ubatch={n_ubatch}")
    return n


class CallableDraft(Drafter):
    """A llama-cpp-python draft model (``LlamaDraftModel`` or any callable ``input_ids -> token ids``).

    What it returns is cut at ``k`` and at the first value that is not a token id of the model (so a
    faulty draft model can only waste a step, never reach llama.cpp with a bad token). An exception
    raised by it propagates to the call, as in llama-cpp-python.
    """

    def __init__(self, draft_model: Any) -> None:
        if not callable(draft_model):
            raise ArgumentTypeError(f"draft_model must be a LlamaDraftModel (a callable input_ids -> token ids), "
                                    f"not {type(draft_model).__name__}")
        self.draft_model = draft_model
        self._n_vocab = 0

    def __repr__(self) -> str:
        return f"CallableDraft({self.draft_model!r})"

    def attach(self, model: Model, n_draft: int, ctx_opts: dict[str, Any], target: Any = None) -> None:
        self._n_vocab = model.n_vocab

    def draft(self, context_tokens: Sequence[int], k: int) -> list[int]:
        proposed = self.draft_model(np.asarray(context_tokens, dtype=np.intc))
        out: list[int] = []
        for value in np.asarray(proposed).reshape(-1)[:k]:
            if not isinstance(value, (int, np.integer)) or not 0 <= int(value) < self._n_vocab:
                logger.debug("draft_model proposed %r: not a token id of the model; drafts cut there", value)
                break
            out.append(int(value))
        return out
