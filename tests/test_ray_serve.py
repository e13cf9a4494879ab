"""Replicas of the HTTP server on Ray Serve (llama_ctypes/interfaces/ray_serve.py, examples/ray_serve.py).

The session key and the in-process bridge of a replica are tested without Ray; then a small local
Ray instance runs 2 replicas of the tiny model behind the session front, used through the
official ``openai`` client: one session stays on one replica (and hits its prefix cache),
sessions spread over both, both replicas answer as a single local server does.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from starlette.datastructures import Headers

from http_helpers import free_port, metric_samples, wait_for
from llama_ctypes.interfaces.ray_serve import REPLICA_HEADER, LlamaReplica, conversation_start, session_key

# (Ray's own modules warn about their pydantic usage on import)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

CHAT = "/v1/chat/completions"
TURN1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
REPLICA_OPTIONS = dict(model_id="tiny", chat_template="chatml",
                       load_options=dict(n_parallel=2, n_ctx=4096, kv_unified=False, n_threads=1, n_threads_batch=1))


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


# ---- the session key (no Ray) ----------------------------------------------------------------

def test_session_key_order_header_user_conversation():
    turn2 = [*TURN1, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}]
    key1 = session_key(CHAT, {}, _body(messages=TURN1))
    assert key1 and key1.startswith("prefix:")
    assert session_key(CHAT, {}, _body(messages=turn2, temperature=0)) == key1  # every turn of one conversation
    assert conversation_start(turn2) == [["system", "Be brief."], ["user", "Name three colours."]]
    other = [TURN1[0], {"role": "user", "content": "Count to ten."}]
    assert session_key(CHAT, {}, _body(messages=other)) != key1
    assert session_key(CHAT, {}, _body(messages=TURN1, user="ann")) == "user:ann"
    headers = Headers({"X-Session-Id": " s1 "})  # (case-insensitive, as the front passes them)
    assert session_key(CHAT, headers, _body(messages=TURN1, user="ann")) == "session:s1"
    assert session_key("/health", headers, b"") == "session:s1"


def test_session_key_of_completions_and_of_what_has_none():
    long = "x" * 600
    key = session_key("/v1/completions", {}, _body(prompt=long + "a"))
    assert key == session_key("/completions", {}, _body(prompt=long + "b"))  # (the first 512 characters)
    assert key == session_key("/v1/completions", {}, _body(prompt=[long, "other"]))
    assert session_key("/v1/completions", {}, _body(prompt=[1, 2, 3])) != key
    for path, body in [("/v1/models", b""), ("/v1/embeddings", _body(input="hi")), (CHAT, b"{not json"),
                       (CHAT, b"[1]"), (CHAT, _body(messages="hi")), (CHAT, _body(messages=[])),
                       ("/v1/completions", _body(prompt=""))]:
        assert session_key(path, {}, body) is None, (path, body)


# ---- one replica in-process (no Ray) ---------------------------------------------------------

async def _collect(replica: LlamaReplica, body: dict, path: str = CHAT) -> tuple[dict, bytes]:
    gen = replica.forward("POST", path, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())
    start = await gen.__anext__()
    return start, b"".join([chunk async for chunk in gen])


def test_replica_forward_answers_streams_and_cancels(tiny_model_path):
    replica = LlamaReplica(str(tiny_model_path), **REPLICA_OPTIONS)
    try:
        async def main():
            start, body = await _collect(replica, {"messages": TURN1, "max_tokens": 8, "temperature": 0})
            headers = dict(start["headers"])
            assert start["status"] == 200 and headers[REPLICA_HEADER.encode()] == replica.replica.encode()
            reply = json.loads(body)
            assert reply["usage"]["completion_tokens"] == 8

            start, body = await _collect(replica, {}, "/nowhere")
            assert start["status"] == 404 and json.loads(body)["error"]["code"] == "not_found"

            # A caller that leaves mid-stream: the generation is cancelled, its slot freed.
            gen = replica.forward("POST", CHAT, b"", [], _body(messages=TURN1, max_tokens=1000, stream=True))
            assert (await gen.__anext__())["status"] == 200
            await gen.__anext__()
            await gen.aclose()
            server = replica.manager.server("tiny")
            for _ in range(100):
                if server.stats()["active_slots"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert server.stats()["active_slots"] == 0
            return reply

        asyncio.run(main())
    finally:
        replica.close()


# ---- two replicas on a local Ray instance ----------------------------------------------------

@pytest.fixture(scope="module")
def ray_url(tiny_model_path):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from llama_ctypes.interfaces.ray_serve import build_app

    port = free_port()
    # (small: the CI machine has 2 cores; the replicas reserve 0.5 CPU each and run 1 thread)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = REPLICA_OPTIONS["load_options"]
        serve.run(build_app(str(tiny_model_path), model_id="tiny", chat_template="chatml", num_replicas=2,
                            num_cpus=0.5, max_ongoing_requests=8, **options),
                  name="llama", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def client(ray_url):
    return openai.OpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, messages: list, session: str | None = None, **opts):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, temperature=0, max_tokens=opts.pop("max_tokens", 12),
        extra_headers={"X-Session-Id": session} if session else None, **opts)
    return raw.headers[REPLICA_HEADER], raw.parse()


@pytest.fixture(scope="module")
def replica_of(client) -> dict[str, str]:
    """A session id per replica: 16 sessions spread over both replicas."""
    seen = {}
    for i in range(16):
        replica, _ = _chat(client, TURN1, session=f"s{i}", max_tokens=1)
        seen.setdefault(replica, f"s{i}")
        assert _chat(client, TURN1, session=f"s{i}", max_tokens=1)[0] == replica  # (and stays there)
    assert len(seen) == 2, seen
    return seen


@pytest.mark.timeout(180)
def test_a_conversation_stays_on_its_replica_and_hits_its_cache(client):
    messages, replicas, cached = list(TURN1), set(), []
    for turn in range(3):
        replica, reply = _chat(client, messages)  # (no header: the key is the conversation's start)
        replicas.add(replica)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And then {turn}?"}]
    assert len(replicas) == 1
    assert cached[1] > 0 and cached[2] > cached[1], cached  # each turn reuses the one before it


@pytest.mark.timeout(180)
def test_both_replicas_answer_as_one_local_server(client, replica_of, tiny_model_path):
    from starlette.testclient import TestClient

    body = {"model": "tiny", "messages": TURN1, "temperature": 0, "max_tokens": 16}
    answers = {}
    for replica, session in replica_of.items():
        served_by, reply = _chat(client, TURN1, session=session, max_tokens=16)
        assert served_by == replica
        answers[replica] = (reply.choices[0].message.content, reply.usage.completion_tokens)
    local = LlamaReplica(str(tiny_model_path), **REPLICA_OPTIONS)
    try:
        with TestClient(local.app, base_url="http://127.0.0.1") as http:
            reply = http.post(CHAT, json=body).json()
    finally:
        local.close()
    assert set(answers.values()) == {(reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"])}


@pytest.mark.timeout(180)
def test_streaming_and_errors_through_the_front(client, ray_url):
    import httpx

    _, whole = _chat(client, TURN1, session="s0", max_tokens=16)
    stream = client.chat.completions.create(model="tiny", messages=TURN1, temperature=0, max_tokens=16, stream=True,
                                            extra_headers={"X-Session-Id": "s0"})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    r = httpx.get(f"{ray_url}/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and REPLICA_HEADER in r.headers
    r = httpx.post(f"{ray_url}{CHAT}", content=b"{", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.timeout(180)
def test_clients_that_leave_free_the_replicas_slots(ray_url):
    import httpx

    session = {"X-Session-Id": "s0"}  # (so /metrics comes from the replica that ran them)
    long = {"model": "tiny", "messages": TURN1, "max_tokens": 4000, "temperature": 0.8}

    def in_use() -> float:
        text = httpx.get(f"{ray_url}/metrics", headers=session, timeout=30).text
        return metric_samples(text, "llama_ctypes_slots_in_use")[(("model", "tiny"),)]

    with httpx.Client(base_url=ray_url, headers=session, timeout=30) as http:
        with http.stream("POST", CHAT, json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (kept: dropping the iterator would close the connection)
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) == 3
            assert in_use() == 1
        with pytest.raises(httpx.ReadTimeout):
            http.post(CHAT, json=long, timeout=0.5)
    # Each would run for 7 s (4000 tokens on one thread) if leaving did not cancel it on the replica.
    assert wait_for(lambda: in_use() == 0, 3.0)
