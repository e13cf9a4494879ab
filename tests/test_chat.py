"""Chat templates (all of llama.cpp's), thinking control and separation, OpenAI shapes, hostile templates."""

from __future__ import annotations

import json

import pytest

import llama_ctypes as lc
from llama_ctypes.features.chat import ChatStream, prompt_tokens, render_prompt
from llama_ctypes.features.chat_template import ChatTemplate, ChatTemplateError
from llama_ctypes.features.reasoning import FORMATS, ReasoningSplitter, opens_inside_reasoning
from conftest import llama_cpp_dir
from tiny_models import write_tiny_llama

TEMPLATES = sorted((llama_cpp_dir() / "models" / "templates").glob("*.jinja"))

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},  # OpenAI clients send a JSON string
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 C in Paris."},
    {"role": "user", "content": "Thanks!"},
]

# Templates that cannot render the standard tool conversation, and why (none since text joined to an
# undefined value is the text, as in llama.cpp: Cohere's tool_use template adds parameter fields the
# standard format leaves out).
TOOL_EXCEPTIONS: dict[str, str] = {}
# Template variables a template needs beyond the chat API (passed as template_kwargs by a caller).
EXTRA_VARIABLES = {
    "fireworks-ai-llama-3-firefunction-v2.jinja": {"functions": json.dumps([t["function"] for t in TOOLS]),
                                                   "datetime": "Nov 30 2026"},
}


