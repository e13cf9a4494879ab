"""Speculative decoding inside the batching Server: drafts ride in each tick's batch next to the other
slots' tokens, the request's own sampler verifies them, and rejected drafts are cut off that slot's
KV (and recurrent state) alone. The invariant: every request's output is what the server gives
without speculation, whatever the other slots do."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
from fake_kv import FakeKV
from margins import assert_greedy_equivalent
from test_scheduler import EOG, FakeSampler, Letters, items, plan
from test_speculative import GEMMA_GROUNDED
from tiny_models import write_perturbed_copy, write_tiny_llama

import llama_ctypes as lc
from llama_ctypes.core.generation import GenerationParams
from llama_ctypes.core.text import TextAssembler
from llama_ctypes.engines.server.request import Channel, Request, Status
from llama_ctypes.engines.server.scheduler import SKIPPED, Scheduler
from llama_ctypes.engines.server.slots import SlotPool
from llama_ctypes.engines.server.strategies import DecodeMaximal

SRV = dict(n_ctx=256, n_threads=1, kv_unified=False)
PROMPTS = ["Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4",
           "The quick brown fox jumps over the lazy dog. The quick brown fox", "a b c a b c a b"]


# ---- the scheduler with synthetic outputs ------------------------------------------------------

def make(n_parallel=2, budget=16, n_ctx=64, n_draft=4, partial=True):
    kv = FakeKV(partial=partial)
    pool = SlotPool(n_parallel, kv, unified=True, partial_reuse=True)
    return Scheduler(pool, DecodeMaximal(), budget, n_ctx, is_eog=lambda t: t == EOG, n_draft=n_draft), kv


def req(prompt, *, max_tokens=16, speculative=True, ignore_eos=False, stop=()):
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=ignore_eos, cache_prompt=False, stop=stop)
    return Request(list(prompt), params, FakeSampler(), Channel(), text=TextAssembler(Letters(), params.stop),
                   speculative=speculative)


def prefill(sched, first_token):
    p = plan(sched)
    sched.update_from_output(p, [first_token] * p.n_outputs)


def test_drafts_ride_in_the_step_and_rejected_ones_are_cut():
    s, kv = make(n_parallel=1)
    r = req([1, 2, 3])
    s.submit(r)
    prefill(s, 4)
    assert r.generated == [4]
    (ask,) = s.draft_asks()
    assert ask.context == [1, 2, 3, 4] and ask.k == 4
    r.draft = [5, 6, 7, 8]
    p = s.schedule()
    (step,) = p.steps
    assert step.tokens == [4, 5, 6, 7, 8] and step.sample == (0, 1, 2, 3, 4) and step.n_draft == 4
    assert r.draft == []  # consumed
    # rows: 5 and 6 agree with the drafts, then 9 (not 7): the rest was not sampled
    s.update_from_output(p, [5, 6, 9, SKIPPED, SKIPPED])
    assert r.generated == [4, 5, 6, 9]
    assert s.pool.slots[0].tokens == [1, 2, 3, 4, 5, 6]
    assert kv.calls[-1] == ("truncate", 0, 6)
    assert (r.drafted, r.accepted, s.drafted, s.accepted) == (4, 2, 4, 2)
    assert r.timings().draft_tokens == 4 and r.timings().draft_accepted == 2


def test_all_drafts_accepted_keeps_every_token_and_adds_the_bonus():
    s, kv = make(n_parallel=1)
    r = req([1, 2])
    s.submit(r)
    prefill(s, 3)
    s.draft_asks()
    r.draft = [4, 5]
    p = s.schedule()
    n_calls = len(kv.calls)
    s.update_from_output(p, [4, 5, 6])
    assert r.generated == [3, 4, 5, 6] and s.pool.slots[0].tokens == [1, 2, 3, 4, 5]
    assert len(kv.calls) == n_calls  # nothing to cut


def test_draft_length_respects_max_tokens_context_and_budget():
    s, _ = make(n_parallel=2, budget=6, n_ctx=10)
    a, b = req([1, 2, 3], max_tokens=3), req([1, 2], max_tokens=50)
    s.submit(a)
    s.submit(b)
    prefill(s, 4)
    asks = {ask.seq_id: ask for ask in s.draft_asks()}
    assert asks[0].k == 1  # two more tokens may be emitted: the pending one's successor and one more
    assert asks[1].k == 4  # n_draft
    a.draft, b.draft = [5], [6, 7, 8, 9]
    p = s.schedule()
    # the budget (6) holds 2 pending tokens and 4 drafts: b's draft is cut to 3
    assert [st.n_draft for st in p.steps] == [1, 3] and p.n_tokens == 6
    s.update_from_output(p, [5, 6, 6, 7, 8, 1])
    assert a.status is Status.FINISHED and a.generated == [4, 5, 6] and a.finish_reason == "length"
    # context bound: b holds 2 prompt + ... tokens; drafts never pass the slot's n_ctx
    for _ in range(3):
        asks = s.draft_asks()
        if not asks:
            break
        (ask,) = asks
        assert len(ask.context) + ask.k <= 10
        b.draft = [0] * ask.k
        p = s.schedule()
        s.update_from_output(p, [0] * ask.k + [1])
    assert b.status is Status.FINISHED and b.finish_reason == "length"
    assert len(s.pool.slots[1].tokens) <= 10 if s.pool.slots[1].request else True


def test_eog_inside_a_draft_ends_the_request_there():
    s, _ = make(n_parallel=1)
    r = req([1, 2])
    s.submit(r)
    prefill(s, 3)
    s.draft_asks()
    r.draft = [4, EOG, 6]
    p = s.schedule()
    s.update_from_output(p, [4, EOG, SKIPPED, SKIPPED])
    assert r.generated == [3, 4] and r.finish_reason == "eog"
    assert "".join(x for x in items(r) if isinstance(x, str)) == "de"


def test_opted_out_and_prefilling_requests_get_no_draft():
    s, _ = make(n_parallel=2)
    a, b = req([1, 2], speculative=False), req([1, 2, 3])
    s.submit(a)
    s.submit(b)
    assert s.draft_asks() == []  # both still prefilling
    prefill(s, 4)
    (ask,) = s.draft_asks()
    assert ask.request is b


def test_a_memory_that_cannot_cut_back_fails_only_that_request():
    s, _ = make(n_parallel=1, partial=False)
    r = req([1, 2])
    s.submit(r)
    prefill(s, 3)
    s.draft_asks()
    r.draft = [4, 5]
    s.update_from_output(s.schedule(), [9, SKIPPED, SKIPPED])
    assert r.status is Status.FAILED
    assert isinstance(items(r)[-1], lc.LlamaError)
    assert s.pool.slots[0].free and s.pool.slots[0].tokens == []


def test_no_drafts_without_speculation():
    s, _ = make(n_parallel=1, n_draft=0)
    r = req([1, 2])
    s.submit(r)
    prefill(s, 3)
    assert s.draft_asks() == []


# ---- a real model -------------------------------------------------------------------------------

class OracleSlots(lc.Drafter):
    """Drafts each prompt's known continuation, corrupting every ``wrong_every``-th drafted token:
    acceptance and rejection on demand, with no per-sequence state (one drafter serves every slot)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], n_vocab: int, wrong_every: int = 3):
        self.refs, self.n_vocab, self.wrong_every = refs, n_vocab, wrong_every
        self.calls = 0
        self.lock = threading.Lock()

    def draft(self, context_tokens, k):
        for prompt, ref in self.refs.items():
            if tuple(context_tokens[:len(prompt)]) == prompt:
                pos = len(context_tokens) - len(prompt)
                out = []
                for tok in ref[pos:pos + k]:
                    with self.lock:
                        self.calls += 1
                        wrong = self.calls % self.wrong_every == 0
                    out.append((tok + 1) % self.n_vocab if wrong else tok)
                return out
        return []


