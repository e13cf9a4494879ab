"""A chain that starts with top-k draws from the row's k largest logits alone (lcx_sampler_sample_top_k),
found in one pass, instead of from a candidate array of the whole vocabulary (llama_sampler_sample)."""

from __future__ import annotations

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.core.sampler import TOP_K_FIRST_MAX, Sampler, SamplingParams

PROMPTS = ["The history of the city of Rome begins", "Once upon a time, in a small village,",
           "def fibonacci(n):", "Ingredients: flour, sugar, eggs and"]

CASES = [(1, {}), (5, {}), (40, {}), (40, dict(temp=1.5, top_p=0.9, min_p=0.01)),
         (100, dict(temp=2.0, top_p=1.0, min_p=0.0)), (300, dict(temp=1.2, typical_p=0.9, xtc_probability=0.5))]


@pytest.mark.parametrize("which", ["tiny", pytest.param("gemma", marks=pytest.mark.gemma)])
def test_top_k_first_draws_what_the_whole_vocabulary_chain_draws(which, tiny_model, request):
    """Same seed, same options: every draw equals llama_sampler_sample's over the whole vocabulary, on rows
    whose k+1 largest logits are distinct (a tie there makes either choice right, and the order of tied
    candidates is the sort's own)."""
    model = tiny_model if which == "tiny" else request.getfixturevalue("gemma")
    checked, varied = 0, 0
    with lc.Context.create(model, n_ctx=256, n_threads=2) as ctx, ctx.lease() as lease:
        for prompt in PROMPTS:
            lease.prefill(model.tokenize(prompt), reuse=False)
            top = np.sort(np.array(lease.logits_view_fn()(-1)))[::-1]
            for k, opts in CASES:
                if len(np.unique(top[:k + 1])) < k + 1:
                    continue
                fast = Sampler(model, SamplingParams(top_k=k, seed=11, **{"temp": 1.0, **opts}))
                plain = Sampler(model, SamplingParams(top_k=k, seed=11, **{"temp": 1.0, **opts}))
                assert fast._top_k_first == k
                draw_fast, draw_plain = lease.sample_fn(fast._ptr, top_k=k), lease.sample_fn(plain._ptr)
                got = [draw_fast(-1) for _ in range(150)]
                assert got == [draw_plain(-1) for _ in range(150)], (prompt, k, opts)
                checked += 1
                varied += len(set(got)) > 2
                fast.close()
                plain.close()
    assert checked >= 12 and varied >= 3  # (the comparison ran, and on draws that differ)


def test_which_chains_take_the_top_k_path(tiny_model):
    """Only a chain whose first sampler is top-k: anything before it reads or changes every logit."""
    n_vocab = tiny_model.n_vocab

    def first(**opts) -> int:
        with Sampler(tiny_model, SamplingParams(**opts)) as sampler:
            return sampler._top_k_first

    assert first(temp=0.8, top_k=40) == 40
    assert first(temp=0.8, top_k=40, top_p=0.5, min_p=0.1, typical_p=0.9) == 40
    assert first(temp=0.8, top_k=0) == 0
    assert first(temp=0.8, top_k=n_vocab) == first(temp=0.8, top_k=n_vocab + 5) == 0
    # (past TOP_K_FIRST_MAX, or 1/32 of the vocabulary, the heap costs more than the candidate array)
    assert first(temp=0.8, top_k=min(TOP_K_FIRST_MAX, n_vocab // 32)) > 0
    assert first(temp=0.8, top_k=min(TOP_K_FIRST_MAX, n_vocab // 32) + 1) == 0
    assert first(temp=0.8, top_k=40, logit_bias={3: 2.0}) == 0
    assert first(temp=0.8, top_k=40, penalty_repeat=1.1) == 0
    assert first(temp=0.8, top_k=40, dry_multiplier=0.8) == 0
    assert first(temp=0.8, top_k=40, top_n_sigma=1.0) == 0
    assert first(temp=0.8, top_k=40, mirostat=2) == 0
    assert first(temp=0, top_k=40) == 0  # (greedy: an argmax)


def test_native_call_refuses_what_it_cannot_draw(tiny_model):
    """The adapter returns -1, never aborts, where llama_sampler_sample would assert."""
    lib = tiny_model._lib
    with lc.Context.create(tiny_model, n_ctx=256) as ctx, ctx.lease() as lease, \
            Sampler(tiny_model, SamplingParams(temp=1.0, top_k=8, seed=1)) as sampler:
        lease.prefill(tiny_model.tokenize("Hello"), reuse=False)
        for k in (0, -3, tiny_model.n_vocab + 1):
            assert lib.lcx_sampler_sample_top_k(sampler._ptr, lease._ptr, -1, k) == -1
        assert 0 <= lib.lcx_sampler_sample_top_k(sampler._ptr, lease._ptr, -1, 8) < tiny_model.n_vocab


def test_a_row_with_a_nan_logit_is_refused(tiny_model):
    """A NaN would break the heap's order (the row's largest logits silently left out): the draw raises
    DecodeError, and the same row draws again once the NaN is gone."""
    with lc.Context.create(tiny_model, n_ctx=256, n_threads=1) as ctx, ctx.lease() as lease, \
            Sampler(tiny_model, SamplingParams(temp=1.0, top_k=40, seed=3)) as sampler:
        tokens = tiny_model.tokenize("Once upon a time")
        for where in (3, 1000, tiny_model.n_vocab - 1):  # (among the first k, past them, the last id)
            lease.prefill(tokens, reuse=False)
            row = lease.logits_view_fn()(-1)
            row[where] = np.nan
            draw = lease.sample_fn(sampler._ptr, top_k=sampler._top_k_first)
            with pytest.raises(lc.DecodeError, match="not numbers"):
                draw(-1)
            row[where] = -np.inf
            assert 0 <= draw(-1) < tiny_model.n_vocab
