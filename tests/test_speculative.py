"""Speculative decoding: greedy identity with plain decoding, the exact sampling rules, rollback of
rejected drafts (KV and recurrent state), lifetimes across threads, and bad input."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.engines.speculative.drafters import ngram_lookup
from llama_ctypes.engines.speculative.verify import (numpy_supported, speculative_accept, target_distribution,
                                                     verify_by_sampling)
from margins import assert_greedy_equivalent, assert_same_greedy, tops
from tiny_models import write_perturbed_copy, write_tiny_llama

# One thread: the test machine's cores are shared, and spinning ggml threads then crawl.
CTX = dict(n_ctx=512, n_threads=1)
PROMPTS = ["Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]


def plain(model, prompt, **opts):
    return lc.generate(model, prompt, **{**CTX, **opts})


class OracleDraft(lc.Drafter):
    """Drafts a known continuation with every ``wrong_every``-th drafted token corrupted:
    acceptance and rejection on demand, through the public Drafter interface."""

    def __init__(self, prompt_len: int, continuation: list[int], n_vocab: int, wrong_every: int = 3):
        self.prompt_len, self.ref, self.n_vocab, self.wrong_every = prompt_len, continuation, n_vocab, wrong_every
        self.calls = self.accepted = 0
        self.started = self.finished = 0

    def start(self):
        self.started += 1

    def finish(self):
        self.finished += 1

    def draft(self, context_tokens, k):
        pos = len(context_tokens) - self.prompt_len
        out = []
        for i, tok in enumerate(self.ref[pos:pos + k]):
            self.calls += 1
            out.append((tok + 1) % self.n_vocab if self.calls % self.wrong_every == 0 else tok)
        return out

    def accept(self, n_accepted):
        self.accepted += n_accepted


@pytest.fixture(scope="module")
def tiny_drafter(tiny_model, tmp_path_factory):
    # 1% noise on every matrix: about half the drafted tokens are what the target picks
    path = write_perturbed_copy(tiny_model.path, tmp_path_factory.mktemp("spec") / "draft.gguf", scale=0.01)
    model = lc.load_model(path)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hybrid_drafter(tiny_hybrid, tmp_path_factory):
    path = write_perturbed_copy(tiny_hybrid.path, tmp_path_factory.mktemp("spec") / "hybrid-draft.gguf",
                                scale=0.003)
    model = lc.load_model(path)
    yield model
    model.close()


def assert_kv_consistent(session, prompt_tokens, out_tokens):
    """The target holds a prefix of prompt + output, and its KV holds exactly ctx.tokens."""
    ctx = session.context
    held = ctx.tokens
    assert held == (prompt_tokens + out_tokens)[:len(held)]
    assert len(held) >= len(prompt_tokens) + len(out_tokens) - 1
    assert ctx.seq_pos_max(0) + 1 == len(held)


# ---- greedy identity -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_greedy_identity_tiny(tiny_model, tiny_drafter, kind):
    drafter = lc.DraftModel(tiny_drafter) if kind == "draft" else lc.NgramDraft()
    emitted = 0
    with lc.SpeculativeSession(tiny_model, drafter, n_draft=4, **CTX) as s:
        for prompt in PROMPTS:
            ref = plain(tiny_model, prompt, temp=0, max_tokens=48)
            out = s.generate(prompt, temp=0, max_tokens=48)
            assert out.tokens == ref.tokens and str(out) == str(ref)
            assert out.finish_reason == ref.finish_reason
            assert_kv_consistent(s, tiny_model.tokenize(prompt), out.tokens)
            emitted += len(out.tokens)
        stats = s.stats()
    assert stats.calls == len(PROMPTS) and stats.tokens_emitted == emitted
    if kind == "draft":  # partly rejected drafts: the rollback path ran
        assert stats.accepted > 0 and stats.rejected > 0
        assert stats.tokens_per_decode > 1.0


def test_rollback_with_oracle_drafter(tiny_model):
    prompt = PROMPTS[0]
    ids = tiny_model.tokenize(prompt)
    ref = plain(tiny_model, prompt, temp=0, max_tokens=40, ignore_eos=True)
    oracle = OracleDraft(len(ids), ref.tokens, tiny_model.n_vocab)
    with lc.SpeculativeSession(tiny_model, oracle, n_draft=5, **CTX) as s:
        out = s.generate(prompt, temp=0, max_tokens=40, ignore_eos=True)
        stats = s.stats()
        assert_kv_consistent(s, ids, out.tokens)
    assert out.tokens == ref.tokens
    assert stats.accepted == oracle.accepted > 0 and stats.rejected > 0
    assert oracle.started == oracle.finished == 1


def test_greedy_identity_hybrid(tiny_hybrid, hybrid_drafter):
    """A hybrid (recurrent + attention) target rolls rejected drafts back through recurrent snapshots."""
    for drafter in (lc.DraftModel(hybrid_drafter), lc.NgramDraft()):
        with lc.SpeculativeSession(tiny_hybrid, drafter, n_draft=4, **CTX) as s:
            for prompt in PROMPTS[:2]:
                ref = plain(tiny_hybrid, prompt, temp=0, max_tokens=48)
                assert s.generate(prompt, temp=0, max_tokens=48).tokens == ref.tokens
            stats = s.stats()
        if isinstance(drafter, lc.DraftModel):
            assert stats.accepted > 0 and stats.rejected > 0
            # the draft model (hybrid too) drafts from its exact state: a cut past its last decode
            # once restored a stale recurrent snapshot, and acceptance fell to about 0.2
            assert stats.acceptance_rate > 0.6


def test_hybrid_without_snapshots_recomputes(tiny_hybrid, caplog):
    """n_rs_seq=0: the recurrent state cannot cut back, so the kept tokens are recomputed; still exact."""
    caplog.set_level("DEBUG", logger="llama_ctypes.engines.speculative.loop")
    prompt = PROMPTS[1]
    ids = tiny_hybrid.tokenize(prompt)
    ref = plain(tiny_hybrid, prompt, temp=0, max_tokens=24, ignore_eos=True)
    oracle = OracleDraft(len(ids), ref.tokens, tiny_hybrid.n_vocab)
    with lc.SpeculativeSession(tiny_hybrid, oracle, n_draft=4, n_rs_seq=0, **CTX) as s:
        out = s.generate(prompt, temp=0, max_tokens=24, ignore_eos=True)
        assert_kv_consistent(s, ids, out.tokens)
        assert s.stats().rejected > 0
    assert out.tokens == ref.tokens
    assert "recomputes the sequence" in caplog.text


def test_recurrent_prefix_reuse_never_restores_a_stale_snapshot(tiny_hybrid):
    """llama.cpp keeps a recurrent-state snapshot per token of the LAST decode only, yet accepts any
    cut of up to n_rs_seq tokens. A cut reaching past the last decode (here: into tokens decoded one
    at a time) restored an older batch's snapshot and the next call continued from a wrong state."""
    prompt = PROMPTS[1]
    ids = tiny_hybrid.tokenize(prompt)
    ref = plain(tiny_hybrid, prompt, temp=0, max_tokens=20, ignore_eos=True)
    # plain generation on a context with snapshots: 3 tokens, then the same prompt again (cut 3 back)
    ctx = lc.Context.create(tiny_hybrid, n_rs_seq=4, **CTX)
    sampler = lc.Sampler.create(tiny_hybrid, temp=0)
    try:
        assert ctx.generate(sampler, ids, max_tokens=3, ignore_eos=True, cache_prompt=True).tokens == ref.tokens[:3]
        again = ctx.generate(sampler, ids, max_tokens=20, ignore_eos=True, cache_prompt=True)
        assert again.tokens == ref.tokens
    finally:
        sampler.close()
        ctx.close()
    # a session with cache_prompt: its last step decoded one token, the next call cuts further back
    with lc.SpeculativeSession(tiny_hybrid, lc.NgramDraft(), n_draft=4, **CTX) as s:
        assert s.generate(prompt, temp=0, max_tokens=2, ignore_eos=True, cache_prompt=True).tokens == ref.tokens[:2]
        out = s.generate(prompt, temp=0, max_tokens=20, ignore_eos=True, cache_prompt=True)
        assert out.tokens == ref.tokens
        assert_kv_consistent(s, ids, out.tokens)


