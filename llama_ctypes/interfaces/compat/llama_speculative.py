"""llama-cpp-python's ``llama_speculative``: prompt-lookup drafting (n-grams of the context itself)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LlamaDraftModel", "LlamaPromptLookupDecoding"]


class LlamaDraftModel:
    """The draft-model protocol: ``draft(input_ids) -> token ids`` to verify."""

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        raise NotImplementedError


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Proposes what followed the earliest earlier occurrence of the context's last n-gram (``max_ngram_size``
    down to 1 tokens), up to ``num_pred_tokens`` tokens."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10) -> None:
        for name, value in (("max_ngram_size", max_ngram_size), ("num_pred_tokens", num_pred_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens

    @staticmethod
    def find_candidate_pred_tokens(input_ids: np.ndarray, max_ngram_size: int, num_pred_tokens: int) -> np.ndarray:
        ids = np.asarray(input_ids).reshape(-1)
        n = ids.size
        for size in range(min(max_ngram_size, n - 1), 0, -1):
            tail = ids[n - size:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[:n - 1], size)  # (not the tail itself)
            for start in np.flatnonzero(np.all(windows == tail, axis=1)):
                begin = int(start) + size
                if begin < n:
                    return ids[begin:min(begin + num_pred_tokens, n)]
        return np.array([], dtype=np.intc)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        return self.find_candidate_pred_tokens(input_ids, self.max_ngram_size, self.num_pred_tokens)
