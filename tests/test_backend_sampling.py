"""In-graph (backend) sampling: a sampler chain attached to a sequence runs inside llama_decode.

Invariants: greedy picks the same tokens as the CPU path; seeded sampling draws from the chain's
distribution (a chi-square test over many draws against the probabilities computed from the logits);
requests that sample in the graph and requests that cannot share a Server's ticks; the context never
keeps a chain after its binding or its lease let go of it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from margins import assert_greedy_equivalent

import llama_ctypes as lc
from llama_ctypes.core.batch import Batch
from llama_ctypes.core.context import Context
from llama_ctypes.core.params import ContextParams
from llama_ctypes.core.sampler import Sampler, SamplingParams
from llama_ctypes.errors import InvalidArgumentError

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture
def ctx(tiny_model):
    c = Context(tiny_model, ContextParams(n_ctx=512, n_seq_max=4, n_batch=64, n_ubatch=64))
    yield c
    c.close()


def _decode_prompt(lease, tokens: list[int], seq: int = 0) -> None:
    batch = Batch(64, 1)
    batch.add_sequence(tokens, 0, seq, output_last=True)
    lease.decode(batch)


@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_in_graph_greedy_picks_the_cpu_greedy_tokens(which, tiny_model, request):
    model = tiny_model if which == "tiny" else request.getfixturevalue("gemma")
    for prompt in PROMPTS[:2]:
        ref = lc.generate(model, prompt, temp=0, max_tokens=32, ignore_eos=True, logprobs=2)
        out = lc.generate(model, prompt, temp=0, max_tokens=32, ignore_eos=True, backend_sampling=True)
        # (the same logits either way: the graph's argmax can only differ from numpy's at an exact tie)
        assert_greedy_equivalent(out, ref, margin=1e-4, what=f"{which}: {prompt!r}")
        # with a logit bias, which runs in the graph too
        opts = dict(temp=0, max_tokens=24, ignore_eos=True, logit_bias={ref.tokens[0]: -5.0})
        assert lc.generate(model, prompt, backend_sampling=True, **opts).tokens == lc.generate(model, prompt,
                                                                                                **opts).tokens


@pytest.mark.parametrize("temp,top_k,top_p", [(4.0, 8, 1.0), (2.5, 0, 0.999)])
def test_seeded_in_graph_sampling_draws_from_the_chains_distribution(ctx, temp, top_k, top_p):
    """Many in-graph draws from one row, against the probabilities the chain gives it (exact, from the
    logits): chi-square at p = 0.001. The same test holds for the CPU path, and it can fail: the draws are
    not those of the same chain at temperature 1. (The tiny model's logits are steep: high temperatures
    give several tokens a real share.)"""
    prompt = ctx.model.vocab.tokenize("1, 2, 3", add_special=True)
    params = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=0.0, seed=1234, backend_sampling=True)
    with ctx.lease() as lease:
        _decode_prompt(lease, prompt)
        logits = lease.logits(-1).astype(np.float64)
        probs = _chain_probs(logits, temp, top_k, top_p)

        def draws(in_graph: bool, n: int) -> np.ndarray:
            sampler = Sampler(ctx.model, params)
            binding = sampler.bind(lease, seq=0 if in_graph else None)
            assert binding.in_graph is in_graph
            batch, out = Batch(8, 1), []
            try:
                for _ in range(n):  # (the last prompt token again, at its position: the same row each time)
                    lease.seq_rm(0, len(prompt) - 1, -1)
                    batch.clear()
                    batch.add(prompt[-1], len(prompt) - 1, 0, True)
                    lease.decode(batch)
                    out.append(binding.sample(0))
            finally:
                binding.release()
                sampler.close()
            return np.array(out)

        for in_graph in (True, False):
            got = draws(in_graph, 1500)
            assert set(got.tolist()) <= set(np.flatnonzero(probs).tolist()), "a token the chain excludes"
            stat, df = _chi_square(got, probs)
            assert stat < _CHI2_999[df], f"in_graph={in_graph}: chi2={stat:.1f} with {df} degrees of freedom"
        stat, df = _chi_square(got, _chain_probs(logits, 1.0, top_k, top_p))
        assert df >= 2 and stat > _CHI2_999[df]


def _chain_probs(logits: np.ndarray, temp: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities llama.cpp's top-k → top-p → temperature → dist chain draws from."""
    keep = np.ones_like(logits, dtype=bool)
    if top_k > 0:
        keep[:] = False
        keep[np.argsort(-logits, kind="stable")[:top_k]] = True
    if top_p < 1.0:  # (on the softmax of the raw logits, smallest set reaching top_p)
        p = np.exp(logits - logits[keep].max()) * keep
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        n = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        keep[:] = False
        keep[order[:n]] = True
    z = np.where(keep, logits / temp, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


# 99.9% quantiles of chi-square by degrees of freedom
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
             10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79,
             18: 42.31, 19: 43.82, 20: 45.31}