def test_recurrent_truncate_only_within_the_last_decode(tiny_hybrid):
    """ContextLease.truncate on a recurrent state: exact inside the last decode_run, refused beyond it
    (and a second cut before the next decode), never silently wrong."""
    ids = tiny_hybrid.tokenize(PROMPTS[0])
    ctx = lc.Context.create(tiny_hybrid, n_rs_seq=4, n_outputs_max=5, **CTX)
    try:
        with ctx.lease() as lease:
            lease.prefill(ids, reuse=False)
            lease.decode_run([10, 11, 12, 13])
            assert lease.truncate(len(ids) + 2)          # drop 2 of the run's 4: a snapshot exists
            assert not lease.truncate(len(ids) + 1)      # one rollback per decode (llama.cpp: pending)
            assert lease.tokens == ids + [10, 11]
            lease.append_fn()(12)                        # a 1-token decode: no snapshot behind it
            assert not lease.truncate(len(ids) + 2)
            assert not lease.seq_rm(0, len(ids) + 2, -1)  # nor through the general cut
            assert lease.tokens == ids + [10, 11, 12] and lease.seq_pos_max(0) + 1 == len(lease.tokens)
            lease.decode_run([13, 14])
            assert not lease.truncate(len(ids) + 3)      # 2 back = before this 2-token run
            assert lease.truncate(len(ids) + 4)
            assert lease.tokens == ids + [10, 11, 12, 13]
            lease.decode_run([20])
            got = lease.logits(-1)
        with ctx.lease() as lease:
            lease.prefill(ids + [10, 11, 12, 13, 20], reuse=False)
            want = lease.logits(-1)
        # the rolled-back state is the exact one (batch shapes round apart by ~1e-3; a stale state: ~90)
        np.testing.assert_allclose(got, want, rtol=0, atol=0.05)
    finally:
        ctx.close()


