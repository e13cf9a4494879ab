"""MTP speculative decoding (``lc.MTP``, ``lc.MTPDraft``): the model's own multi-token-prediction head
drafts, the target verifies. Greedy identity with plain decoding (drafts partly rejected: KV, recurrent
state and the MTP cache rolled back), which hidden row each MTP input gets, sampling, stats, streams,
threads, lifetimes and bad input, on tiny qwen35 models with an MTP block (tests/tiny_models.py)."""

from __future__ import annotations

import ctypes
import json
import threading
import time

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.core.context import ContextLease
from llama_ctypes.native import llama_h
from tiny_models import write_tiny_qwen35

# One thread: the test machine's cores are shared, and spinning ggml threads then crawl.
CTX = dict(n_ctx=512, n_threads=1)
PROMPTS = ["Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4",
           "The quick brown fox jumps over the lazy dog. The quick brown fox", "Hello world"]


def plain(model, prompt, **opts):
    return lc.generate(model, prompt, **{**CTX, **opts})


def _write(tmp_path_factory, vocab_dir, name, **kw):
    return write_tiny_qwen35(tmp_path_factory.mktemp("mtp") / name, vocab_dir / "ggml-vocab-llama-spm.gguf", **kw)


@pytest.fixture(scope="module")
def mtp_state_model(tmp_path_factory, vocab_dir):
    """A head that passes the target's hidden row straight to the LM head: its first draft is the
    target's own prediction for the position before the pending token, i.e. the pending token."""
    model = lc.load_model(_write(tmp_path_factory, vocab_dir, "state.gguf", mtp="state"), load_mtp=True)
    yield model
    model.close()


@pytest.fixture(scope="module")
def mtp_exact_model(tmp_path_factory, vocab_dir):
    """A trunk that adds nothing to the token's embedding and a token-only head: every draft is right."""
    path = _write(tmp_path_factory, vocab_dir, "exact.gguf", mtp="token", trunk_scale=0.0)
    model = lc.load_model(path, load_mtp=True)
    yield model
    model.close()


class Spy:
    """Records the MTP drafter's accepts, the target's cuts and every decode with state rows."""

    def __init__(self, monkeypatch):
        self.accepts: list[tuple[int, int]] = []  # (accepted, drafted)
        self.cuts: list[tuple[int, int, int, bool]] = []  # (id(ctx), held, keep, ok)
        self.decodes: list[tuple[int, int, list[int], list[np.ndarray], bool]] = []
        accept, truncate, decode = lc.MTPDraft.accept, ContextLease.truncate, ContextLease.decode_with_states

        def spy_accept(drafter, n):
            self.accepts.append((n, drafter._last_draft[1]))
            return accept(drafter, n)

        def spy_truncate(lease, n):
            held = len(lease.tokens)
            ok = truncate(lease, n)
            self.cuts.append((id(lease.ctx), held, n, ok))
            return ok

        def spy_decode(lease, tokens, states, output_last):
            width = lease.n_embd_out()
            rows = [np.ctypeslib.as_array((ctypes.c_float * width).from_address(a)).copy() for a in states]
            self.decodes.append((len(lease.tokens), id(lease.ctx), list(tokens), rows, output_last))
            return decode(lease, tokens, states, output_last)

        monkeypatch.setattr(lc.MTPDraft, "accept", spy_accept)
        monkeypatch.setattr(ContextLease, "truncate", spy_truncate)
        monkeypatch.setattr(ContextLease, "decode_with_states", spy_decode)


def assert_in_step(session, prompt_tokens, out_tokens):
    """The target holds a prefix of prompt + output, and the MTP cache holds exactly what the target holds."""
    target, mtp = session.context, session.drafter.context
    held = target.tokens
    assert held == (prompt_tokens + out_tokens)[:len(held)]
    assert len(held) >= len(prompt_tokens) + len(out_tokens) - 1
    assert target.seq_pos_max(0) + 1 == len(held)
    assert mtp.tokens == held and mtp.seq_pos_max(0) + 1 == len(held)


