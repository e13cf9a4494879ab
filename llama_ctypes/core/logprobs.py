"""Log-probabilities of generated tokens (OpenAI's ``logprobs`` / ``top_logprobs``).

The values are the model's raw distribution: the log-softmax of the logits
row a token was sampled from, before temperature, penalties, logit bias or a
grammar reshape it. That is what llama-server's ``n_probs`` reports by default
and what OpenAI documents, and it does not depend on the sampling settings:
the same prompt gives the same values greedy or sampled.

Asked for (``post_sampling=True``), the values are instead those of the candidates the sampler
chain left (llama-server's ``post_sampling_probs``): after top-k/top-p/min-p and temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["TokenLogprob", "MAX_TOP_LOGPROBS", "log_softmax_top", "token_logprob", "post_sampling_logprob"]

#: Most alternatives per token (OpenAI's limit for ``top_logprobs``).
MAX_TOP_LOGPROBS = 20

# Block size of the top-k prefilter (see _top_ids).
_BLOCK = 256


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token with its log-probability (natural log, <= 0).

    ``bytes`` is the token's piece as the detokenizer emits it (a special token
    rendered as its text when the request renders specials; possibly part of a
    UTF-8 character). ``top`` holds the most likely alternatives at that step,
    by descending logprob (each with an empty ``top``); empty when only the
    chosen token's logprob was asked for (``logprobs=0``).
    """

    token: int
    bytes: bytes
    logprob: float
    top: tuple[TokenLogprob, ...] = ()

    @property
    def text(self) -> str:
        """``bytes`` as text (an incomplete UTF-8 character becomes U+FFFD)."""
        return self.bytes.decode("utf-8", errors="replace")


def _top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values of ``row``, by descending value; ties go to the smaller id
    (as argmax picks the first maximum, so greedy's token is ``top[0]`` even at a tie)."""
    n = row.size
    # Prefilter: the k-th largest of the block maxima bounds the k-th largest value from below (k
    # distinct blocks reach it), so every top-k value, ties included, is >= it. It leaves a few
    # candidates instead of a 262k-token argpartition (a fourth of the time).
    nb = n // _BLOCK * _BLOCK
    heads = np.concatenate((row[:nb].reshape(-1, _BLOCK).max(axis=1), row[nb:]))
    if heads.size > k:
        cand = np.flatnonzero(row >= np.partition(heads, heads.size - k)[heads.size - k])
    else:
        cand = np.arange(n)
    if cand.size > 4 * k:  # many ties at the bound (e.g. -inf logits): cut down before sorting
        vals = row[cand]
        cand = cand[vals >= vals[np.argpartition(vals, vals.size - k)[vals.size - k]]]
    return cand[np.lexsort((cand, -row[cand]))[:k]]


def log_softmax_top(logits: np.ndarray, token: int, k: int = 0) -> tuple[float, np.ndarray, np.ndarray]:
    """Log-softmax of one logits row at ``token``, and the ``k`` most likely tokens.

    ``logits``: the raw float32 row (n_vocab values). Returns ``(logprob, ids, logprobs)``:
    the chosen token's log-probability and the top-``k`` ids (int64) with theirs (float64),
    by descending probability. The log-sum-exp is taken in float64 after subtracting the
    maximum, so large logits cannot overflow; ``-inf`` logits (banned tokens) get ``-inf``.
    """
    row = np.asarray(logits)
    m = float(row.max())
    if m == -math.inf:  # no token is possible: every log-probability is -inf
        lse = math.inf
    else:
        shifted = np.subtract(row, m, dtype=np.float64)
        lse = m + math.log(float(np.exp(shifted, out=shifted).sum()))
    chosen = float(row[token]) - lse
    if k <= 0:
        return chosen, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    ids = _top_ids(row, min(k, row.size))
    return chosen, ids, row[ids].astype(np.float64) - lse


def token_logprob(logits: np.ndarray, token: int, k: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` sampled from ``logits`` (see :func:`log_softmax_top`).

    ``k``: alternatives to list (0 = none); ``piece(token) -> bytes`` renders a token.
    """
    chosen, ids, values = log_softmax_top(logits, token, k)
    top = tuple(TokenLogprob(t, piece(t), v) for t, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, piece(token), chosen, top)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def post_sampling_logprob(post: Any, k: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """The :class:`TokenLogprob` of a token from what the sampler chain left (a ``PostSampling``,
    ``core/sampler.py``): log-probabilities after truncation and temperature, up to ``k`` alternatives."""
    top = tuple(TokenLogprob(t, piece(t), _log(p)) for t, p in zip(post.ids[:k].tolist(), post.probs[:k].tolist()))
    return TokenLogprob(post.token, piece(post.token), _log(post.p), top)