def test_decode_run_refuses_bad_input_without_losing_the_sequence(tiny_model):
    """Unknown ids (llama.cpp refuses them only inside the decode) and a run past the context window
    raise before anything runs: the sequence and its token list stay as they were."""
    ids = tiny_model.tokenize(PROMPTS[0])
    ctx = lc.Context.create(tiny_model, n_ctx=256, n_threads=1, n_outputs_max=4)
    try:
        with ctx.lease() as lease:
            lease.prefill(ids, reuse=False)
            for bad in ([-5], [tiny_model.n_vocab], [2**40], [5, True]):
                with pytest.raises((lc.TokenizationError, lc.ArgumentTypeError)):
                    lease.decode_run(bad)
            lease.prefill(ids + [7] * (256 - len(ids) - 2), reuse=True)
            with pytest.raises(lc.ContextOverflowError):
                lease.decode_run([7, 7, 7])
            assert lease.tokens == ids + [7] * (256 - len(ids) - 2)
            assert lease.seq_pos_max(0) + 1 == len(lease.tokens)
            lease.decode_run([7, 7])  # exactly full
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def gemma_exact(gemma_path):
    # Without repacked weights this machine's CPU matmul of a 5-row verification batch rounds like
    # five 1-row decodes (the repacked q4_K GEMM does not, which can flip near-tied argmaxes). Other
    # CPUs (AVX-512, AMX, ...) and GPUs pick other kernels per batch width: see assert_greedy_equivalent.
    model = lc.load_model(gemma_path, use_extra_bufts=False)
    yield model
    model.close()


GEMMA_GROUNDED = ("<start_of_turn>user\nCopy this list exactly, then stop: apple, banana, cherry, date, "
                  "elderberry, fig, grape, honeydew, kiwi, lemon, mango<end_of_turn>\n<start_of_turn>model\n")


