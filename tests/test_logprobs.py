"""Log-probabilities (``logprobs=``) on every path, and the server's AsyncServerStream.

Invariants, not text: the values are a log-softmax of the raw logits (<= 0, the
top-k sums to at most 1), greedy picks the top alternative, the single-sequence
path and the server agree, and entries stay aligned with ``tokens``.
"""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.core.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, log_softmax_top, token_logprob
from llama_ctypes.engines.server.request import Status
from margins import assert_greedy_equivalent, assert_same_greedy, tops
from server_helpers import wait_idle

MODELS = ["tiny_model", pytest.param("gemma", marks=pytest.mark.gemma)]
PROMPT = "The capital of France is"
# Gemma continues it with wide top-2 gaps: batched and solo runs pick the same greedy tokens.
COUNTING = "1, 2, 3, 4, 5, 6, 7,"


@pytest.fixture(params=MODELS)
def model(request):
    return request.getfixturevalue(request.param)


def reference(row: np.ndarray) -> np.ndarray:
    """Log-softmax in float64, the textbook way."""
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def check_entries(done, k: int) -> None:
    """Invariants of a completion's entries requested with ``logprobs=k``."""
    assert done.logprobs is not None and len(done.logprobs) == len(done.tokens)
    for tok, entry in zip(done.tokens, done.logprobs):
        assert isinstance(entry, TokenLogprob) and entry.token == tok
        assert entry.logprob <= 0.0
        assert len(entry.top) == k
        assert all(a.logprob >= b.logprob for a, b in zip(entry.top, entry.top[1:]))
        assert all(t.logprob <= 0.0 and t.top == () for t in entry.top)
        assert sum(math.exp(t.logprob) for t in entry.top) <= 1.0 + 1e-6


def close_entries(a, b, tol: float) -> bool:
    """Entries of two runs agree to ``tol``: the same tokens with close logprobs, and top alternatives whose
    values agree; their order (and which token makes the top-k cut) may differ only between alternatives
    within ``tol`` of each other, as two paths' rounding can order a near tie either way."""
    return len(a) == len(b) and all(x.token == y.token and abs(x.logprob - y.logprob) <= tol
                                    and _close_tops(x.top, y.top, tol) for x, y in zip(a, b))


def _close_tops(x, y, tol: float) -> bool:
    if len(x) != len(y):
        return False
    xv, yv = {t.token: t.logprob for t in x}, {t.token: t.logprob for t in y}
    for mine, theirs, other in ((xv, yv, y), (yv, xv, x)):
        for tok, value in mine.items():
            if tok in theirs:
                if abs(value - theirs[tok]) > tol:
                    return False
            elif abs(value - other[-1].logprob) > tol:
                return False  # missing from the other's top-k though not at its cut
    # the ranks agree except among values within tol of each other
    return all(abs(s.logprob - t.logprob) <= tol for s, t in zip(x, y))


def _cut(entry, k: int):
    """``entry`` with its top alternatives cut to ``k``."""
    return lc.TokenLogprob(entry.token, entry.bytes, entry.logprob, entry.top[:k])


#: How far the tiny model's logprobs may move between a batch of rows and one row (2e-3 seen on AVX2).
TINY_BATCH_TOLERANCE = 1e-2
#: How far Gemma's probabilities may move between a batch of rows and one row (other kernels, other
#: rounding): as probabilities, since an unlikely alternative's logprob moves far more (0.2 nats at
#: p = 0.02 with AVX kernels) than the distribution does (0.005).
GEMMA_BATCH_TOLERANCE = 0.03


def close_distributions(a, b, tol: float) -> bool:
    """Like :func:`close_entries`, comparing probabilities (``exp(logprob)``) to ``tol``."""
    def prob(entry):
        return lc.TokenLogprob(entry.token, entry.bytes, math.exp(entry.logprob),
                               tuple(prob(t) for t in entry.top))
    return close_entries([prob(e) for e in a], [prob(e) for e in b], tol)


# ---- the pure function --------------------------------------------------------------------------------


