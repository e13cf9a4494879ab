"""The reasoning budget (llama-server's ``--reasoning-budget`` / ``thinking_budget_tokens``): after N tokens of
thinking the end of the reasoning block is forced; what came before is the model's own."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import ServeProcess

import llama_ctypes as lc
from llama_ctypes.core.budget import ReasoningBudget

#: A template that thinks: its generation prompt leaves a ``<think>`` block open.
THINKING = ("{%- for message in messages -%}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
            "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{%- endif -%}")
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


def _end_ids(model) -> list[int]:
    return model.vocab.tokenize("</think>", add_special=False, parse_special=True)


def _run(state, draws, pieces=None):
    """What a runner emits when the sampler would draw ``draws`` in turn (a forced token is not drawn)."""
    out, draws = [], list(draws)
    while draws:
        forced = state.forced()
        if forced is None:
            tok = draws.pop(0)
            state.seen(tok)
            out.append(tok)
        else:
            out.append(forced)
    return out


class _Bytes:
    """A vocabulary stand-in for the UTF-8 wait: token t's piece is ``pieces[t]``."""

    def __init__(self, pieces):
        self.pieces = pieces

    def check_tokens(self, tokens):
        return tokens

    def token_bytes(self, t, special=True):
        return self.pieces.get(t, b"x")


def test_the_state_machine_counts_inside_the_block_and_forces_its_end():
    budget = ReasoningBudget(3, (((10, 11), (12, 13)), ((20,), (21,))), message=(5,))
    state = budget.start()
    # idle until a start marker; three tokens inside; then the message and the matching end marker
    assert _run(state, [1, 20, 30, 31, 32, 33, 34]) == [1, 20, 30, 31, 32, 5, 21, 33, 34]
    assert not state.in_block and state.n_forced == 2
    # a later block gets a budget of its own
    assert _run(state, [20, 40, 41, 42, 43]) == [20, 40, 41, 42, 5, 21, 43]
    ended = ReasoningBudget(5, (((10,), (12,)),)).start()
    assert _run(ended, [10, 1, 12, 3, 4, 5, 6, 7, 8]) == [10, 1, 12, 3, 4, 5, 6, 7, 8]  # ended by itself
    assert not ended.in_block and ended.n_forced == 0
    at_once = ReasoningBudget(0, (((10,), (12, 13)),), open_end=(12, 13)).start()
    assert _run(at_once, [7, 8, 9]) == [12, 13, 7, 8, 9]
    control = ReasoningBudget(100, (((10,), (12,)),), open_end=(12,)).start()
    assert _run(control, [1]) == [1] and control.force_end() and _run(control, [2]) == [12, 2]
    assert not control.force_end()
    # the end waits for a character to be whole: token 2 starts a 3-byte one, token 3 finishes it
    vocab = _Bytes({2: "€".encode()[:1], 3: "€".encode()[1:]})
    utf8 = ReasoningBudget(2, (((10,), (12,)),), open_end=(12,)).start(vocab)
    assert _run(utf8, [1, 2, 3, 4]) == [1, 2, 3, 12, 4]
    with pytest.raises(lc.InvalidArgumentError):
        ReasoningBudget(-1, (((1,), (2,)),))
    with pytest.raises(lc.InvalidArgumentError):
        ReasoningBudget(1, ())
    with pytest.raises(lc.ArgumentTypeError):
        lc.GenerationParams(reasoning_budget=5)


def test_a_budget_with_ids_outside_the_vocabulary_fails_its_request_alone(tiny_model):
    bad = ReasoningBudget(0, (((1,), (2,)),), open_end=(10**6,))
    with pytest.raises(lc.TokenizationError):
        lc.generate(tiny_model, "Hello", max_tokens=2, reasoning_budget=bad)
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=512, n_threads=1) as server:
        with pytest.raises(lc.TokenizationError):
            server.generate("Hello", max_tokens=2, reasoning_budget=bad)
        assert len(server.generate("Hello", max_tokens=2, temp=0).tokens) >= 1  # (the server goes on)