def test_assert_greedy_equivalent_rejects_real_divergence():
    """The Gemma check tolerates a near-tie flip and nothing else."""
    def entry(tok, alts):
        return lc.TokenLogprob(tok, b"", alts[0][1], tuple(lc.TokenLogprob(t, b"", v) for t, v in alts))

    class Run:
        def __init__(self, tokens, logprobs=None, finish_reason="length"):
            self.tokens, self.logprobs, self.finish_reason = tokens, logprobs, finish_reason

    ref = Run([1, 2, 3], [entry(1, [(1, -0.1), (9, -3.0)]), entry(2, [(2, -0.69), (7, -0.70)]),
                          entry(3, [(3, -0.2), (4, -2.0)])])
    assert_greedy_equivalent(Run([1, 2, 3]), ref)
    assert_greedy_equivalent(Run([1, 7, 5]), ref)  # near tie at 1: anything may follow
    for bad in ([9, 2, 3], [1, 2, 4], [1, 8, 3], [1, 2]):  # clear margins, not the runner-up, a prefix
        with pytest.raises(AssertionError):
            assert_greedy_equivalent(Run(bad), ref)


@pytest.mark.gemma
def test_greedy_identity_gemma(gemma_exact, gemma):
    prompts = [GEMMA_GROUNDED, "The capital of France is"]
    opts = dict(temp=0, max_tokens=48, ignore_eos=True)
    refs = [plain(gemma_exact, p, logprobs=3, n_ctx=1024, **opts) for p in prompts]
    # n-gram: grounded output is drafted from the prompt; a free continuation is partly rejected
    with lc.SpeculativeSession(gemma_exact, lc.NgramDraft(), n_draft=4, **{**CTX, "n_ctx": 1024}) as s:
        for p, ref in zip(prompts, refs):
            assert_greedy_equivalent(s.generate(p, **opts), ref)
        stats = s.stats()
    assert stats.accepted > 0 and stats.rejected > 0
    # a second Model object of the same file: the full vocabulary check runs, and passes
    with lc.SpeculativeSession(gemma_exact, lc.DraftModel(gemma), n_draft=4, **{**CTX, "n_ctx": 1024}) as s:
        for p, ref in zip(prompts, refs):
            assert_greedy_equivalent(s.generate(p, **opts), ref)
        assert s.stats().acceptance_rate > 0.5


# ---- sampling -------------------------------------------------------------------------------

def test_seeded_sampling_reproducible(tiny_model, tiny_drafter):
    opts = dict(temp=0.9, seed=1234, max_tokens=40, ignore_eos=True)
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, **CTX) as s:
        a, b = s.generate(PROMPTS[0], **opts), s.generate(PROMPTS[0], **opts)
        c = s.generate(PROMPTS[0], **{**opts, "seed": 99})
        assert s.stats().drafted > 0
    assert a.tokens == b.tokens and str(a) == str(b)
    assert c.tokens != a.tokens


def test_each_call_starts_with_a_cold_draft_context(tiny_model, tiny_drafter):
    """Without cache_prompt the draft context starts empty, like the target's: a seeded call's draft
    distributions (hence its tokens, under speculative sampling) must not depend on what the previous
    call left there, whose prefix reuse decodes in other batch shapes (which round apart)."""
    drafter = lc.DraftModel(tiny_drafter)
    with lc.SpeculativeSession(tiny_model, drafter, n_draft=4, **CTX) as s:
        s.generate(PROMPTS[0], temp=0, max_tokens=10)
        assert drafter.context.tokens  # what the first call left
        st = s.stream(PROMPTS[2], temp=0.9, seed=3, max_tokens=10)
        next(st)  # the first token comes from the prefill: nothing was drafted yet
        assert drafter.context.tokens == []
        st.close()
        s.generate(PROMPTS[0], temp=0, max_tokens=10)
        st = s.stream(PROMPTS[0], temp=0, max_tokens=10, cache_prompt=True)
        next(st)
        assert drafter.context.tokens  # cache_prompt keeps it, as it keeps the target's
        st.close()