# ---- greedy identity and rollback ----------------------------------------------------------------

def test_greedy_identity_with_partly_rejected_drafts(tiny_mtp, monkeypatch, caplog):
    caplog.set_level("DEBUG", logger="llama_ctypes.engines.speculative.loop")
    spy = Spy(monkeypatch)
    emitted = 0
    with lc.MTP(tiny_mtp, n_draft=3, **CTX) as s:
        for prompt in PROMPTS:
            ref = plain(tiny_mtp, prompt, temp=0, max_tokens=48, ignore_eos=True)
            out = s.generate(prompt, temp=0, max_tokens=48, ignore_eos=True)
            assert out.tokens == ref.tokens and str(out) == str(ref)
            assert_in_step(s, tiny_mtp.tokenize(prompt), out.tokens)
            emitted += len(out.tokens)
        stats = s.stats()
        target_id = id(s.context)
    assert stats.calls == len(PROMPTS) and stats.tokens_emitted == emitted
    assert stats.drafted > stats.accepted > 0 and stats.iterations > 0
    # all three outcomes: a draft kept whole, cut in the middle, rejected from its first token
    assert {"whole", "part", "none"} <= {("whole" if m == n else "part" if m else "none")
                                         for m, n in spy.accepts if n}
    # the hybrid target cut rejected drafts off through its recurrent snapshots, never by recomputing
    target_cuts = [c for c in spy.cuts if c[0] == target_id and c[2] < c[1]]
    assert target_cuts and all(ok for *_, ok in target_cuts)
    assert any(0 < held - keep < 3 for _, held, keep, _ in target_cuts)  # partial: a mid-run snapshot
    assert "recomputes" not in caplog.text


def test_target_without_snapshots_recomputes_and_the_mtp_cache_follows(tiny_mtp, caplog):
    """n_rs_seq=0: the hybrid target cannot cut rejected drafts off, so it recomputes the kept tokens
    (a prefill, mirrored into the MTP cache like any other); output and caches stay exact."""
    caplog.set_level("DEBUG", logger="llama_ctypes.engines.speculative.loop")
    with lc.MTP(tiny_mtp, n_draft=3, n_rs_seq=0, **CTX) as s:
        for prompt in PROMPTS[:2]:
            ref = plain(tiny_mtp, prompt, temp=0, max_tokens=32, ignore_eos=True)
            out = s.generate(prompt, temp=0, max_tokens=32, ignore_eos=True)
            assert out.tokens == ref.tokens
            assert_in_step(s, tiny_mtp.tokenize(prompt), out.tokens)
        assert s.stats().accepted > 0 and s.stats().rejected > 0
    assert "recomputes the sequence" in caplog.text


