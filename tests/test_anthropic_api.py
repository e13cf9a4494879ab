"""Anthropic's Messages API on ``llama-ctypes serve`` (``/v1/messages``, ``/v1/messages/count_tokens``),
used through the official ``anthropic`` package and raw HTTP.

Small models' text is compared only where the reference's top-1 margins are clear (margins.py): the
reference is the same conversation through ``/v1/chat/completions`` with logprobs.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from conftest import llama_cpp_dir
from http_helpers import ServeProcess, wait_for
from margins import http_clear_prefix

from llama_ctypes.features.anthropic import MessageEvents, to_openai

KEY = "anthropic-test-key"
GREEDY = {"temperature": 0}  # (the SDK has no sampling arguments any more: sent as extra fields)
ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"location": {"type": "string"}},
                            "required": ["location"]}}
TEMPLATES = llama_cpp_dir() / "models" / "templates"


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory, gemma_path):
    folder = tmp_path_factory.mktemp("anthropic")
    proc = ServeProcess(["--model", str(gemma_path), "--alias", "gemma", "--chat-template", "gemma",
                         "--parallel", "2", "--ctx-size", "4096"], folder / "serve.log", api_key=KEY)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(gemma_server):
    with anthropic.Anthropic(base_url=gemma_server.base_url, api_key=KEY, max_retries=0) as c:
        yield c


def _clear_prefix(server: ServeProcess, messages: list, max_tokens: int) -> tuple[str, list[str], bool]:
    return http_clear_prefix(server.base_url, messages, max_tokens, server.headers)


def test_a_reply_and_its_stream_agree_where_the_model_is_sure(gemma_server, client):
    prefix, tokens, whole = _clear_prefix(gemma_server, ASK, 12)
    assert len(prefix) >= 8, f"the reference is unsure from its start: {tokens!r}"
    reply = client.messages.create(model="gemma", max_tokens=12, messages=ASK, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "gemma"
    assert reply.id.startswith("msg_")
    (block,) = reply.content
    assert block.type == "text" and block.text.startswith(prefix)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 12
    assert (reply.usage.output_tokens == 12) == (reply.stop_reason == "max_tokens")
    count = client.messages.count_tokens(model="gemma", messages=ASK).input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == count

    with client.messages.stream(model="gemma", max_tokens=12, messages=ASK, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text and final.content[0].text.startswith(prefix)
    if whole:  # no near tie anywhere: the two paths give the same reply
        assert final.content[0].text == block.text and final.stop_reason == reply.stop_reason
        assert final.usage.output_tokens == reply.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count
    assert final.usage.cache_read_input_tokens > 0  # (the second time, the prompt came from the cache)


def test_stream_events_come_in_anthropics_order_and_names(gemma_server):
    body = {"model": "gemma", "max_tokens": 6, "messages": ASK, "stream": True, "temperature": 0}
    events = []
    with httpx.stream("POST", f"{gemma_server.base_url}/v1/messages", json=body,
                      headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name  # every event is named by its type
                events.append(data)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] > 0 and start["usage"]["output_tokens"] == 0
    assert events[-2]["usage"]["output_tokens"] == 6 and events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert "[DONE]" not in json.dumps(events) and all("timings" not in e for e in events)


def test_a_stop_sequence_ends_the_reply_and_is_named(gemma_server, client):
    prefix, tokens, _ = _clear_prefix(gemma_server, ASK, 12)
    # a word inside the clear prefix (not its first token): the reply must end just before it
    k = next((i for i in range(1, len(tokens)) if tokens[i].strip().isalpha()
              and len("".join(tokens[:i + 1])) <= len(prefix)), None)
    assert k is not None, f"no word in the clear prefix of {tokens!r}"
    word = tokens[k].strip()
    before = "".join(tokens[:k]) + tokens[k][:len(tokens[k]) - len(tokens[k].lstrip())]
    assert word not in before, "the word appears earlier: pick the test's prompt again"
    reply = client.messages.create(model="gemma", max_tokens=12, messages=ASK, stop_sequences=["\u2603", word],
                                   extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word
    assert reply.content[0].text == before
    with client.messages.stream(model="gemma", max_tokens=12, messages=ASK, stop_sequences=[word],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


def test_a_forced_tool_comes_back_as_a_tool_use_block(client):
    reply = client.messages.create(model="gemma", max_tokens=60, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    assert reply.stop_reason == "tool_use"
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input["location"], str)

    with client.messages.stream(model="gemma", max_tokens=60, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "What's the weather in Paris?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    stops = [e for e in events if e.type == "content_block_stop"]
    assert [e.index for e in starts] == [e.index for e in stops] == list(range(len(starts)))
    tool = next(e for e in starts if e.content_block.type == "tool_use")
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.index == tool.index)
    assert json.loads(partial) == final.content[tool.index].input and "location" in json.loads(partial)
    assert final.stop_reason == "tool_use"


def test_tool_results_go_back_to_the_model(client):
    history = [{"role": "user", "content": "What's the weather in Paris?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"location": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": [{"type": "text", "text": "Sunny, 25 C"}]},
                                            {"type": "text", "text": "And in Rome?"}]}]
    reply = client.messages.create(model="gemma", max_tokens=8, tools=[WEATHER], messages=history, extra_body=GREEDY)
    assert reply.type == "message" and reply.content
    base = client.messages.count_tokens(model="gemma", tools=[WEATHER], messages=history).input_tokens
    failed = json.loads(json.dumps(history))
    failed[2]["content"][0]["is_error"] = True
    assert client.messages.count_tokens(model="gemma", tools=[WEATHER], messages=failed).input_tokens > base


def test_the_conversion_keeps_a_tool_result_right_after_its_call():
    fields = to_openai({"system": [{"type": "text", "text": "Be brief."}], "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "text", "text": "also"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 100},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert [m["role"] for m in fields["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assistant = fields["messages"][2]
    assert assistant["reasoning_content"] == "hmm" and assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert fields["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "42"}
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert fields["parallel_tool_calls"] is False and fields["stop"] == ["END"] and fields["max_tokens"] == 5
    assert fields["chat_template_kwargs"] == {"enable_thinking": True}
    assert fields["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_events_open_and_close_blocks_in_the_order_they_are_sent():
    events = MessageEvents("msg_1", "m")
    out = []
    for delta in ({"reasoning_content": "a"}, {"reasoning_content": "b"}, {"content": "c"},
                  {"tool_calls": [{"index": 0, "id": "t0", "function": {"name": "f", "arguments": "{"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                  {"tool_calls": [{"index": 1, "id": "t1", "function": {"name": "g", "arguments": "{}"}}]}):
        out += events.feed(delta)
    out += events.finish("tool_use", None, 7)
    starts = [(e["index"], e["content_block"]["type"]) for e in out if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    assert [e["index"] for e in out if e["type"] == "content_block_stop"] == [0, 1, 2, 3]
    signature = [e for e in out if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"]
    assert [e["index"] for e in signature] == [0]  # the thinking block's, before it closes
    assert out[-2] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                       "usage": {"output_tokens": 7}}


def test_errors_come_in_anthropics_shape(gemma_server, client):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=gemma_server.base_url, api_key="wrong", max_retries=0).messages.create(
            model="gemma", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported"):  # (not a 500: no retries)
        client.messages.create(model="gemma", max_tokens=4,
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}])
    with pytest.raises(anthropic.BadRequestError, match="server tool"):
        client.messages.create(model="gemma", max_tokens=4, messages=ASK,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    r = httpx.post(f"{gemma_server.base_url}/v1/messages", headers={"x-api-key": KEY}, json={"max_tokens": 4})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "invalid 'messages': this field is required"}}
    r = httpx.post(f"{gemma_server.base_url}/v1/messages", headers={"x-api-key": KEY},
                   json={"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]})
    assert r.status_code == 400 and "messages[0].content[0].type" in r.json()["error"]["message"]
    for bad in ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                {"system": [{"type": "text", "text": 3}], "messages": ASK},
                {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}]},
                {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                            "content": [{"type": "text", "text": 7}]}]}]},
                {"messages": ["hello"]}):
        r = httpx.post(f"{gemma_server.base_url}/v1/messages", headers={"x-api-key": KEY},
                       json={"max_tokens": 4, **bad})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)


def test_leaving_a_stream_frees_its_slot(gemma_server, client):
    def idle() -> bool:
        r = httpx.get(f"{gemma_server.base_url}/slots", headers=gemma_server.headers)
        return not any(s["is_processing"] for s in r.json())

    with client.messages.stream(model="gemma", max_tokens=2000, messages=ASK,
                                extra_body={"temperature": 1.0, "ignore_eos": True}) as stream:
        for n, _ in enumerate(stream.text_stream):
            if n == 3:
                break
        assert not idle()
    assert wait_for(idle, 10)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, tiny_model_path):
    """The tiny model with DeepSeek R1's template: its generation prompt opens a <think> block."""
    folder = tmp_path_factory.mktemp("anthropic-thinking")
    proc = ServeProcess(["--model", str(tiny_model_path), "--alias", "r1", "--ctx-size", "2048",
                         "--chat-template-file", str(TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")],
                        folder / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_reasoning_comes_back_as_a_thinking_block(thinking_server):
    with anthropic.Anthropic(base_url=thinking_server.base_url, api_key="none", max_retries=0) as c:
        reply = c.messages.create(model="r1", max_tokens=8, messages=ASK, extra_body=GREEDY,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
        assert reply.content[0].type == "thinking" and reply.content[0].thinking and reply.content[0].signature == ""
        with c.messages.stream(model="r1", max_tokens=8, messages=ASK, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            events = list(stream)
    raw = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
           "message_stop")  # (the SDK adds derived events of its own: "thinking", "signature", ...)
    kinds = [(e.type, e.delta.type if e.type == "content_block_delta" else None) for e in events if e.type in raw]
    assert ("content_block_delta", "thinking_delta") in kinds
    # the signature closes the thinking block, as Anthropic's streams do
    assert kinds.index(("content_block_delta", "signature_delta")) == kinds.index(("content_block_stop", None)) - 1


def test_thinking_in_the_history_reaches_the_template(tmp_path, tiny_model_path):
    proc = ServeProcess(["--model", str(tiny_model_path), "--ctx-size", "2048",
                         "--chat-template-file", str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja")], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        call = {"type": "tool_use", "id": "call_1", "name": "list_files", "input": {"path": "."}}
        result = {"type": "tool_result", "tool_use_id": "call_1", "content": "main.py"}
        history = [{"role": "user", "content": "Fix the bug"}, {"role": "assistant", "content": [call]},
                   {"role": "user", "content": [result]}]
        thought = json.loads(json.dumps(history))
        thought[1]["content"].insert(0, {"type": "thinking", "thinking": "Look at the layout first.", "signature": ""})
        tool = {"name": "list_files", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
        with anthropic.Anthropic(base_url=proc.base_url, api_key="none", max_retries=0) as c:
            without = c.messages.count_tokens(model="x", messages=history, tools=[tool]).input_tokens
            with_thinking = c.messages.count_tokens(model="x", messages=thought, tools=[tool]).input_tokens
        assert with_thinking > without
    finally:
        proc.stop()
