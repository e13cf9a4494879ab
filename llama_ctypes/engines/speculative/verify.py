"""Verification of a draft: which drafted tokens the target keeps, and the token after them.

Two exact rules (both leave the output distribution equal to the target's own):

* **match** (``verify_by_sampling``): sample the target's token at each drafted position
  with the request's own sampler and keep drafts while they equal it. Every emitted token
  is the sampler's draw given exactly the accepted prefix, so any sampler works (grammar,
  penalties, mirostat, ...). Greedy is the special case "keep drafts while they are the
  argmax"; for a deterministic drafter (n-gram) it is also the speculative-sampling rule
  below with a one-hot q (accept x with probability p(x), else sample p without x).
* **speculative sampling** (``speculative_accept``; Leviathan et al. 2023, Chen et al.
  2023): for drafts sampled from the drafter's distribution q, accept draft x with
  probability min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q));
  when every draft is accepted, sample a bonus token from the next row of p. More drafts
  are accepted than by matching, but p must be known as numbers:
  ``target_distribution`` computes it in numpy for the samplers it can reproduce exactly
  (``numpy_supported``: temperature, top-k, top-p, min-p, logit bias), in llama.cpp's order.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ...core.sampler import SamplingParams

__all__ = ["numpy_supported", "target_distribution", "sample_from", "speculative_accept", "verify_by_sampling"]

ProbsOf = Callable[[int], np.ndarray]


def numpy_supported(params: SamplingParams) -> bool:
    """Whether :func:`target_distribution` reproduces the sampler of ``params`` exactly (temp > 0 only)."""
    penalties = params.penalty_last_n != 0 and (
        params.penalty_repeat != 1.0 or params.penalty_freq != 0 or params.penalty_present != 0)
    return (params.temp > 0 and params.grammar is None and not penalties and params.dry_multiplier == 0
            and params.mirostat == 0 and params.typical_p >= 1.0 and params.top_n_sigma <= 0
            and params.xtc_probability == 0 and params.dynatemp_range == 0 and params.adaptive_target < 0)


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities (float64, n_vocab) the llama.cpp chain of ``params`` samples from for ``logits``.

    The chain's order: logit bias, top-k, top-p and min-p on the untempered logits, then
    temperature, then softmax. Only for ``numpy_supported(params)``.
    """
    row = np.asarray(logits, dtype=np.float32)
    if params.logit_bias:
        row = row.copy()
        for tok, bias in params.logit_bias.items():
            if tok < row.size:
                row[tok] += bias
    n = row.size
    # Candidates as ids sorted by descending logit (ties: the smaller id first).
    k = params.top_k if 0 < params.top_k < n else n
    if k < n:
        cand = np.argpartition(-row, k - 1)[:k]
    else:
        cand = np.arange(n)
    cand = cand[np.lexsort((cand, -row[cand]))]
    vals = row[cand].astype(np.float64)
    finite = np.isfinite(vals)
    if not finite.all():  # banned tokens (-inf bias) never survive a softmax
        cand, vals = cand[finite], vals[finite]
    min_keep = params.min_keep
    if params.top_p < 1.0 and cand.size > 1:
        p = np.exp(vals - vals[0])
        p /= p.sum()
        cum = np.cumsum(p)
        # The first index where the running sum reaches top_p (float32 in llama.cpp; the
        # boundary token is kept), but never fewer than min_keep tokens.
        reach = np.flatnonzero((cum >= params.top_p) & (np.arange(1, cum.size + 1) >= min_keep))
        keep = int(reach[0]) + 1 if reach.size else cum.size
        cand, vals = cand[:keep], vals[:keep]
    if params.min_p > 0.0 and cand.size > 1:
        threshold = vals[0] + math.log(params.min_p)
        keep_mask = vals >= threshold
        keep_mask[:max(min_keep, 1)] = True
        cand, vals = cand[keep_mask], vals[keep_mask]
    z = (vals - vals[0]) / params.temp
    p = np.exp(z)
    p /= p.sum()
    out = np.zeros(n, dtype=np.float64)
    out[cand] = p
    return out


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn from ``probs`` (non-negative, any positive sum)."""
    cum = np.cumsum(probs)
    total = float(cum[-1])
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    i = int(np.searchsorted(cum, rng.random() * total, side="right"))
    return min(i, probs.size - 1)


def speculative_accept(p_of: ProbsOf, drafts: Sequence[int], q_rows: Sequence[np.ndarray] | None,
                       rng: np.random.Generator) -> tuple[int, int]:
    """The speculative-sampling rule over one draft: ``(n_accepted, next_token)``.

    ``p_of(i)``: the target's distribution at draft position ``i`` (after the prefix and
    ``drafts[:i]``), asked for lazily, up to ``len(drafts)`` (the bonus row). ``q_rows[i]``: the
    distribution ``drafts[i]`` was sampled from; None for a deterministic drafter (one-hot q).
    ``next_token`` is the correction at the first rejection, or the bonus token.
    """
    for i, x in enumerate(drafts):
        p = p_of(i)
        px = float(p[x])
        qx = 1.0 if q_rows is None else float(q_rows[i][x])
        if qx <= 0.0:  # not a draw from q (a drafter bug): accept as if q were one-hot
            qx = 1.0
        if rng.random() * qx < px:  # probability min(1, p/q)
            continue
        if q_rows is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - q_rows[i], 0.0)
        if not residual.sum() > 0:  # p == q (up to rounding): nothing left to correct with
            residual = p
        return i, sample_from(residual, rng)
    return len(drafts), sample_from(p_of(len(drafts)), rng)


def verify_by_sampling(sample: Callable[[int], int], drafts: Sequence[int]) -> tuple[int, list[int]]:
    """The match rule: ``(n_accepted, tokens)`` with ``tokens`` the accepted drafts plus the next token.

    ``sample(row)`` draws (and accepts into the sampler's state) the target's token from
    verification row ``row``; row ``i`` holds the distribution after ``drafts[:i]``.
    """
    out: list[int] = []
    for i, x in enumerate(drafts):
        tok = sample(i)
        out.append(tok)
        if tok != x:
            return i, out
    out.append(sample(len(drafts)))
    return len(drafts), out