def test_forced_tokens_are_what_the_sampler_accepts(tiny_model):
    """A forced token is given to the sampler as emitted: post-sampling logprobs name it, at probability 1
    (the entry of a token that was never sampled comes from the forced token, not from a discarded draw)."""
    end = _end_ids(tiny_model)
    out = lc.chat(tiny_model, MESSAGES, chat_template=THINKING, reasoning_budget=2, temp=0, max_tokens=8,
                  ignore_eos=True, logprobs=1, post_sampling=True)
    assert out.tokens[2:2 + len(end)] == end
    for entry, tok in zip(out.logprobs, out.tokens):
        assert entry.token == tok
    for entry in out.logprobs[2:2 + len(end)]:
        assert entry.logprob == 0.0  # (probability 1)


@pytest.mark.parametrize("where", ["one-call", "server"])
def test_chat_forces_the_end_of_thinking_after_the_budget(tiny_model, where):
    # (no prefix cache: every run below is cold, in the same batch shapes, so greedy runs compare exactly)
    target = tiny_model if where == "one-call" else lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024,
                                                              n_threads=1, cache_prompt=False)
    try:
        opts = dict(chat_template=THINKING, temp=0, max_tokens=16, ignore_eos=True)
        free = lc.chat(target, MESSAGES, **opts)
        budgeted = lc.chat(target, MESSAGES, reasoning_budget=5, **opts)
        end = _end_ids(tiny_model)
        # the first five tokens are the model's own (the same run as without a budget: same shapes, greedy)
        assert budgeted.tokens[:5] == free.tokens[:5]
        assert budgeted.tokens[5:5 + len(end)] == end  # then the end of the block, forced
        assert len(budgeted.tokens) == 16
        # the reply splits there: the reasoning is the five tokens' text, the answer comes after the marker
        five = b"".join(lc.Tokenizer.token_bytes(tiny_model, t) for t in budgeted.tokens[:5])
        assert budgeted.reasoning.strip() == five.decode("utf-8", "replace").strip()
        assert "</think>" not in budgeted.content and "</think>" not in budgeted.reasoning
        assert "</think>" not in free.content + free.reasoning and not free.content  # (never ends by itself)
        # a budget of 0 ends the block at once; -1 is no limit
        none = lc.chat(target, MESSAGES, reasoning_budget=0, **opts)
        assert none.tokens[:len(end)] == end and none.reasoning == ""
        assert lc.chat(target, MESSAGES, reasoning_budget=-1, **opts).tokens == free.tokens
        with pytest.raises(lc.InvalidArgumentError):
            lc.chat(target, MESSAGES, reasoning_budget=-2, **opts)
    finally:
        if where == "server":
            target.close()


def test_a_template_that_does_not_think_ignores_the_budget(tiny_model):
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    opts = dict(chat_template=template, temp=0, max_tokens=8, ignore_eos=True)
    assert lc.chat(tiny_model, MESSAGES, reasoning_budget=0, **opts).tokens == \
        lc.chat(tiny_model, MESSAGES, **opts).tokens


