"""One request must not freeze the server: stranger-supplied patterns, schemas and templates, each sent while
another client streams from the same server.

Python's ``re`` holds the GIL for the whole of one ``search``, and so do ``str()``, ``json.dumps`` and ``==``
over a large structure: a request that makes the server run one of them for seconds used to stop every
thread — the event loop (``/health`` took 16.7 s behind one ``grep_search``) and the model's scheduler (the
streaming client's tokens stopped). Each test measures the streaming client's longest wait between two
tokens while the hostile request runs: about 3 ms normally here (2 cores, the tiny model, 35 ms at most
over seconds), and as long as the hostile request with the old code (2-35 s); 1 s is the bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")
from http_helpers import ServeProcess  # noqa: E402

from llama_ctypes.core.json_schema.normalize import PATTERN_CHECK_SECONDS  # noqa: E402
from llama_ctypes.interfaces.http.schemas import MAX_STOP_CHARS  # noqa: E402
from llama_ctypes.interfaces.http.tools.builtin import GREP_SEARCH_TIMEOUT  # noqa: E402

#: Longest wait allowed between two streamed tokens, and for /health, while a hostile request runs (seconds).
MAX_GAP = 1.0

# A template that renders a ChatML prompt, unless the last message says "boom": then it sums 3,000 lists of 300
# items (|sum copies its running total at each step: 1.35e9 copies, 15 s in one C call with the old code).
EVIL_TEMPLATE = ("{%- if messages[-1]['content'] == 'boom' -%}{% set row = range(300)|list %}"
                 "{{ ([row] * 3000)|sum(start=[])|length }}{%- endif -%}"
                 "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
                 "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    tmp = tmp_path_factory.mktemp("stalls")
    (tmp / "evil.jinja").write_text(EVIL_TEMPLATE)
    proc = ServeProcess([str(tiny_model_path), "--chat-template", str(tmp / "evil.jinja"), "--threads", "1",
                         "-np", "2", "-c", "32768", "--tools", "grep_search", "--no-webui"], tmp / "serve.log",
                        metrics=False)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()


class _Streamer(threading.Thread):
    """Streams a long completion, stamping each event's arrival."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.stamps: list[float] = []
        self.started = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 15000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.stamps.append(time.monotonic())
                        if len(self.stamps) == 20:
                            self.started.set()
                    if self.done.is_set():
                        break
        except BaseException as exc:  # (reported by the test)
            self.error = exc
        finally:
            self.started.set()

    def longest_gap(self, since: float, until: float) -> float:
        """The longest wait between two tokens around [since, until]; the stream must have gone past ``until``."""
        stamps = self.stamps
        assert stamps and stamps[-1] > until, "the stream ended before the hostile request did"
        first = max([i for i, t in enumerate(stamps) if t <= since] or [0])
        last = min(i for i, t in enumerate(stamps) if t >= until)
        return max(b - a for a, b in zip(stamps[first:last], stamps[first + 1:last + 1]))


def _while_streaming(server: ServeProcess, hostile: Callable[[], Any]) -> tuple[Any, float, float, float]:
    """Run ``hostile()`` while another client streams; (its result, its seconds, the longest gap between two
    streamed tokens meanwhile, the slowest /health meanwhile)."""
    streamer = _Streamer(server.base_url)
    streamer.start()
    assert streamer.started.wait(60) and streamer.error is None, streamer.error
    time.sleep(0.3)
    health: list[float] = []
    finished = threading.Event()
    probing = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=60) as http:
            while not finished.is_set():
                t0 = time.monotonic()
                http.get(f"{server.base_url}/health")
                health.append(time.monotonic() - t0)
                probing.set()
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    assert probing.wait(60)  # (a hostile call refused at once may end before a first probe would start)
    start = time.monotonic()
    try:
        result = hostile()
    finally:
        end = time.monotonic()
        finished.set()
        prober.join(60)
        time.sleep(0.3)
        streamer.done.set()
        streamer.join(60)
    assert streamer.error is None, streamer.error
    return result, end - start, streamer.longest_gap(start, end), max(health)