def test_each_mtp_input_pairs_a_token_with_the_previous_hidden_row(tiny_mtp, monkeypatch):
    """Token p enters the MTP head with the target's hidden row of position p - 1 (zeros at 0): in the
    prompt's chunks (n_batch=8: the first row of each chunk is carried over from the previous one), in
    verification runs (row 0 of a run: the last kept row of the previous run), and at each draft's
    first step. Compared with the rows of one plain decode of the final sequence."""
    spy = Spy(monkeypatch)
    prompt = PROMPTS[2]
    with lc.MTP(tiny_mtp, n_draft=3, n_batch=8, n_ubatch=8, **CTX) as s:
        out = s.generate(prompt, temp=0, max_tokens=40, ignore_eos=True)
        mtp_id = id(s.drafter.context)
        assert s.stats().accepted > 0
    seq = tiny_mtp.tokenize(prompt) + out.tokens
    assert len(tiny_mtp.tokenize(prompt)) > 8  # several prompt chunks
    ref_ctx = lc.Context.create(tiny_mtp, **CTX)
    rows: list[np.ndarray] = []
    try:
        with ref_ctx.lease() as lease:
            lease.set_embeddings_nextn(True, False)
            lease.after_decode = lambda tl, toks, pos: rows.append(tl.nextn_rows(len(toks)).copy())
            lease.prefill(seq, reuse=False)
    finally:
        ref_ctx.close()
    ref = np.concatenate(rows)
    assert ref.shape == (len(seq), tiny_mtp.n_embd_out)
    checked = {"prompt": 0, "verify": 0, "draft": 0}
    prev = None
    for start, ctx_id, tokens, states, output_last in spy.decodes:
        assert ctx_id == mtp_id
        if output_last:  # a draft step: only its first step takes a target row
            first_step = not (prev is not None and prev[4] and prev[0] == start - 1)
            if first_step:
                assert tokens[0] == seq[start]  # the pending token
                np.testing.assert_allclose(states[0], ref[start - 1], atol=1e-3)
                checked["draft"] += 1
        else:
            for i, (tok, state) in enumerate(zip(tokens, states)):
                q = start + i
                if tokens[:i] != seq[start:q]:  # after a rejected draft: a row of another sequence
                    break
                want = ref[q - 1] if q else np.zeros_like(state)
                np.testing.assert_allclose(state, want, atol=1e-3)
                checked["prompt" if q < len(seq) - len(out.tokens) else "verify"] += 1
        prev = (start, ctx_id, tokens, states, output_last)
    assert checked["prompt"] == len(seq) - len(out.tokens)
    assert checked["verify"] > 10 and checked["draft"] > 10


def test_first_draft_is_the_pending_token_under_a_state_head(mtp_state_model, monkeypatch):
    """Under a head that maps the target's row of position p - 1 back to the target's own prediction,
    the first draft of every step must be the pending token: the drafter read the right row."""
    drafts: list[tuple[int, list[int]]] = []
    draft = lc.MTPDraft.draft

    def spy(drafter, context_tokens, k):
        out = draft(drafter, context_tokens, k)
        drafts.append((context_tokens[-1], out))
        return out

    monkeypatch.setattr(lc.MTPDraft, "draft", spy)
    with lc.MTP(mtp_state_model, n_draft=2, **CTX) as s:
        for prompt in PROMPTS[:2]:
            ref = plain(mtp_state_model, prompt, temp=0, max_tokens=30, ignore_eos=True)
            assert s.generate(prompt, temp=0, max_tokens=30, ignore_eos=True).tokens == ref.tokens
    assert len(drafts) > 20 and all(out and out[0] == pending for pending, out in drafts)


def test_drafts_good_by_construction_are_all_accepted(mtp_exact_model):
    with lc.MTP(mtp_exact_model, n_draft=4, **CTX) as s:
        for prompt in PROMPTS[:2]:
            ref = plain(mtp_exact_model, prompt, temp=0, max_tokens=40, ignore_eos=True)
            assert s.generate(prompt, temp=0, max_tokens=40, ignore_eos=True).tokens == ref.tokens
        stats = s.stats()
    assert stats.acceptance_rate == 1.0 and stats.drafted > 50
    assert stats.tokens_per_decode > 4.0  # n_draft + 1 tokens per target decode, the prefill aside


def test_prompt_cache_and_context_limit(tiny_mtp):
    opts = dict(temp=0, max_tokens=24, ignore_eos=True)
    with lc.MTP(tiny_mtp, n_draft=3, **CTX) as s:
        first = s.generate(PROMPTS[2], cache_prompt=True, **opts)
        again = s.generate(PROMPTS[2], cache_prompt=True, **opts)
        longer = s.generate(PROMPTS[2] + " jumps", cache_prompt=True, **opts)
        assert_in_step(s, tiny_mtp.tokenize(PROMPTS[2] + " jumps"), longer.tokens)
    # (a hybrid target reuses no prefix here: its recurrent state cannot cut back past its last decode)
    assert again.tokens == first.tokens == plain(tiny_mtp, PROMPTS[2], **opts).tokens
    assert longer.tokens == plain(tiny_mtp, PROMPTS[2] + " jumps", **opts).tokens
    limit = dict(temp=0, max_tokens=-1, ignore_eos=True)
    with lc.MTP(tiny_mtp, n_draft=3, n_ctx=48, n_threads=1) as s:
        out = s.generate(PROMPTS[1], **limit)
    ref = lc.generate(tiny_mtp, PROMPTS[1], n_ctx=48, n_threads=1, **limit)
    assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason == "length"