def test_reasoning_budget_over_http(tmp_path, tiny_model_path, tiny_model):
    """``reasoning_budget_tokens`` (and ``thinking_budget_tokens``), ``--reasoning-budget`` as every request's
    default, and Anthropic's ``thinking.budget_tokens``, as llama-server."""
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    # (no prefix cache: every request runs cold, in the same shapes, so their texts compare exactly)
    proc = ServeProcess([str(tiny_model_path), "--chat-template", str(template), "--reasoning-budget", "3",
                         "--no-cache-prompt"], tmp_path / "serve.log")
    end = _end_ids(tiny_model)

    def chat(**fields) -> dict:
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                **fields}
        r = httpx.post(f"{proc.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        proc.wait_ready()
        default = chat()["choices"][0]["message"]  # the server's budget: 3
        assert default["reasoning_content"] and default["content"]
        five = chat(reasoning_budget_tokens=5)["choices"][0]["message"]
        assert len(five["reasoning_content"]) > len(default["reasoning_content"])
        assert chat(thinking_budget_tokens=5)["choices"][0]["message"] == five
        # streamed: the same reasoning and answer, split as the plain response splits them
        with httpx.stream("POST", f"{proc.base_url}/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                "reasoning_budget_tokens": 5, "stream": True}) as r:
            import json
            deltas = [json.loads(line[6:])["choices"] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        reasoning = "".join(c[0]["delta"].get("reasoning_content") or "" for c in deltas if c)
        content = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
        assert (reasoning, content) == (five["reasoning_content"], five["content"])
        # Anthropic's thinking budget
        r = httpx.post(f"{proc.base_url}/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 12, "temperature": 0, "messages": MESSAGES,
            "thinking": {"type": "enabled", "budget_tokens": 5}})
        assert r.status_code == 200, r.text
        blocks = r.json()["content"]
        assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == five["reasoning_content"]
        assert any(b["type"] == "text" for b in blocks)
        bad = httpx.post(f"{proc.base_url}/v1/chat/completions", json={"messages": MESSAGES,
                                                                       "reasoning_budget_tokens": -5})
        assert bad.status_code == 400
        assert end  # (the marker is several tokens in this vocabulary: forced one by one)
    finally:
        proc.stop()


def test_the_control_endpoint_ends_the_reasoning_of_a_running_completion(tmp_path, tiny_model_path):
    """``reasoning_control: true`` arms a chat completion; ``POST /v1/chat/completions/control`` with its id and
    ``reasoning_end`` ends its thinking while it streams, as llama-server."""
    import json

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    proc = ServeProcess([str(tiny_model_path), "--chat-template", str(template)], tmp_path / "serve.log")

    def control(**body) -> httpx.Response:
        return httpx.post(f"{proc.base_url}/v1/chat/completions/control", json=body, timeout=30)

    try:
        proc.wait_ready()
        assert control(action="reasoning_end").status_code == 400  # (no id)
        assert control(id="chatcmpl-x", action="nap").status_code == 400
        assert control(id="chatcmpl-x", action="reasoning_end").json() == {
            "success": False, "message": "no active completion for this id"}
        body = {"messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        for armed in (False, True):
            reasoning, content, ended = [], [], None
            with httpx.stream("POST", f"{proc.base_url}/v1/chat/completions", timeout=60,
                              json={**body, "reasoning_control": armed}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                    reasoning.append(delta.get("reasoning_content") or "")
                    content.append(delta.get("content") or "")
                    if ended is None and sum(map(bool, reasoning)) >= 3:
                        ended = control(id=chunk["id"], action="reasoning_end").json()
                        if not armed:
                            assert ended["success"] is False and "not enabled" in ended["message"]
                            break
                        assert ended == {"success": True}
                    if armed and "".join(content):
                        break  # (the answer started: the reasoning was ended)
            assert "".join(reasoning) and ("".join(content) != "") is armed
    finally:
        proc.stop()


def test_speculative_decoding_and_a_budget(tiny_model):
    """A single-sequence speculative session refuses a budget (a forced token is no draw a draft could
    match); a speculating Server runs a budgeted request without drafts, and still forces the end."""
    budget = ReasoningBudget(2, ((tuple(tiny_model.vocab.tokenize("<think>", add_special=False)), (5, 6)),),
                             open_end=(5, 6))
    with lc.SpeculativeSession(tiny_model, lc.NgramDraft(), n_draft=4, n_ctx=512) as session:
        with pytest.raises(lc.InvalidArgumentError, match="reasoning budget"):
            session.generate("Hello", max_tokens=4, reasoning_budget=budget)
    server = lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, n_threads=1, speculative="ngram")
    try:
        out = server.generate("Hello hello hello hello", max_tokens=8, temp=0, ignore_eos=True,
                              reasoning_budget=budget)
        assert out.tokens[2:4] == [5, 6] and len(out.tokens) == 8
        assert server.stats()["draft_tokens"] == 0
    finally:
        server.close()


@pytest.mark.parametrize("where", ["one-call", "server"])
def test_a_forced_end_that_wakes_a_lazy_grammar_it_does_not_fit_fails_that_request_alone(tiny_model, where):
    """The forced end of thinking is given to the sampler; when its text matches a lazy grammar's trigger and
    the grammar refuses it, llama.cpp throws. That request fails with a GrammarError; a Server goes on serving
    (it used to stop, every request after it a ServerClosedError)."""
    target = tiny_model if where == "one-call" else lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024)
    try:
        opts = dict(chat_template=THINKING, temp=0, max_tokens=8, ignore_eos=True)
        with pytest.raises(lc.GrammarError, match="grammar_lazy_triggers"):
            lc.chat(target, MESSAGES, reasoning_budget=0, grammar='root ::= "\\x01"',
                    grammar_lazy_triggers=["think>"], **opts)
        assert len(lc.chat(target, MESSAGES, reasoning_budget=0, **opts).tokens) == 8
        if where == "server":
            assert target.stats()["active_slots"] == 0
    finally:
        if where == "server":
            target.close()
