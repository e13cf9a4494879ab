"""The continuous-batching server: equality with solo runs, cancellation, backpressure, asyncio, faults."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

import llama_ctypes as lc
from llama_ctypes.engines.server.strategies import Balanced, DecodeMaximal, PrefillPriority
from margins import assert_greedy_equivalent
from server_helpers import wait_idle

PROMPTS = [f"Request number {i} says" for i in range(8)]





def _concurrently(fn, args):
    results, errors = [None] * len(args), []

    def run(i, a):
        try:
            results[i] = fn(a)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("strategy", [DecodeMaximal, PrefillPriority, Balanced])
def test_concurrent_greedy_equals_solo(tiny_model, strategy):
    solo = [lc.generate(tiny_model, p, max_tokens=20, temp=0, ignore_eos=True).tokens for p in PROMPTS]
    with lc.Server(model=tiny_model, n_parallel=4, n_ctx=512, batch_strategy=strategy, n_batch=64,
                   cache_prompt=False, kv_unified=False) as srv:
        got = _concurrently(lambda p: srv.generate(p, max_tokens=20, temp=0, ignore_eos=True).tokens, PROMPTS)
        assert got == solo
        assert srv.stats()["avg_batch_tokens"] > 1  # requests really shared ticks
        wait_idle(srv)
        assert srv.kv_positions() == [-1] * 4  # without the prefix cache nothing stays in KV


@pytest.mark.gemma
def test_gemma_concurrent_greedy_equals_solo(gemma):
    prompts = ["1, 2, 3, 4, 5,", "Monday, Tuesday, Wednesday,", "a, b, c, d, e,", "January, February, March,",
               "10, 20, 30, 40,", "red, orange, yellow,", "one, two, three, four,", "A B C D E F"]
    solo = [lc.generate(gemma, p, max_tokens=8, temp=0, ignore_eos=True, logprobs=2) for p in prompts]
    with lc.Server(model=gemma, n_parallel=4, n_ctx=256) as srv:
        got = _concurrently(lambda p: srv.generate(p, max_tokens=8, temp=0, ignore_eos=True), prompts)
    # batching changes kernel paths: equal up to a near tie of the two best tokens (margins.py)
    for g, s, p in zip(got, solo, prompts):
        assert_greedy_equivalent(g, s, what=p)


@pytest.mark.parametrize("which", ["tiny", pytest.param("gemma", marks=pytest.mark.gemma)])
def test_native_chain_rows_drawn_on_several_threads_give_the_solo_answers(which, tiny_model, request):
    """A tick's rows sampled by native chains are drawn on the decode's threads at once; each chain keeps its
    own state, so every request gets what it gets alone. top_k=1 at temperature 1 runs the whole chain (dist
    included) and picks the argmax, so the answers are comparable with greedy references."""
    model = tiny_model if which == "tiny" else request.getfixturevalue("gemma")
    opts = dict(temp=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    solo = [lc.generate(model, p, temp=0, max_tokens=16, ignore_eos=True, logprobs=5) for p in PROMPTS]
    with lc.Server(model=model, n_parallel=8, n_ctx=1024, n_threads=2, cache_prompt=False) as srv:
        got = _concurrently(lambda p: srv.generate(p, seed=7, **opts), PROMPTS)
        seeded = [srv.stream(p, temp=1.0, top_k=40, seed=i, max_tokens=12, ignore_eos=True)
                  for i, p in enumerate(PROMPTS)]
        seeded = [s.completion() for s in seeded]
        stats = srv.stats()
    assert stats["concurrent_sampled_rows"] > 0 and stats["avg_busy_slots"] > 2
    for g, s, p in zip(got, solo, PROMPTS):
        assert_greedy_equivalent(g, s, what=p)
    assert all(len(s.tokens) == 12 for s in seeded)


def test_per_request_seed_and_options(server):
    a = server.generate("Hello", max_tokens=12, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    b = server.generate("Hello", max_tokens=12, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    assert a.tokens == b.tokens
    constrained = server.generate("x", grammar='root ::= "yes" | "no"', temp=0)
    assert constrained in ("yes", "no") and constrained.finish_reason == "eog"
    full = server.generate("Hello", max_tokens=30, temp=0, ignore_eos=True)
    stop = full.text.split()[len(full.text.split()) // 2]
    stopped = server.generate("Hello", max_tokens=30, temp=0, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:full.text.index(stop)]
    assert server.generate_tokens(server.get_model().tokenize("Hello"), max_tokens=30, temp=0,
                                  ignore_eos=True).tokens == full.tokens
    with pytest.raises(TypeError, match="tmp"):
        server.generate("Hello", tmp=0.5)
    with pytest.raises(lc.GrammarError):
        server.generate("Hello", grammar="root ::= (")


def test_streams_cancelled_early_free_their_slots(server):
    for i in range(200):
        stream = server.stream(f"Cancel me {i % 7}", max_tokens=500, temp=0, ignore_eos=True)
        for j, _ in enumerate(stream):
            if j == 1:
                break
        stream.close()
    wait_idle(server)
    assert server.kv_positions() == [-1] * 4
    # dropped (garbage-collected) streams are cancelled too
    stream = server.stream("dropped", max_tokens=500, temp=0, ignore_eos=True)
    next(stream)
    del stream
    gc.collect()
    wait_idle(server)
    assert server.kv_positions() == [-1] * 4


def test_explicit_cancel(server):
    stream = server.stream("cancel explicitly", max_tokens=500, temp=0, ignore_eos=True)
    next(stream)
    server.cancel(stream)
    with pytest.raises(lc.CancelledError):
        for _ in stream:
            pass
    assert len(stream.tokens) < 500
    wait_idle(server)


def test_queue_full_raises_at_once(tiny_model):
    events = []
    lc.telemetry.attach("queue-test", ["server.queue_full"], lambda e, m, md: events.append(m))
    try:
        with lc.Server(model=tiny_model, n_parallel=1, n_ctx=512, max_queue=2) as srv:
            running = [srv.stream("busy", max_tokens=400, temp=0, ignore_eos=True)]
            next(running[0])  # admitted and running: the next two wait
            running += [srv.stream(f"busy {i}", max_tokens=400, temp=0, ignore_eos=True) for i in range(2)]
            t0 = time.monotonic()
            with pytest.raises(lc.QueueFullError):
                srv.stream("one too many", max_tokens=5)
            assert time.monotonic() - t0 < 1.0
            for s in running:
                s.close()
        assert events and events[0]["queue_length"] == 2
    finally:
        lc.telemetry.detach("queue-test")


def test_asyncio_requests_do_not_block_the_loop(server, tiny_model):
    expected = lc.generate(tiny_model, "async 3", max_tokens=16, temp=0, ignore_eos=True).tokens

    async def main():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(*[server.agenerate(f"async {i}", max_tokens=16, temp=0, ignore_eos=True)
                                         for i in range(32)])
        pieces = [p async for p in server.astream("async 3", max_tokens=16, temp=0, ignore_eos=True)]
        stop.set()
        await tick
        return results, pieces, gaps

    results, pieces, gaps = asyncio.run(main())
    assert len(results) == 32 and all(len(r.tokens) == 16 for r in results)
    assert results[3].tokens == expected
    assert "".join(pieces) == results[3].text
    assert max(gaps) < 0.25  # the loop kept running while 32 requests were served


def test_a_tick_hands_its_pieces_to_the_event_loop_at_once(server):
    """The pieces of one tick reach an event loop in one hand-off (one wake-up of its thread), not one
    per stream: 4 streams x 24 tokens arrive whole, in order, with far fewer wake-ups than pieces."""
    from llama_ctypes.engines.server.request import _mailbox

    async def main():
        box = _mailbox(asyncio.get_running_loop())
        before = box.wakeups
        streams = [server.asubmit(f"hand-off {i}", max_tokens=24, temp=0, ignore_eos=True) for i in range(4)]
        texts = []
        for st in streams:
            texts.append([p async for p in st])
        return streams, texts, box.wakeups - before

    streams, texts, wakeups = asyncio.run(main())
    for st, pieces in zip(streams, texts):
        assert len(st.tokens) == 24 and "".join(pieces) == st.text
        spelled = b"".join(lc.Tokenizer.token_bytes(server.model, t) for t in st.tokens)
        assert st.text == spelled.decode("utf-8", errors="replace")  # nothing lost, nothing reordered
    items = sum(len(p) for p in texts) + len(streams)  # the pieces and each stream's end
    assert items >= 4 * 20 and wakeups <= items // 2, (wakeups, items)


def test_cancelling_an_asyncio_task_frees_its_slot(server):
    async def main():
        task = asyncio.create_task(server.agenerate("long", max_tokens=5000, temp=0, ignore_eos=True))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(server)
    assert server.kv_positions() == [-1] * 4


def test_greedy_rows_of_a_tick_take_one_argmax(tiny_model):
    """A tick whose rows are mostly plain greedy takes their tokens from one argmax over the logits
    block (the very memory of each row's own view); the sampled request of the tick samples alone."""
    srv = lc.Server(model=tiny_model, n_parallel=4, n_ctx=512, n_threads=1)
    engine = srv._engine
    blocks, view = [], engine.lease.logits_view_fn()
    rows_view = engine._logits_rows

    def checked(rows):
        block = rows_view(rows)
        if block is not None:
            for k, row in enumerate(rows):  # (the same memory as each row's own view)
                assert block[k].ctypes.data == view(row).ctypes.data
            if len(rows) >= 3:  # a row left out: not one block
                assert rows_view([rows[0], rows[-1]]) is None
            blocks.append(len(rows))
        return block

    engine._logits_rows = checked
    try:
        opts = dict(max_tokens=24, ignore_eos=True)
        streams = [srv.stream(f"greedy {i}", temp=0, **opts) for i in range(3)]
        streams.append(srv.stream("sampled", temp=0.8, seed=7, **opts))
        done = [st.completion() for st in streams]
    finally:
        srv.close()
    assert blocks and max(blocks) == 4  # the three greedy rows and the sampled one, in one block
    assert all(len(c.tokens) == 24 for c in done)
    for i in range(3):
        ref = lc.generate(tiny_model, f"greedy {i}", temp=0, logprobs=2, n_ctx=512, **opts)
        assert_greedy_equivalent(done[i], ref)


def test_sixteen_threads_share_one_server(server, tiny_model):
    prompts = [f"thread {i}" for i in range(16)]
    solo = [lc.generate(tiny_model, p, max_tokens=10, temp=0, ignore_eos=True).tokens for p in prompts]
    got = _concurrently(lambda p: server.generate(p, max_tokens=10, temp=0, ignore_eos=True).tokens, prompts)
    assert got == solo


def test_unified_kv_under_concurrency_matches_solo_where_margins_are_clear(tiny_model):
    # With one KV buffer for all slots, attention runs over cells of every sequence (masked), so
    # a request's logits move by rounding with its batch-mates; greedy choices can flip only at
    # near-ties. Every request completes; nearly all match their solo run.
    prompts = [f"unified {i} says" for i in range(16)]
    solo = [lc.generate(tiny_model, p, max_tokens=10, temp=0, ignore_eos=True).tokens for p in prompts]
    with lc.Server(model=tiny_model, n_parallel=4, n_ctx=512) as srv:
        got = _concurrently(lambda p: srv.generate(p, max_tokens=10, temp=0, ignore_eos=True).tokens, prompts)
    assert all(len(g) == 10 for g in got)
    assert sum(g == s for g, s in zip(got, solo)) >= 14


def test_close_under_load_ends_every_request(tiny_model):
    srv = lc.Server(model=tiny_model, n_parallel=2, n_ctx=512)
    streams = [srv.stream(f"load {i}", max_tokens=5000, temp=0, ignore_eos=True) for i in range(6)]
    next(streams[0])
    outcomes = []

    def consume(s):
        try:
            for _ in s:
                pass
            outcomes.append("finished")
        except lc.ServerClosedError:
            outcomes.append("closed")

    threads = [threading.Thread(target=consume, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    time.sleep(0.1)
    srv.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert outcomes.count("closed") >= 4
    with pytest.raises(lc.ServerClosedError):
        srv.generate("after close")
    assert lc.generate(tiny_model, "model still fine", max_tokens=2, temp=0).tokens


def test_a_failed_decode_fails_only_its_requests(server, monkeypatch):
    engine = server._engine
    real = engine._decode
    calls = {"n": 0}

    def fail_once(batch):
        calls["n"] += 1
        return -3 if calls["n"] == 1 else real(batch)  # (a compute error; 1, a full KV, fails one request)

    monkeypatch.setattr(engine, "_decode", fail_once)
    with pytest.raises(lc.DecodeError):
        server.generate("this one fails", max_tokens=5, temp=0)
    assert server.generate("this one works", max_tokens=5, temp=0, ignore_eos=True).tokens
    wait_idle(server)


def test_shared_kv_lets_one_slot_fill_the_pool_and_a_full_pool_stops_only_the_last_arrival(tiny_model):
    # 4 slots x 64 tokens: 256 KV cells. Split, a slot holds 64; shared, one request may use them all.
    opts = dict(model=tiny_model, n_parallel=4, n_ctx=64, n_batch=64, temp=0, ignore_eos=True)
    with lc.Server(**opts) as split:
        assert split.n_ctx == 64 and len(split.generate("one long answer", max_tokens=200).tokens) < 64
    with lc.Server(**opts, share_kv=True) as srv:
        pool = srv.n_ctx
        assert pool == 256 and srv.slots()[0].n_ctx == pool
        solo = srv.generate("one long answer", max_tokens=200)
        assert len(solo.tokens) == 200 and solo.finish_reason == "length"
        with pytest.raises(lc.ContextOverflowError):
            srv.generate("word " * 300, max_tokens=4)  # longer than the whole pool
        # Four requests of 100 tokens need ~420 cells: the pool fills while all four run.
        streams = [srv.stream(f"request {i}", max_tokens=100) for i in range(4)]  # (arrival order)
        results = []
        for st in streams:
            try:
                results.append(len(st.completion().tokens))
            except lc.KVPoolFullError as exc:
                results.append(exc)
        failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
        assert failed and 3 in failed, results  # the last to arrive goes first
        assert all("context size has been exceeded" in str(results[i]).lower() for i in failed)
        assert all(results[i] == 100 for i in range(4) if i not in failed)  # the others went on to the end
        assert len(failed) < 4
        wait_idle(srv)
        again = srv.generate("one long answer", max_tokens=200)  # the pool is whole again
        assert len(again.tokens) == 200
    with pytest.raises(ValueError, match="share_kv"):
        lc.Server(model=tiny_model, share_kv=True, kv_unified=False)


def test_shared_kv_a_request_that_does_not_fit_yet_waits_instead_of_failing(tiny_model):
    # 2 slots x 128 tokens: 256 cells. A fills most of them; B's prompt arrives when it cannot fit.
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=128, n_batch=128, temp=0, ignore_eos=True,
                   share_kv=True, cache_prompt=False) as srv:
        a = srv.stream("x", max_tokens=240)
        while len(a.tokens) < 200:
            next(iter(a))
        b = srv.stream("y " * 80, max_tokens=5)
        assert len(b.completion().tokens) == 5  # it waited for A's cells, then ran
        assert len(a.completion().tokens) == 240
        wait_idle(srv)


def test_prompt_too_long_for_a_slot(server):
    with pytest.raises(lc.ContextOverflowError):
        server.generate("word " * 600, max_tokens=4)
    assert server.generate("fine", max_tokens=2, temp=0, ignore_eos=True).tokens


def test_telemetry_events(server):
    seen = []
    lc.telemetry.attach("t1", ["server.request.start", "server.request.stop", "server.tick",
                               "server.request.cancelled"], lambda e, m, md: seen.append((e, dict(m), dict(md))))
    lc.telemetry.attach("broken", ["server.tick"], lambda e, m, md: 1 / 0)  # must not break the server
    try:
        done = server.generate("telemetry", max_tokens=6, temp=0, ignore_eos=True)
        s = server.stream("cancel", max_tokens=500, temp=0, ignore_eos=True)
        next(s)
        s.close()
        wait_idle(server)
    finally:
        assert lc.telemetry.detach("t1") and lc.telemetry.detach("broken")
    names = [e for e, _, _ in seen]
    assert "server.request.start" in names and "server.tick" in names and "server.request.cancelled" in names
    stop = next(m for e, m, md in seen if e == "server.request.stop" and md["finish_reason"] == "length")
    assert stop["generated_tokens"] == len(done.tokens) and stop["ttft_ms"] > 0 and stop["prompt_tokens"] > 0
    tick = next(m for e, m, _ in seen if e == "server.tick")
    assert tick["batch_tokens"] == tick["decode_tokens"] + tick["prefill_tokens"]
    with pytest.raises(ValueError):
        lc.telemetry.attach("dup", ["x"], print)
        lc.telemetry.attach("dup", ["y"], print)
    lc.telemetry.detach("dup")


def test_stats_split_the_scheduler_threads_time(server):
    before = server.stats()["tick_seconds"]
    server.generate("where does the time go", max_tokens=16, temp=0, ignore_eos=True)
    after = server.stats()["tick_seconds"]
    assert set(after) == {"admit", "draft", "schedule", "decode", "sample", "update", "text", "handoff"}
    grew = {k for k in after if after[k] > before[k]}
    assert {"admit", "schedule", "decode", "sample", "update", "text", "handoff"} <= grew, (before, after)
    assert after["update"] - before["update"] >= (after["text"] - before["text"]) + (after["handoff"] - before["handoff"])


def test_strategies_split_the_budget():
    decoding = ["d1", "d2", "d3"]
    prefilling = [("p1", 10), ("p2", 10)]
    dm = DecodeMaximal().plan(decoding, prefilling, 8)
    assert dm.decode == decoding and dm.prefill == [("p1", 5)]
    pp = PrefillPriority().plan(decoding, prefilling, 8)
    assert pp.decode == [] and pp.prefill == [("p1", 8)]
    pp2 = PrefillPriority().plan(decoding, [("p1", 3)], 8)
    assert pp2.decode == decoding and pp2.prefill == [("p1", 3)]
    bal = Balanced().plan(decoding, prefilling, 8)
    assert bal.decode == decoding and bal.prefill == [("p1", 5)] and bal.n_tokens == 8
    bal2 = Balanced().plan(["d"] * 10, prefilling, 8)
    assert len(bal2.decode) == 4 and bal2.prefill == [("p1", 4)]
    assert Balanced().plan(["d"] * 10, [], 8).decode == ["d"] * 8


def test_server_options_are_validated(tiny_model, tiny_model_path):
    with pytest.raises(TypeError, match="exactly one"):
        lc.Server()
    with pytest.raises(TypeError, match="n_parallelz"):
        lc.Server(model=tiny_model, n_parallelz=2)
    with pytest.raises(ValueError):
        lc.Server(model=tiny_model, n_parallel=0)
    with pytest.raises(TypeError, match="batch_strategy"):
        lc.Server(model=tiny_model, batch_strategy="fast")
    with lc.Server(model_path=tiny_model_path, n_parallel=2, temp=0, max_tokens=3) as owned:
        assert len(owned.generate("defaults apply").tokens) <= 3
    assert owned.model.closed  # a server that loaded its model closes it


def test_slots_show_what_runs_where_and_refuse_after_close(tiny_model):
    srv = lc.Server(model=tiny_model, n_parallel=2, n_ctx=256, temp=0, seed=7)
    try:
        assert srv.defaults["seed"] == 7 and srv.defaults["temp"] == 0
        idle = srv.slots()
        assert [s.id for s in idle] == [0, 1] and not any(s.is_processing for s in idle)
        assert all(s.n_ctx == 256 for s in idle)
        stream = srv.stream(PROMPTS[0], max_tokens=200, ignore_eos=True)
        next(iter(stream))  # running: one slot holds it
        busy = [s for s in srv.slots() if s.is_processing]
        assert len(busy) == 1 and busy[0].n_prompt_tokens > 0 and busy[0].n_decoded >= 1
        assert busy[0].n_remaining == 200 - busy[0].n_decoded
        stream.close()
    finally:
        srv.close()
    with pytest.raises(lc.ServerClosedError):
        srv.slots()