def server_runs(model, prompts, *, concurrent=True, **opts):
    """Each prompt's Completion from one server, all submitted together (or one by one)."""
    server_opts = {k: opts.pop(k) for k in ("speculative", "n_draft", "n_parallel", "n_ctx", "n_batch", "n_ubatch",
                                            "n_outputs_max")
                   if k in opts}
    server_opts.setdefault("n_parallel", len(prompts))
    with lc.Server(model=model, **{**SRV, **server_opts}) as srv:
        if concurrent:
            streams = [srv.stream(p, **opts) for p in prompts]
            outs = [s.completion() for s in streams]
        else:
            outs = [srv.generate(p, **opts) for p in prompts]
        return outs, srv.stats()


def references(model, prompts, **opts):
    outs, _ = server_runs(model, prompts, **opts)
    return outs


@pytest.fixture(scope="module")
def tiny_draft_model(tiny_model, tmp_path_factory):
    path = write_perturbed_copy(tiny_model.path, tmp_path_factory.mktemp("srvspec") / "draft.gguf", scale=0.01)
    model = lc.load_model(path)
    yield model
    model.close()


def test_greedy_identity_oracle_tiny(tiny_model):
    """Partly rejected drafts in 4 concurrent slots: every output equals the server's own without speculation."""
    opts = dict(temp=0, max_tokens=40, ignore_eos=True)
    refs = references(tiny_model, PROMPTS, **opts)
    oracle = OracleSlots({tuple(tiny_model.tokenize(p)): r.tokens for p, r in zip(PROMPTS, refs)}, tiny_model.n_vocab)
    outs, stats = server_runs(tiny_model, PROMPTS, speculative=oracle, n_draft=5, **opts)
    for out, ref in zip(outs, refs):
        assert out.tokens == ref.tokens and str(out) == str(ref) and out.finish_reason == ref.finish_reason
        assert out.timings.draft_tokens > out.timings.draft_accepted > 0
    assert stats["draft_tokens"] > stats["draft_accepted"] > 0
    assert stats["draft_acceptance"] == stats["draft_accepted"] / stats["draft_tokens"]
    assert stats["ticks"] < sum(len(r.tokens) for r in refs) // len(PROMPTS) + 10  # fewer ticks than tokens