# ---- sampling --------------------------------------------------------------------------------------

def test_seeded_sampling_reproducible_and_equal_to_plain(tiny_mtp):
    opts = dict(temp=0.9, seed=1234, max_tokens=40, ignore_eos=True)
    with lc.MTP(tiny_mtp, **CTX) as s:
        a, b = s.generate(PROMPTS[0], **opts), s.generate(PROMPTS[0], **opts)
        c = s.generate(PROMPTS[0], **{**opts, "seed": 99})
        pen = dict(temp=0.8, seed=7, penalty_repeat=1.3, top_k=0, max_tokens=32)
        d = s.generate(PROMPTS[1], **pen)
        assert s.stats().drafted > 0
    assert a.tokens == b.tokens and str(a) == str(b) and c.tokens != a.tokens
    # drafts are verified by matching: each token is the request sampler's own draw
    assert a.tokens == plain(tiny_mtp, PROMPTS[0], **opts).tokens
    assert d.tokens == plain(tiny_mtp, PROMPTS[1], **pen).tokens


def test_grammar_and_json_schema(tiny_mtp):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    gram = dict(temp=0.7, seed=3, grammar='root ::= [a-z ]+ "."', max_tokens=32)
    with lc.MTP(tiny_mtp, **CTX) as s:
        g = s.generate(PROMPTS[0], **gram)
        j = s.generate(PROMPTS[0], temp=0, json_schema=schema, max_tokens=64)
        assert s.stats().drafted > 0
    assert g.tokens == plain(tiny_mtp, PROMPTS[0], **gram).tokens
    assert set(str(g)) <= set("abcdefghijklmnopqrstuvwxyz .")
    assert str(g).endswith(".") or g.finish_reason == "length"
    value = json.loads(str(j))
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    assert j.tokens == plain(tiny_mtp, PROMPTS[0], temp=0, json_schema=schema, max_tokens=64).tokens


# ---- stats, events, threads ------------------------------------------------------------------------

def test_stats_fields_and_cumulative(tiny_mtp):
    with lc.MTP(tiny_mtp, n_draft=3, **CTX) as s:
        assert s.stats() == lc.SpeculativeStats()
        first = s.generate(PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True)
        one = s.stats()
        second = s.generate(PROMPTS[1], temp=0, max_tokens=20, ignore_eos=True)
        two = s.stats()
    assert one.calls == 1 and one.tokens_emitted == len(first.tokens) == 30
    assert one.iterations > 0 and one.drafted > 0 and one.prefill_s > 0 and one.decode_s > 0 and one.draft_s > 0
    assert one.acceptance_rate == one.accepted / one.drafted and one.rejected == one.drafted - one.accepted
    assert one.tokens_per_s == pytest.approx(30 / one.decode_s)
    assert one.tokens_per_decode == pytest.approx(30 / (one.iterations + 1))
    assert two.calls == 2 and two.tokens_emitted == 30 + len(second.tokens) == 50
    for name in ("iterations", "drafted", "accepted", "prefill_s", "decode_s", "draft_s"):
        assert getattr(two, name) > getattr(one, name)
    assert first.timings.prompt_tokens == len(tiny_mtp.tokenize(PROMPTS[0]))


