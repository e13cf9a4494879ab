"""The OpenAI-compatible HTTP server (``llama-ctypes serve``), run as a real process and used through
the official ``openai`` package (and ``httpx`` for raw requests).

Small models' text is never asserted; the tests compare two paths (streamed == not streamed,
concurrent == alone, float == base64) and check shapes, status codes and the server's state.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import signal
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import jsonschema
import numpy as np
import openai
import pytest

import llama_ctypes as lc
from conftest import llama_cpp_dir
from http_helpers import ServeProcess, api_error, busy, metric_samples, metrics_text, wait_for
from margins import assert_same_greedy, http_tops
from tiny_models import write_tiny_bert

KEY = "test-key"
HERMES_TEMPLATE = llama_cpp_dir() / "models" / "templates" / "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
PROMPTS = ["Tell me about the sea.", "Count to ten.", "What is a cat?", "Write a short poem."]


@pytest.fixture(scope="module")
def bert_paths(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("http-bert")
    vocab = vocab_dir / "ggml-vocab-bert-bge.gguf"
    return (write_tiny_bert(folder / "embed.gguf", vocab, pooling=1),
            write_tiny_bert(folder / "rerank.gguf", vocab, pooling=4, seed=1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_path, bert_paths):
    """One process, five models from a config: 'tiny' (4 slots, a KV buffer per slot so concurrent
    output equals solo output), 'tiny-small' (1 slot, a queue of 1), 'tiny-tools' (a template with
    a tool-call syntax: llama.cpp's chat code), 'embed' and 'rerank' (direct)."""
    folder = tmp_path_factory.mktemp("http-tiny")
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
id = "tiny"
path = "{tiny_model_path}"
default = true
aliases = ["gpt-4o-mini"]
n_parallel = 4
n_ctx = 2048
kv_unified = false

[[models]]
id = "tiny-small"
path = "{tiny_model_path}"
n_parallel = 1
n_ctx = 2048
max_queue = 1

[[models]]
id = "tiny-tools"
path = "{tiny_model_path}"
chat_template = "{HERMES_TEMPLATE}"
n_parallel = 1
n_ctx = 1024

[[models]]
id = "embed"
path = "{bert_paths[0]}"
mode = "direct"

[[models]]
id = "rerank"
path = "{bert_paths[1]}"
mode = "direct"
""")
    # (one thread: the test's own clients share the CI machine's two cores, and ggml's spinning
    # threads slow down a hundredfold when the scheduler preempts one of them)
    server = ServeProcess(["--config", str(config), "--chat-template", "chatml", "--threads", "1"],
                          folder / "serve.log", api_key=KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
    assert "Traceback" not in server.log(), server.log()
    assert code in (0, -signal.SIGTERM), server.log()  # (uvicorn re-raises the signal once it has shut down)


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=f"{tiny.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory, gemma_path):
    folder = tmp_path_factory.mktemp("http-gemma")
    server = ServeProcess([str(gemma_path), "-np", "2", "-c", "2048", "--no-kv-unified", "--chat-template", "gemma",
                           "--threads", "1"], folder / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


_metrics, _busy, _error = metrics_text, busy, api_error


# ---- the basics ------------------------------------------------------------------------------

def test_health_is_open_and_models_are_listed(tiny, client):
    health = httpx.get(f"{tiny.base_url}/health")  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["models"]["tiny"]["slots_total"] == 4
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-small", "tiny-tools", "embed", "rerank"]


def test_chat_stream_reassembles_to_the_reply(client):
    opts = dict(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    reply = client.chat.completions.create(**opts)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24

    chunks = list(client.chat.completions.create(**opts, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_options_and_aliases(tiny, client):
    base = dict(messages=CHAT, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model="tiny", **base).choices[0].message.content
    # an alias routes to its model; a stop string and a seed are accepted
    assert client.chat.completions.create(model="gpt-4o-mini", **base).choices[0].message.content == plain
    reply = client.chat.completions.create(model="tiny", n=3, seed=7, top_p=0.9, presence_penalty=0.5,
                                           frequency_penalty=0.5, stop=["\n\n"], messages=CHAT, max_tokens=8,
                                           temperature=1.0, logit_bias={"13": -100},
                                           extra_body={"top_k": 20, "min_p": 0.01, "unknown_field": 1})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 24
    # content as text parts, a path without /v1
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "},
                                          {"type": "text", "text": "colours."}]}]
    r = httpx.post(f"{tiny.base_url}/chat/completions", headers=tiny.headers,
                   json={"model": "tiny", "messages": parts, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_completions_stream_and_choices(client):
    opts = dict(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0)
    done = client.completions.create(**opts)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**opts, stream=True) if c.choices)
    assert streamed == done.choices[0].text
    eight = client.completions.create(**{**opts, "max_tokens": 8}).choices[0].text
    several = client.completions.create(model="tiny", prompt=["Once upon a time", "Hello"], n=2, max_tokens=8,
                                        temperature=0, echo=True)
    texts = [c.text for c in sorted(several.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] == texts[1] == "Once upon a time" + eight
    assert texts[2].startswith("Hello") and texts[2] == texts[3]
    tokens = client.completions.create(model="tiny", prompt=[1, 9038, 2501, 263, 931], max_tokens=16, temperature=0)
    assert tokens.choices[0].text  # a prompt of token ids


def test_async_client(tiny):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{tiny.base_url}/v1", api_key=KEY, max_retries=0)
        reply = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
        stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return reply.choices[0].message.content, text

    reply, streamed = asyncio.run(main())
    assert reply == streamed


def test_embeddings_float_and_base64(tiny, client, bert_paths):
    texts = ["a cat", "the quick brown fox jumps"]
    floats = client.embeddings.create(model="embed", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.usage.prompt_tokens > 0
    raw = httpx.post(f"{tiny.base_url}/v1/embeddings", headers=tiny.headers,
                     json={"model": "embed", "input": texts, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    for d, vec in zip(floats.data, decoded):
        assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), vec)
    by_default = client.embeddings.create(model="embed", input="a cat")  # (the client asks for base64)
    assert np.array_equal(np.asarray(by_default.data[0].embedding, dtype=np.float32), decoded[0])
    with lc.load_model(bert_paths[0]) as model:
        assert np.allclose(lc.embed(model, texts), np.stack(decoded), atol=1e-5)


def test_rerank_and_tokens(tiny, bert_paths):
    with tiny.client() as http:
        docs = ["a cat sat", "stock prices", "cats purr", "rain"]
        r = http.post("/v1/rerank", json={"model": "rerank", "query": "what is a cat", "documents": docs, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 3
        scores = [x["relevance_score"] for x in results]
        assert scores == sorted(scores, reverse=True)
        with lc.load_model(bert_paths[1]) as model:
            expected = lc.rerank(model, "what is a cat", docs)
        for x in results:
            assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-4)
        assert http.post("/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["d"]}).status_code == 400
        # TEI's shape, as llama-server answers it: "texts" in, a bare list of {index, score[, text]} out
        tei = http.post("/rerank", json={"model": "rerank", "query": "what is a cat", "texts": docs, "top_n": 2,
                                         "return_text": True})
        assert tei.status_code == 200, tei.text
        assert [(x["index"], x["text"]) for x in tei.json()] == [(x["index"], docs[x["index"]]) for x in results[:2]]
        for x in tei.json():
            assert x["score"] == pytest.approx(expected[x["index"]], abs=1e-4)
        missing = http.post("/rerank", json={"model": "rerank", "query": "q"})
        assert missing.status_code == 400 and "'documents'" in missing.json()["error"]["message"]

        tokens = http.post("/tokenize", json={"model": "tiny", "content": "Hello world"}).json()["tokens"]
        assert tokens and all(isinstance(t, int) for t in tokens)
        pieces = http.post("/tokenize", json={"model": "tiny", "content": "Hello world", "with_pieces": True}).json()
        assert [p["id"] for p in pieces["tokens"]] == tokens
        assert http.post("/detokenize", json={"model": "tiny", "tokens": tokens}).json()["content"].strip() == \
            "Hello world"


# ---- errors --------------------------------------------------------------------------------

def test_errors_in_openai_shape(tiny):
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 4}
    with tiny.client() as http:
        _error(http.post("/v1/chat/completions", content=b"{not json"), 400)
        _error(http.post("/v1/chat/completions", json=[1, 2]), 400)
        _error(http.post("/v1/chat/completions", json={**chat, "max_tokens": -1}), 400, "max_tokens")
        _error(http.post("/v1/chat/completions", json={**chat, "temperature": "hot"}), 400, "temperature")
        _error(http.post("/v1/chat/completions", json={**chat, "n": 0}), 400, "n")
        _error(http.post("/v1/chat/completions", json={"model": "tiny"}), 400, "messages")
        _error(http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user"}]}), 400, "messages[0]")
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        e = _error(http.post("/v1/chat/completions", json={**chat, "messages": image}), 400, "messages[0].content")
        assert "not supported" in e["message"]  # (the tiny model has no projector)
        _error(http.post("/v1/chat/completions", json={**chat, "logit_bias": {"cat": 1}}), 400, "logit_bias")
        _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
        e = _error(http.post("/v1/chat/completions", json={**chat, "model": "no-such-model"}), 404, "model")
        assert "no-such-model" in e["message"]
        _error(http.post("/v1/embeddings", json={"model": "tiny", "input": "x"}), 400, "model")
        _error(http.post("/v1/embeddings", json={"model": "embed", "input": [1, 2]}), 400, "input")
        refused = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
        _error(http.post("/v1/chat/completions", json={**chat, "response_format": refused}), 400, "response_format")
        e = _error(http.post("/v1/chat/completions", content=b"x" * (9 * 2**20)), 413)
        assert e["code"] == "request_too_large"
        _error(http.get("/v1/no-such-endpoint"), 404)
    # the key
    _error(httpx.post(f"{tiny.base_url}/v1/chat/completions", json=chat), 401)
    _error(httpx.post(f"{tiny.base_url}/v1/chat/completions", json=chat,
                      headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(f"{tiny.base_url}/metrics"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{tiny.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_chunked_body_over_the_limit_is_refused(tiny):
    def body():
        for _ in range(9):
            yield b" " * 2**20

    with tiny.client() as http:
        _error(http.post("/v1/chat/completions", content=body()), 413)


def test_a_model_that_cannot_load_stops_the_server(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    server = ServeProcess([str(bad)], tmp_path / "serve.log")
    try:
        assert server.proc.wait(120) == 1
    finally:
        server.stop()
    assert "error: loading broken" in server.log() and "Traceback" not in server.log()


class _FakeManager:
    """Just enough of a ModelManager for the app's states that need no model (loading, failures)."""

    def __init__(self, *infos):
        self.infos = list(infos)
        self.default = infos[0].id

    def list(self):
        return list(self.infos)

    def _target(self, model_id, capability):
        raise RuntimeError("secret internals")

    def close(self):
        pass


def _info(model_id, status):
    return lc.ModelInfo(id=model_id, source="x.gguf", status=status, mode="server", capabilities=("generate", "chat"),
                        placement=(), estimated={}, actual=None, default=True)


def test_loading_closing_and_internal_errors_in_process():
    from starlette.testclient import TestClient

    from llama_ctypes.interfaces.http import create_app

    chat = {"model": "m", "messages": CHAT}
    app = create_app(_FakeManager(_info("m", "loading")))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        e = _error(http.get("/health"), 503)
        assert "loading" in e["message"] and http.get("/health").headers["retry-after"] == "1"
        _error(http.post("/v1/chat/completions", json=chat), 503)
    app = create_app(_FakeManager(_info("m", "ready")))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        e = _error(http.post("/v1/chat/completions", json=chat), 500)
        assert e["message"] == "internal server error" and "secret" not in json.dumps(e)
        assert 'status="500"' in http.get("/metrics").text
        app.state.llama.closing = True
        _error(http.post("/v1/chat/completions", json=chat), 503)


# ---- concurrency ---------------------------------------------------------------------------

def test_concurrent_streams_equal_single_answers(tiny, client):
    opts = dict(model="tiny", max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    alone = {p: client.chat.completions.create(messages=[{"role": "user", "content": p}], **opts).choices[0]
             for p in PROMPTS}

    async def one(aclient, prompt):
        stream = await aclient.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=True,
                                                       **opts)
        pieces, tokens, finish = [], [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                tokens += [t.token for t in (chunk.choices[0].logprobs.content or [])] \
                    if chunk.choices[0].logprobs else []
                finish = chunk.choices[0].finish_reason or finish
        return prompt, "".join(pieces), tokens, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{tiny.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % 4]) for i in range(16)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 16
    for prompt, text, tokens, finish in results:
        assert finish == "length" and text == "".join(tokens)
        # 4 in a batch vs alone: the same greedy tokens up to a near tie (margins.py)
        ref_tokens, ref_top = http_tops(alone[prompt].logprobs.content)
        if assert_same_greedy(tokens, ref_tokens, ref_top, what=prompt) == len(ref_tokens):
            assert text == alone[prompt].message.content
    assert wait_for(lambda: _busy(tiny, "tiny") == (0, 0), 5)


def test_clients_that_leave_free_their_slots(tiny):
    long = {"model": "tiny", "messages": CHAT, "max_tokens": 1900, "temperature": 0.8}

    async def leave_a_stream(http):
        async with http.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:  # the role chunk and two pieces: it is running
                        return

    async def leave_a_reply(http):
        with pytest.raises(httpx.ReadTimeout):  # (the connection is closed)
            await http.post("/v1/chat/completions", json=long, timeout=0.5)

    async def main():
        async with httpx.AsyncClient(base_url=tiny.base_url, headers=tiny.headers, timeout=60) as http:
            await asyncio.gather(*(leave_a_stream(http) for _ in range(8)), leave_a_reply(http), leave_a_reply(http))

    asyncio.run(main())
    # Each would run for seconds (1900 tokens, 10 requests on 4 slots) if its slot were not freed.
    assert wait_for(lambda: _busy(tiny, "tiny") == (0, 0), 2.0), _busy(tiny, "tiny")
    r = httpx.post(f"{tiny.base_url}/v1/chat/completions", headers=tiny.headers,
                   json={"model": "tiny", "messages": CHAT, "max_tokens": 4})
    assert r.status_code == 200  # and the server still answers
    requests = metric_samples(_metrics(tiny), "llama_ctypes_http_requests_total")
    assert requests[(("endpoint", "chat_completions"), ("status", "499"))] >= 2


def test_a_full_queue_answers_429_and_the_server_keeps_serving(tiny, client):
    long = {"model": "tiny-small", "messages": CHAT, "max_tokens": 1900, "stream": True}
    with tiny.client() as http, tiny.client() as http2:
        with http.stream("POST", "/v1/chat/completions", json=long) as running:
            lines = running.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) == 3  # running
            with http2.stream("POST", "/v1/chat/completions", json=long) as waiting:
                assert waiting.status_code == 200  # queued (the queue holds one)
                t0 = time.monotonic()
                refused = httpx.post(f"{tiny.base_url}/v1/chat/completions", headers=tiny.headers,
                                     json={**long, "stream": False})
                assert time.monotonic() - t0 < 2.0
                e = _error(refused, 429)
                assert e["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
                with pytest.raises(openai.RateLimitError):
                    client.chat.completions.create(model="tiny-small", messages=CHAT, max_tokens=4)
                # meanwhile the other models and the health check answer
                assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4).choices
                assert httpx.get(f"{tiny.base_url}/health").status_code == 200
                assert _busy(tiny, "tiny-small") == (1, 1)
    assert wait_for(lambda: _busy(tiny, "tiny-small") == (0, 0), 2.0)
    assert client.chat.completions.create(model="tiny-small", messages=CHAT, max_tokens=4).choices


