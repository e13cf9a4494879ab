"""The speculative token loop: draft, verify in one target decode, roll back, emit.

The target context holds every emitted token but the last (``pending``): each step
decodes ``[pending] + drafts`` with a logits row per token, keeps the drafts the
verifier accepts, cuts the rejected ones off the KV cache (and recurrent state), and
emits the accepted tokens plus the verifier's next token, which becomes ``pending``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from ...core.context import ContextLease
from ...core.generation import FinishReason, GenerationParams, Timings, read_prompt
from ...core.logprobs import TokenLogprob, token_logprob
from ...core.sampler import SamplingParams
from .drafters import Drafter
from .stats import StatsRecorder
from .verify import sample_from, speculative_accept, target_distribution, verify_by_sampling

__all__ = ["Verifier", "MatchVerifier", "SamplingVerifier", "SpecRun", "speculative_loop", "rollback"]

log = logging.getLogger(__name__)


class Verifier(Protocol):
    def first(self) -> int:
        """The token after the prompt, from the prefill's last logits row."""

    def draft(self, drafter: Drafter, context: Sequence[int], k: int) -> list[int]:
        """Ask ``drafter`` for up to ``k`` tokens, as this rule needs them."""

    def verify(self, drafts: list[int]) -> tuple[int, list[int]]:
        """``(n_accepted, tokens)``: accepted drafts plus the next token, from rows 0..len(drafts)."""


class MatchVerifier:
    """Keep drafts while they equal what the request's own sampler draws (exact for any sampler)."""

    def __init__(self, sample: Callable[[int], int]) -> None:
        self._sample = sample

    def first(self) -> int:
        return self._sample(-1)

    def draft(self, drafter: Drafter, context: Sequence[int], k: int) -> list[int]:
        return drafter.draft(context, k)

    def verify(self, drafts: list[int]) -> tuple[int, list[int]]:
        return verify_by_sampling(self._sample, drafts)


