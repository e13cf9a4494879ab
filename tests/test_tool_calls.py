"""Tool calls through llama.cpp's own chat code (features/tool_calls.py over the C adapter).

The parser cases are upstream's own vectors: each input string and expected message is
taken from llama.cpp's ``tests/test-chat.cpp`` in the pinned source (the line of each
case is given), run against the same templates from ``models/templates``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jsonschema
import pytest

import llama_ctypes as lc
from conftest import llama_cpp_dir
from margins import assert_same_greedy, http_tops
from llama_ctypes.features.tool_calls import (ChatFormatter, OutputParser, ToolCallError, _GenericOutput,
                                              plan_chat)

TEMPLATES = llama_cpp_dir() / "models" / "templates"

# test-chat.cpp:425 special_function_tool
SPECIAL_FUNCTION = {"type": "function", "function": {
    "name": "special_function", "description": "I'm special",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer", "description": "The arg."}},
                   "required": ["arg1"]}}}
USER = [{"role": "user", "content": "Hey there!"}]  # test-chat.cpp:956 message_user
CALL = {"name": "special_function", "arguments": {"arg1": 1}}

# (template, model output, reasoning_format, expected content, expected reasoning, expected calls, test-chat.cpp line)
VECTORS = [
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', "none", "", "", [CALL], 3332),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
     'Hello, world!\nWhat\'s up?<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
     "none", "Hello, world!\nWhat's up?", "", [CALL], 3340),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]', "none", "", "",
     [dict(CALL, id="123456789")], 5917),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "Hello, world!\nWhat's up?", "none",
     "Hello, world!\nWhat's up?", "", [], 5916),
    ("meetkai-functionary-medium-v3.1.jinja", '<function=special_function>{"arg1": 1}</function>', "none", "", "",
     [CALL], 5934),
    ("meetkai-functionary-medium-v3.2.jinja", 'special_function\n{"arg1": 1}', "none", "", "", [CALL], 5952),
    ("meetkai-functionary-medium-v3.2.jinja", "all\nHello, world!\nWhat's up?", "none",
     "Hello, world!\nWhat's up?", "", [], 5951),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
     "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n"
     '    {"tool_call_id": "0", "tool_name": "special_function", "parameters": {"arg1": 1}}\n]<|END_ACTION|>',
     "deepseek", "", "I'm\nthinking", [dict(CALL, id="0")], 5881),
    ("CohereForAI-c4ai-command-r-plus-tool_use.jinja",
     'Action:\n```json\n[{"tool_name": "special_function", "parameters": {"arg1": 1}}]\n```', "none", "", "",
     [CALL], 5896),
    ("llama-cpp-deepseek-r1.jinja",
     "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
     '```json\n{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "deepseek", "", "", [CALL], 6028),
    ("llama-cpp-deepseek-r1.jinja", "I'm\nthinking</think>Hello, world!\nWhat's up?", "deepseek",
     "Hello, world!\nWhat's up?", "I'm\nthinking", None, 6025),
    ("ibm-granite-granite-4.0.jinja",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', "none", "", "", [CALL],
     3411),
    ("openai-gpt-oss-120b.jinja", "<|channel|>final<|message|>Hello, world!\nWhat's up?", "none",
     "Hello, world!\nWhat's up?", "", None, 6428),
    ("openai-gpt-oss-120b.jinja",
     "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello, world!\nWhat's up?", "auto", "Hello, world!\nWhat's up?", "I'm\nthinking", None, 6434),
]


def _formatter(name: str) -> ChatFormatter:
    return ChatFormatter(None, (TEMPLATES / name).read_text())


@pytest.mark.parametrize("name,output,reasoning,content,thinking,calls,line", VECTORS,
                         ids=[f"{v[0].split('.jinja')[0]}:{v[-1]}" for v in VECTORS])
def test_upstream_parser_vectors(name, output, reasoning, content, thinking, calls, line):
    formatter = _formatter(name)
    tools = [SPECIAL_FUNCTION] if calls is not None else None
    fmt = formatter.apply(USER, tools=tools, reasoning_format=reasoning, parallel_tool_calls=name.startswith("llama-cpp-deepseek"))
    msg = OutputParser(fmt).parse(output, partial=False)
    assert msg["role"] == "assistant"
    # Upstream compares with assert_msg_equals(..., ignore_whitespace_differences=true).
    assert (msg.get("content") or "").strip() == content
    assert (msg.get("reasoning_content") or "").strip() == thinking
    got = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]),
            **({"id": c["id"]} if "id" in c else {})} for c in msg.get("tool_calls", [])]
    assert got == (calls or [])


@pytest.mark.parametrize("name", ["NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
                                  "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "mistralai-Mistral-Nemo-Instruct-2407.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja"])
def test_tool_templates_give_a_grammar_and_describe_the_tools(name):
    fmt = _formatter(name).apply(USER, tools=[SPECIAL_FUNCTION], tool_choice="required")
    assert fmt.caps["supports_tool_calls"]
    assert "special_function" in fmt.prompt  # the template describes the tool
    assert fmt.grammar and not fmt.grammar_lazy  # required: a strict grammar from the first token
    auto = _formatter(name).apply(USER, tools=[SPECIAL_FUNCTION], tool_choice="auto")
    assert auto.grammar == "" or (auto.grammar_lazy and auto.trigger_patterns)
    none = _formatter(name).apply(USER, tools=[SPECIAL_FUNCTION], tool_choice="none")
    assert none.grammar == ""


def test_streamed_deltas_reassemble_to_the_final_message():
    fmt = _formatter("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja").apply(USER, tools=[SPECIAL_FUNCTION])
    output = ('Let me check.<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'
              '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 22}}</tool_call>')
    from llama_ctypes.features.tool_calls import ChatOutput
    parser = OutputParser(fmt)
    out = ChatOutput(parser.parse, parser)
    deltas = []
    for i in range(0, len(output), 3):  # pieces cut anywhere, markers included
        deltas += out.feed(output[i:i + 3])
    deltas += out.end()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            slot = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = c.get("id", slot["id"])
            slot["name"] += c.get("function", {}).get("name", "")
            slot["arguments"] += c.get("function", {}).get("arguments", "")
    msg = out.message
    assert content == msg["content"] == "Let me check."
    assert len(msg["tool_calls"]) == 2 and out.has_tool_calls
    for i, call in enumerate(msg["tool_calls"]):
        assert calls[i]["id"] == call["id"] and calls[i]["id"].startswith("call_")
        assert calls[i]["name"] == call["function"]["name"] == "special_function"
        assert json.loads(calls[i]["arguments"]) == json.loads(call["function"]["arguments"]) == {"arg1": [1, 22][i]}


def test_bad_requests_raise_clear_errors(tiny_model):
    fmt_t = _formatter("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    with pytest.raises(lc.InvalidArgumentError, match="tool_choice"):
        plan_chat(tiny_model, USER, tools=[SPECIAL_FUNCTION], tool_choice="sometimes", chat_template="chatml")
    with pytest.raises(lc.InvalidArgumentError, match="not among the tools"):
        plan_chat(tiny_model, USER, tools=[SPECIAL_FUNCTION],
                  tool_choice={"type": "function", "function": {"name": "nope"}}, chat_template="chatml")
    with pytest.raises(lc.InvalidArgumentError, match=r"tools\[0\]"):
        plan_chat(tiny_model, USER, tools=[{"type": "function"}], chat_template="chatml")
    with pytest.raises(lc.InvalidArgumentError, match="needs tools"):
        plan_chat(tiny_model, USER, tools=[], tool_choice="required", chat_template="chatml")
    with pytest.raises(ToolCallError):  # llama.cpp rejects the message list (role missing content)
        fmt_t.apply([{"role": "user"}], tools=[SPECIAL_FUNCTION])
    with pytest.raises(lc.LlamaError):
        ChatFormatter(None, "{% for %}")  # a template llama.cpp's Jinja cannot parse
    with pytest.raises(lc.InvalidArgumentError):
        ChatFormatter(None, None)


def test_formatter_is_closed_with_its_model_and_refuses_use_after(tiny_model_path):
    model = lc.load_model(tiny_model_path)
    from llama_ctypes.features.tool_calls import formatter_for
    formatter = formatter_for(model, (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    assert formatter is formatter_for(model, (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    model.close()
    assert formatter.closed
    with pytest.raises(lc.ClosedError):
        formatter.apply(USER, tools=[SPECIAL_FUNCTION])


def test_apply_from_many_threads():
    formatter = _formatter("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    prompts, errors = [], []

    def work():
        try:
            for _ in range(20):
                prompts.append(formatter.apply(USER, tools=[SPECIAL_FUNCTION]).prompt)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(prompts)) == 1 and len(prompts) == 80


GEMMA_TEMPLATE = "google-gemma-2-2b-it.jinja"  # Gemma 3 uses the same turn format; it has no tool syntax
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


@pytest.mark.gemma
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_tool_call_on_gemma_is_valid(gemma, choice):
    template = (TEMPLATES / GEMMA_TEMPLATE).read_text()
    messages = [{"role": "user", "content": "What's the weather in Paris for the next 2 days?"}]
    plan = plan_chat(gemma, messages, tools=[WEATHER, SPECIAL_FUNCTION], tool_choice=choice, chat_template=template)
    assert plan.format is None  # the template cannot express tools: the generic JSON scheme
    reply = lc.generate(gemma, plan.prompt, max_tokens=96, temp=0, **plan.options)
    out = plan.output()
    for piece in reply:
        out.feed(piece)
    msg = out.finish()
    assert reply.finish_reason == "eog" and out.has_tool_calls
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]["function"]
    if isinstance(choice, dict):
        assert call["name"] == "get_weather"
    tool = {"get_weather": WEATHER, "special_function": SPECIAL_FUNCTION}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


def test_generic_output_reads_an_answer_or_calls():
    out = _GenericOutput()
    out.feed('{"response": "hi"}')
    assert out.finish() == {"role": "assistant", "content": "hi"}
    out = _GenericOutput()
    out.feed('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}')
    msg = out.finish()
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    out = _GenericOutput()
    out.feed("not json")
    assert out.finish() == {"role": "assistant", "content": "not json"}  # kept as the answer


@pytest.mark.gemma
def test_python_api_tool_calls_streamed_equal_non_streamed_on_model_and_server(gemma):
    template = (TEMPLATES / GEMMA_TEMPLATE).read_text()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    opts = dict(tools=[WEATHER], tool_choice="required", chat_template=template, max_tokens=60, temp=0,
                logprobs=2)
    done = lc.chat_completion(gemma, messages, **opts)
    choice = done["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    # streamed and not, on the model: the streamed call reuses the prompt the first one left in a pooled
    # context (its last token decoded alone, not in the prompt's batch), so the two may part at a near tie
    chunks = list(lc.stream_chat_completion(gemma, messages, **opts))
    args = "".join(tc["function"].get("arguments", "") for c in chunks
                   for tc in c["choices"][0]["delta"].get("tool_calls", []))
    ref, ref_top = http_tops(choice["logprobs"]["content"])
    pieces = [t for c in chunks for t in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    streamed, _ = http_tops(pieces)
    if assert_same_greedy(streamed, ref, ref_top, what="streamed tool call") == len(ref) == len(streamed):
        assert json.loads(args) == json.loads(call["function"]["arguments"])
        assert chunks[-1]["usage"]["completion_tokens"] == done["usage"]["completion_tokens"]
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    with lc.Server(model=gemma, n_parallel=2, n_ctx=1024) as server:
        served = lc.chat_completion(server, messages, **opts)["choices"][0]["message"]
        # (the server decodes in other shapes: its free-form argument may take the other side of a near
        # tie, so it is checked for validity, not equality)
        assert served["tool_calls"][0]["function"]["name"] == call["function"]["name"]
        jsonschema.validate(json.loads(served["tool_calls"][0]["function"]["arguments"]),
                            WEATHER["function"]["parameters"])
        # tool_choice="none" keeps the plain chat path
        plain = lc.chat_completion(server, messages, **dict(opts, tool_choice="none", max_tokens=4))
        assert plain["choices"][0]["message"].get("tool_calls") is None


def _shape(obj):
    return {k: _shape(v) for k, v in obj.items()} if isinstance(obj, dict) else type(obj).__name__


@pytest.mark.gemma
def test_one_usage_shape_on_every_python_path(gemma):
    """The plain and the tool-call paths, whole and streamed, on a model and on a Server, and a
    ChatReply: the same usage object (prompt_tokens_details included), its counts adding up."""
    from llama_ctypes.features.openai import usage

    template = (TEMPLATES / GEMMA_TEMPLATE).read_text()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = dict(chat_template=template, max_tokens=3, temp=0)
    tools = dict(plain, tools=[WEATHER], tool_choice="required", max_tokens=40)
    expected = _shape(usage(1, 2, 3))
    with lc.Server(model=gemma, n_parallel=2, n_ctx=1024) as server:
        found = {
            "chat reply": lc.chat(gemma, messages, **plain).usage,
            "plain": lc.chat_completion(gemma, messages, **plain)["usage"],
            "plain streamed": list(lc.stream_chat_completion(gemma, messages, **plain))[-1]["usage"],
            "tools": lc.chat_completion(gemma, messages, **tools)["usage"],
            "tools streamed": list(lc.stream_chat_completion(gemma, messages, **tools))[-1]["usage"],
            "server plain": lc.chat_completion(server, messages, **plain)["usage"],
            "server tools": lc.chat_completion(server, messages, **tools)["usage"],
            "server tools streamed": list(lc.stream_chat_completion(server, messages, **tools))[-1]["usage"],
        }
        # the server's prefix cache served the repeated prompt: counted on the tool path too
        assert found["server tools streamed"]["prompt_tokens_details"]["cached_tokens"] > 0
    for path, u in found.items():
        assert _shape(u) == expected, path
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > 0, path


@pytest.mark.gemma
def test_grammar_prefill_skips_text_already_in_the_prompt(gemma):
    grammar = 'root ::= "Hello" " world"'
    out = lc.generate(gemma, "Say hi:", grammar=grammar, grammar_prefill="Hello", max_tokens=8, temp=0)
    assert out == " world" and out.finish_reason == "eog"
    sampler = lc.Sampler.create(gemma, grammar=grammar, grammar_prefill="Hello")
    sampler.reset()  # the prefill is fed again after a reset
    assert sampler.names[0] == "grammar"
    with pytest.raises(lc.GrammarError, match="grammar_prefill"):
        lc.Sampler.create(gemma, grammar=grammar, grammar_prefill="Goodbye")  # refused, not an abort
    with pytest.raises(lc.InvalidArgumentError, match="non-lazy"):
        lc.Sampler.create(gemma, grammar=grammar, grammar_prefill="Hello", grammar_lazy_triggers=["x"])
    # what the chat code asks for with a native tool format: the grammar starts with the generation prompt
    plan = plan_chat(gemma, USER, tools=[SPECIAL_FUNCTION], tool_choice="required",
                     chat_template=(TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text())
    assert plan.options["grammar_prefill"] == plan.format.generation_prompt != ""
    lc.Sampler.create(gemma, grammar=plan.options["grammar"], grammar_prefill=plan.options["grammar_prefill"])


# ---- hostile outputs and requests ---------------------------------------------------------------

HERMES = "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"


def _output(name: str = HERMES):
    from llama_ctypes.features.tool_calls import ChatOutput
    parser = OutputParser(_formatter(name).apply(USER, tools=[SPECIAL_FUNCTION]))
    return ChatOutput(parser.parse, parser, parser.aparse)


def test_a_reply_cut_by_the_length_limit_is_length_even_in_a_tool_call():
    from llama_ctypes.features.openai import finish_reason
    out = _output()
    text = 'Let me see.<tool_call>\n{"name": "special_function", "arguments": {"arg1": 12'
    deltas = [d for i in range(0, len(text), 4) for d in out.feed(text[i:i + 4])]
    deltas += out.end(truncated=True)
    assert out.message["content"] == "Let me see." and out.message["tool_calls"][0]["function"]["name"] == \
        "special_function"
    assert "".join(d.get("content", "") for d in deltas) == "Let me see."
    # OpenAI and llama-server: "length" whatever the cut text holds; "tool_calls" only after a natural end
    assert finish_reason("length", out.has_tool_calls) == "length"
    assert finish_reason("eog", True) == "tool_calls" and finish_reason("stop", False) == "stop"


def test_an_unparsable_end_after_streamed_calls_does_not_repeat_them_as_content():
    out = _output()
    text = ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'
            'garbage<tool_call>{bad')
    deltas = [d for i in range(0, len(text), 5) for d in out.feed(text[i:i + 5])]
    deltas += out.end()  # llama.cpp refuses the complete text
    assert [c["function"]["arguments"] for c in out.message["tool_calls"]] == ['{"arg1": 1}']
    assert "<tool_call>" not in (out.message["content"] or "")
    assert "<tool_call>" not in "".join(d.get("content", "") for d in deltas)


def test_text_after_a_nul_character_is_not_lost():
    msg = OutputParser(_formatter(HERMES).apply(USER, tools=[SPECIAL_FUNCTION])).parse("Hello\0world", False)
    assert msg["content"] == "Hello\ufffdworld"


def test_async_feed_gives_the_same_deltas():
    import asyncio

    text = 'Hi.<tool_call>\n{"name": "special_function", "arguments": {"arg1": 7}}</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    sync = _output()
    expected = [d for p in pieces for d in sync.feed(p)] + sync.end()

    async def run():
        out = _output()
        got = [d for p in pieces for d in await out.afeed(p)]
        return got + await out.aend(), out.message

    got, message = asyncio.run(run())
    strip = [{k: v for k, v in d.items() if k != "tool_calls"} for d in got]
    assert strip == [{k: v for k, v in d.items() if k != "tool_calls"} for d in expected]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"arg1": 7}'


def _isolated(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a native crash must not take the test run with it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=240)


def test_deeply_nested_output_does_not_crash_the_parser():
    # llama.cpp's PEG parser recurses per level of JSON: 5000 levels overflowed the 8 MiB main stack
    result = _isolated("""
        from llama_ctypes.features.tool_calls import OutputParser, ToolCallError
        from test_tool_calls import _formatter, HERMES, SPECIAL_FUNCTION, USER
        parser = OutputParser(_formatter(HERMES).apply(USER, tools=[SPECIAL_FUNCTION]))
        start = '<tool_call>\\n{"name": "special_function", "arguments": {"arg1": '
        for depth in (5000, 40000):
            for partial in (True, False):
                msg = parser.parse(start + '[' * depth + ']' * depth + '}}</tool_call>', partial)
                assert msg["tool_calls"][0]["function"]["arguments"].count("[") == depth
        try:
            parser.parse(start + '[' * 100000, True)  # more than the parse thread's stack takes
        except ToolCallError as e:
            assert "opening brackets" in str(e)
        else:
            raise AssertionError("parsed")
        print("survived")
    """)
    assert result.returncode == 0 and "survived" in result.stdout, (result.returncode, result.stderr[-2000:])


def test_deeply_nested_tool_call_arguments_in_the_history_are_refused():
    # jinja::from_json converts earlier calls' arguments one level per call: 50000 levels overflowed
    # the stack; some templates also render them in quadratic time and size
    result = _isolated("""
        import llama_ctypes as lc
        from test_tool_calls import _formatter, HERMES, SPECIAL_FUNCTION, USER
        def history(depth):
            args = '{"arg1": ' + '[' * depth + ']' * depth + '}'
            return [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                     "function": {"name": "special_function", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "1", "content": "ok"}]
        formatter = _formatter(HERMES)
        assert formatter.apply(history(100), tools=[SPECIAL_FUNCTION]).prompt
        for depth in (50000, 300):
            try:
                formatter.apply(history(depth), tools=[SPECIAL_FUNCTION])
            except lc.InvalidArgumentError as e:
                assert "nested deeper" in str(e)
            else:
                raise AssertionError(depth)
        print("survived")
    """)
    assert result.returncode == 0 and "survived" in result.stdout, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("depth", [5000, 300])
def test_deep_tool_call_arguments_are_refused_by_the_jinja_renderer_too(depth):
    """(From a review) the Jinja renderer parsed the arguments with Python's json: 5000 levels were a
    RecursionError (a 500 over HTTP), 300 went through where the native path refuses past 256."""
    from llama_ctypes.features.chat_template import ChatTemplate

    args = '{"arg1": ' + '[' * depth + ']' * depth + '}'
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
               "function": {"name": "special_function", "arguments": args}}]},
               {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    template = ChatTemplate((TEMPLATES / HERMES).read_text())
    with pytest.raises(lc.InvalidArgumentError, match="nested deeper than 256"):
        template.render(history, tools=[SPECIAL_FUNCTION])
    shallow = '{"arg1": ' + '[' * 100 + ']' * 100 + '}'
    history[1]["tool_calls"][0]["function"]["arguments"] = shallow
    assert "special_function" in template.render(history, tools=[SPECIAL_FUNCTION])


def test_generic_scheme_refuses_malformed_history_and_survives_deep_replies(tiny_model):
    bad = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}]
    with pytest.raises(lc.InvalidArgumentError, match=r"messages\[1\]\.tool_calls\[0\]"):
        plan_chat(tiny_model, bad, tools=[SPECIAL_FUNCTION], chat_template="chatml")
    with pytest.raises(lc.InvalidArgumentError, match=r"messages\[1\]\.tool_calls"):
        plan_chat(tiny_model, [*USER, {"role": "assistant", "tool_calls": "x"}], tools=[SPECIAL_FUNCTION],
                  chat_template="chatml")
    deep = '{"arg1": ' + "[" * 100000 + "]" * 100000 + "}"
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "special_function", "arguments": deep}}]}]
    assert plan_chat(tiny_model, history, tools=[SPECIAL_FUNCTION], chat_template="chatml").prompt
    out = _GenericOutput()
    out.feed('{"tool_calls": [{"name": "f", "arguments": {"a": ' + "[" * 100000 + "]" * 100000 + "}}]}")
    assert out.finish()["content"].startswith('{"tool_calls"')  # Python's parser gave up: the text is kept


def test_grammar_prefill_after_a_special_token_on_a_space_prefix_vocab(tiny_model):
    # SentencePiece with add_space_prefix puts a space before text that follows a special token
    # ("<s>assistant" -> "<s>", " assistant"): the grammar must still be fed the text itself
    for prefill in ("<s>assistant\n", "<|im_start|>assistant\n", "assistant\n"):
        grammar = 'root ::= "' + prefill.replace("\n", "\\n") + '" "yes"'
        out = lc.generate(tiny_model, "Hi", grammar=grammar, grammar_prefill=prefill, max_tokens=6, temp=0)
        assert out == "yes", prefill
    with pytest.raises(lc.GrammarError, match="grammar_prefill"):
        lc.Sampler.create(tiny_model, grammar='root ::= "<s>assistant" "x"', grammar_prefill="<s>assistent")