def test_stream_events_and_text(tiny_mtp):
    with lc.MTP(tiny_mtp, **CTX) as s:
        ref = s.generate(PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True)
        events = list(s.stream_events(PROMPTS[0], emit_stats_every=8, temp=0, max_tokens=30, ignore_eos=True))
        pieces = list(s.stream(PROMPTS[0], temp=0, max_tokens=30, ignore_eos=True))
        eos = tiny_mtp.vocab.eos
        eog = list(s.stream_events(PROMPTS[0], temp=0, logit_bias={eos: 100.0}))
    kinds = [e.kind for e in events]
    assert kinds.count("token") == 30 and kinds.count("stats") == 3 and kinds[-1] == "done"
    assert [e.token for e in events if e.kind == "token"] == ref.tokens
    assert "".join(e.text for e in events) == str(ref) == "".join(pieces)
    assert events[-1].finish_reason == "length" and events[-1].stats.tokens_emitted == 60
    stats_seen = [e.stats.tokens_emitted for e in events if e.kind == "stats"]
    assert stats_seen == sorted(stats_seen) and stats_seen[0] >= 30 + 8
    assert [e.kind for e in eog] == ["eog", "done"] and eog[0].token == eos and eog[1].finish_reason == "eog"


def test_stats_from_another_thread_while_streaming(tiny_mtp):
    with lc.MTP(tiny_mtp, **CTX) as s:
        seen, took = [], []
        done = threading.Event()

        def poll():
            while not done.is_set():
                t0 = time.perf_counter()
                st = s.stats()
                took.append(time.perf_counter() - t0)
                seen.append(st.tokens_emitted)
                time.sleep(0.0005)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            n = sum(1 for _ in s.stream(PROMPTS[0], temp=0, max_tokens=200, ignore_eos=True))
        finally:
            done.set()
            poller.join()
        final = s.stats()
    assert final.tokens_emitted == 200 and n > 0
    assert any(0 < k < 200 for k in seen) and seen == sorted(seen)
    assert float(np.median(took)) < 0.0005  # a snapshot read, never a wait for the decode


def test_cancel_from_another_thread(tiny_mtp):
    with lc.MTP(tiny_mtp, n_ctx=2048, n_threads=1) as s:
        st = s.stream(PROMPTS[0], temp=0, max_tokens=-1, ignore_eos=True)
        next(st)
        threading.Timer(0.05, st.cancel).start()
        with pytest.raises(lc.CancelledError):
            for _ in st:
                pass
        assert st.cancelled
        # everything was released and the next call starts clean
        ref = plain(tiny_mtp, PROMPTS[1], temp=0, max_tokens=12, ignore_eos=True)
        assert s.generate(PROMPTS[1], temp=0, max_tokens=12, ignore_eos=True).tokens == ref.tokens
        for i, _ in enumerate(s.stream(PROMPTS[0], temp=0, max_tokens=50, ignore_eos=True)):
            if i == 3:
                break  # a dropped stream releases too
        assert s.generate(PROMPTS[1], temp=0, max_tokens=12, ignore_eos=True).tokens == ref.tokens


def test_cancel_aborts_an_mtp_decode_in_flight(tiny_mtp, monkeypatch):
    """A cancel that lands while the MTP context decodes stops it (its abort flag) and the stream ends
    with CancelledError; the session serves the next call."""
    with lc.MTP(tiny_mtp, **CTX) as s:
        st = s.stream(PROMPTS[0], temp=0, max_tokens=100, ignore_eos=True)
        decode = ContextLease.decode_with_states
        mtp_ctx = s.drafter.context

        codes = []

        def cancel_first(lease, tokens, states, output_last):
            if lease.ctx is mtp_ctx and output_last:
                st.cancel()  # lands "during" this draft step: the MTP context's abort flag is set
            try:
                return decode(lease, tokens, states, output_last)
            except lc.DecodeError as exc:
                codes.append(exc.code)
                raise

        monkeypatch.setattr(ContextLease, "decode_with_states", cancel_first)
        with pytest.raises(lc.CancelledError):
            list(st)
        assert codes == [2]  # llama_process stopped (aborted), not a later check of the flag
        monkeypatch.setattr(ContextLease, "decode_with_states", decode)
        ref = plain(tiny_mtp, PROMPTS[1], temp=0, max_tokens=12, ignore_eos=True)
        assert s.generate(PROMPTS[1], temp=0, max_tokens=12, ignore_eos=True).tokens == ref.tokens


