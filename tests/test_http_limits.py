"""The HTTP server against hostile and slow clients: admission limits, and deadlines on loopback sockets.

A real ``llama-ctypes serve`` process with small limits: every request over a bound is refused with
a 400 naming the bound and its option before any work; a fan-out is queued as one unit (429 when it
does not fit) and cancelled as one when its client leaves; half-sent headers, trickled bodies and
readers that never read are cut off; connections beyond the cap are refused.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from http_helpers import ServeProcess, api_error, busy, metric_samples, metrics_text, wait_for
from tiny_models import write_tiny_bert

KEY = "limits-key"
CHAT = [{"role": "user", "content": "Name three colours."}]
HEADER_TIMEOUT, BODY_TIMEOUT, WRITE_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS = 1.0, 2.0, 2.0, 1.0, 12


@pytest.fixture(scope="module")
def limited(tmp_path_factory, tiny_model_path, vocab_dir):
    folder = tmp_path_factory.mktemp("http-limits")
    vocab = vocab_dir / "ggml-vocab-bert-bge.gguf"
    embed = write_tiny_bert(folder / "embed.gguf", vocab, pooling=1)
    rerank = write_tiny_bert(folder / "rerank.gguf", vocab, pooling=4, seed=1)
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
id = "tiny"
path = "{tiny_model_path}"
default = true
n_parallel = 2
n_ctx = 2048
max_queue = 4

[[models]]
id = "embed"
path = "{embed}"
mode = "direct"

[[models]]
id = "rerank"
path = "{rerank}"
mode = "direct"
""")
    server = ServeProcess(["--config", str(config), "--chat-template", "chatml", "--threads", "1",
                           "--max-choices", "8", "--max-inputs", "4", "--max-input-tokens", "200",
                           "--max-tokenize-bytes", "1000", "--header-timeout", str(HEADER_TIMEOUT),
                           "--body-timeout", str(BODY_TIMEOUT), "--timeout", str(WRITE_TIMEOUT),
                           "--keep-alive-timeout", str(KEEP_ALIVE), "--max-connections", str(MAX_CONNECTIONS)],
                          folder / "serve.log", api_key=KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
    assert "Traceback" not in server.log(), server.log()
    assert code in (0, -signal.SIGTERM), server.log()


def _post(server: ServeProcess, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", headers=server.headers, json=body, timeout=30, **kw)


def _idle(server: ServeProcess) -> bool:
    return busy(server, "tiny") == (0, 0)


# ---- admission -----------------------------------------------------------------------------------

def test_a_fan_out_over_the_limit_is_refused_before_any_work(limited):
    """{"prompt": ["a"] * 12000, "n": 16} was 192,000 queued requests; now a 400 names --max-choices."""
    t0 = time.monotonic()
    r = _post(limited, "/v1/completions", {"prompt": ["a"] * 12000, "n": 16, "max_tokens": 1})
    e = api_error(r, 400, "prompt")
    assert "--max-choices" in e["message"] and "192000" in e["message"] and e["code"] == "request_too_large"
    assert time.monotonic() - t0 < 5
    api_error(_post(limited, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}), 400)
    api_error(_post(limited, "/v1/chat/completions", {"messages": CHAT, "n": 9, "max_tokens": 1}), 400, "n")
    assert _idle(limited)
    ok = _post(limited, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_group_that_does_not_fit_the_queue_is_refused_whole(limited):
    long = {"model": "tiny", "messages": CHAT, "max_tokens": 1900, "stream": True}
    with limited.client() as http, limited.client() as http2:
        with http.stream("POST", "/v1/chat/completions", json={**long, "n": 2}) as running:  # both slots
            lines = running.iter_lines()
            assert sum(1 for _, line in zip(range(8), lines) if line.startswith("data: ")) >= 3
            with http2.stream("POST", "/v1/chat/completions", json={**long, "n": 3}) as waiting:
                assert waiting.status_code == 200  # 3 of the queue's 4 places
                # 3 choices, 1 place left: refused as a whole at once, nothing of it queued
                r = _post(limited, "/v1/completions", {"prompt": ["x", "y", "z"], "max_tokens": 1})
                e = api_error(r, 429)
                assert "together or not at all" in e["message"] and int(r.headers["retry-after"]) >= 1
                # 6 choices: more than the whole queue, which retrying cannot help: a 400
                r = _post(limited, "/v1/completions", {"prompt": ["x", "y"], "n": 3, "max_tokens": 1})
                assert "could never be queued" in api_error(r, 400)["message"]
                assert busy(limited, "tiny") == (2, 3)
    assert wait_for(lambda: _idle(limited), 3.0)


def test_a_fan_out_whose_client_leaves_is_cancelled_as_one(limited):
    body = json.dumps({"model": "tiny", "prompt": ["p0", "p1"], "n": 2, "max_tokens": 1900,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: busy(limited, "tiny")[0] > 0, 5)  # submitted and running
    # 4 choices of 1900 tokens on 2 slots would take seconds; the group goes at once
    assert wait_for(lambda: _idle(limited), 3.0), busy(limited, "tiny")
    requests = metric_samples(metrics_text(limited), "llama_ctypes_http_requests_total")
    assert requests[(("endpoint", "completions"), ("status", "499"))] >= 1


def test_embedding_rerank_and_tokenize_sizes_are_bounded(limited):
    e = api_error(_post(limited, "/v1/embeddings", {"model": "embed", "input": ["a"] * 5}), 400, "input")
    assert "--max-inputs" in e["message"]
    long_text = "word " * 300
    e = api_error(_post(limited, "/v1/embeddings", {"model": "embed", "input": [long_text]}), 400, "input")
    assert "--max-input-tokens" in e["message"]
    assert _post(limited, "/v1/embeddings", {"model": "embed", "input": ["a"] * 4}).status_code == 200
    e = api_error(_post(limited, "/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"] * 5}),
                  400, "documents")
    assert "--max-inputs" in e["message"]
    e = api_error(_post(limited, "/v1/rerank", {"model": "rerank", "query": "q", "documents": [long_text]}),
                  400, "documents")
    assert "--max-input-tokens" in e["message"]
    e = api_error(_post(limited, "/tokenize", {"content": "<s>" * 400, "with_pieces": True}), 400, "content")
    assert "--max-tokenize-bytes" in e["message"]
    assert _post(limited, "/tokenize", {"content": "<s>" * 300}).status_code == 200


def test_oversized_schemas_and_tools_are_refused_before_compiling(limited):
    props = {f"p{i}": {"type": "string"} for i in range(20_000)}
    t0 = time.monotonic()
    r = _post(limited, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": {"type": "object", "properties": props}}}})
    e = api_error(r, 400, "response_format")
    assert "SchemaLimits.max_properties" in e["message"] and e["code"] == "invalid_schema"
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "enum": [f"v{i}" for i in range(10_000)]}}}}}
    r = _post(limited, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "tools": [tool]})
    assert "SchemaLimits.max_enum_values" in api_error(r, 400, "tools")["message"]
    deep: dict = {"type": "string"}
    for _ in range(40):  # (80 levels of JSON: past the bound of 64; the body parser stops at 200)
        deep = {"type": "object", "properties": {"a": deep}}
    r = _post(limited, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}})
    assert "SchemaLimits.max_depth" in api_error(r, 400, "response_format")["message"]  # (was a RecursionError)
    assert time.monotonic() - t0 < 10  # (bench/hostile_inputs.py times each: milliseconds)