class SamplingVerifier:
    """Speculative sampling (min(1, p/q), residual on rejection) over drafts drawn from q."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator,
                 logits_of: Callable[[int], np.ndarray]) -> None:
        self._params, self._rng, self._logits_of = params, rng, logits_of
        self._q: list[np.ndarray] = []

    def _p(self, row: int) -> np.ndarray:
        return target_distribution(self._logits_of(row), self._params)

    def first(self) -> int:
        return sample_from(self._p(-1), self._rng)

    def draft(self, drafter: Drafter, context: Sequence[int], k: int) -> list[int]:
        drafts, self._q = drafter.draft_sampled(context, k, self._params, self._rng)
        return drafts

    def verify(self, drafts: list[int]) -> tuple[int, list[int]]:
        m, tok = speculative_accept(self._p, drafts, self._q[:len(drafts)], self._rng)
        return m, drafts[:m] + [tok]


class SpecRun:
    """What one speculative generation reports to the layers above."""

    def __init__(self, logprobs: bool) -> None:
        self.finish_reason: FinishReason | None = None
        self.eog_token: int | None = None
        self.timings = Timings()
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None


def rollback(lease: ContextLease, keep: int) -> None:
    """Bring sequence 0 back to its first ``keep`` tokens (KV, recurrent state, ``tokens``)."""
    if lease.truncate(keep) and lease.prefix_complete(0, keep):
        return
    # The memory could not cut back (too few recurrent snapshots, or window cells already
    # reused): recompute the kept tokens. Correct, but it costs a prefill.
    log.debug("speculative rollback to %d tokens recomputes the sequence", keep)
    lease.prefill(lease.tokens[:keep], reuse=True)


def speculative_loop(lease: ContextLease, verifier: Verifier, drafter: Drafter, prompt: list[int],
                     params: GenerationParams, n_draft: int, run: SpecRun, recorder: StatsRecorder,
                     cancelled: Callable[[], bool] = lambda: False) -> Iterator[int]:
    """Yield generated token ids; the caller holds the target (``lease``), the sampler and the drafter.

    Tokens come in bursts (one per accepted draft, plus one), each yielded before the next
    decode starts. ``cancelled()`` is checked after every token.
    """
    clock = time.perf_counter
    t0 = clock()
    timings = run.timings
    timings.prompt_tokens = len(prompt)
    timings.cached_tokens = read_prompt(lease, prompt, params)
    t_mark = clock()
    timings.prompt_ms = (t_mark - t0) * 1e3
    recorder.add(calls=1, prefill_s=t_mark - t0)
    ctx = lease.ctx
    vocab = ctx.vocab
    eog_get, is_eog = vocab.eog_cache().get, vocab.is_eog
    held, tokens = lease.tokens, run.tokens
    max_tokens, n_ctx, ignore_eos = params.max_tokens, ctx.n_ctx_seq, params.ignore_eos
    entry = _logprob_fn(lease, params) if params.logprobs is not None else None
    entries = run.logprobs
    decode_s = sample_s = 0.0
    t_first = None
    try:
        ts = clock()
        pending = [verifier.first()]
        t_first = clock()
        sample_s += t_first - ts
        timings.ttft_ms = (t_first - t0) * 1e3
        # Logprobs are read off the rows before the next decode replaces them.
        pending_lp = [entry(-1, pending[0])] if entry is not None else []
        while True:
            for j, tok in enumerate(pending):
                if not ignore_eos:
                    eog = eog_get(tok)
                    if eog is None:
                        eog = is_eog(tok)
                    if eog:
                        run.finish_reason, run.eog_token = "eog", tok
                        return
                if entries is not None:
                    entries.append(pending_lp[j])
                tokens.append(tok)
                timings.generated_tokens = len(tokens)
                now = clock()
                recorder.add(tokens_emitted=1, decode_s=now - t_mark)
                t_mark = now
                yield tok
                # (the context test mirrors token_loop's: the same lengths end both)
                if len(tokens) == max_tokens or len(prompt) + len(tokens) - 1 >= n_ctx:
                    run.finish_reason = "length"
                    return
                if cancelled():
                    return
            last = pending[-1]
            k = min(n_draft, n_ctx - len(held) - 1)
            if max_tokens > 0:
                k = min(k, max_tokens - len(tokens) - 1)  # more could never be emitted
            ts = clock()
            drafts = verifier.draft(drafter, held + [last], k) if k > 0 else []
            t_drafted = clock()
            if drafts:
                drafts = vocab.check_tokens(drafts[:k]).tolist()  # a drafter's bug must not reach llama.cpp
            n_before = len(held)
            lease.decode_run([last] + drafts)
            t_decoded = clock()
            m, pending = verifier.verify(drafts)
            if entry is not None:
                pending_lp = [entry(row, tok) for row, tok in enumerate(pending)]
            t_verified = clock()
            if m < len(drafts):
                rollback(lease, n_before + 1 + m)
            drafter.accept(m)
            decode_s += t_decoded - t_drafted
            sample_s += t_verified - t_decoded
            recorder.add(iterations=1, drafted=len(drafts), accepted=m, draft_s=t_drafted - ts)
    finally:
        recorder.add(decode_s=clock() - t_mark)
        if t_first is not None:
            timings.generation_ms = (clock() - t_first) * 1e3
            timings.decode_ms = decode_s * 1e3
            timings.sample_ms = sample_s * 1e3


def _logprob_fn(lease: ContextLease, params: GenerationParams) -> Callable[[int, int], TokenLogprob]:
    """``(row, token) -> TokenLogprob`` over the last decode's logits (the model's raw distribution)."""
    logits_of, k, special = lease.logits_view_fn(), params.logprobs or 0, params.special
    token_bytes = lease.ctx.vocab.token_bytes

    def piece(token: int) -> bytes:
        return token_bytes(token, special)

    return lambda row, token: token_logprob(logits_of(row), token, k, piece)