@pytest.mark.gemma
def test_seeded_speculative_sampling_reproduces_within_a_session(gemma):
    # (a quantized draft model: its batched and 1-row decodes round apart, so a warm draft context
    # gave other draft distributions, and other tokens, on the second call)
    draft = lc.load_model(gemma.path)
    try:
        prompt = "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n"
        with lc.SpeculativeSession(gemma, lc.DraftModel(draft), n_draft=4, **{**CTX, "n_ctx": 512}) as s:
            runs = [s.generate(prompt, temp=0.9, seed=1, max_tokens=40).tokens for _ in range(3)]
    finally:
        draft.close()
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_deterministic_drafter_sampling_equals_plain(tiny_model):
    """With match verification every token is the request sampler's own draw: the same seed gives
    plain sampling's tokens exactly, for any sampler (here with penalties and a grammar)."""
    cases = [dict(temp=0.8, seed=7), dict(temp=0.8, seed=7, penalty_repeat=1.3, top_k=0),
             dict(temp=0.7, seed=3, grammar='root ::= [a-z ]+ "."')]
    with lc.SpeculativeSession(tiny_model, lc.NgramDraft(), n_draft=3, **CTX) as s:
        for opts in cases:
            ref = plain(tiny_model, PROMPTS[1], max_tokens=32, **opts)
            assert s.generate(PROMPTS[1], max_tokens=32, **opts).tokens == ref.tokens


def test_grammar_with_draft_model_sampling(tiny_model, tiny_drafter):
    # not reproducible in numpy: the draft model drafts greedily and the request's sampler verifies
    opts = dict(temp=0.8, seed=11, grammar='root ::= [a-z ]+ "."', max_tokens=32)
    assert not numpy_supported(lc.SamplingParams(temp=0.8, grammar='root ::= "a"'))
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, **CTX) as s:
        out = s.generate(PROMPTS[0], **opts)
    assert out.tokens == plain(tiny_model, PROMPTS[0], **opts).tokens


def _frequencies(samples, n):
    return np.bincount(np.asarray(samples), minlength=n) / len(samples)


@pytest.mark.parametrize("with_q", [True, False])
def test_speculative_sampling_rule_matches_target(with_q):
    """Emitted tokens follow p whatever q proposes (Leviathan et al.): first token ~ p0; the second,
    given a first accepted draft, ~ p1 (the synthetic p does not depend on the prefix)."""
    rng = np.random.default_rng(0)
    n, trials = 8, 20000
    p = [rng.dirichlet(np.ones(n)) for _ in range(3)]
    q = [rng.dirichlet(np.ones(n) * 0.5) for _ in range(2)]
    first, second = [], []
    for _ in range(trials):
        if with_q:
            drafts = [int(rng.choice(n, p=q[0])), int(rng.choice(n, p=q[1]))]
            m, tok = speculative_accept(lambda i: p[i], drafts, q, rng)
        else:  # a deterministic drafter (one-hot q) proposing each row's likeliest token
            drafts = [int(p[0].argmax()), int(p[1].argmax())]
            m, tok = speculative_accept(lambda i: p[i], drafts, None, rng)
        emitted = drafts[:m] + [tok]
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
    assert np.abs(_frequencies(first, n) - p[0]).max() < 0.02
    assert len(second) > 2000 and np.abs(_frequencies(second, n) - p[1]).max() < 0.03


def test_target_distribution_matches_llama_cpp_sampler(tiny_model):
    """numpy's p (top-k, top-p, min-p, temperature, in llama.cpp's order) is what the native chain samples."""
    params = lc.SamplingParams(temp=1.5, top_k=12, top_p=0.9, min_p=0.02, seed=5)
    ctx = lc.Context.create(tiny_model, **CTX)
    sampler = lc.Sampler(tiny_model, params)
    try:
        with ctx.lease() as lease:
            lease.prefill(tiny_model.tokenize("Hello there"), reuse=False)
            logits = lease.logits(-1)
            draws = [sampler.sample(lease, -1) for _ in range(6000)]
    finally:
        sampler.close()
        ctx.close()
    p = target_distribution(logits, params)
    assert set(np.flatnonzero(p)) >= set(draws)
    assert np.abs(_frequencies(draws, p.size) - p).max() < 0.025