def test_log_softmax_top_matches_numpy_reference():
    rng = np.random.default_rng(0)
    for n in (3, 255, 256, 1000, 32000):
        row = (rng.standard_normal(n) * 4).astype(np.float32)
        row[rng.integers(0, n, n // 10)] = -np.inf  # banned tokens
        row[rng.integers(0, n, 3)] = row.max()  # a tie for the top: the smallest id goes first, as argmax
        ref = reference(row)
        for k in (0, 1, 5, 20):
            tok = int(row.argmax())
            chosen, ids, values = log_softmax_top(row, tok, k)
            want = sorted(range(n), key=lambda i: (-row[i], i))[:min(k, n)]
            assert ids.tolist() == want
            assert chosen == pytest.approx(ref[tok], abs=1e-9)
            np.testing.assert_allclose(values, ref[want], atol=1e-9)
            if k:
                assert ids[0] == tok and values[0] == chosen
        for banned in np.flatnonzero(np.isinf(row))[:1].tolist():
            assert log_softmax_top(row, banned)[0] == -math.inf


def test_log_softmax_is_stable_and_sums_to_one():
    row = np.array([1e4, 1e4 - 1.0, -1e4, -np.inf, 3.0], dtype=np.float32)  # exp(1e4) overflows float64
    chosen, ids, values = log_softmax_top(row, 0, 5)
    assert math.isfinite(chosen) and chosen < 0
    assert np.exp(values).sum() == pytest.approx(1.0, abs=1e-12)
    assert ids.tolist() == [0, 1, 4, 2, 3] and values[-1] == -math.inf
    # nothing possible: everything is -inf, never NaN
    chosen, _, values = log_softmax_top(np.full(4, -np.inf, dtype=np.float32), 1, 2)
    assert chosen == -math.inf and (values == -math.inf).all()


def test_token_logprob_entry():
    row = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32))
    entry = token_logprob(row, 1, 2, lambda t: b"\xe2\x82" if t == 1 else bytes([97 + t]))
    assert entry.token == 1 and entry.bytes == b"\xe2\x82" and entry.text == "\ufffd"
    assert entry.logprob == pytest.approx(math.log(0.25))
    assert [(t.token, t.text) for t in entry.top] == [(0, "a"), (1, "\ufffd")]
    assert entry.top[1].logprob == entry.logprob and entry.top[0].top == ()
    with pytest.raises(AttributeError):
        entry.logprob = 0.0  # type: ignore[misc]
    assert lc.TokenLogprob is TokenLogprob


# ---- options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error", [(True, lc.ArgumentTypeError), (1.0, lc.ArgumentTypeError),
                                          ("3", lc.ArgumentTypeError), (-1, lc.InvalidArgumentError),
                                          (MAX_TOP_LOGPROBS + 1, lc.InvalidArgumentError)])
def test_logprobs_option_is_validated(tiny_model, server, value, error):
    with pytest.raises(error, match="logprobs"):
        lc.GenerationParams(logprobs=value)
    with pytest.raises(error, match="logprobs"):
        lc.generate(tiny_model, PROMPT, max_tokens=2, logprobs=value)
    with pytest.raises(error, match="logprobs"):
        server.stream(PROMPT, max_tokens=2, logprobs=value)
    assert lc.GenerationParams(logprobs=0).logprobs == 0
    assert lc.GenerationParams(logprobs=MAX_TOP_LOGPROBS).logprobs == MAX_TOP_LOGPROBS


def test_logprobs_are_none_unless_requested(tiny_model, server):
    assert lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0).logprobs is None
    stream = lc.stream(tiny_model, PROMPT, max_tokens=4, temp=0)
    assert stream.logprobs is None
    "".join(stream)
    assert stream.logprobs is None
    s = server.stream(PROMPT, max_tokens=4, temp=0)
    assert s.completion().logprobs is None and s.logprobs is None

    async def main():
        s = server.asubmit(PROMPT, max_tokens=4, temp=0)
        done = await s.completion()
        return s.logprobs, done.logprobs

    assert asyncio.run(main()) == (None, None)