def test_close_session_while_streaming(tiny_mtp):
    s = lc.MTP(tiny_mtp, **CTX)
    st = s.stream(PROMPTS[0], temp=0, max_tokens=40, ignore_eos=True)
    next(st)
    s.close()  # the stream holds both contexts: it runs to its end, then they are freed
    mtp_ctx = s.drafter.context
    assert not s.context.freed and not mtp_ctx.freed
    out = st.completion()
    assert len(out.tokens) == 40 and out.finish_reason == "length"
    assert s.context.freed and mtp_ctx.freed
    for call in (lambda: s.generate("x"), lambda: s.stream("x"), lambda: s.stream_events("x")):
        with pytest.raises(lc.ClosedError):
            call()
    s.close()  # idempotent

    # closed from another thread while this one iterates: no crash, nothing used after free
    s2 = lc.MTP(tiny_mtp, **CTX)
    st2 = s2.stream(PROMPTS[0], temp=0, max_tokens=200, ignore_eos=True)
    closer = threading.Timer(0.02, s2.close)
    closer.start()
    assert len(st2.completion().tokens) == 200
    closer.join()
    assert s2.closed and s2.context.freed and s2.drafter.context.freed


def test_busy_while_streaming(tiny_mtp):
    with lc.MTP(tiny_mtp, **CTX) as s:
        st = s.stream(PROMPTS[0], temp=0, max_tokens=20)
        next(st)
        with pytest.raises(lc.BusyError):
            s.generate(PROMPTS[0], temp=0, max_tokens=5)
        st.close()
        assert s.generate(PROMPTS[0], temp=0, max_tokens=5)


def test_model_from_a_path_is_loaded_with_mtp_and_owned(tiny_mtp):
    with lc.MTP(tiny_mtp.path, n_draft=2, **CTX) as s:
        model = s.model
        assert model is not tiny_mtp and model.params.load_mtp
        ref = plain(tiny_mtp, PROMPTS[0], temp=0, max_tokens=16, ignore_eos=True)
        st = s.stream(PROMPTS[0], temp=0, max_tokens=16, ignore_eos=True)
        next(st)
    assert model.closed and not model.freed  # the running stream still holds it
    assert st.completion().tokens == ref.tokens
    assert model.freed
    with lc.MTP(tiny_mtp.path, model_params={"n_gpu_layers": 0}, **CTX) as s:
        assert s.model.params.n_gpu_layers == 0 and s.model.params.load_mtp


# ---- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_draft", [0, 33, True, 2.5, "3"])
def test_bad_n_draft(tiny_mtp, n_draft):
    with pytest.raises(lc.InvalidArgumentError, match="n_draft"):
        lc.MTP(tiny_mtp, n_draft=n_draft, **CTX)


def _users(model):
    return model._users  # contexts (and calls) holding the model: none left by a failed constructor


def assert_refused_without_mtp(model):
    before = _users(model)
    with pytest.raises(lc.InvalidArgumentError, match="no multi-token-prediction"):
        lc.MTP(model, **CTX)
    with pytest.raises(lc.InvalidArgumentError, match="no multi-token-prediction"):
        lc.SpeculativeSession(model, lc.MTPDraft(), **CTX)
    assert _users(model) == before  # nothing half-built


@pytest.mark.gemma
def test_gemma_has_no_mtp_head(gemma):
    assert_refused_without_mtp(gemma)