def test_verify_by_sampling_and_ngram_lookup():
    row_tokens = {0: 5, 1: 6, 2: 9}
    assert verify_by_sampling(row_tokens.__getitem__, [5, 6]) == (2, [5, 6, 9])
    assert verify_by_sampling(row_tokens.__getitem__, [5, 7]) == (1, [5, 6])
    assert verify_by_sampling(row_tokens.__getitem__, []) == (0, [5])
    toks = np.array([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert ngram_lookup(toks, 3, 1, 4) == [7, 8, 1]  # the latest earlier "1 2 3"
    assert ngram_lookup(np.array([4, 5, 6]), 3, 1, 4) == []


# ---- streams, events, reuse --------------------------------------------------------------------

def test_stream_events_and_text(tiny_model, tiny_drafter):
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, **CTX) as s:
        ref = s.generate(PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True)
        events = list(s.stream_events(PROMPTS[0], emit_stats_every=8, temp=0, max_tokens=30, ignore_eos=True))
        pieces = list(s.stream(PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True))
        eos = tiny_model.vocab.eos
        eog = list(s.stream_events(PROMPTS[0], temp=0, logit_bias={eos: 100.0}))
    kinds = [e.kind for e in events]
    assert kinds.count("token") == 30 and kinds.count("stats") == 3 and kinds[-1] == "done"
    assert [e.token for e in events if e.kind == "token"] == ref.tokens
    assert "".join(e.text for e in events) == str(ref) == "".join(pieces)
    assert events[-1].finish_reason == "length" and events[-1].stats.tokens_emitted == 60
    stats_seen = [e.stats.tokens_emitted for e in events if e.kind == "stats"]
    assert stats_seen == sorted(stats_seen) and stats_seen[0] >= 30 + 8
    assert [e.kind for e in eog] == ["eog", "done"] and eog[0].token == eos and eog[1].finish_reason == "eog"


def test_stop_logprobs_and_prompt_cache(tiny_model, tiny_drafter):
    # Verification batches round apart from one-row decodes: outputs agree up to a near tie (margins.py).
    full = plain(tiny_model, PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True, logprobs=2)
    stop = str(full).split()[len(str(full).split()) // 2]
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, **CTX) as s:
        stopped = s.generate(PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True, stop=[stop])
        n = assert_same_greedy(stopped.tokens, full.tokens, tops(full.logprobs), allow_prefix=True)
        upto = len(lc.Tokenizer.decode(tiny_model, full.tokens[:n]))
        if upto > str(full).index(stop):  # (no near tie before the stop string)
            assert stopped.finish_reason == "stop" and str(stopped) == str(full)[:str(full).index(stop)]
        lp = s.generate(PROMPTS[0], temp=0, max_tokens=12, logprobs=2)
        ref_lp = plain(tiny_model, PROMPTS[0], temp=0, max_tokens=12, logprobs=2)
        assert [e.token for e in lp.logprobs] == lp.tokens
        n = assert_greedy_equivalent(lp, ref_lp)
        assert np.allclose([e.logprob for e in lp.logprobs[:n]], [e.logprob for e in ref_lp.logprobs[:n]], atol=1e-3)
        first = s.generate(PROMPTS[2], temp=0, max_tokens=20, cache_prompt=True, logprobs=2)
        again = s.generate(PROMPTS[2], temp=0, max_tokens=20, cache_prompt=True)
    assert again.timings.cached_tokens > 0
    assert_greedy_equivalent(again, first, what="cached vs cold")


def test_context_limit_ends_like_plain(tiny_model, tiny_drafter):
    opts = dict(temp=0, max_tokens=-1, ignore_eos=True, n_ctx=48, n_threads=1)
    ref = lc.generate(tiny_model, PROMPTS[1], **opts)
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, n_ctx=48, n_threads=1) as s:
        out = s.generate(PROMPTS[1], temp=0, max_tokens=-1, ignore_eos=True)
    assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason == "length"