# ---- single sequence ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_picks_the_top_alternative(model, k):
    done = lc.generate(model, PROMPT, max_tokens=12, temp=0, ignore_eos=True, logprobs=k)
    check_entries(done, k)
    vocab = model.vocab
    for entry in done.logprobs:
        assert entry.bytes == vocab.token_bytes(entry.token)
        if k:
            assert entry.top[0].token == entry.token and entry.top[0].logprob == entry.logprob
            assert all(t.bytes == vocab.token_bytes(t.token) for t in entry.top)
    # the stream gives the same entries, growing with the tokens
    stream = lc.stream(model, PROMPT, max_tokens=12, temp=0, ignore_eos=True, logprobs=k)
    assert stream.logprobs == []
    for _ in stream:
        assert len(stream.logprobs) == len(stream.tokens)
    assert stream.logprobs == done.logprobs


def test_top20_covers_nearly_all_mass_on_the_tiny_model(tiny_model):
    # (32000 tokens, but the random weights make a peaked distribution)
    done = lc.generate(tiny_model, PROMPT, max_tokens=6, temp=0, ignore_eos=True, logprobs=MAX_TOP_LOGPROBS)
    check_entries(done, MAX_TOP_LOGPROBS)
    mass = [sum(math.exp(t.logprob) for t in e.top) for e in done.logprobs]
    assert min(mass) > 0.99, mass


def test_values_are_the_log_softmax_of_the_context_logits(model):
    tokens = lc.Tokenizer.encode(model, PROMPT)
    with lc.Context.create(model, n_ctx=256) as ctx, lc.Sampler.create(model, temp=0) as smp:
        done = ctx.generate(smp, tokens, max_tokens=1, logprobs=5)
        row = ctx.logits(-1)  # max_tokens=1: the row the token was sampled from is the last one decoded
    ref = reference(row)
    entry = done.logprobs[0]
    assert entry.token == done.tokens[0] == int(row.argmax())
    assert entry.logprob == pytest.approx(ref[entry.token], abs=1e-6)
    order = np.argsort(-ref, kind="stable")[:5]
    assert [t.token for t in entry.top] == order.tolist()
    np.testing.assert_allclose([t.logprob for t in entry.top], ref[order], atol=1e-6)


def test_sampled_tokens_get_the_raw_distribution(tiny_model):
    # temperature and truncation change what is drawn, not the reported distribution
    greedy = lc.generate(tiny_model, PROMPT, max_tokens=1, temp=0, logprobs=MAX_TOP_LOGPROBS)
    sampled = lc.generate(tiny_model, PROMPT, max_tokens=24, temp=1.5, top_k=0, top_p=1.0, min_p=0.0,
                          seed=7, ignore_eos=True, logprobs=MAX_TOP_LOGPROBS)
    again = lc.generate(tiny_model, PROMPT, max_tokens=24, temp=1.5, top_k=0, top_p=1.0, min_p=0.0,
                        seed=7, ignore_eos=True, logprobs=MAX_TOP_LOGPROBS)
    check_entries(sampled, MAX_TOP_LOGPROBS)
    assert again.tokens == sampled.tokens and again.logprobs == sampled.logprobs
    assert sampled.logprobs[0].top == greedy.logprobs[0].top
    for entry in sampled.logprobs:
        alt = {t.token: t.logprob for t in entry.top}
        if entry.token in alt:
            assert alt[entry.token] == entry.logprob
    # each step's value against a fresh log-softmax of that step's row (a prefill: other batch shape)
    prompt = lc.Tokenizer.encode(tiny_model, PROMPT)
    with lc.Context.create(tiny_model, n_ctx=256) as ctx, lc.Sampler.create(tiny_model, temp=0) as smp:
        for i in (0, 5, 17):
            ctx.generate(smp, prompt + sampled.tokens[:i], max_tokens=1)
            ref = reference(ctx.logits(-1))
            assert sampled.logprobs[i].logprob == pytest.approx(ref[sampled.tokens[i]], abs=2e-3)