def test_every_llama_cpp_template_renders_a_standard_conversation():
    assert len(TEMPLATES) >= 70, "the llama.cpp tree should ship its templates"
    rendered = tool_rendered = 0
    failures = []
    for path in TEMPLATES:
        template = ChatTemplate(path.read_text(), bos_token="<s>", eos_token="</s>")
        extra = EXTRA_VARIABLES.get(path.name, {})
        try:
            text = template.render(CONVERSATION, **extra)
            assert "What is 2+2?" in text and "Hello!" in text
            rendered += 1
        except ChatTemplateError as exc:
            failures.append(f"{path.name}: {exc}")
        if template.supports_tools and path.name not in TOOL_EXCEPTIONS:
            try:
                text = template.render(TOOL_CONVERSATION, tools=TOOLS, **extra)
                assert "get_weather" in text and "Paris" in text
                tool_rendered += 1
            except ChatTemplateError as exc:
                failures.append(f"{path.name} (tools): {exc}")
    assert not failures, "\n".join(failures)
    assert rendered == len(TEMPLATES)
    assert tool_rendered >= 60  # every template that reads `tools`, but the listed exceptions


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja"])
def test_enable_thinking_controls_the_empty_think_prefix(name):
    template = ChatTemplate((llama_cpp_dir() / "models" / "templates" / name).read_text())
    messages = [{"role": "user", "content": "Hi"}]
    head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(messages, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    thinking = template.render(messages, enable_thinking=True)
    assert thinking in (head, head + "<think>\n")  # Qwen3 lets the model open the block; Qwen3.5 opens it
    assert "</think>" not in thinking


def test_tool_call_arguments_reach_templates_in_the_form_they_expect():
    qwen = ChatTemplate((llama_cpp_dir() / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text())
    assert qwen.tool_arguments_as_object
    out = qwen.render(TOOL_CONVERSATION, tools=TOOLS)
    assert '"city": "Paris"' in out
    functionary = ChatTemplate(
        (llama_cpp_dir() / "models" / "templates" / "meetkai-functionary-medium-v3.2.jinja").read_text())
    assert not functionary.tool_arguments_as_object
    assert '{"city": "Paris"}' in functionary.render(TOOL_CONVERSATION, tools=TOOLS)
    # the caller's messages are never modified
    assert TOOL_CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


HOSTILE = {
    "globals walk": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "function globals": "{{ raise_exception.__globals__ }}",
    "format string": "{{ '{0.__class__}'.format(messages) }}",
    "huge range": "{% for i in range(10**8) %}{% endfor %}",
    "nested ranges": "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}"
                     "{% endfor %}{% endfor %}{% endfor %}",
    "string bomb": "{{ 'x' * 10**9 }}",
    "filter bomb": "{{ 'x'|center(10**9) }}",
    "format bomb": "{{ '{:>1000000000}'.format('x') }}",
    "percent bomb": "{{ '%1000000000s' % 'x' }}",
    "star width bomb": "{{ '%*s' % (10**9, 'x') }}",
    "ljust bomb": "{{ 'x'.ljust(10**9) }}",
    "replace amplification": "{% set s = 'x' * 1000 %}{% set t = s.replace('x', s) %}{{ t.replace('x', t) }}",
    "replace filter amplification": "{% set s = 'x' * 1000 %}{{ s|replace('x', s)|replace('x', s) }}",
    "indent amplification": "{% set s = 'x\n' * 100000 %}{{ s|indent(100) }}",
    "range list": "{{ range(10**9)|list }}",
    "output bomb": "{% for i in range(100000) %}{{ messages | tojson }}{{ messages | tojson }}{% endfor %}",
    "include a file": "{% include '/etc/passwd' %}",
    "busy loop": "{% set x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] %}{% for a in x %}{% for b in x %}{% for c in x %}"
                 "{% for d in x %}{% for e in x %}{% for f in x %}{% for g in x %}{% for h in x %}{% for i in x %}"
                 "{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}"
                 "{% endfor %}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_templates_are_refused_or_bounded(kind):
    import time

    t0 = time.monotonic()
    template = ChatTemplate(HOSTILE[kind])  # compiling must not evaluate anything big either
    with pytest.raises(ChatTemplateError):
        template.render(CONVERSATION, timeout=1.0)
    assert time.monotonic() - t0 < 5.0
    # and the sandbox still renders honest templates afterwards
    assert ChatTemplate("{{ messages[0]['content'] }}").render(CONVERSATION) == CONVERSATION[0]["content"]



_DOUBLED = "{% set ns = namespace(d=[], e=[]) %}{% for i in range(30) %}{% set ns.d = [ns.d, ns.d] %}" \
           "{% set ns.e = [ns.e, ns.e] %}{% endfor %}"
#: Single operations that run long in C (holding the GIL, so the time budget checked between lines cannot stop them)
HOSTILE_C_CALLS = {
    "string doubling with ~": "{% set ns = namespace(s='a') %}{% for i in range(31) %}{% set ns.s = ns.s ~ ns.s %}"
                              "{% endfor %}{{ ns.s|length }}",
    "string doubling with +": "{% set ns = namespace(s='a') %}{% for i in range(31) %}{% set ns.s = ns.s + ns.s %}"
                              "{% endfor %}{{ ns.s|length }}",
    "list doubling with +": "{% set ns = namespace(s=[1]) %}{% for i in range(31) %}{% set ns.s = ns.s + ns.s %}"
                            "{% endfor %}{{ ns.s|length }}",
    "shared lists printed": _DOUBLED + "{{ ns.d }}",
    "shared lists as json": _DOUBLED + "{{ ns.d|tojson|length }}",
    "shared lists as a string": _DOUBLED + "{{ ns.d|string|length }}",
    "shared lists joined": _DOUBLED + "{{ ns.d|join(',')|length }}",
    "shared lists concatenated": _DOUBLED + "{{ ('' ~ ns.d)|length }}",
    "shared lists formatted": _DOUBLED + "{{ ('%s' % [ns.d])|length }}",
    "shared lists compared": _DOUBLED + "{{ ns.d == ns.e }}",
    "shared lists searched": _DOUBLED + "{{ ns.d in [ns.e] }}",
    "shared dicts as json": "{% set ns = namespace(d={}) %}{% for i in range(30) %}{% set ns.d = dict(a=ns.d, b=ns.d) %}"
                            "{% endfor %}{{ ns.d|tojson|length }}",
    "nested repetition": "{{ ([[[0] * 1000] * 1000] * 1000)|string|length }}",
    "sum of lists": "{% set row = range(300)|list %}{{ ([row] * 3000)|sum(start=[])|length }}",
    "a huge integer power": "{{ (((9**64)**64)**64)**64 > 0 }}",
    "a huge integer product": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                              "{% endfor %}{{ ns.x > 0 }}",
    "tabs expanded": '{% set t = "\t" * 500 %}{{ t.expandtabs(3999999)|length }}',
    "many results kept alive": "{% set l = [] %}{% for i in range(3000) %}{% set _ = l.append(' '.ljust(3999990) ~ i) %}"
                               "{% endfor %}{{ l|length }}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_C_CALLS))
def test_hostile_templates_never_hold_the_gil_for_long(kind):
    """Each of these was one C call of seconds to minutes (6 GB for the doubled strings): every thread of a
    server waited for it. They are refused before the call now, and other threads run meanwhile."""
    import threading
    import time

    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.wait(0.01):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ChatTemplateError):
            ChatTemplate(HOSTILE_C_CALLS[kind]).render(CONVERSATION, timeout=1.0)
    finally:
        done.set()
        ticker.join()
    assert time.monotonic() - t0 < 5.0
    assert max(gaps, default=0) < 0.5, f"another thread waited {max(gaps):.2f} s for the GIL"


#: Small values that build big ones out of nothing, inside lists whose own length is all that is counted
HOSTILE_MEMORY = {
    "padded batches": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                      "{% set ns.l = ns.l + ([0]|batch(3999999, 0)|list) %}{% endfor %}{{ ns.l|length }}",
    "padded slices": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                     "{% set ns.l = ns.l + ([0]|slice(3999999, 0)|list) %}{% endfor %}{{ ns.l|length }}",
    # (indentation grows with the depth on every line: quadratic; 1 MB of nesting indented by a million)
    "deep json indented": "{% set ns = namespace(x=[]) %}{% for i in range(200) %}{% set ns.x = [ns.x] %}"
                          "{% endfor %}{{ ns.x|tojson(indent=1000000) }}",
    "deep json indented by a string": "{% set ns = namespace(x=[]) %}{% for i in range(200) %}{% set ns.x = [ns.x] %}"
                                      "{% endfor %}{{ ns.x|tojson(indent=' ' * 100000) }}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_MEMORY))
def test_hostile_templates_are_bounded_in_memory(kind):
    """(From a review) 4 GB within the time budget before: |batch and |slice count the items they pad with."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match="budget"):
            ChatTemplate(HOSTILE_MEMORY[kind]).render(CONVERSATION, timeout=5.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, peak
    assert ChatTemplate("{{ (messages|batch(2)|list)|length }} {{ [1, 2, 3]|slice(2)|list }}").render(
        CONVERSATION) == f"{(len(CONVERSATION) + 1) // 2} [[1, 2], [3]]"


def test_a_conversation_may_be_any_iterable_and_deep_messages_are_refused():
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert template.render(iter([{"role": "user", "content": "hi"}]), add_generation_prompt=False) == "<user>hi"
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(lc.InvalidArgumentError, match="nested deeper"):
        template.render([deep])


def test_checked_operators_keep_their_meaning():
    template = ChatTemplate("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' ~ 1 ~ none }} {{ [1] == [1] }} {{ 'b' in 'abc' }} "
                            "{{ [1] not in [[2]] }} {{ (1, 2) in {(1, 2): 0} }} {{ [[1], [2]]|sum(start=[]) }} "
                            "{{ 'x' + 'y' }} {{ [1] + [2] }} {{ {'k': [1, 2]} }} {{ ns }}")
    assert template.render(CONVERSATION) == "True False a1None True True True True [1, 2] xy [1, 2] {'k': [1, 2]} "

def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="line"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="refused the conversation: no"):
        ChatTemplate("{{ raise_exception('no') }}").render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("  ")


# ---- reasoning separation ---------------------------------------------------------------------

def _split(chunks, formats=FORMATS, open_format=None):
    splitter = ReasoningSplitter(formats, open_format)
    out = [p for c in chunks for p in splitter.feed(c)] + splitter.flush()
    merged: list[list[str]] = []
    for kind, text in out:
        if merged and merged[-1][0] == kind:
            merged[-1][1] += text
        else:
            merged.append([kind, text])
    return [tuple(x) for x in merged], splitter


def test_reasoning_is_separated_even_when_markers_are_split_across_pieces():
    text = "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4."
    for size in (1, 2, 3, 7, len(text)):
        parts, _ = _split([text[i:i + size] for i in range(0, len(text), size)])
        assert parts == [("reasoning", "Let me add 2 and 2.\n"), ("content", "The answer is 4.")], size


def test_prompt_that_opens_the_block_starts_in_reasoning():
    fmt = opens_inside_reasoning("<|im_start|>assistant\n<think>\n", FORMATS)
    assert fmt is not None and fmt.start == "<think>"
    assert opens_inside_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", FORMATS) is None
    parts, _ = _split(["Hmm, 2+2", " is 4.</think>Four."], open_format=fmt)
    assert parts == [("reasoning", "Hmm, 2+2 is 4."), ("content", "Four.")]


def test_cut_off_inside_thinking_is_reported_as_reasoning():
    parts, splitter = _split(["<think>I am still thin", "king about it"])
    assert parts == [("reasoning", "I am still thinking about it")]
    assert splitter.in_reasoning


def test_gpt_oss_channels():
    gpt_oss = [f for f in FORMATS if "analysis" in f.start]
    parts, _ = _split(["<|channel|>analysis<|message|>User wants 4.<|end|>",
                       "<|start|>assistant<|channel|>final<|message|>4"], formats=gpt_oss)
    assert parts == [("reasoning", "User wants 4."), ("content", "4")]


class _FakeTextStream:
    """Stands in for a TextStream: yields fixed pieces."""

    def __init__(self, pieces, finish_reason):
        self._pieces = iter(pieces)
        self.finish_reason = None
        self._final = finish_reason
        self.tokens = list(range(len(pieces)))
        self.prompt_tokens = 3
        self.timings = lc.Timings()
        self.logprobs = None  # not asked for

    def __iter__(self):
        for p in self._pieces:
            yield p
        self.finish_reason = self._final

    def close(self):
        pass


def test_chat_stream_reports_thinking_cut_off_by_length():
    fmt = FORMATS[0]
    stream = ChatStream(_FakeTextStream(["<think>", "still going"], "length"), ReasoningSplitter(FORMATS))
    assert list(stream) == []
    reply = stream.reply()
    assert reply == "" and reply.reasoning == "still going" and reply.finish_reason == "length"
    assert stream.in_reasoning
    done = ChatStream(_FakeTextStream(["<think>a</think>", "b"], "eog"), ReasoningSplitter([fmt])).reply()
    assert (done.content, done.reasoning, done.finish_reason) == ("b", "a", "eog")


# ---- end to end ----------------------------------------------------------------------------------

GEMMA_TEMPLATE = "google-gemma-2-2b-it.jinja"  # Gemma 3 uses the same turn format


@pytest.mark.gemma
def test_chat_on_gemma_with_a_user_template(gemma):
    template = (llama_cpp_dir() / "models" / "templates" / GEMMA_TEMPLATE).read_text()
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    opts = dict(chat_template=template, max_tokens=24, temp=0)
    reply = lc.chat(gemma, messages, **opts)
    assert isinstance(reply, str) and reply.finish_reason in ("eog", "length")
    streamed = lc.stream_chat(gemma, messages, **opts)
    assert "".join(streamed) == reply
    # the template writes <bos>; it must not be doubled
    text, _ = render_prompt(gemma, messages, lc.ChatParams(chat_template=template))
    ids = prompt_tokens(gemma, text)
    assert text.startswith("<bos>") and ids[0] == lc.Tokenizer.bos(gemma) != ids[1]
    # the system prompt was folded into the user turn (this template has no system role)
    assert "Answer in one word." in text


@pytest.mark.gemma
def test_openai_shapes_on_gemma(gemma):
    template = (llama_cpp_dir() / "models" / "templates" / GEMMA_TEMPLATE).read_text()
    messages = [{"role": "user", "content": "Say hello."}]
    done = lc.chat_completion(gemma, messages, chat_template=template, max_tokens=12, temp=0)
    json.dumps(done)
    assert set(done) == {"id", "object", "created", "model", "choices", "usage"}
    assert done["object"] == "chat.completion" and done["id"].startswith("chatcmpl-")
    choice = done["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = done["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    chunks = list(lc.stream_chat_completion(gemma, messages, chat_template=template, max_tokens=12, temp=0))
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}  # (llama-server's)
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == choice["message"]["content"]
    # the same counts; the streamed call found the first call's prompt in the model's pooled context
    streamed = chunks[-1]["usage"]
    assert streamed["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert {**streamed, "prompt_tokens_details": None} == {**usage, "prompt_tokens_details": None}


def test_chat_on_the_tiny_model_with_its_own_and_builtin_templates(tmp_path, vocab_dir):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_tiny_llama(tmp_path / "tiny-chat.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf",
                            chat_template=template)
    messages = [{"role": "user", "content": "Hi there"}]
    with lc.load_model(path) as model:
        assert model.chat_template == template
        reply = lc.chat(model, messages, max_tokens=8, temp=0)
        streamed = list(lc.stream_chat(model, messages, max_tokens=8, temp=0))
        assert "".join(streamed) == reply and len(reply.tokens) > 0
        builtin = lc.chat(model, messages, chat_template="chatml", max_tokens=4, temp=0, system="Be brief.")
        assert builtin.finish_reason in ("eog", "length")


def test_model_without_a_template_gets_a_clear_error(tiny_model):
    with pytest.raises(ChatTemplateError, match="has no chat template.*chat_template="):
        lc.chat(tiny_model, [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="built-in"):
        lc.chat(tiny_model, [{"role": "user", "content": "hi"}], chat_template="no-such-format")
    with pytest.raises(TypeError, match="messages"):
        lc.chat(tiny_model, "hi", chat_template="chatml")
    with pytest.raises(TypeError, match="enable_thinkin"):
        lc.chat(tiny_model, [{"role": "user", "content": "hi"}], chat_template="chatml", enable_thinkin=False)


def test_bos_is_added_once_when_the_template_does_not_write_it(tiny_model):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    text, _ = render_prompt(tiny_model, [{"role": "user", "content": "hello"}], lc.ChatParams(chat_template=template))
    ids = prompt_tokens(tiny_model, text)
    bos = lc.Tokenizer.bos(tiny_model)
    assert ids[0] == bos and ids.count(bos) == 1
    with_bos = "{{ bos_token }}" + template
    text, _ = render_prompt(tiny_model, [{"role": "user", "content": "hello"}], lc.ChatParams(chat_template=with_bos))
    assert prompt_tokens(tiny_model, text).count(bos) == 1


def test_thinking_template_end_to_end_separates_reasoning(tiny_model):
    # A Qwen3.5-style template opens <think> in the generation prompt; force the model to close it.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")
    close_tokens = lc.Tokenizer.encode(tiny_model, "</think>", add_special=False)
    bias = {t: 1e4 - 1e3 * i for i, t in enumerate(close_tokens)}
    stream = lc.stream_chat(tiny_model, [{"role": "user", "content": "2+2?"}], chat_template=template,
                            max_tokens=len(close_tokens) + 3, temp=0, logit_bias=bias, penalty_repeat=1e9)
    kinds = [kind for kind, _ in stream.deltas()]
    reply = stream.reply()
    assert "</think>" not in reply and "</think>" not in reply.reasoning
    assert kinds and set(kinds) <= {"reasoning", "content"}