def test_greedy_identity_draft_model_tiny(tiny_model, tiny_draft_model):
    opts = dict(temp=0, max_tokens=48)
    refs = references(tiny_model, PROMPTS, **opts)
    outs, stats = server_runs(tiny_model, PROMPTS, speculative=lc.DraftModel(tiny_draft_model), n_draft=4, **opts)
    assert [o.tokens for o in outs] == [r.tokens for r in refs]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in refs]
    assert stats["draft_tokens"] > stats["draft_accepted"] > 0


def test_greedy_identity_ngram_and_cache_hits(tiny_model):
    """N-gram drafts; a second round of the same prompts hits the prefix cache and gives the same tokens."""
    opts = dict(temp=0, max_tokens=40)
    refs = references(tiny_model, PROMPTS, **opts)
    with lc.Server(model=tiny_model, n_parallel=2, speculative=lc.NgramDraft(), n_draft=4, **SRV) as srv:
        for _ in range(2):
            streams = [srv.stream(p, **opts) for p in PROMPTS]  # 4 requests, 2 slots: a queue
            assert [s.completion().tokens for s in streams] == [r.tokens for r in refs]
        assert srv.stats()["cache_hits"] > 0


def test_greedy_identity_hybrid(tiny_hybrid, tmp_path_factory):
    """Recurrent state rolled back per sequence through llama.cpp's snapshots, several slots per batch."""
    opts = dict(temp=0, max_tokens=32, ignore_eos=True)
    prompts = PROMPTS[:3]
    refs = references(tiny_hybrid, prompts, **opts)
    oracle = OracleSlots({tuple(tiny_hybrid.tokenize(p)): r.tokens for p, r in zip(prompts, refs)},
                         tiny_hybrid.n_vocab)
    outs, stats = server_runs(tiny_hybrid, prompts, speculative=oracle, n_draft=4, **opts)
    assert [o.tokens for o in outs] == [r.tokens for r in refs]
    assert stats["draft_tokens"] > stats["draft_accepted"] > 0
    path = write_perturbed_copy(tiny_hybrid.path, tmp_path_factory.mktemp("srvspec") / "hd.gguf", scale=0.003)
    outs, stats = server_runs(tiny_hybrid, prompts, speculative=lc.DraftModel(path), n_draft=4, **opts)
    assert [o.tokens for o in outs] == [r.tokens for r in refs]
    assert stats["draft_tokens"] > stats["draft_accepted"] > 0


def test_mixed_batch_speculating_and_plain_requests(tiny_model):
    """Requests that opt out, sampled ones and greedy ones share the batch; each gets its own output."""
    opts = dict(max_tokens=32, ignore_eos=True)
    per = [dict(temp=0), dict(temp=0, speculative=False), dict(temp=0.8, seed=7), dict(temp=0.8, seed=7,
                                                                                     speculative=False)]
    with lc.Server(model=tiny_model, n_parallel=4, **SRV) as srv:
        refs = [s.completion() for s in [srv.stream(p, **opts, **{k: v for k, v in o.items() if k != "speculative"})
                                         for p, o in zip(PROMPTS, per)]]
    with lc.Server(model=tiny_model, n_parallel=4, speculative=lc.NgramDraft(n_min=1), **SRV) as srv:
        streams = [srv.stream(p, **opts, **o) for p, o in zip(PROMPTS, per)]
        outs = [s.completion() for s in streams]
    # (the match rule draws each token with the request's own seeded sampler: seeded runs reproduce too)
    assert [o.tokens for o in outs] == [r.tokens for r in refs]
    assert outs[1].timings.draft_tokens == 0 and outs[3].timings.draft_tokens == 0