def test_metrics_count_requests_tokens_and_latency(tiny, client):
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    text = _metrics(tiny)
    requests = metric_samples(text, "llama_ctypes_http_requests_total")
    assert requests[(("endpoint", "chat_completions"), ("status", "200"))] >= 1
    assert metric_samples(text, "llama_ctypes_generated_tokens_total")[(("model", "tiny"),)] >= 6
    assert metric_samples(text, "llama_ctypes_prompt_tokens_total")[(("model", "tiny"),)] > 0
    assert metric_samples(text, "llama_ctypes_time_to_first_token_seconds_count")[(("model", "tiny"),)] >= 1
    assert metric_samples(text, "llama_ctypes_generation_tokens_per_second_count")[(("model", "tiny"),)] >= 1
    assert metric_samples(text, "llama_ctypes_slots_total")[(("model", "tiny"),)] == 4
    hits = metric_samples(text, "llama_ctypes_prefix_cache_hits_total")[(("model", "tiny"),)]
    misses = metric_samples(text, "llama_ctypes_prefix_cache_misses_total")[(("model", "tiny"),)]
    assert hits + misses > 0


def test_logprobs(client):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert t.logprob <= 0 and t.logprob == pytest.approx(max(a.logprob for a in t.top_logprobs))
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    legacy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                       logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == legacy.choices[0].text


