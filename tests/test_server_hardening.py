"""Server hardening: no native work under the engine lock, exact stop counts, frozen results, queue
removal on cancel, kv_positions on the scheduler thread, break = cancel without the garbage collector,
closed event loops, close() with a tiny timeout, and a hostile mix of all of it."""

from __future__ import annotations

import asyncio
import gc
import random
import re
import threading
import time
import tracemalloc

import pytest

import llama_ctypes as lc
from llama_ctypes.core.generation import GenerationParams
from llama_ctypes.engines.server.prompt_cache import PromptCache
from llama_ctypes.engines.server.request import Channel, Request
from server_helpers import slow_decode, wait_idle

SYSTEM = "You are a careful assistant who answers questions about geography and history in detail. "





_slow_decode = slow_decode


class _Events:
    def __init__(self, *names):
        self.seen = []
        self.id = f"hardening-{id(self)}"
        lc.telemetry.attach(self.id, list(names), lambda e, m, md: self.seen.append((e, dict(m), dict(md))))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        lc.telemetry.detach(self.id)

    def of(self, name):
        return [(m, md) for e, m, md in self.seen if e == name]


# ---- 3: KV state copies happen outside the engine lock --------------------------------------------

def test_kv_state_copies_do_not_stall_the_event_loop(tiny_model, monkeypatch):
    # One slot and a RAM cache: admitting a new prompt saves the slot's previous KV state. A large
    # state takes a while to copy (here 0.3 s, with the GIL released as the native copy does); a
    # submission from the event loop during the copy must not wait for it.
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_ram_mb=64) as srv:
        srv.generate("Conversation A: " + SYSTEM, max_tokens=2, temp=0)
        kv = srv._engine.pool.kv
        real_save = kv.save
        saving = threading.Event()

        def slow_save(seq):
            saving.set()
            time.sleep(0.3)
            return real_save(seq)

        monkeypatch.setattr(kv, "save", slow_save)

        async def main():
            gaps, done = [], asyncio.Event()

            async def ticker():
                last = time.perf_counter()
                while not done.is_set():
                    await asyncio.sleep(0.002)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            for i in range(3):
                saving.clear()
                evicting = asyncio.create_task(srv.agenerate(f"Conversation {i}: " + SYSTEM, max_tokens=2, temp=0))
                t0 = time.monotonic()
                while not saving.is_set():  # the scheduler is now copying the previous prompt's state
                    assert time.monotonic() - t0 < 10, "no state was saved"
                    await asyncio.sleep(0.001)
                during = asyncio.create_task(srv.agenerate(f"Submitted during the copy {i}: " + SYSTEM,
                                                           max_tokens=2, temp=0))
                await asyncio.gather(evicting, during)
            done.set()
            await tick
            return gaps

        gaps = asyncio.run(main())
        assert srv.stats()["ram_cache_entries"] >= 1
    assert max(gaps) < 0.15, f"event loop stalled {max(gaps) * 1e3:.0f} ms"


# ---- 4 and 13: stop strings end where the tokens are produced, results are frozen ----------------------

def _stop_for(tiny_model, prompt):
    full = lc.generate(tiny_model, prompt, max_tokens=40, temp=0, ignore_eos=True)
    mid = len(full.text) // 2
    return full.text[mid:mid + 3]


def test_stop_counts_equal_the_single_sequence_path_even_with_a_slow_consumer(server, tiny_model):
    prompt = "Hello"
    stop = _stop_for(tiny_model, prompt)
    expected = lc.generate(tiny_model, prompt, max_tokens=40, temp=0, ignore_eos=True, stop=[stop])
    assert expected.finish_reason == "stop"
    for _ in range(3):
        stream = server.stream(prompt, max_tokens=40, temp=0, ignore_eos=True, stop=[stop])
        for _piece in stream:
            time.sleep(0.03)  # a slow consumer changes nothing
        assert stream.finish_reason == "stop"
        assert stream.tokens == expected.tokens and stream.text == expected.text
    done = server.generate(prompt, max_tokens=40, temp=0, ignore_eos=True, stop=[stop])
    assert done.tokens == expected.tokens and done.timings.generated_tokens == len(expected.tokens)
    # a finished request's results no longer change
    before = (list(stream.tokens), stream.timings)
    time.sleep(0.05)
    assert (stream.tokens, stream.timings) == before