def test_stats_from_another_thread(tiny_model, tiny_drafter):
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, **CTX) as s:
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "out", s.generate(PROMPTS[0], temp=0, max_tokens=300, ignore_eos=True)))
        worker.start()
        seen, took = [], []
        while worker.is_alive():
            t0 = time.perf_counter()
            st = s.stats()
            took.append(time.perf_counter() - t0)
            seen.append(st.tokens_emitted)
            time.sleep(0.0005)
        worker.join()
        final = s.stats()
    assert final.tokens_emitted == 300 == len(result["out"].tokens)
    assert any(0 < n < 300 for n in seen) and seen == sorted(seen)
    assert float(np.median(took)) < 0.0005  # a snapshot read, never a wait for the decode


def test_cancel_from_another_thread(tiny_model, tiny_drafter):
    # a context far longer than the time the cancel takes to arrive
    with lc.SpeculativeSession(tiny_model, lc.DraftModel(tiny_drafter), n_draft=4, n_ctx=2048, n_threads=1) as s:
        st = s.stream(PROMPTS[0], temp=0, max_tokens=-1, ignore_eos=True)
        next(st)
        threading.Timer(0.05, st.cancel).start()
        with pytest.raises(lc.CancelledError):
            for _ in st:
                pass
        assert st.cancelled
        # everything was released: the session serves the next call
        assert len(s.generate(PROMPTS[1], temp=0, max_tokens=5, ignore_eos=True).tokens) == 5
        # a dropped stream releases too
        for i, _ in enumerate(s.stream(PROMPTS[0], temp=0, max_tokens=50, ignore_eos=True)):
            if i == 3:
                break
        assert len(s.generate(PROMPTS[1], temp=0, max_tokens=5, ignore_eos=True).tokens) == 5


def test_close_session_while_streaming(tiny_model, tiny_drafter):
    drafter = lc.DraftModel(tiny_drafter)
    s = lc.SpeculativeSession(tiny_model, drafter, n_draft=4, **CTX)
    st = s.stream(PROMPTS[0], temp=0, max_tokens=40, ignore_eos=True)
    next(st)
    s.close()  # the stream holds both contexts: it runs to its end, then they are freed
    assert not s.context.freed and not drafter.context.freed
    out = st.completion()
    assert len(out.tokens) == 40 and out.finish_reason == "length"
    assert s.context.freed and drafter.context.freed
    for call in (lambda: s.generate("x"), lambda: s.stream("x"), lambda: s.stream_events("x")):
        with pytest.raises(lc.ClosedError):
            call()

    # closed from another thread while this one iterates: no crash, nothing used after free
    s2 = lc.SpeculativeSession(tiny_model, lc.NgramDraft(), n_draft=4, **CTX)
    st2 = s2.stream(PROMPTS[0], temp=0, max_tokens=200, ignore_eos=True)
    closer = threading.Timer(0.02, s2.close)
    closer.start()
    assert len(st2.completion().tokens) == 200
    closer.join()
    assert s2.closed and s2.context.freed


def test_busy_while_streaming(tiny_model):
    with lc.SpeculativeSession(tiny_model, lc.NgramDraft(), **CTX) as s:
        st = s.stream(PROMPTS[0], temp=0, max_tokens=20)
        next(st)
        with pytest.raises(lc.BusyError):
            s.generate(PROMPTS[0], temp=0, max_tokens=5)
        st.close()
        assert s.generate(PROMPTS[0], temp=0, max_tokens=5)


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("n_draft", [0, 33, True, 2.5, "4"])
def test_bad_n_draft(tiny_model, n_draft):
    with pytest.raises(lc.InvalidArgumentError, match="n_draft"):
        lc.SpeculativeSession(tiny_model, lc.NgramDraft(), n_draft=n_draft, **CTX)


