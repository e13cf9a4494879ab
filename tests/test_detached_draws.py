"""Draws taken off the tick (engines/server/detached.py): a grammar row drawn on a worker from a copy of its
logits gives the token the tick would have drawn; a request whose draw outlasts its tick waits for it while
the others go on, and cancelling it or closing the server meanwhile ends everything cleanly."""

from __future__ import annotations

import threading
import time

import pytest

import llama_ctypes as lc
from llama_ctypes.engines.server import detached

PROMPT = "Once upon a time"
JSONISH = r'''root ::= "{" ws "\"name\":" ws "\"" [a-z ]{1,12} "\"," ws "\"age\":" ws [0-9]{1,3} ws "}"
ws ::= [ \n]?'''


def _words(n: int) -> str:
    """A grammar of ``n`` words: where the model's pick is refused, every token is tested against every word
    (~2 s per token on the tiny model's 32k vocabulary at 8,000: just under the work bound)."""
    return "root ::= (" + " | ".join(f'"w{i} "' for i in range(n)) + ")+"


def _run(model, monkeypatch, wait: float | None, **opts):
    if wait is not None:
        monkeypatch.setattr(detached, "DETACHED_WAIT_S", wait)
    with lc.Server(model=model, n_parallel=1, n_ctx=512) as server:
        out = server.stream(PROMPT, **opts).completion()
        return out, server.stats()["late_sampled_rows"]


@pytest.mark.parametrize("opts", [
    dict(grammar=JSONISH, max_tokens=24, temp=0, logprobs=3),
    dict(grammar=JSONISH, max_tokens=24, temp=0.9, top_k=40, seed=11),
    dict(grammar=JSONISH, max_tokens=24, temp=0.9, seed=5, logprobs=2, post_sampling=True),
], ids=["greedy-logprobs", "sampled", "post-sampling"])
def test_a_detached_draw_gives_the_token_of_the_tick(tiny_model, monkeypatch, opts):
    """The same request with every grammar row left to finish after its tick (a wait of 0) and with the usual
    wait: the same tokens (the same decodes in the same order: one request, one row per tick) and the same
    log-probabilities, computed at delivery from the row's copy."""
    ontick, late0 = _run(tiny_model, monkeypatch, None, **opts)
    off, late = _run(tiny_model, monkeypatch, 0.0, **opts)
    assert late > 0 and late0 == 0
    assert off.tokens == ontick.tokens and off.text == ontick.text and len(off.tokens) > 5
    if "logprobs" in opts:
        assert len(off.logprobs) == len(off.tokens)
        for a, b in zip(off.logprobs, ontick.logprobs):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t.token for t in a.top] == [t.token for t in b.top]


def _pieces_while(server, stamps: list[float], stop: threading.Event) -> threading.Thread:
    """Greedy streams one after another until ``stop``, stamping each piece."""
    def run():
        while not stop.is_set():
            stream = server.stream(PROMPT, max_tokens=2000, ignore_eos=True, temp=0)
            for _ in stream:
                stamps.append(time.monotonic())
                if stop.is_set():
                    stream.cancel()
                    break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_slow_grammar_stalls_no_other_request(tiny_model, speculative):
    """A grammar just under the work bound (~2 s per token here) runs at its own pace; a greedy stream beside
    it keeps its pace (gaps of a few ms; 1.7-3.4 s while the grammar was drawn on the tick). On a speculative
    server the slow request stops drafting (a drafted step's rows are drawn on the tick, in order)."""
    opts = dict(speculative=lc.DraftModel(tiny_model), n_draft=3) if speculative else {}
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=8192, n_threads=1, **opts) as server:
        stamps: list[float] = []
        stop = threading.Event()
        reader = _pieces_while(server, stamps, stop)
        while len(stamps) < 5:
            time.sleep(0.01)
        t0 = time.monotonic()
        bad = server.stream(PROMPT, grammar=_words(8000), max_tokens=4, ignore_eos=True).completion()
        t1 = time.monotonic()
        time.sleep(0.2)
        stop.set()
        reader.join(30)
        assert bad.text.startswith("w") and server.stats()["late_sampled_rows"] >= 1
    assert stamps[-1] > t1, "the greedy stream ended before the slow one"
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= t0 and a <= t1]
    assert t1 - t0 > 1.0 and max(during) < 0.5, (t1 - t0, max(during))


def test_cancel_or_close_while_a_draw_runs(tiny_model):
    """Cancelled while its draw runs, a request ends once the draw has (its sampler is in use until then) and
    frees its slot; a server closed meanwhile waits for the draw, fails the request, and nothing crashes."""
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=512) as server:
        bad = server.stream(PROMPT, grammar=_words(8000), max_tokens=8, ignore_eos=True)
        time.sleep(0.5)  # (its first draw takes seconds)
        t0 = time.monotonic()
        bad.cancel()
        with pytest.raises(lc.CancelledError):
            bad.completion()
        assert time.monotonic() - t0 < 10
        after = server.stream(PROMPT, max_tokens=6, ignore_eos=True).completion()  # its slot was freed
        assert len(after.tokens) == 6
    server = lc.Server(model=tiny_model, n_parallel=1, n_ctx=512)
    bad = server.stream(PROMPT, grammar=_words(8000), max_tokens=8, ignore_eos=True)
    time.sleep(0.5)
    server.close()
    with pytest.raises(lc.LlamaError):
        bad.completion()
    with pytest.raises(lc.ClosedError):
        server.stream(PROMPT, max_tokens=2)