def test_chat_usage_with_a_slow_consumer_equals_the_model_path(server, tiny_model):
    messages = [{"role": "user", "content": "Tell me a long story about rivers."}]
    opts = dict(chat_template="chatml", max_tokens=64, temp=0, ignore_eos=True)
    full = lc.chat(tiny_model, messages, **opts)
    stop = full[len(full) // 3:len(full) // 3 + 2]
    expected = lc.chat_completion(tiny_model, messages, stop=[stop], **opts)
    chunks = []
    for chunk in lc.stream_chat_completion(server, messages, stop=[stop], **opts):
        chunks.append(chunk)
        time.sleep(0.03)
    assert chunks[-1]["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"] < 64
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == expected["choices"][0]["message"]["content"]


# ---- 5: cancelled waiting requests leave the queue at once --------------------------------------------

def test_cancelled_waiting_requests_leave_the_queue(tiny_model, monkeypatch):
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=512, max_queue=2) as srv:
        _slow_decode(monkeypatch, srv, 0.01)
        running = srv.stream("busy", max_tokens=400, temp=0, ignore_eos=True)
        next(running)
        waiting = [srv.stream(f"waiting {i}", max_tokens=4, temp=0) for i in range(2)]
        assert srv.stats()["queue_length"] == 2
        waiting[0].cancel()
        srv.cancel(waiting[1])
        assert srv.stats()["queue_length"] == 0
        third = srv.stream("accepted", max_tokens=4, temp=0)  # the queue has room again
        t0 = time.monotonic()
        for w in waiting:
            with pytest.raises(lc.CancelledError):
                next(w)
        assert time.monotonic() - t0 < 0.5  # at once, not when the slot frees (seconds away)
        assert srv.stats()["active_slots"] == 1
        running.close()
        assert third.completion().finish_reason in ("length", "eog")


# ---- 6: kv_positions goes through the scheduler --------------------------------------------------------

def test_kv_positions_runs_on_the_scheduler_thread_and_raises_after_close(tiny_model, monkeypatch):
    srv = lc.Server(model=tiny_model, n_parallel=2, n_ctx=512)
    threads = set()
    real = srv._lease.seq_pos_max

    def spy(seq):
        threads.add(threading.current_thread())
        return real(seq)

    monkeypatch.setattr(srv._lease, "seq_pos_max", spy)
    stream = srv.stream("positions", max_tokens=200, temp=0, ignore_eos=True)
    next(stream)
    seen = [srv.kv_positions() for _ in range(20)]
    stream.close()
    assert threads == {srv._engine.thread}
    assert all(len(p) == 2 for p in seen) and any(max(p) > 0 for p in seen)
    srv.close()
    with pytest.raises(lc.ClosedError):
        srv.kv_positions()


# ---- 11: break = cancel, without the cycle collector -----------------------------------------------------

def test_breaking_out_or_dropping_a_stream_cancels_without_gc(server, monkeypatch):
    _slow_decode(monkeypatch, server, 0.005)  # 400 tokens would take 2 s
    with _Events("server.request.cancelled", "server.request.stop") as events:
        gc.disable()
        try:
            for _piece in server.stream("Tell me a story:", max_tokens=400, temp=0, ignore_eos=True):
                break
            dropped = server.stream("Dropped:", max_tokens=400, temp=0, ignore_eos=True)
            next(dropped)
            del dropped
            t0 = time.monotonic()
            wait_idle(server, timeout=1.0)
            assert time.monotonic() - t0 < 1.0
        finally:
            gc.enable()
    assert len(events.of("server.request.cancelled")) == 2
    assert not events.of("server.request.stop")


def test_cancel_and_close_from_another_thread(server, monkeypatch):
    _slow_decode(monkeypatch, server, 0.005)
    stream = server.stream("cancel me", max_tokens=400, temp=0, ignore_eos=True)
    timer = threading.Timer(0.1, stream.cancel)
    timer.start()
    with pytest.raises(lc.CancelledError):
        for _ in stream:
            pass
    assert len(stream.tokens) < 400
    closing = server.stream("close me", max_tokens=400, temp=0, ignore_eos=True)
    timer = threading.Timer(0.1, closing.close)
    timer.start()
    try:  # close() from another thread: a next() in flight raises CancelledError, a later one ends
        for _ in closing:
            pass
    except lc.CancelledError:
        pass
    assert closing.finish_reason is None and len(closing.tokens) < 400
    with pytest.raises(StopIteration):
        next(closing)
    wait_idle(server)
    assert server.kv_positions() == [-1] * 4


# ---- 14: closed event loops, close() with a tiny timeout, refused submissions -----------------------

@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_closed_event_loop_cancels_its_pending_stream(server, monkeypatch):
    _slow_decode(monkeypatch, server, 0.005)
    with _Events("server.request.cancelled", "server.request.stop") as events:
        loop = asyncio.new_event_loop()
        agen = server.astream("the loop goes away", max_tokens=400, temp=0, ignore_eos=True)
        loop.run_until_complete(agen.__anext__())
        loop.close()  # the async generator is never closed; nobody can receive its pieces
        wait_idle(server, timeout=1.0)
        deadline = time.monotonic() + 2.0  # (the slot is freed just before the event is emitted)
        while not events.of("server.request.cancelled") and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(events.of("server.request.cancelled")) == 1 and not events.of("server.request.stop")
    del agen