def _regex_workers(server: ServeProcess) -> list[int]:
    """Pids of the server's regex workers (core/regex_worker.py) still alive."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[1]) == server.proc.pid and stat[0] != "Z" and b"-I" in cmdline and b"-S" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_a_backtracking_grep_pattern_freezes_nothing(server, tmp_path):
    """(a+)+$ over 28 a's and a '!': 35 s of backtracking here, in one re.search holding the GIL; /health and
    every stream stopped meanwhile. Now a tool error at the search's deadline, and nothing else waits."""
    (tmp_path / "evil.txt").write_text("a" * 28 + "!\n")
    call = {"tool": "grep_search", "params": {"path": str(tmp_path), "pattern": "(a+)+$"}}
    r, seconds, gap, health = _while_streaming(
        server, lambda: httpx.post(f"{server.base_url}/tools", json=call, timeout=120))
    assert r.status_code == 200
    assert r.json()["error"].startswith(
        f"grep_search stopped: matching the pattern took longer than {GREP_SEARCH_TIMEOUT:g} s"), r.text
    assert GREP_SEARCH_TIMEOUT - 0.5 < seconds < GREP_SEARCH_TIMEOUT + 5, seconds
    assert gap < MAX_GAP and health < MAX_GAP, (gap, health)
    assert not _regex_workers(server)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_a_grep_whose_client_leaves_is_stopped(server, tmp_path):
    (tmp_path / "evil.txt").write_text("a" * 40 + "!\n")
    call = {"tool": "grep_search", "params": {"path": str(tmp_path), "pattern": "(a+)+$"}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/tools", json=call, timeout=1.5)
    deadline = time.monotonic() + 3
    while _regex_workers(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _regex_workers(server), "the search outlived its client"
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200


def test_a_backtracking_schema_pattern_freezes_nothing(server):
    """jsonschema checks an enum value against its schema's pattern with Python's re: ^(a+)+$ against 30 a's
    and a '!' held the GIL for about a minute while the schema was being converted."""
    schema = {"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 30 + "!", "aaa"]}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "evil", "schema": schema}}}
    r, seconds, gap, health = _while_streaming(
        server, lambda: httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120))
    assert r.status_code == 400, r.text
    assert f"took longer than {PATTERN_CHECK_SECONDS:g} s" in r.json()["error"]["message"]
    assert seconds < PATTERN_CHECK_SECONDS + 3, seconds
    assert gap < MAX_GAP and health < MAX_GAP, (gap, health)


def test_bodies_of_millions_of_json_values_freeze_nothing(server):
    """Parsing builds a Python object per array and object with the GIL held: an 8 MB chat body of 2 million
    ``[1]`` (in a free field, chat_template_kwargs) or of 200,000 messages, three at once, stopped /health and
    the other stream for 1.5-4.9 s. Such a body is counted, not parsed: a 413 (json_cost.py); and counting
    takes linear time."""
    heavy = b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": [' \
        + b",".join([b"[1]"] * 2_000_000) + b"]}}"
    many = ('{"messages": [' + ", ".join(['{"role": "user", "content": "hi"}'] * 200_000) + "]}").encode()
    # (a string never closed, full of brackets and escaped quotes: telling brackets in strings from the others
    # once tried every escaped quote as a string's start, 16 s for these 100 KB)
    unclosed = b'{"messages": [{"role": "user", "content": "' + b"[" * 50_001 + b'\\"' * 30_000
    # (a list of the wrong type: pydantic reported each element, 89 s for 8 MB; now it stops at the first)
    wrong = b'{"messages": [{"role": "user", "content": "hi"}], "stop": [' + b",".join([b"1"] * 500_000) + b"]}"
    ids = b'{"prompt": [' + b",".join([b"1"] * 4_000_000) + b"]}"  # (valid: 1.4 s to parse; over the values bound)

    def five() -> list[int]:
        codes: list[int] = []

        def post(body: bytes) -> None:
            r = httpx.post(f"{server.base_url}/v1/chat/completions", content=body, timeout=120,
                           headers={"Content-Type": "application/json"})
            codes.append(r.status_code)
        posts = [threading.Thread(target=post, args=(b,)) for b in (heavy, many, unclosed, wrong, ids)]
        for t in posts:
            t.start()
        for t in posts:
            t.join(120)
        return codes

    codes, _, gap, health = _while_streaming(server, five)
    assert sorted(codes) == [400, 400, 413, 413, 413], codes
    assert gap < MAX_GAP and health < MAX_GAP, (gap, health)


def test_a_grammar_at_the_work_bound_freezes_nothing(server):
    """A grammar of 8,000 words, just under what the vocabulary's bound allows: where the model's pick is
    refused, llama.cpp tests each of the 32k tokens against each word, ~2 s per token. Drawn on the scheduler
    thread, each of its tokens stopped the other stream for as long (gaps of 1.7-3.4 s); drawn on a worker
    (engines/server/detached.py), it goes at its own pace."""
    grammar = "root ::= (" + " | ".join(f'"w{i} "' for i in range(8000)) + ")+"
    body = {"prompt": "Once upon a time", "n_predict": 3, "grammar": grammar, "ignore_eos": True}
    r, seconds, gap, health = _while_streaming(
        server, lambda: httpx.post(f"{server.base_url}/completion", json=body, timeout=120))
    assert r.status_code == 200, r.text
    assert r.json()["content"].startswith("w") and seconds > 1.0, (r.text, seconds)
    assert gap < MAX_GAP and health < MAX_GAP, (gap, health)


def test_a_hostile_chat_template_freezes_nothing(server):
    """The server's template sums lists when the last message says "boom": one C call of 15 s before. It is
    refused before the call now."""
    body = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 4}
    r, seconds, gap, health = _while_streaming(
        server, lambda: httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120))
    assert r.status_code in (400, 500), r.text
    assert "|sum would copy more than" in r.json()["error"]["message"], r.text
    assert seconds < 5, seconds
    assert gap < MAX_GAP and health < MAX_GAP, (gap, health)
    # (the template itself is fine otherwise)
    ok = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_stop_strings_are_bounded_and_cost_nothing_per_token(server):
    """Stop strings are matched in the model's scheduler thread at every token: a stop string over
    MAX_STOP_CHARS is a 400; 16 of the longest, on 8 choices, leave the other stream's pace alone."""
    base = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    for stop in (["x" * (MAX_STOP_CHARS + 1)], "y" * (MAX_STOP_CHARS + 1), ["ok", "z" * 100_000]):
        r = httpx.post(f"{server.base_url}/v1/completions", json={**base, "stop": stop}, timeout=60)
        assert r.status_code == 400 and f"over the limit of {MAX_STOP_CHARS}" in r.text, r.text
    # (what the model generates, as the head of every stop string: each is held back to its last character)
    text = httpx.post(f"{server.base_url}/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    stops = [text[:MAX_STOP_CHARS - 1 - i] + "\x01" for i in range(16)]
    body = {**base, "n": 8, "stop": stops}
    r, seconds, gap, health = _while_streaming(
        server, lambda: httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120))
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] == "length" and c["text"] for c in r.json()["choices"])
    assert gap < MAX_GAP and health < MAX_GAP, (gap, health)