def test_models_without_an_mtp_head_are_refused(tiny_model, tiny_hybrid, tiny_mtp):
    for model in (tiny_model, tiny_hybrid):
        assert_refused_without_mtp(model)
    with pytest.raises(lc.InvalidArgumentError, match="no multi-token-prediction"):
        lc.MTP(tiny_model.path, **CTX)  # loaded, refused, closed again
    without = lc.load_model(tiny_mtp.path)  # the MTP tensors are skipped unless load_mtp=True
    try:
        for make in (lambda: lc.MTP(without, **CTX), lambda: lc.SpeculativeSession(without, lc.MTPDraft(), **CTX)):
            with pytest.raises(lc.InvalidArgumentError, match="load_mtp=True"):
                make()
        assert _users(without) == 0
    finally:
        without.close()
    assert without.freed


def test_bad_options(tiny_mtp, tiny_model):
    before = _users(tiny_mtp)
    with pytest.raises(lc.InvalidArgumentError, match="embeddings"):
        lc.MTP(tiny_mtp, embeddings=True, **CTX)
    with pytest.raises(lc.InvalidArgumentError, match="n_batch"):
        lc.MTP(tiny_mtp, n_draft=8, n_batch=4, n_ubatch=4, **CTX)
    with pytest.raises(lc.ArgumentTypeError):
        lc.MTP(tiny_mtp, bogus=1)
    with pytest.raises(lc.ArgumentTypeError):
        lc.MTP(42)  # type: ignore[arg-type]
    with pytest.raises(lc.InvalidArgumentError, match="model_params"):
        lc.MTP(tiny_mtp, model_params={"n_gpu_layers": 0})
    with pytest.raises(lc.InvalidArgumentError, match="load_mtp"):
        lc.MTP(tiny_mtp.path, model_params={"load_mtp": False})
    for p_min in (-0.1, 1.5, True, "x"):
        with pytest.raises(lc.InvalidArgumentError, match="p_min"):
            lc.MTP(tiny_mtp, p_min=p_min, **CTX)
    assert _users(tiny_mtp) == before
    drafter = lc.MTPDraft()
    with pytest.raises(lc.InvalidArgumentError, match="not attached"):
        drafter.start()
    with lc.SpeculativeSession(tiny_mtp, drafter, n_draft=2, **CTX) as s:
        with pytest.raises(lc.InvalidArgumentError, match="already serves"):
            lc.SpeculativeSession(tiny_mtp, drafter, **CTX)
        ref = plain(tiny_mtp, PROMPTS[0], temp=0, max_tokens=8)
        assert s.generate(PROMPTS[0], temp=0, max_tokens=8).tokens == ref.tokens
    with pytest.raises(lc.ClosedError):
        lc.SpeculativeSession(tiny_mtp, drafter, **CTX)  # closed with its session


def test_p_min_ends_drafts_early(tiny_mtp):
    with lc.MTP(tiny_mtp, n_draft=3, **CTX) as loose, lc.MTP(tiny_mtp, n_draft=3, p_min=1.0, **CTX) as strict:
        ref = loose.generate(PROMPTS[0], temp=0, max_tokens=24, ignore_eos=True)
        out = strict.generate(PROMPTS[0], temp=0, max_tokens=24, ignore_eos=True)
        assert out.tokens == ref.tokens
        assert loose.stats().drafted > 0 and strict.stats().drafted == 0  # no top token reaches p = 1


def test_llama_embd_mirror():
    # passed by value, and not in the adapter's layout table: the layout it must have
    assert ctypes.sizeof(llama_h.llama_embd) == 3 * ctypes.sizeof(ctypes.c_void_p)
    assert [getattr(llama_h.llama_embd, f).offset for f in ("data", "n_rows", "n_embd")] == \
        [0, ctypes.sizeof(ctypes.c_void_p), 2 * ctypes.sizeof(ctypes.c_void_p)]