def test_an_async_stream_iterated_from_another_loop_raises_instead_of_stalling(tiny_model, monkeypatch):
    """Items reach an AsyncServerStream through the loop that submitted it; a task of another loop
    waiting for them was never woken (it stalled until something else woke its loop)."""
    server = lc.Server(model=tiny_model, n_parallel=2, n_ctx=256, n_threads=1)
    _slow_decode(monkeypatch, server, 0.02)
    loop_a = asyncio.new_event_loop()
    runner = threading.Thread(target=loop_a.run_forever, daemon=True)
    runner.start()
    try:
        async def submit():
            return server.asubmit("another loop", max_tokens=20, temp=0, ignore_eos=True)

        stream = asyncio.run_coroutine_threadsafe(submit(), loop_a).result(5)

        async def elsewhere():
            return [p async for p in stream]

        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="event loop"):
            asyncio.run(asyncio.wait_for(elsewhere(), 3))
        assert time.monotonic() - t0 < 1.0
        # the request is untouched: its own loop still reads it to the end
        done = asyncio.run_coroutine_threadsafe(stream.completion(), loop_a).result(10)
        assert len(done.tokens) == 20
        # aclose() from another thread and loop: the request ends, its reader gets CancelledError
        other = asyncio.run_coroutine_threadsafe(submit(), loop_a).result(5)
        reader = asyncio.run_coroutine_threadsafe(other.completion(), loop_a)
        deadline = time.monotonic() + 10
        while not other.tokens and time.monotonic() < deadline:
            time.sleep(0.005)
        asyncio.run(other.aclose())
        with pytest.raises(lc.CancelledError):
            reader.result(10)
    finally:
        loop_a.call_soon_threadsafe(loop_a.stop)
        runner.join(5)
        loop_a.close()
        try:
            wait_idle(server)
        finally:
            server.close()


def test_close_with_a_tiny_timeout_frees_the_context_when_the_thread_ends(tiny_model_path, monkeypatch):
    srv = lc.Server(model_path=tiny_model_path, n_parallel=2, n_ctx=512)
    _slow_decode(monkeypatch, srv, 0.2)
    stream = srv.stream("closing", max_tokens=50, temp=0, ignore_eos=True)
    next(stream)
    srv.close(timeout=0.0001)  # returns while the scheduler is inside a decode
    assert srv._engine.thread.is_alive()
    srv._engine.thread.join(5)
    assert not srv._engine.thread.is_alive()
    assert srv._ctx.freed and srv.model.closed
    with pytest.raises(lc.ServerClosedError):
        for _ in stream:
            pass


def test_a_refused_submission_closes_its_sampler(server, tiny_model):
    sampler = lc.Sampler.create(tiny_model, temp=0)
    request = Request([1, 2, 3], GenerationParams(), sampler, Channel())
    server._engine.scheduler.close()  # what a closing or failed scheduler does
    with pytest.raises(lc.ServerClosedError):
        server._engine.submit(request)
    assert sampler.closed


def test_prompt_cache_counts_its_trie_in_the_budget():
    budget = 2_000_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = PromptCache(budget)
        for i in range(100):  # long token sequences with tiny states: the trie is the memory
            cache.put([i] + list(range(100_000 + 2000 * i, 100_000 + 2000 * (i + 1))), b"s")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < len(cache) < 100 and cache.used <= budget
    assert held < 1.5 * budget


# ---- hostile use: nothing hangs, nothing crashes --------------------------------------------------------