def test_grammar_stop_logprobs_with_speculation(tiny_model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    opts = [dict(json_schema=schema, temp=0, max_tokens=40), dict(stop=["e"], temp=0, max_tokens=40),
            dict(logprobs=3, temp=0, max_tokens=24)]
    prompts = PROMPTS[:3]
    refs = [references(tiny_model, [p], **o)[0] for p, o in zip(prompts, opts)]
    oracle = OracleSlots({tuple(tiny_model.tokenize(p)): r.tokens for p, r in zip(prompts, refs)},
                         tiny_model.n_vocab, wrong_every=2)
    with lc.Server(model=tiny_model, n_parallel=3, speculative=oracle, **SRV) as srv:
        streams = [srv.stream(p, **o) for p, o in zip(prompts, opts)]
        outs = [s.completion() for s in streams]
    for out, ref in zip(outs, refs):
        assert out.tokens == ref.tokens and str(out) == str(ref) and out.finish_reason == ref.finish_reason
    lp = outs[2].logprobs
    assert len(lp) == len(outs[2].tokens)
    assert [e.token for e in lp] == outs[2].tokens and all(e.top[0].token == e.token for e in lp)
    # (the same distributions, up to the rounding of another batch shape)
    assert [e.logprob for e in lp] == pytest.approx([e.logprob for e in refs[2].logprobs], abs=1e-3)


def test_cancel_and_close_mid_stream_free_the_slot(tiny_model, tiny_draft_model):
    with lc.Server(model=tiny_model, n_parallel=2, speculative=lc.DraftModel(tiny_draft_model), **SRV) as srv:
        stream = srv.stream(PROMPTS[0], temp=0, max_tokens=200, ignore_eos=True)
        next(iter(stream))
        threading.Thread(target=stream.cancel).start()
        with pytest.raises(lc.CancelledError):
            for _ in stream:
                pass
        deadline = time.monotonic() + 10
        while srv.stats()["active_slots"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats()["active_slots"] == 0
        # the slot serves a new request correctly afterwards
        ref = references(tiny_model, [PROMPTS[1]], temp=0, max_tokens=16)[0]
        assert srv.generate(PROMPTS[1], temp=0, max_tokens=16).tokens == ref.tokens
        running = srv.stream(PROMPTS[2], temp=0, max_tokens=500, ignore_eos=True)
        next(iter(running))
    # closed with a request running and drafting: it ends with an error, no crash
    with pytest.raises(lc.ServerClosedError):
        for _ in running:
            pass


def test_bad_speculative_options(tiny_model, tmp_path, vocab_dir):
    with pytest.raises(lc.InvalidArgumentError, match="n_draft"):
        lc.Server(model=tiny_model, speculative=lc.NgramDraft(), n_draft=0, **SRV)
    with pytest.raises(lc.InvalidArgumentError, match="n_draft"):
        lc.Server(model=tiny_model, speculative=lc.NgramDraft(), n_draft=33, **SRV)
    with pytest.raises(lc.ArgumentTypeError, match="Drafter"):
        lc.Server(model=tiny_model, speculative=42, **SRV)
    with pytest.raises(FileNotFoundError):
        lc.Server(model=tiny_model, speculative=str(tmp_path / "missing.gguf"), **SRV)
    assert not tiny_model.closed
    # a draft model with another vocabulary: refused, and the draft model it loaded is closed again
    other = write_tiny_llama(tmp_path / "other.gguf", vocab_dir / "ggml-vocab-gpt-2.gguf")
    drafter = lc.DraftModel(other)
    with pytest.raises(lc.InvalidArgumentError, match="vocabular"):
        lc.Server(model=tiny_model, speculative=drafter, **SRV)
    assert drafter.model.closed
    assert not tiny_model.closed
    with lc.Server(model=tiny_model, n_parallel=1, speculative=lc.NgramDraft(), **SRV) as srv:
        with pytest.raises(lc.ArgumentTypeError, match="speculative"):
            srv.generate("x", speculative="yes")
        assert srv.generate("x", max_tokens=4, speculative=False).timings.draft_tokens == 0
    with lc.Server(model=tiny_model, n_parallel=1, speculative="ngram", n_draft=2, **SRV) as srv:
        assert isinstance(srv.speculative, lc.NgramDraft) and srv.n_draft == 2


@pytest.mark.gemma
def test_greedy_identity_gemma(gemma_path):
    """Gemma as its own drafter and n-gram drafts, 2 slots; near-tie tolerance (see test_speculative)."""
    model = lc.load_model(gemma_path, use_extra_bufts=False)
    try:
        prompts = [GEMMA_GROUNDED, "The capital of France is"]
        # (32 tokens: the copy is confident to there, then the model rambles at margins of ~0.1 nats;
        # batch compositions depend on timing, and a two-sequence verification batch rounds apart from
        # the 1-row reference by up to ~0.2 nats there: hence the margin of 0.25)
        opts = dict(temp=0, max_tokens=32)
        refs = [lc.generate(model, p, logprobs=3, n_ctx=1024, n_threads=1, **opts) for p in prompts]
        gopts = dict(n_ctx=1024, n_parallel=2)
        for drafter in (lc.NgramDraft(), lc.DraftModel(gemma_path)):
            outs, stats = server_runs(model, prompts, speculative=drafter, n_draft=4, **gopts, **opts)
            for out, ref in zip(outs, refs):
                assert_greedy_equivalent(out, ref, margin=0.25)
            assert stats["draft_accepted"] > 0
            if isinstance(drafter, lc.NgramDraft):
                assert stats["draft_tokens"] > stats["draft_accepted"]
            else:
                assert stats["draft_acceptance"] > 0.5
    finally:
        model.close()


def test_serve_with_a_draft_model_over_http(tiny_model, tmp_path):
    """``llama-ctypes serve --model-draft``: completions equal a plain server's; /metrics counts the drafts."""
    from http_helpers import ServeProcess, metric_samples

    prompts = PROMPTS[:2]
    refs = references(tiny_model, prompts, temp=0, max_tokens=24)
    server = ServeProcess([str(tiny_model.path), "--model-draft", str(tiny_model.path), "--draft-max", "3",
                           "-np", "2", "-c", "512", "--threads", "1", "--no-kv-unified"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        with server.client() as http:
            for prompt, ref in zip(prompts, refs):
                r = http.post("/v1/completions", json={"model": "x", "prompt": prompt, "temperature": 0,
                                                       "max_tokens": 24})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["choices"][0]["text"] == str(ref)
                assert body["usage"]["completion_tokens"] == len(ref.tokens)
            text = http.get("/metrics").text
        drafted = sum(metric_samples(text, "llama_ctypes_draft_tokens_total").values())
        accepted = sum(metric_samples(text, "llama_ctypes_draft_tokens_accepted_total").values())
        assert drafted >= accepted > 0  # the model drafting for itself: (nearly) every draft is kept
    finally:
        server.stop()
    assert "--draft-max needs" in _serve_error(["--draft-max", "3", str(tiny_model.path)], tmp_path)


def _serve_error(args, tmp_path) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "llama_ctypes", "serve", *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    return out.stdout + out.stderr


# ---- regressions found in review ------------------------------------------------------------------

def test_small_batches_and_output_budgets(tiny_model, tiny_hybrid, tiny_draft_model):
    """Shapes that once aborted the process or killed the scheduler: n_batch < n_parallel, a hybrid model
    with n_draft + 1 > n_ubatch (llama.cpp keeps n_rs_seq + 1 tokens per micro-batch), a user-given
    n_outputs_max, a draft model with a small n_batch."""
    opts = dict(temp=0, max_tokens=16, ignore_eos=True)
    ref = references(tiny_model, PROMPTS[:2], **opts)
    cases = [(tiny_model, dict(n_parallel=4, n_batch=3, n_ubatch=3, speculative="ngram")),
             (tiny_model, dict(n_parallel=4, n_outputs_max=4, speculative="ngram", n_draft=8)),
             (tiny_model, dict(n_parallel=2, n_batch=8, speculative=lc.DraftModel(tiny_draft_model)))]
    for model, server_opts in cases:
        outs, _ = server_runs(model, PROMPTS[:2], **server_opts, **opts)
        assert [o.tokens for o in outs] == [r.tokens for r in ref], server_opts
    href = references(tiny_hybrid, PROMPTS[:2], **opts)
    oracle = OracleSlots({tuple(tiny_hybrid.tokenize(p)): r.tokens for p, r in zip(PROMPTS[:2], href)},
                         tiny_hybrid.n_vocab)
    outs, stats = server_runs(tiny_hybrid, PROMPTS[:2], speculative=oracle, n_draft=8, n_batch=8, **opts)
    assert [o.tokens for o in outs] == [r.tokens for r in href] and stats["draft_accepted"] > 0
    # a recurrent memory without snapshots cannot verify drafts in a server: refused at creation
    with pytest.raises(lc.InvalidArgumentError, match="roll its recurrent state back"):
        lc.Server(model=tiny_hybrid, speculative="ngram", n_rs_seq=0, **SRV)
    # and a single-sequence context whose micro-batch cannot hold the snapshots is refused, not aborted
    with pytest.raises(lc.InvalidArgumentError, match="n_ubatch"):
        lc.Context.create(tiny_hybrid, n_ctx=256, n_batch=8, n_ubatch=4, n_rs_seq=4)


class Raising(lc.Drafter):
    def __init__(self, result):
        self.result = result

    def draft(self, context_tokens, k):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def test_a_broken_drafter_costs_speed_only(tiny_model):
    opts = dict(temp=0, max_tokens=8)
    ref = references(tiny_model, [PROMPTS[0]], **opts)[0]
    for result in (ValueError("bug"), None, [-1, 5], [10**9], ["x"], [1.5]):
        with lc.Server(model=tiny_model, n_parallel=1, speculative=Raising(result), **SRV) as srv:
            assert srv.generate(PROMPTS[0], **opts).tokens == ref.tokens
            assert srv.generate(PROMPTS[0], speculative=False, **opts).tokens == ref.tokens


def test_draft_model_ownership(tiny_model, tiny_draft_model):
    """A DraftModel serving one server is refused by a second (and stays open); a server that fails to
    build closes the drafter it took over."""
    first = lc.DraftModel(tiny_draft_model)
    with lc.Server(model=tiny_model, n_parallel=1, speculative=first, **SRV) as srv:
        with pytest.raises(lc.InvalidArgumentError, match="already serves"):
            lc.Server(model=tiny_model, n_parallel=1, speculative=first, **SRV)
        assert not first.closed
        assert srv.generate(PROMPTS[0], temp=0, max_tokens=8).timings.draft_tokens > 0
    assert first.closed and not tiny_draft_model.closed  # (a Model handed in stays the caller's)
    failing = lc.DraftModel(tiny_draft_model)
    with pytest.raises(lc.InvalidArgumentError):
        lc.Server(model=tiny_model, speculative=failing, type_k="nonsense", **SRV)
    assert failing.closed


def test_tick_telemetry_counts_drafts_apart(tiny_model):
    ticks = []
    lc.telemetry.attach("spec-ticks", ["server.tick"], lambda e, m, md: ticks.append(m))
    try:
        prompt = PROMPTS[2]
        ref = references(tiny_model, [prompt], temp=0, max_tokens=20, ignore_eos=True)[0]
        oracle = OracleSlots({tuple(tiny_model.tokenize(prompt)): ref.tokens}, tiny_model.n_vocab)
        ticks.clear()
        server_runs(tiny_model, [prompt], speculative=oracle, temp=0, max_tokens=20, ignore_eos=True)
    finally:
        lc.telemetry.detach("spec-ticks")
    assert sum(t["prefill_tokens"] for t in ticks) == len(tiny_model.tokenize(prompt))
    assert sum(t["draft_tokens"] for t in ticks) > 0
    assert all(t["batch_tokens"] == t["prefill_tokens"] + t["decode_tokens"] for t in ticks)


# ---- MTP inside the Server ------------------------------------------------------------------------

def test_greedy_identity_mtp(tiny_mtp):
    """The model's own MTP head drafting for 3 slots (its cache mirrors every tick of every slot):
    outputs equal the plain server's, with drafts kept, cut and rejected; a second round reuses the
    slots' prefixes (the mirror follows the pool's cuts)."""
    opts = dict(temp=0, max_tokens=32, ignore_eos=True)
    prompts = PROMPTS[:3]
    refs = references(tiny_mtp, prompts, **opts)
    with lc.Server(model=tiny_mtp, n_parallel=3, speculative="mtp", n_draft=3, **SRV) as srv:
        for _ in range(2):
            streams = [srv.stream(p, **opts) for p in prompts]
            assert [s.completion().tokens for s in streams] == [r.tokens for r in refs]
        stats = srv.stats()
    assert stats["draft_tokens"] > stats["draft_accepted"] > 0


def test_mtp_drafts_right_by_construction_are_kept(tmp_path_factory, vocab_dir):
    from tiny_models import write_tiny_qwen35

    path = write_tiny_qwen35(tmp_path_factory.mktemp("srvmtp") / "exact.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf",
                             mtp="token", trunk_scale=0.0)
    model = lc.load_model(path, load_mtp=True)
    try:
        opts = dict(temp=0, max_tokens=24, ignore_eos=True)
        refs = references(model, PROMPTS[:2], **opts)
        outs, stats = server_runs(model, PROMPTS[:2], speculative=lc.MTPDraft(), n_draft=3, **opts)
        assert [o.tokens for o in outs] == [r.tokens for r in refs]
        assert stats["draft_acceptance"] > 0.9
        assert stats["ticks"] < sum(len(r.tokens) for r in refs) // 2
    finally:
        model.close()


def test_mtp_in_a_server_needs_an_mtp_model(tiny_model, tiny_hybrid):
    for model in (tiny_model, tiny_hybrid):
        with pytest.raises(lc.InvalidArgumentError, match="MTP"):
            lc.Server(model=model, speculative="mtp", **SRV)


def test_mtp_mirror_pairs_each_token_with_the_previous_hidden_row(tiny_mtp, monkeypatch):
    """Every token a slot's MTP sequence receives (prompt chunks, plain steps, the kept part of
    verification steps, draft steps' pending tokens; three slots per batch) enters with the target's
    hidden row of the position before it, compared with one plain decode of each final sequence."""
    import numpy as np

    from llama_ctypes.core.context import ContextLease

    calls = []
    decode_states = ContextLease.decode_states

    def spy(lease, seq_ids, positions, tokens, states, outputs):
        width = lease.n_embd_out()
        rows = [np.ctypeslib.as_array((ctypes.c_float * width).from_address(a)).copy() for a in states]
        calls.append((list(seq_ids), list(positions), list(tokens), rows, bool(outputs)))
        return decode_states(lease, seq_ids, positions, tokens, states, outputs)

    monkeypatch.setattr(ContextLease, "decode_states", spy)
    prompts = PROMPTS[:3]
    outs, stats = server_runs(tiny_mtp, prompts, speculative="mtp", n_draft=3, n_batch=8,
                              temp=0, max_tokens=24, ignore_eos=True)
    assert stats["draft_accepted"] > 0
    monkeypatch.undo()
    finals, refs = {}, {}
    for prompt, out in zip(prompts, outs):
        seq = tiny_mtp.tokenize(prompt) + out.tokens
        ctx = lc.Context.create(tiny_mtp, n_ctx=256, n_threads=1)
        rows = []
        try:
            with ctx.lease() as lease:
                lease.set_embeddings_nextn(True, False)
                lease.after_decode = lambda tl, toks, pos: rows.append(tl.nextn_rows(len(toks)).copy())
                lease.prefill(seq, reuse=False)
        finally:
            ctx.close()
        finals[tuple(seq[:4])], refs[tuple(seq[:4])] = seq, np.concatenate(rows)
    # (one round, a slot per prompt: a slot's first mirrored tokens name its prompt)
    heads: dict[int, dict[int, int]] = {}
    for seq_ids, positions, tokens, _, drafting in calls:
        for s_id, pos, tok in zip(seq_ids, positions, tokens):
            if not drafting and pos < 4:
                heads.setdefault(s_id, {})[pos] = tok
    owner = {s_id: next(key for key, seq in finals.items() if all(seq[p] == t for p, t in h.items()))
             for s_id, h in heads.items()}
    assert sorted(owner.values()) == sorted(finals)
    checked = {"mirror": 0, "draft": 0}
    mirrored: dict[int, int] = {}  # positions each MTP sequence holds
    for seq_ids, positions, tokens, states, drafting in calls:
        for s_id, pos, tok, state in zip(seq_ids, positions, tokens, states):
            key = owner[s_id]
            seq, ref = finals[key], refs[key]
            if drafting and pos != mirrored.get(s_id):
                continue  # a later draft step: the head's own row
            if not drafting:
                mirrored[s_id] = pos + 1
            assert seq[pos] == tok, (s_id, pos)
            want = ref[pos - 1] if pos else np.zeros_like(state)
            np.testing.assert_allclose(state, want, atol=1e-3, err_msg=f"seq {s_id} pos {pos}")
            checked["draft" if drafting else "mirror"] += 1
    assert checked["mirror"] >= sum(len(s) for s in finals.values()) - len(finals) * 3
    assert checked["draft"] > 10


def test_mtp_regressions(tiny_mtp, monkeypatch):
    """An MTPDraft serves one user; pooling is refused; a lost MTP mirror is rebuilt (the prefix is
    recomputed) so a continuing conversation drafts again."""
    from llama_ctypes.core.context import ContextLease

    drafter = lc.MTPDraft()
    with lc.SpeculativeSession(tiny_mtp, drafter, n_draft=3, **SRV) as session:
        with pytest.raises(lc.InvalidArgumentError, match="already serves"):
            lc.Server(model=tiny_mtp, speculative=drafter, **SRV)
        assert session.generate(PROMPTS[0], temp=0, max_tokens=8).tokens  # still usable
    for bad in (dict(pooling="mean"), dict(pooling="rank")):
        with pytest.raises(lc.InvalidArgumentError, match="pooling"):
            lc.MTP(tiny_mtp, **SRV, **bad)
        with pytest.raises(lc.InvalidArgumentError, match="pooling"):
            lc.Server(model=tiny_mtp, speculative="mtp", **SRV, **bad)
    # a mirror decode that fails once: the next turn of the conversation drafts again
    opts = dict(temp=0, max_tokens=12, ignore_eos=True, session="chat")
    with lc.Server(model=tiny_mtp, n_parallel=1, speculative="mtp", n_draft=3, **SRV) as srv:
        first = srv.generate(PROMPTS[1], **opts)
        real = ContextLease.decode_states
        failed = []

        def fail_once(lease, seq_ids, positions, tokens, states, outputs):
            if not failed and not outputs:
                failed.append(1)
                return 1
            return real(lease, seq_ids, positions, tokens, states, outputs)

        monkeypatch.setattr(ContextLease, "decode_states", fail_once)
        turn = tiny_mtp.tokenize(PROMPTS[1]) + first.tokens  # (token ids: the slot's history is a prefix)
        second = srv.generate_tokens(turn, **opts)
        monkeypatch.undo()
        third = srv.generate_tokens(turn + second.tokens + [7, 8], **opts)
        assert failed and third.timings.draft_tokens > 0
        assert srv.stats()["cache_hits"] >= 1  # (the second turn continued the first's sequence)


def test_mtp_session_follows_again_after_its_cache_was_lost(tiny_mtp):
    with lc.MTP(tiny_mtp, n_draft=3, **SRV) as s:
        a = s.generate(PROMPTS[1], temp=0, max_tokens=10, cache_prompt=True)
        with s.drafter.context.lease() as lease:
            lease.clear()  # as an aborted MTP decode leaves it
        before = s.stats().drafted
        prompt = s.model.tokenize(PROMPTS[1]) + a.tokens
        b = s.generate(prompt, temp=0, max_tokens=10, cache_prompt=True)
        assert s.stats().drafted > before
    assert b.tokens == lc.generate(tiny_mtp, prompt, temp=0, max_tokens=10, n_ctx=256, n_threads=1).tokens


def test_server_model_path_with_mtp_loads_its_layers(tiny_mtp):
    with lc.Server(model_path=str(tiny_mtp.path), n_parallel=1, speculative="mtp", **SRV) as srv:
        assert srv.model.params.load_mtp
        assert srv.generate(PROMPTS[0], temp=0, max_tokens=8).tokens


def test_nextn_rows_bounds(tiny_mtp):
    ctx = lc.Context.create(tiny_mtp, n_ctx=64, n_threads=1)
    try:
        with ctx.lease() as lease:
            with pytest.raises(lc.InvalidArgumentError, match="row per token"):
                lease.nextn_rows(1)
            lease.set_embeddings_nextn(True, False)
            lease.prefill([1, 2, 3, 4], reuse=False)
            assert lease.nextn_rows(4).shape == (4, tiny_mtp.n_embd_out)
            with pytest.raises(lc.InvalidArgumentError, match="last decode"):
                lease.nextn_rows(5)
            lease.set_embeddings_nextn(True, True)
            with pytest.raises(lc.InvalidArgumentError, match="row per token"):
                lease.nextn_rows(1)
    finally:
        ctx.close()