def test_bias_and_eog_keep_entries_aligned_with_tokens(tiny_model):
    eos = tiny_model.vocab.eos
    plain = lc.generate(tiny_model, PROMPT, max_tokens=1, temp=0, logprobs=2)
    assert plain.tokens and plain.tokens[0] != eos
    # a biased-in end of generation ends the run at once: no token, no entry
    ended = lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0, logit_bias={eos: 100.0}, logprobs=2)
    assert ended.finish_reason == "eog" and ended.tokens == [] and ended.logprobs == []
    # kept with ignore_eos, it is a token and has its entry: the raw value, not the biased one
    kept = lc.generate(tiny_model, PROMPT, max_tokens=3, temp=0, logit_bias={eos: 100.0}, ignore_eos=True,
                       special=True, logprobs=2)
    assert kept.tokens == [eos] * 3 and len(kept.logprobs) == 3
    first, raw = kept.logprobs[0], plain.logprobs[0]
    assert [(t.token, t.logprob) for t in first.top] == [(t.token, t.logprob) for t in raw.top]
    assert first.logprob < raw.logprob  # eos keeps its raw (unbiased) log-probability
    assert first.bytes == tiny_model.vocab.token_bytes(eos, True) == b"</s>"  # rendered as the text is


def test_stop_strings_keep_entries_aligned(model):
    full = lc.generate(model, PROMPT, max_tokens=16, temp=0, ignore_eos=True)
    stop = full.text[len(full.text) // 2:][:3]
    done = lc.generate(model, PROMPT, max_tokens=16, temp=0, ignore_eos=True, stop=[stop], logprobs=1)
    assert done.finish_reason == "stop"
    check_entries(done, 1)


# ---- the server ---------------------------------------------------------------------------------------


def test_server_matches_single_sequence(tiny_model, server):
    solo = lc.generate(tiny_model, PROMPT, max_tokens=16, temp=0, ignore_eos=True, logprobs=5, cache_prompt=False)
    got = server.generate(PROMPT, max_tokens=16, temp=0, ignore_eos=True, logprobs=5, cache_prompt=False)
    check_entries(got, 5)
    n = assert_greedy_equivalent(got, solo, what="server vs solo")
    assert close_entries(got.logprobs[:n], solo.logprobs[:n], TINY_BATCH_TOLERANCE)


@pytest.mark.gemma
def test_gemma_server_matches_single_sequence(gemma):
    solo = lc.generate(gemma, COUNTING, max_tokens=12, temp=0, ignore_eos=True, logprobs=3, cache_prompt=False)
    with lc.Server(model=gemma, n_parallel=2, n_ctx=256, kv_unified=False, cache_prompt=False) as srv:
        streams = [srv.stream(COUNTING, max_tokens=12, temp=0, ignore_eos=True, logprobs=3) for _ in range(2)]
        got = [s.completion() for s in streams]  # two in one batch: batched kernels
    for done in got:
        check_entries(done, 3)
        # the same greedy tokens up to a near tie, whose rounding batched kernels may break the other way;
        # the values agree to kernel noise up to there (the top-3 order only where it is not a near tie)
        n = assert_greedy_equivalent(done, solo, what="2 in a batch vs solo")
        assert n >= 4, f"diverged at {n}: the counting prompt has clear margins for its first tokens"
        assert close_distributions(done.logprobs[:n], solo.logprobs[:n], GEMMA_BATCH_TOLERANCE)


def test_server_stream_entries_keep_step_with_its_text(server):
    stream = server.stream(PROMPT, max_tokens=24, temp=0, ignore_eos=True, logprobs=2)
    assert stream.logprobs == []
    for _ in stream:
        read = b"".join(e.bytes for e in stream.logprobs).decode("utf-8", errors="replace")
        assert read.startswith(stream.text)  # the entries behind every piece read have arrived
        assert len(stream.logprobs) <= len(stream.tokens)
    assert stream.logprobs == stream.completion().logprobs and len(stream.logprobs) == 24


def test_server_logprobs_per_request_among_others(tiny_model, server):
    # a batch mixing requests with and without logprobs, and a sampled one
    streams = [server.stream(f"mixed {i}", max_tokens=10, temp=0, ignore_eos=True, cache_prompt=False,
                             **({"logprobs": i} if i % 2 else {})) for i in range(4)]
    sampled = server.stream("mixed sampled", max_tokens=10, temp=1.0, seed=3, ignore_eos=True, logprobs=4)
    done = [s.completion() for s in streams]
    for i, d in enumerate(done):
        if i % 2:
            check_entries(d, i)
            solo = lc.generate(tiny_model, f"mixed {i}", max_tokens=10, temp=0, ignore_eos=True,
                               logprobs=max(i, 2))
            n = assert_same_greedy(d.tokens, solo.tokens, tops(solo.logprobs), what=f"mixed {i}")
            assert close_entries(d.logprobs[:n], [_cut(e, i) for e in solo.logprobs[:n]], TINY_BATCH_TOLERANCE)
        else:
            assert d.logprobs is None
    check_entries(sampled.completion(), 4)


def test_server_default_logprobs_and_eog(tiny_model):
    eos = tiny_model.vocab.eos
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=256, logprobs=1) as srv:
        done = srv.generate(PROMPT, max_tokens=5, temp=0, ignore_eos=True)
        check_entries(done, 1)
        ended = srv.generate(PROMPT, max_tokens=5, temp=0, logit_bias={eos: 100.0})
        assert ended.finish_reason == "eog" and ended.tokens == [] and ended.logprobs == []
        assert srv.generate(PROMPT, max_tokens=2, logprobs=None).logprobs is None