def test_hostile_mix_then_close_under_load(tiny_model):
    srv = lc.Server(model=tiny_model, n_parallel=3, n_ctx=256, max_queue=8, prompt_cache_ram_mb=1)
    rng = random.Random(0)
    errors = []
    stop = threading.Event()

    def client(seed):
        r = random.Random(seed)
        while not stop.is_set():
            try:
                what = r.randrange(6)
                prompt = f"{SYSTEM[:r.randrange(10, 90)]} client {seed}"
                if what == 0:
                    srv.generate(prompt, max_tokens=r.randrange(1, 20), temp=0.8, stop=["e"])
                elif what == 1:
                    for i, _ in enumerate(srv.stream(prompt, max_tokens=100)):
                        if i == 2:
                            break
                elif what == 2:
                    s = srv.stream(prompt, max_tokens=100)
                    threading.Timer(r.random() * 0.05, s.cancel).start()
                    list(s)
                elif what == 3:
                    s = srv.stream(prompt, max_tokens=100)
                    del s
                elif what == 4:
                    srv.kv_positions()
                else:
                    s = srv.stream(prompt, max_tokens=100)
                    threading.Timer(r.random() * 0.05, s.close).start()
                    list(s)
            except (lc.CancelledError, lc.QueueFullError, lc.ClosedError):
                pass
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

    async def async_clients():
        async def one(i):
            try:
                if i % 3 == 0:
                    task = asyncio.ensure_future(srv.agenerate(f"async {i}", max_tokens=50))
                    await asyncio.sleep(rng.random() * 0.05)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                else:
                    async for _ in srv.astream(f"async {i}", max_tokens=20, stop=["a"]):
                        pass
            except (lc.CancelledError, lc.QueueFullError, lc.ClosedError):
                pass

        await asyncio.gather(*[one(i) for i in range(40)])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    aio = threading.Thread(target=lambda: asyncio.run(async_clients()))
    aio.start()
    time.sleep(1.5)
    srv.close(timeout=0.001)  # under load, with a timeout shorter than a tick
    stop.set()
    for t in threads + [aio]:
        t.join(20)
        assert not t.is_alive(), "a client hung"
    srv._engine.thread.join(10)
    assert not srv._engine.thread.is_alive() and srv._ctx.freed
    assert not errors, errors
    with pytest.raises(lc.ServerClosedError):
        srv.generate("after close")
    assert lc.generate(tiny_model, "the model still works", max_tokens=2, temp=0).tokens


def test_a_sampler_dead_end_fails_its_request_alone(server, tiny_model):
    """A grammar whose only continuation logit_bias bans (every end-of-generation token) used to
    abort the process (llama.cpp throws accepting the token); in a Server it failed every request."""
    eog = [t for t in range(tiny_model.n_vocab) if lc.Tokenizer.is_eog(tiny_model, t)]
    dead_end = dict(grammar='root ::= "a"', logit_bias={t: float("-inf") for t in eog}, max_tokens=8)
    with pytest.raises(lc.GrammarError, match="no token allowed by the grammar"):
        lc.generate(tiny_model, "Hello", temp=0, **dead_end)
    with pytest.raises(lc.GrammarError, match="no token allowed by the grammar"):
        lc.generate(tiny_model, "Hello", temp=0.8, seed=1, **dead_end)
    other = server.stream("Once upon a time", max_tokens=24, temp=0, ignore_eos=True)
    with pytest.raises(lc.GrammarError):
        server.generate("Hello", temp=0, **dead_end)
    assert len(other.completion().tokens) == 24  # its batch-mate went on
    assert server.generate("Hello", max_tokens=4, temp=0, ignore_eos=True).tokens  # and the server serves
    wait_idle(server)
    assert server.stats()["active_slots"] == 0


def test_a_lazy_grammar_whose_trigger_text_does_not_fit_fails_its_request_alone(server, tiny_model):
    """When a trigger matches, llama.cpp feeds the grammar the text from the match on and throws if the
    grammar refuses it; through ctypes that was std::terminate (the process died). A tool-call format's
    trigger followed by something else from the model gets here too."""
    lazy = dict(grammar='root ::= "\\x01\\x02"', grammar_lazy_triggers=["."], max_tokens=8, ignore_eos=True)
    for options in (dict(temp=0), dict(temp=0.8, seed=1), dict(temp=0, logprobs=2)):
        with pytest.raises(lc.GrammarError, match="grammar_lazy_triggers"):
            lc.generate(tiny_model, "Hello", **lazy, **options)
    other = server.stream("Once upon a time", max_tokens=24, temp=0, ignore_eos=True)
    with pytest.raises(lc.GrammarError, match="grammar_lazy_triggers"):
        server.generate("Hello", temp=0, **lazy)
    assert len(other.completion().tokens) == 24
    wait_idle(server)
    assert server.stats()["active_slots"] == 0
    # a Sampler the caller keeps is usable after the error (its grammar back at the start, not stackless:
    # llama.cpp's next apply would assert)
    sampler = lc.Sampler(tiny_model, lc.SamplingParams(temp=0, grammar='root ::= "\\x01\\x02"',
                                                       grammar_lazy_triggers=["."]))
    with lc.Context.create(tiny_model, n_ctx=128) as ctx, ctx.lease() as lease:
        lease.prefill(tiny_model.tokenize("Hello"), reuse=False)
        with pytest.raises(lc.GrammarError, match="grammar_lazy_triggers"):
            sampler.sample(lease, -1)
        for _ in range(3):
            with pytest.raises(lc.GrammarError, match="grammar_lazy_triggers"):
                sampler.sample(lease, -1)
    sampler.close()
    # a trigger whose text does fit still constrains what follows
    out = lc.generate(tiny_model, "Hello", grammar='root ::= [a-z]+ "!"', grammar_lazy_triggers=["[a-z]"],
                      max_tokens=8, temp=0)
    assert re.fullmatch(r"[^a-z]*[a-z]+!?", out.text), out.text
