"""Chat prompts against llama.cpp's own: every template in the llama.cpp tree, rendered here and by
``llama-server --jinja`` (``POST /apply-template``) from the same build, must give the same text.

The conversations cover a system prompt, none, several turns, past reasoning, tool definitions and
a tool-call history, each with ``enable_thinking`` and ``preserve_reasoning`` passed explicitly to
both sides (their defaults differ on purpose; see docs/chat.md). llama.cpp strips the BOS text a
template writes when the tokenizer adds BOS itself; ours keeps it in the text and drops the
duplicate token (``prompt_tokens``), so the comparison removes it from ours.

One llama-server per template (a template is a server option): the tiny model starts in a
fraction of a second, and a few run at once. Skipped when llama-server is not built.
"""

from __future__ import annotations

import concurrent.futures
import difflib
from datetime import datetime

import pytest

from llama_ctypes.core.tokenizer import Tokenizer
from llama_ctypes.features.chat import ChatParams, chat_variables, render_prompt, template_for
from llama_ctypes.features.chat_template import ChatTemplate, ChatTemplateError
from conftest import llama_cpp_dir
from llama_server import NOT_BUILT, LlamaServer, find_llama_server

TEMPLATES = sorted((llama_cpp_dir() / "models" / "templates").glob("*.jinja"))

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
CONVERSATIONS = {
    "basic": ([{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "What is 2+2?"}], None),
    "no_system": ([{"role": "user", "content": "Hello!"}], None),
    "multi_turn": ([{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another one?"}], None),
    "past_reasoning": ([{"role": "user", "content": "What is 3*7?"},
                        {"role": "assistant", "content": "21.", "reasoning_content": "3 times 7 is 21."},
                        {"role": "user", "content": "And 3*8?"}], None),
    "tools": ([{"role": "system", "content": "You can call tools."},
               {"role": "user", "content": "Weather in Paris?"}], TOOLS),
    "tool_history": ([{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [  # as OpenAI clients send it
                          {"id": "call12345", "type": "function",  # Mistral wants 9 alphanumerics
                           "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
                       "content": "{\"temp_c\": 21}"},
                      {"role": "assistant", "content": "It is 21 C in Paris."},
                      {"role": "user", "content": "Thanks!"}], TOOLS),
}
# (conversation, enable_thinking, preserve_reasoning)
CASES = [(conv, think, preserve) for conv in CONVERSATIONS for think in (True, False)
         for preserve in ((True, False) if conv in ("multi_turn", "past_reasoning") else (True,))]

# Templates whose prompts still differ from llama-server's, and why. Each must still differ (else
# the entry, and docs/chat.md, are out of date).
KNOWN_DIFFERENCES = {
    "google-gemma-4-31B-it-interleaved":
        "llama.cpp recognises this outdated Gemma 4 template and rewrites tool results into the assistant "
        "turn (tool_responses); we render the template as written (for the current Gemma 4 template, "
        "google-gemma-4-31B-it, both agree)",
    "unsloth-mistral-Devstral-Small-2507":
        "llama.cpp mistakes this Unsloth template for Ministral 3 and turns an assistant turn with "
        "reasoning_content into content blocks, of which the template prints only the first: the "
        "answer text is lost; we render the answer",
}

RENDER_WORKERS = 4


def _error(text: str) -> str:
    return "ERROR: " + text


@pytest.fixture(scope="module")
def llama_server_prompts(tiny_model_path):
    """{(template name, case): prompt text or 'ERROR: ...'} from llama-server."""
    exe = find_llama_server()
    if exe is None:
        pytest.fail(NOT_BUILT)

    def render_all(path):
        server = LlamaServer(exe, tiny_model_path, ["--jinja", "--chat-template-file", str(path), "-c", "256",
                                                    "-np", "1", "-t", "1", "--no-warmup", "--cache-ram", "0",
                                                    "-fit", "off"])
        out = {}
        try:
            server.start().wait(60)
        except RuntimeError as exc:
            server.close()
            return {(path.stem, case): _error(f"llama-server refused the template: {exc}") for case in CASES}
        try:
            for case in CASES:
                conv, think, preserve = case
                messages, tools = CONVERSATIONS[conv]
                body = {"messages": messages,
                        "chat_template_kwargs": {"enable_thinking": think, "preserve_reasoning": preserve}}
                if tools:
                    body["tools"] = tools
                response = server.post("/apply-template", body)
                out[(path.stem, case)] = (response.json()["prompt"] if response.status_code == 200
                                          else _error(response.text))
        finally:
            server.close(kill=True)
        return out

    results: dict = {}
    with concurrent.futures.ThreadPoolExecutor(RENDER_WORKERS) as pool:
        for out in pool.map(render_all, TEMPLATES):
            results.update(out)
    return results


def _ours(model, template, case) -> str:
    conv, think, preserve = case
    messages, tools = CONVERSATIONS[conv]
    params = ChatParams(tools=tools, enable_thinking=think, preserve_reasoning=preserve)
    try:
        text = template.render(messages, tools=tools, **chat_variables(params))
    except ChatTemplateError as exc:
        return _error(str(exc))
    bos = Tokenizer.bos(model)
    bos_text = Tokenizer.token_to_piece(model, bos, special=True) if bos is not None else ""
    if Tokenizer.add_bos(model) and bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]  # what llama.cpp strips (the tokenizer adds the token)
    return text


def _differences(model, path, server_prompts) -> list[str]:
    template = template_for(model, ChatParams(chat_template=path.read_text()))  # compiled once for all cases
    out = []
    for case in CASES:
        ours, theirs = _ours(model, template, case), server_prompts[(path.stem, case)]
        if ours.startswith("ERROR: ") and theirs.startswith("ERROR: "):
            continue  # both refuse the conversation (Gemma 2 has no tool role, ...)
        if ours != theirs:
            diff = "\n".join(difflib.unified_diff(ours.splitlines(), theirs.splitlines(), "ours", "llama-server",
                                                  lineterm="", n=1))
            out.append(f"{case}:\n{diff[:1500]}")
    return out


def test_the_llama_cpp_tree_has_its_templates():
    assert len(TEMPLATES) >= 70


@pytest.mark.needs_tools
@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_prompt_matches_llama_server(path, llama_server_prompts, tiny_model):
    differences = _differences(tiny_model, path, llama_server_prompts)
    reason = KNOWN_DIFFERENCES.get(path.stem)
    if reason is not None:
        assert differences, f"{path.stem} now renders like llama-server: remove it from KNOWN_DIFFERENCES and docs"
        pytest.xfail(reason)
    assert not differences, "\n\n".join(differences)


# ---- the llama.cpp behaviours above, without llama-server ------------------------------------------------------

def _template(name: str) -> ChatTemplate:
    return ChatTemplate((llama_cpp_dir() / "models" / "templates" / f"{name}.jinja").read_text(),
                        bos_token="<s>", eos_token="</s>")


def test_today_is_the_date_and_template_kwargs_override_it():
    messages = CONVERSATIONS["basic"][0]
    llama = _template("meta-llama-Llama-3.1-8B-Instruct")
    assert f"Today Date: {datetime.now():%d %b %Y}" in llama.render(messages)
    assert "Today Date: 01 Jan 2030" in llama.render(messages, date_string="01 Jan 2030")


def test_safe_strings_do_not_html_escape_what_is_added_to_them():
    text = _template("meetkai-functionary-medium-v3.1").render(CONVERSATIONS["tools"][0], tools=TOOLS)
    assert '{"name": "get_weather"' in text and "&#34;" not in text


def test_preserve_reasoning_sets_the_names_templates_use():
    source = "{{ preserve_thinking }} {{ clear_thinking }} {{ truncate_history_thinking }} {{ drop_thinking }}"
    template = ChatTemplate(source)
    assert template.render([], preserve_reasoning=True) == "True False False False"
    assert template.render([], preserve_reasoning=False) == "False True True True"
    assert template.render([], preserve_reasoning=True, clear_thinking=True) == "True True False False"
    assert ChatTemplate("{{ reasoning_strength }}").render([], reasoning_effort="low") == "low"


@pytest.mark.parametrize("name", ["LFM2.5-8B-A1B", "mistralai-Ministral-3-14B-Reasoning-2512", "openai-gpt-oss-120b"])
def test_past_reasoning_reaches_templates_that_read_it_under_another_name(name):
    messages = CONVERSATIONS["past_reasoning"][0] + [{"role": "assistant", "content": "24.",
                                                     "reasoning_content": "3 times 8 is 24."}]
    text = _template(name).render(messages, add_generation_prompt=False, preserve_reasoning=True)
    assert "3 times 8 is 24." in text and "24." in text
    assert messages[-1] == {"role": "assistant", "content": "24.", "reasoning_content": "3 times 8 is 24."}


def test_a_system_prompt_is_folded_with_one_newline_and_none_content_is_empty():
    text = _template("google-gemma-2-2b-it").render(CONVERSATIONS["basic"][0])
    assert "You are a helpful assistant.\nWhat is 2+2?" in text
    assert ChatTemplate("{{ messages[0].content is none }}").render([{"role": "assistant", "content": None}]) == "False"


def test_an_undefined_template_variable_says_how_to_pass_it():
    with pytest.raises(ChatTemplateError, match="'functions' is undefined.*template_kwargs"):
        ChatTemplate("{{ functions.name }}").render(CONVERSATIONS["basic"][0])


def test_text_joined_with_an_undefined_or_null_value_is_the_text_as_in_llama_cpp():
    # (firefunction-v2 adds its `functions` variable, which no caller sets, to its system prompt)
    text = _template("fireworks-ai-llama-3-firefunction-v2").render(CONVERSATIONS["no_system"][0])
    assert f"Today is {datetime.now():%b %d %Y}." in text and "Hello!" in text
    source = "{{ 'a' + missing }}|{{ none + 'b' }}|{{ 'c' + none }}|{{ 'd' + 'e' }}"
    assert ChatTemplate(source).render([]) == "a|b|c|de"
    with pytest.raises(ChatTemplateError):  # (only text: a number plus nothing is still an error)
        ChatTemplate("{{ 1 + missing }}").render([])


def test_thinking_defaults_to_the_templates_own_choice(tiny_model):
    messages = CONVERSATIONS["basic"][0]
    deepseek = (llama_cpp_dir() / "models" / "templates" / "deepseek-ai-DeepSeek-V3.1.jinja").read_text()
    default, _ = render_prompt(tiny_model, messages, ChatParams(chat_template=deepseek))
    on, _ = render_prompt(tiny_model, messages, ChatParams(chat_template=deepseek, enable_thinking=True))
    assert default.endswith("<think></think>") and on.endswith("<think>")  # llama-server's default is `on`
