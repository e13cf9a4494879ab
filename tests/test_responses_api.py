"""OpenAI's Responses API on ``llama-ctypes serve`` (``/v1/responses``, ``/v1/responses/input_tokens``),
used through the official ``openai`` package: stateless, function tools, structured output, streaming.

Small models' text is compared only where the reference's top-1 margins are clear (margins.py): the
reference is the same conversation through ``/v1/chat/completions`` with logprobs.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from http_helpers import ServeProcess, wait_for
from margins import http_clear_prefix

from llama_ctypes.features.openai.responses import ResponseEvents, to_chat

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write one sentence about the sea."}]
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_path):
    folder = tmp_path_factory.mktemp("responses")
    proc = ServeProcess(["--model", str(gemma_path), "--alias", "gemma", "--chat-template", "gemma",
                         "--parallel", "2", "--ctx-size", "4096"], folder / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def _clear_prefix(server: ServeProcess, messages: list, max_tokens: int) -> tuple[str, bool]:
    prefix, _, whole = http_clear_prefix(server.base_url, messages, max_tokens)
    return prefix, whole


def test_a_response_and_its_stream_agree_where_the_model_is_sure(server, client):
    prefix, whole = _clear_prefix(server, ASK, 10)
    assert len(prefix) >= 8, "the reference is unsure from its start"
    r = client.responses.create(model="gemma", input=ASK, max_output_tokens=10, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "gemma"
    (item,) = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert r.output_text.startswith(prefix)
    assert (r.status == "incomplete") == (r.usage.output_tokens == 10)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    count = client.responses.input_tokens.count(model="gemma", input=ASK).input_tokens
    assert r.usage.input_tokens == count and r.usage.total_tokens == count + r.usage.output_tokens

    with client.responses.stream(model="gemma", input=ASK, max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    gathered = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert gathered == final.output_text and gathered.startswith(prefix)
    item_id = final.output[0].id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    if whole:
        assert final.output_text == r.output_text and final.status == r.status
    assert final.usage.input_tokens_details.cached_tokens > 0  # (the prompt came from the cache)


def test_a_required_function_comes_back_as_a_function_call_item(client):
    r = client.responses.create(model="gemma", input="What's the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("fc_") and calls[0].call_id
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])

    with client.responses.stream(model="gemma", input="What's the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = next(o for o in final.output if o.type == "function_call")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_function_outputs_go_back_to_the_model(client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"location": "Paris"}'}
    asked = [{"role": "user", "content": "What's the weather in Paris?"}, call]
    answered = asked + [{"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 25 C"}]
    before = client.responses.input_tokens.count(model="gemma", input=asked, tools=[WEATHER]).input_tokens
    after = client.responses.input_tokens.count(model="gemma", input=answered, tools=[WEATHER]).input_tokens
    assert after > before
    r = client.responses.create(model="gemma", input=answered, tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert r.output and r.usage.input_tokens == after


def test_a_json_schema_format_is_followed(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = client.responses.create(model="gemma", input="Describe Paris's weather as JSON.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "weather", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_what_the_server_cannot_do_is_refused_clearly(client):
    with pytest.raises(openai.BadRequestError, match="stateless") as e:
        client.responses.create(model="gemma", input="Hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="function tools only"):
        client.responses.create(model="gemma", input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="image input is not supported"):
        client.responses.create(model="gemma", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    with pytest.raises(openai.BadRequestError, match="item references"):
        client.responses.create(model="gemma", input=[{"type": "item_reference", "id": "msg_1"}])


def test_leaving_a_stream_frees_its_slot(server, client):
    def idle() -> bool:
        return not any(s["is_processing"] for s in httpx.get(f"{server.base_url}/slots").json())

    stream = client.responses.create(model="gemma", input=ASK, max_output_tokens=2000, temperature=1.0,
                                     stream=True, extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 8:
            break
    assert not idle()
    stream.close()
    assert wait_for(idle, 10)


def test_input_items_become_one_assistant_turn_per_run_of_output_items():
    fields = to_chat({"instructions": "Be brief.", "max_output_tokens": 5, "input": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"}],
        "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "low"},
        "tool_choice": {"type": "function", "name": "f"}, "tools": [{"type": "function", "name": "f"}]})
    roles = [m["role"] for m in fields["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"]
    assistant = fields["messages"][3]
    assert assistant["content"] == "Looking." and assistant["reasoning_content"] == "hmm"
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert fields["messages"][2]["content"] == "Weather?"
    assert fields["max_tokens"] == 5 and fields["reasoning_effort"] == "low"
    assert fields["response_format"] == {"type": "json_object"}
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def test_events_number_themselves_and_close_each_item():
    events = ResponseEvents()
    out = events.start({"id": "resp_1"})
    for delta in ({"reasoning_content": "a"}, {"content": "b"}, {"content": "c"},
                  {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}):
        out += events.feed(delta)
    out += events.finish({"id": "resp_1"})
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    added = [e["item"]["type"] for e in out if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert added == [d["type"] for d in done] == ["reasoning", "message", "function_call"]
    assert done[1]["content"][0]["text"] == "bc" and done[2]["arguments"] == "{}"
    assert out[-1]["type"] == "response.completed" and out[-1]["response"]["output"] == done