def test_template_kwargs_naming_the_renderers_variables_are_a_400(limited):
    for key in ("tools", "add_generation_prompt", "messages"):
        r = _post(limited, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                    "chat_template_kwargs": {key: []}})
        e = api_error(r, 400, f"chat_template_kwargs.{key}")
        assert repr(key) in e["message"]
    r = _post(limited, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                "chat_template_kwargs": {"custom_variable": 1}})
    assert r.status_code == 200


# ---- slow and many clients ----------------------------------------------------------------------

def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``s`` within ``seconds`` (and what it sent before)."""
    s.settimeout(seconds)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True, data
            data += chunk
    except socket.timeout:
        return False, data
    except ConnectionResetError:
        return True, data


def test_half_sent_headers_are_cut_off(limited):
    socks = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(6)]
    try:
        for s in socks[:3]:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # ...never finished
        t0 = time.monotonic()  # (the other three send nothing at all)
        for s in socks:
            closed, data = _closed_within(s, HEADER_TIMEOUT + 3)
            assert closed, "a connection that never finished its headers is still open"
            assert data.startswith(b"HTTP/1.1 408"), data[:80]
        assert time.monotonic() - t0 < HEADER_TIMEOUT + 3
        # a header trickled one byte at a time does not stretch the deadline
        with socket.create_connection(("127.0.0.1", limited.port)) as s:
            t0 = time.monotonic()
            try:
                for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 100:
                    s.sendall(bytes([b]))
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert _closed_within(s, 3)[0] and time.monotonic() - t0 < HEADER_TIMEOUT + 3
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{limited.base_url}/health").status_code == 200


def test_a_trickled_body_is_cut_off(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: 5000\r\n\r\n".encode())
        t0 = time.monotonic()
        try:
            for _ in range(200):
                s.sendall(b" ")
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed, data = _closed_within(s, 3)
        assert closed and time.monotonic() - t0 < BODY_TIMEOUT + 3
        assert data.startswith(b"HTTP/1.1 408"), data[:80]


def test_idle_kept_alive_connections_are_closed(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        closed, _ = _closed_within(s, KEEP_ALIVE + 3)
        assert closed


def test_connections_beyond_the_cap_are_refused_at_once(limited):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", limited.port)))
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", limited.port)) as extra:
            closed, data = _closed_within(extra, 2)
            assert closed and data.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in data.lower()
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: httpx.get(f"{limited.base_url}/health").status_code == 200, 3)


def test_a_reader_that_never_reads_is_cut_off_and_frees_its_slot(limited):
    """A stream of ~4 MB (top_logprobs 20 on ~1,900 tokens) to a client that never reads: once the
    buffers are full nothing drains, and after --timeout the connection is aborted, which cancels the
    request (its slot is free) instead of holding the connection and the text forever."""
    body = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 1900, "stream": True, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", limited.port))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: busy(limited, "tiny")[0] == 1, 5)
        # ...and never reads. The slot is freed (the generation ends or is cancelled) and the connection
        # goes within --timeout of the buffers filling up.
        assert wait_for(lambda: _idle(limited), 60), busy(limited, "tiny")
        time.sleep(WRITE_TIMEOUT + 2)
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(1 << 20):
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        assert b"data: [DONE]" not in got[-64:], "the whole stream was delivered: the buffers never filled"
        assert "could not be written for" in limited.log()  # (the guard aborted it)
    finally:
        s.close()
    assert _post(limited, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).status_code == 200


def test_out_of_range_limits_are_refused_naming_the_option(tiny_model_path):
    for option, value in (("--max-choices", "0"), ("--timeout", "0"), ("--max-connections", "2.5")):
        proc = subprocess.run([sys.executable, "-m", "llama_ctypes", "serve", str(tiny_model_path), option, value],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and option in proc.stderr, (option, proc.stderr[-500:])