# ---- Gemma: a real template, JSON schema -----------------------------------------------------

@pytest.mark.gemma
def test_gemma_json_schema_output_validates(gemma_server):
    client = openai.OpenAI(base_url=f"{gemma_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Invent a person. Answer in JSON with name and age."}]
    reply = client.chat.completions.create(
        model="anything", messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # json_object with a schema (llama-server's extension)
    obj = client.chat.completions.create(model="gemma", messages=messages, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object", "schema": schema})
    jsonschema.validate(json.loads(obj.choices[0].message.content), schema)


@pytest.mark.gemma
def test_gemma_stream_equals_reply(gemma_server):
    """The streamed answer is the reply's, token for token, up to a near tie: the second request reuses the
    first's cached prompt (other batch shapes), and on another CPU a near tie may break the other way."""
    client = openai.OpenAI(base_url=f"{gemma_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    opts = dict(model="gemma", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(**opts)
    chunks = list(client.chat.completions.create(**opts, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]
    assert streamed == "".join(streamed_tokens)  # each path's text is its own tokens
    ref_tokens, ref_top = http_tops(reply.choices[0].logprobs.content)
    assert reply.choices[0].message.content == "".join(ref_tokens)
    n = assert_same_greedy(streamed_tokens, ref_tokens, ref_top, what="streamed vs reply")
    if n == len(ref_tokens):
        assert streamed == reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.gemma
def test_gemma_tool_calls(gemma_server):
    client = openai.OpenAI(base_url=f"{gemma_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    opts = dict(model="gemma", messages=messages, tools=tools, tool_choice="required", max_tokens=64, temperature=0)
    reply = client.chat.completions.create(**opts)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert "city" in json.loads(call.function.arguments)

    chunks = list(client.chat.completions.create(**opts, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the call and its result go back in the conversation
    follow_up = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model="gemma", messages=follow_up, tools=tools, max_tokens=16,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_ignore_eos_extension(client):
    # EOS (id 2 in the llama vocabulary) pushed to the top: without ignore_eos the answer ends at once
    opts = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, logit_bias={"2": 100})
    ended = client.completions.create(**opts)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 12
    full = client.completions.create(**opts, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12


# ---- hostile requests ------------------------------------------------------------------------

def _status_count(server: ServeProcess, status: str) -> float:
    return sum(v for k, v in metric_samples(_metrics(server), "llama_ctypes_http_requests_total").items()
               if ("status", status) in k)


def test_hostile_fields_are_refused_with_400s(tiny):
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    errors = _status_count(tiny, "500")
    with tiny.client() as http:
        for key in ("²", "١٢"):  # str.isdigit() says yes: int() fails on the first, reads 12 in the second
            _error(http.post("/v1/chat/completions", json={**chat, "logit_bias": {key: 5}}), 400, "logit_bias")
        _error(http.post("/v1/chat/completions", json={**chat, "top_k": 2**40}), 400, "top_k")
        _error(http.post("/v1/chat/completions", json={**chat, "stop": [f"s{i}" for i in range(17)]}), 400, "stop")
        # NaN and Infinity are no JSON values, wherever they stand
        e = _error(http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [{"role": "user", '
                             b'"content": "x"}], "temperature": Infinity}'), 400)
        assert e["code"] == "invalid_json"
        bad_schema = json.dumps({**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "minimum": math.inf}}}}).encode()
        e = _error(http.post("/v1/chat/completions", content=bad_schema), 400)
        assert e["code"] == "invalid_json"
        text = {**chat, "messages": [{"role": "user", "content": "a, NaN or -Infinity"}]}  # (in a string: fine)
        assert http.post("/v1/chat/completions", json=text).status_code == 200
        # malformed tool calls in the history (the generic JSON scheme of a template without tool syntax)
        history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}]
        _error(http.post("/v1/chat/completions", json={**chat, "messages": history, "tools": [tool]}), 400)
        refused = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
        _error(http.post("/v1/chat/completions", json={**chat, "tools": [refused], "tool_choice": "required"}), 400,
               "tools")
    assert _status_count(tiny, "500") == errors


def test_finish_reason_length_wins_over_a_cut_tool_call():
    from llama_ctypes.interfaces.http.routes.chat import _finish_reason

    call = {"tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}]}
    assert _finish_reason(SimpleNamespace(finish_reason="length"), call) == "length"
    assert _finish_reason(SimpleNamespace(finish_reason="eog"), call) == "tool_calls"
    assert _finish_reason(SimpleNamespace(finish_reason="stop"), {"content": "x"}) == "stop"


def test_non_finite_logprobs_stay_json():
    from llama_ctypes.core.logprobs import TokenLogprob
    from llama_ctypes.features.openai.shapes import chat_logprobs, completion_logprobs

    lps = [TokenLogprob(5, b"a", -math.inf, (TokenLogprob(6, b"b", math.nan),))]
    for shape in (chat_logprobs(lps), completion_logprobs(lps)):
        json.dumps(shape, allow_nan=False)  # (Starlette's JSONResponse refuses NaN and infinities)
    assert chat_logprobs(lps)["content"][0]["logprob"] == -9999.0


def test_native_tool_templates_work_and_survive_deep_histories(tiny):
    tool = {"type": "function", "function": {"name": "special_function", "parameters": {
        "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]}}}
    with tiny.client() as http:
        # The tool-call grammar starts with the generation prompt '<|im_start|>assistant\n', which the
        # llama SentencePiece vocabulary spells ' <', '|', 'im', ...: it is still fed to the grammar.
        r = http.post("/v1/chat/completions", json={"model": "tiny-tools", "messages": CHAT, "tools": [tool],
                                                    "tool_choice": "required", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        chunks = [json.loads(line[6:]) for line in http.post(
            "/v1/chat/completions", json={"model": "tiny-tools", "messages": CHAT, "tools": [tool], "max_tokens": 4,
                                          "temperature": 0, "stream": True}).text.splitlines()
            if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # Earlier calls' arguments nested 50000 deep: llama.cpp's template code overflowed its stack
        # (the server died); refused now
        deep = '{"arg1": ' + "[" * 50000 + "]" * 50000 + "}"
        history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "special_function", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "1", "content": "ok"}]
        e = _error(http.post("/v1/chat/completions", json={"model": "tiny-tools", "messages": history,
                                                           "tools": [tool], "max_tokens": 2}), 400)
        assert "nested deeper" in e["message"]
    assert httpx.get(f"{tiny.base_url}/health").status_code == 200


def test_a_client_that_leaves_while_sending_its_body(tiny):
    errors, gone = _status_count(tiny, "500"), _status_count(tiny, "499")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    for framing, part in (("Content-Length: 1000\r\n\r\n", b'{"model":'), ("Transfer-Encoding: chunked\r\n\r\n",
                                                                          b'5\r\n{"mod\r\n')):
        with socket.create_connection(("127.0.0.1", tiny.port)) as s:
            s.sendall(head.encode() + framing.encode() + part)
            time.sleep(0.3)
    assert wait_for(lambda: _status_count(tiny, "499") >= gone + 2, 5)
    assert _status_count(tiny, "500") == errors
    assert "ClientDisconnect" not in tiny.log()


def test_submitting_a_large_grammar_does_not_stall_the_server(tiny):
    # Each choice's sampler checks and compiles the grammar (~0.1 s here for this schema): 16 choices
    # used to hold the event loop for seconds, and every other request with it.
    fields = {f"field_{i}": {"type": "object", "properties": {f"sub_{j}": {"type": "string", "maxLength": 50}
                                                              for j in range(10)}} for i in range(60)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    body = {"model": "tiny", "messages": CHAT, "n": 16, "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    gaps, done = [], threading.Event()

    def probe():
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                t0 = time.monotonic()
                http.get(f"{tiny.base_url}/health")
                gaps.append(time.monotonic() - t0)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.2)
        r = httpx.post(f"{tiny.base_url}/v1/chat/completions", headers=tiny.headers, json=body, timeout=120)
    finally:
        done.set()
        prober.join()
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    assert max(gaps) < 0.6, sorted(gaps)[-5:]


def test_shutdown_with_requests_in_flight(tmp_path, tiny_model_path):
    """SIGTERM: uvicorn waits 5 s for running requests, then cancels them. A stream still running ends
    with an error event and [DONE], a reply with a 503, and nothing is logged as a crash."""
    server = ServeProcess([str(tiny_model_path), "--chat-template", "chatml", "--threads", "1", "-np", "2",
                           "-c", "16384"], tmp_path / "serve.log")
    results: dict = {}
    try:
        server.wait_ready()
        long = {"messages": CHAT, "max_tokens": 8000, "temperature": 0, "ignore_eos": True}

        def stream():
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**long, "stream": True},
                              timeout=60) as r:
                results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        def reply():
            results["reply"] = httpx.post(f"{server.base_url}/v1/chat/completions", json=long, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=reply)]
        for t in threads:
            t.start()
        assert wait_for(lambda: "slots_processing\":2" in httpx.get(f"{server.base_url}/health").text, 20)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
    finally:
        code = server.stop()
    log = server.log()
    assert code in (0, -signal.SIGTERM), log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "unavailable_error"
    assert results["reply"].status_code == 503


class _UnloadingManager(_FakeManager):
    """Lists a ready model that is unloaded by the time the request looks it up."""

    def loaded(self, model_id):
        return False

    def server(self, model_id):
        raise KeyError(model_id)

    def model(self, model_id):
        raise KeyError(model_id)


def test_a_model_unloaded_during_routing_is_a_503_not_a_500():
    """The name was right and the model is only gone for now (a router loads it again): 503, as for a model
    not loaded (issue 42; a 404 before)."""
    from starlette.testclient import TestClient

    from llama_ctypes.interfaces.http import create_app

    with TestClient(create_app(_UnloadingManager(_info("m", "ready"))), base_url="http://127.0.0.1") as http:
        e = _error(http.post("/v1/chat/completions", json={"model": "m", "messages": CHAT}), 503)
        assert "unloaded" in e["message"] and e["code"] == "model_not_loaded"
        _error(http.post("/tokenize", json={"model": "m", "content": "x"}), 503)