def _chi_square(draws: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 5 times (the rest pooled in one bin)."""
    n = len(draws)
    expected = probs * n
    big = np.flatnonzero(expected >= 5)[:20]
    counts = np.bincount(draws, minlength=len(probs))
    obs = [counts[big].astype(float)]
    exp = [expected[big]]
    rest_e = n - expected[big].sum()
    if rest_e >= 5:
        obs.append(np.array([n - counts[big].sum()], dtype=float))
        exp.append(np.array([rest_e]))
    o, e = np.concatenate(obs), np.concatenate(exp)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def test_what_the_graph_cannot_sample_falls_back_with_its_reason(ctx):
    cases = {"grammar": SamplingParams(grammar='root ::= "a"+', backend_sampling=True),
             "dry": SamplingParams(dry_multiplier=0.8, backend_sampling=True),
             "mirostat": SamplingParams(mirostat=2, backend_sampling=True),
             "xtc": SamplingParams(xtc_probability=0.5, backend_sampling=True),
             # (llama.cpp's penalties refuse the graph where a sequence may output several rows per decode)
             "penalties": SamplingParams(temp=0, penalty_repeat=1.2, backend_sampling=True)}
    with ctx.lease() as lease:
        for reason, params in cases.items():
            with Sampler(ctx.model, params) as sampler:
                binding = sampler.bind(lease, seq=1)
                assert (binding.in_graph, binding.fallback) == (False, reason)
                assert lease.in_graph_sequences == frozenset()
                binding.release()
        with Sampler(ctx.model, SamplingParams(backend_sampling=True)) as sampler:
            for kw, reason in ((dict(candidates=2), "post_sampling_probs"), (dict(blocker="logprobs"), "logprobs")):
                binding = sampler.bind(lease, seq=1, **kw)
                assert (binding.in_graph, binding.fallback) == (False, reason)
                binding.release()
            with pytest.raises(InvalidArgumentError):
                sampler.bind(lease, seq=9)  # (outside n_seq_max: refused before anything is attached)
            assert lease.in_graph_sequences == frozenset()
            binding = sampler.bind(lease, seq=1)  # (the claim was given back by the failed bind)
            assert binding.in_graph and lease.in_graph_sequences == {1}
            binding.release()
    # the one-call API: logprobs read the logits, so they sample as usual (and still agree)
    out = lc.generate(ctx.model, "Hello", temp=0, max_tokens=8, backend_sampling=True, logprobs=1)
    assert len(out.logprobs) == len(out.tokens) == 8


def test_the_context_never_keeps_a_chain_its_binding_or_lease_let_go(ctx):
    model = ctx.model
    prompt = model.vocab.tokenize("Hello world", add_special=True)
    row = len(prompt) - 1
    a = Sampler(model, SamplingParams(temp=0.8, seed=3, backend_sampling=True))
    b = Sampler(model, SamplingParams(temp=0.8, seed=3, backend_sampling=True))
    lease = ctx.lease()
    first = a.bind(lease, seq=0)
    with pytest.raises(lc.BusyError):  # one chain per sequence: a second would take the first's rows
        b.bind(lease, seq=0)
    second = b.bind(lease, seq=1)  # (its claim was given back: it binds elsewhere)
    assert lease.in_graph_sequences == {0, 1}
    _decode_prompt(lease, prompt)
    token = first.sample(row)
    # an in-graph row has no logits row (llama.cpp keeps the sampled candidates there): reading one raises
    assert not lease.has_logits(row)
    with pytest.raises(InvalidArgumentError, match="sampled inside the graph"):
        lease.logits(row)
    with pytest.raises(InvalidArgumentError, match="sampled inside the graph"):
        lease.logits_view_fn()(row)
    with Sampler(model, SamplingParams(temp=0)) as other:
        with pytest.raises(lc.IndexOutOfRangeError):
            other.sample(lease, row)
    first.release()
    assert lease.in_graph_sequences == {1}
    # a closed sampler is freed only when its binding lets go, after the chain was detached
    b.close()
    assert b.closed and not b._freed
    lease.release()  # the lease's end detaches what is left
    assert lease.in_graph_sequences == frozenset()
    second.release()  # (after the lease: nothing to detach, nothing to crash)
    assert b._freed
    # the sampler that sampled in the graph samples on the CPU path again, and binds in the graph again
    with ctx.lease() as fresh:
        assert fresh.in_graph_sequences == frozenset()
        fresh.clear()
        _decode_prompt(fresh, prompt)
        assert fresh.has_logits(row) and fresh.logits(row).shape == (model.n_vocab,)
        assert 0 <= a.sample(fresh, row) < model.n_vocab
        again = a.bind(fresh, seq=0)
        assert again.in_graph
        fresh.clear()
        _decode_prompt(fresh, prompt)
        assert 0 <= again.sample(row) < model.n_vocab
        again.release()
    a.close()
    with pytest.raises(lc.ClosedError):
        second.sample(0)
    # the same sampler through two one-call generations in a row, in the graph both times
    with Sampler(model, SamplingParams(temp=0.8, seed=5, backend_sampling=True)) as s:
        for _ in range(2):
            assert len(ctx.generate(s, prompt, max_tokens=8, ignore_eos=True).tokens) == 8
    assert token >= 0


def test_a_request_sent_back_to_the_queue_binds_its_sampler_again(tiny_model):
    """share_kv: a full pool sends a request with no output yet back to the queue, and its sampler is bound
    a second time when it runs (llama.cpp aborted the process on a chain attached twice)."""
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=128, n_batch=128, temp=0, ignore_eos=True,
                   share_kv=True, cache_prompt=False, backend_sampling=True) as server:
        first = server.stream("x", max_tokens=240)
        pieces = iter(first)
        while len(first.tokens) < 200:
            next(pieces)
        second = server.stream("y " * 80, max_tokens=5)
        assert len(first.completion().tokens) == 240
        assert len(second.completion().tokens) == 5
        assert server.stats()["in_graph_fallbacks"] == {}
        assert server.stats()["in_graph_requests"] == 2  # (counted once, though bound twice)


def test_a_server_mixes_in_graph_and_cpu_requests_in_one_tick(tiny_model):
    opts = dict(temp=0, max_tokens=24, ignore_eos=True, cache_prompt=False)
    with lc.Server(model=tiny_model, n_parallel=4, n_ctx=256) as server:
        refs = [server.stream(p, logprobs=2, **opts) for p in PROMPTS]
        refs = [s.completion() for s in refs]
        kinds = [dict(backend_sampling=True), dict(backend_sampling=True, logprobs=1),
                 dict(backend_sampling=True, grammar="root ::= [a-z ]+"), dict()]
        streams = [server.stream(p, **opts, **kind) for p, kind in zip(PROMPTS, kinds)]
        outs = [s.completion() for s in streams]
        stats = server.stats()
    for i in (0, 1, 3):  # the same batches as the reference run: the same greedy tokens
        assert_greedy_equivalent(outs[i], refs[i], what=f"request {i} ({kinds[i]})")
    assert outs[2].text and set(outs[2].text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert stats["in_graph_requests"] == 1
    assert stats["in_graph_fallbacks"] == {"logprobs": 1, "grammar": 1}
    assert stats["avg_busy_slots"] > 2  # (the four ran together)


def test_a_servers_default_and_cancel_and_close_with_chains_attached(tiny_model):
    server = lc.Server(model=tiny_model, n_parallel=2, n_ctx=256, backend_sampling=True, temp=0.8, seed=7)
    try:
        long = server.stream("Tell me a story", max_tokens=10_000, ignore_eos=True)
        next(iter(long))
        done = threading.Event()

        def cancel() -> None:
            long.cancel()
            done.set()

        threading.Thread(target=cancel).start()
        done.wait(10)
        with pytest.raises(lc.CancelledError):
            long.completion()
        out = server.generate("Once upon a time", max_tokens=16, ignore_eos=True)
        assert len(out.tokens) == 16
        assert server.stats()["in_graph_requests"] == 2 and server.stats()["active_slots"] == 0
        running = server.stream("Keep going", max_tokens=10_000, ignore_eos=True)
        next(iter(running))
    finally:
        server.close()  # (a request still sampling in the graph)
    with pytest.raises((lc.CancelledError, lc.ServerClosedError)):
        running.completion()