def test_bad_options(tiny_model):
    with pytest.raises(lc.InvalidArgumentError, match="embeddings"):
        lc.SpeculativeSession(tiny_model, lc.NgramDraft(), embeddings=True, **CTX)
    with pytest.raises(lc.ArgumentTypeError):
        lc.SpeculativeSession(tiny_model, object(), **CTX)  # type: ignore[arg-type]
    with pytest.raises(lc.ArgumentTypeError):
        lc.SpeculativeSession(tiny_model, lc.NgramDraft(), bogus=1)
    with pytest.raises(lc.InvalidArgumentError):
        lc.NgramDraft(n_min=0)
    with pytest.raises(lc.InvalidArgumentError):
        lc.NgramDraft(n_min=3, n_max=2)
    with lc.SpeculativeSession(tiny_model, lc.NgramDraft(), **CTX) as s:
        with pytest.raises(lc.InvalidArgumentError, match="emit_stats_every"):
            s.stream_events("x", emit_stats_every=0)
        with pytest.raises(lc.ArgumentTypeError):
            s.generate("x", n_ctx=64)  # context options belong to the session
        with pytest.raises(lc.InvalidArgumentError, match="empty"):
            s.generate([])


def test_drafter_with_another_vocabulary(tiny_model, vocab_dir, tmp_path):
    with lc.load_model(tiny_model.path, vocab_only=True) as again:  # another Model of the same file
        assert tiny_model.vocab.same_as(again.vocab) and again.vocab.difference(tiny_model.vocab) is None
    other = write_tiny_llama(tmp_path / "phi3-vocab.gguf", vocab_dir / "ggml-vocab-phi-3.gguf")
    renamed = write_perturbed_copy(tiny_model.path, tmp_path / "renamed.gguf", scale=0.0,
                                   token_edits={1000: "<not-ied>"})
    for path, message in ((other, "32064 vs 32000 tokens"), (renamed, "token 1000")):
        with lc.load_model(path, vocab_only=True) as loaded:
            assert not tiny_model.vocab.same_as(loaded.vocab) and message in tiny_model.vocab.difference(loaded.vocab)
        drafter = lc.DraftModel(path)
        with pytest.raises(lc.InvalidArgumentError, match=message):
            lc.SpeculativeSession(tiny_model, drafter, **CTX)
        assert drafter.context is None  # nothing half-built
        drafter.close()
        assert drafter.model.closed  # loaded from a path: owned and closed with the drafter


def test_draft_model_serves_one_session(tiny_model, tiny_drafter):
    drafter = lc.DraftModel(tiny_drafter)
    with lc.SpeculativeSession(tiny_model, drafter, **CTX):
        with pytest.raises(lc.InvalidArgumentError, match="already serves"):
            lc.SpeculativeSession(tiny_model, drafter, **CTX)
    with pytest.raises(lc.ClosedError):
        lc.SpeculativeSession(tiny_model, drafter, **CTX)  # closed with its session


@pytest.mark.parametrize("finish", ["read", "break"])
def test_a_dropped_stream_is_freed_without_the_cycle_collector(tiny_model, finish):
    # what a stream's run holds (tokens, pieces, the context and drafter references) goes with the stream
    import gc
    import weakref

    with lc.SpeculativeSession(tiny_model, lc.NgramDraft(), n_draft=3, **CTX) as s:
        gc.disable()
        try:
            st = s.stream("Once upon a time", max_tokens=6, temp=0, ignore_eos=True)
            if finish == "read":
                list(st)
            else:
                next(st)
            run, stream = weakref.ref(st._g), weakref.ref(st)
            del st
            assert stream() is None and run() is None
        finally:
            gc.enable()
        assert s.generate("Once upon a time", max_tokens=4, temp=0, ignore_eos=True).tokens  # the session is free