# ---- AsyncServerStream --------------------------------------------------------------------------------


async def _until_idle(server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while server.stats()["active_slots"] or server.stats()["queue_length"]:
        assert time.monotonic() < deadline, server.stats()
        await asyncio.sleep(0.005)


def test_async_stream_pieces_and_completion(tiny_model, server):
    # (cache_prompt=False: a reused prefix was computed in other batch shapes, which moves the values)
    opts = dict(max_tokens=12, temp=0, ignore_eos=True, logprobs=2, cache_prompt=False)
    sync = server.generate(PROMPT, **opts)

    async def main():
        async with server.asubmit(PROMPT, **opts) as s:
            assert isinstance(s, lc.AsyncServerStream) and s.finish_reason is None
            assert s.prompt_tokens == len(lc.Tokenizer.encode(tiny_model, PROMPT))
            pieces = [p async for p in s]
            return s, pieces, await s.completion()

    s, pieces, done = asyncio.run(main())
    assert "".join(pieces) == s.text == done.text == sync.text
    assert s.finish_reason == done.finish_reason == "length"
    assert s.tokens == done.tokens == sync.tokens
    assert s.logprobs == done.logprobs and close_entries(done.logprobs, sync.logprobs, 1e-6)
    assert s.timings.generated_tokens == 12 and done.prompt_tokens == s.prompt_tokens
    assert s.request.status is Status.FINISHED


def test_async_token_prompt_and_astream_agenerate_still_work(tiny_model, server):
    ids = lc.Tokenizer.encode(tiny_model, PROMPT)

    async def main():
        a = await server.asubmit(ids, max_tokens=6, temp=0, ignore_eos=True).completion()
        b = await server.agenerate(ids, max_tokens=6, temp=0, ignore_eos=True, logprobs=0)
        c = [p async for p in server.astream(ids, max_tokens=6, temp=0, ignore_eos=True)]
        return a, b, c

    a, b, c = asyncio.run(main())
    assert a.tokens == b.tokens and "".join(c) == a.text == b.text
    check_entries(b, 0)


def test_eight_concurrent_tasks_equal_sync_generate(server):
    prompts = [f"Request number {i} says" for i in range(8)]
    opts = dict(max_tokens=10, temp=0, ignore_eos=True, logprobs=2, cache_prompt=False)
    sync = [server.generate(p, **opts) for p in prompts]

    async def one(p):
        async with server.asubmit(p, **opts) as s:
            pieces = [piece async for piece in s]
            return "".join(pieces), await s.completion()

    async def main():
        return await asyncio.gather(*[one(p) for p in prompts])

    for (text, done), want in zip(asyncio.run(main()), sync):
        assert text == done.text
        # 8 in a batch vs one at a time: the same greedy tokens up to a near tie, values to rounding
        n = assert_greedy_equivalent(done, want, what="8 concurrent vs alone")
        assert close_entries(done.logprobs[:n], want.logprobs[:n], TINY_BATCH_TOLERANCE)
        if n == len(want.tokens):
            assert done.text == want.text
    wait_idle(server)


def slow_ticks(monkeypatch, server, seconds: float = 0.005) -> None:
    """Slow each decode down, so a long request is still running when the test acts."""
    engine = server._engine
    real = engine._decode

    def slow(batch):
        time.sleep(seconds)
        return real(batch)

    monkeypatch.setattr(engine, "_decode", slow)


def test_async_cancel_paths_free_the_slot(server, monkeypatch):
    slow_ticks(monkeypatch, server)
    opts = dict(max_tokens=5000, temp=0, ignore_eos=True)

    async def main():
        # 1. cancelling the consuming task
        async def consume(s):
            async for _ in s:
                pass

        s = server.asubmit("cancel the task", **opts)
        task = asyncio.create_task(consume(s))
        while not s.tokens:
            await asyncio.sleep(0.005)
        assert server.stats()["active_slots"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_idle(server)
        # 2. aclose, twice; the closed stream yields nothing more and has no completion
        s = server.asubmit("close me", **opts)
        await s.__anext__()
        await s.aclose()
        await s.aclose()
        await _until_idle(server)
        assert [p async for p in s] == []
        with pytest.raises(lc.CancelledError):
            await s.completion()
        # 3. leaving ``async with`` early
        async with server.asubmit("leave early", **opts) as s:
            async for _ in s:
                break
        await _until_idle(server)
        # 4. cancel() from another thread: the reading task gets CancelledError after its pieces
        s = server.asubmit("cancel from a thread", **opts)
        await s.__anext__()
        threading.Timer(0.05, s.cancel).start()
        with pytest.raises(lc.CancelledError):
            async for _ in s:
                pass
        assert 0 < len(s.tokens) < 5000 and s.finish_reason is None
        assert [p async for p in s] == []  # ended: nothing more, no wait
        with pytest.raises(lc.CancelledError):
            await asyncio.wait_for(s.completion(), 5)
        await _until_idle(server)
        # 5. a stream dropped after a ``break`` (async for does not close plain iterators)
        s = server.asubmit("dropped", **opts)
        async for _ in s:
            break
        del s
        gc.collect()
        await _until_idle(server)
        # 6. server.cancel() accepts the stream
        s = server.asubmit("server cancel", **opts)
        server.cancel(s)
        with pytest.raises(lc.CancelledError):
            await s.completion()

    asyncio.run(main())
    wait_idle(server)
    assert server.kv_positions() == [-1] * 4


def test_asubmit_raises_synchronously(tiny_model, server, monkeypatch):
    with pytest.raises(RuntimeError, match="event loop"):
        server.asubmit(PROMPT)

    async def main():
        with pytest.raises(lc.ArgumentTypeError, match="logprobs"):
            server.asubmit(PROMPT, logprobs=True)
        with pytest.raises(lc.InvalidArgumentError, match="logprobs"):
            server.asubmit(PROMPT, logprobs=99)
        with pytest.raises(TypeError):
            server.asubmit(PROMPT, no_such_option=1)
        with pytest.raises(lc.ContextOverflowError):
            server.asubmit("word " * 600)

    asyncio.run(main())
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=256, max_queue=1) as srv:
        slow_ticks(monkeypatch, srv)

        async def queue_full():
            running = srv.asubmit("busy", max_tokens=400, temp=0, ignore_eos=True)
            await running.__anext__()  # admitted: the next one waits in the queue
            waiting = srv.asubmit("waiting", max_tokens=400, temp=0, ignore_eos=True)
            t0 = time.monotonic()
            with pytest.raises(lc.QueueFullError):
                srv.asubmit("one too many", max_tokens=4)  # no await: refused at the call
            assert time.monotonic() - t0 < 1.0
            await waiting.aclose()  # a waiting request leaves the queue at once
            assert srv.stats()["queue_length"] == 0
            await running.aclose()
            await _until_idle(srv)

        asyncio.run(queue_full())
    srv_closed = lc.Server(model=tiny_model, n_parallel=1, n_ctx=256)
    srv_closed.close()

    async def closed():
        with pytest.raises(lc.ServerClosedError):
            srv_closed.asubmit(PROMPT)

    asyncio.run(closed())


def test_async_stream_raises_the_request_error(server, monkeypatch):
    engine = server._engine
    real = engine._decode
    calls = {"n": 0}

    def fail_once(batch):
        calls["n"] += 1
        return -3 if calls["n"] == 1 else real(batch)  # (a compute error: 1, a full KV, would requeue it)

    monkeypatch.setattr(engine, "_decode", fail_once)

    async def main():
        s = server.asubmit("this one fails", max_tokens=5, temp=0)
        with pytest.raises(lc.DecodeError):
            async for _ in s:
                pass
        return await server.asubmit("this one works", max_tokens=5, temp=0, ignore_eos=True).completion()

    assert asyncio.run(main()).tokens
    wait_idle(server)


def test_chat_reply_carries_logprobs(tiny_model):
    messages = [{"role": "user", "content": "Hello"}]
    reply = lc.chat(tiny_model, messages, chat_template="chatml", max_tokens=6, temp=0, logprobs=2)
    assert reply.logprobs is not None and len(reply.logprobs) == len(reply.tokens)
    assert [e.token for e in reply.logprobs] == reply.tokens
    assert all(e.top[0].token == e.token and len(e.top) == 2 for e in reply.logprobs)
    assert lc.chat(tiny_model, messages, chat_template="chatml", max_tokens=2, temp=0).logprobs is None


def test_chat_completion_carries_openai_logprobs_whole_and_streamed(tiny_model):
    messages = [{"role": "user", "content": "Hello"}]
    opts = dict(chat_template="chatml", max_tokens=6, temp=0, ignore_eos=True)
    reply = lc.chat(tiny_model, messages, logprobs=2, **opts)
    out = lc.chat_completion(tiny_model, messages, logprobs=2, **opts)
    content = out["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [e.text for e in reply.logprobs]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
               and e["logprob"] == e["top_logprobs"][0]["logprob"] for e in content)
    assert "".join(e["token"] for e in content) == out["choices"][0]["message"]["content"]
    assert lc.chat_completion(tiny_model, messages, **opts)["choices"][0]["logprobs"] is None
    # logprobs=0: the chosen tokens, no alternatives
    assert all(e["top_logprobs"] == [] for e in
               lc.chat_completion(tiny_model, messages, logprobs=0, **opts)["choices"][0]["logprobs"]["content"])
    # streamed: each token's entry arrives once, in order, on the chunks (none on the role chunk)
    chunks = list(lc.stream_chat_completion(tiny_model, messages, logprobs=2, **opts))
    assert chunks[0]["choices"][0]["logprobs"] is None
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}}}
    called = lc.chat_completion(tiny_model, messages, tools=[tool], logprobs=1, chat_template="chatml",
                                max_tokens=40, temp=0, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert called["choices"][0]["logprobs"]["content"]  # (the tool path: llama.cpp plans the prompt)
    assert len(called["choices"][0]["logprobs"]["content"]) == called["usage"]["completion_tokens"]


def test_asubmit_from_a_worker_thread_for_a_loop(server):
    async def main():
        loop = asyncio.get_running_loop()
        stream = await asyncio.to_thread(lambda: server.asubmit("Hello", loop=loop, max_tokens=6, temp=0,
                                                                 ignore_eos=True, cache_prompt=False))
        text = "".join([piece async for piece in stream])
        return text, stream
    text, stream = asyncio.run(main())
    assert text == stream.text and len(stream.tokens) == 6
    assert text == server.generate("Hello", max_tokens=6, temp=0, ignore_eos=True, cache_prompt=False)
    with pytest.raises(RuntimeError, match="loop="):
        server.asubmit("Hello", max_tokens=1)
    with pytest.raises(lc.ArgumentTypeError):
        server.asubmit("Hello", loop="nope", max_tokens=1)


# ---- post-sampling probabilities (llama-server's post_sampling_probs) ----------------------------

def _check_post(done, top_k: int) -> None:
    """Entries of a run with ``post_sampling=True`` under top-k truncation: the candidates left are
    the k best of the raw row, their probabilities sum to one, and the chosen token is among them."""
    assert len(done.logprobs) == len(done.tokens)
    for entry in done.logprobs:
        probs = [math.exp(alt.logprob) for alt in entry.top]
        assert 0 < len(entry.top) <= top_k and all(0 < p <= 1 for p in probs)
        assert probs == sorted(probs, reverse=True)
        assert sum(probs) == pytest.approx(1.0, abs=1e-4)  # (all k candidates are listed)
        chosen = next(alt for alt in entry.top if alt.token == entry.token)
        assert chosen.logprob == entry.logprob


def test_post_sampling_reports_what_the_chain_left_and_draws_the_same_tokens(tiny_model):
    # (both cold: the same logits, not a cached prefix's)
    opts = dict(max_tokens=10, temp=0.9, top_k=4, seed=123, ignore_eos=True, cache_prompt=False)
    plain = lc.generate(tiny_model, PROMPT, **opts, logprobs=4)
    post = lc.generate(tiny_model, PROMPT, **opts, logprobs=4, post_sampling=True)
    assert post.tokens == plain.tokens  # (the same chain, the same seed, the same logits)
    _check_post(post, 4)
    # what the chain left is the raw distribution over its best tokens (top-k, then top-p and min-p
    # may cut more), renormalised at temperature 0.9
    for raw, entry in zip(plain.logprobs, post.logprobs):
        left = [alt.token for alt in entry.top]
        assert left == [alt.token for alt in raw.top][:len(left)]
        scaled = {alt.token: alt.logprob / 0.9 for alt in raw.top if alt.token in left}
        norm = math.log(sum(math.exp(v) for v in scaled.values()))
        for alt in entry.top:
            assert alt.logprob == pytest.approx(scaled[alt.token] - norm, abs=1e-4)
    greedy = lc.generate(tiny_model, PROMPT, max_tokens=4, temp=0, logprobs=3, post_sampling=True)
    assert all(e.logprob == 0.0 and [a.token for a in e.top] == [e.token] for e in greedy.logprobs)
    with pytest.raises(ValueError, match="logprobs"):
        lc.generate(tiny_model, PROMPT, max_tokens=2, post_sampling=True)


def test_post_sampling_in_a_server_with_other_requests(tiny_model):
    opts = dict(max_tokens=8, temp=0.9, top_k=4, seed=7, ignore_eos=True, cache_prompt=False)
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=128) as srv:
        plain = srv.generate(PROMPT, **opts, logprobs=4)
        post = srv.generate(PROMPT, **opts, logprobs=4, post_sampling=True)
        assert post.tokens == plain.tokens  # solo both times: the same logits and the same draws
        _check_post(post, 4)
        # beside a request that asks for raw logprobs, each gets its own kind
        a = srv.stream(PROMPT, **opts, logprobs=4, post_sampling=True)
        b = srv.stream("Another prompt", **{**opts, "temp": 0}, logprobs=4)
        done_a, done_b = a.completion(), b.completion()
        _check_post(done_a, 4)
        # greedy and raw: four alternatives of the whole row (post-sampling would leave the chosen one alone)
        assert all(len(e.top) == 4 and e.top[0].token == e.token and e.logprob < 0 for e in done_b.logprobs)
        wait_idle(srv)
