"""llama_ctypes.compat: llama-cpp-python's ``Llama`` API over our engine (issue 43, item 1).

The reference for each behaviour is our own one-call API on the same model (the compat layer must add
no second engine) and llama-cpp-python's documented shapes and tokenizer test values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.compat import (Llama, LlamaDiskCache, LlamaGrammar, LlamaRAMCache, LlamaState, LogitsProcessorList,
                                 MinTokensLogitsProcessor, StoppingCriteriaList)
from margins import NEAR_TIE, assert_same_greedy

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    with Llama(str(tiny_model_path), verbose=False, seed=7, embedding=True, chat_format="chatml") as model:
        yield model


def _reference(tiny_model, max_tokens=12, **opts):
    """Our one-call API, cold, greedy, with the alternatives at each step."""
    return lc.generate(tiny_model, PROMPT, max_tokens=max_tokens, temp=0, logprobs=3, cache_prompt=False,
                       n_ctx=512, n_batch=512, flash_attn="disabled", **opts)


def _ref_pieces(ref):
    return [e.text for e in ref.logprobs], [[(a.text, a.logprob) for a in e.top] for e in ref.logprobs]


def _clear_prefix(ref) -> int:
    """Characters of the reference's text before its first near tie (two paths may part there)."""
    offset = 0
    for entry in ref.logprobs:
        top = entry.top
        if len(top) >= 2 and top[0].logprob - top[1].logprob < NEAR_TIE:
            break
        offset += len(entry.text)
    return offset


def test_tokenizer_matches_llama_cpp_pythons_own_test_values(vocab_dir):
    """The values of llama-cpp-python's test_llama_cpp_tokenization, on the same vocab file."""
    llama = Llama(model_path=str(vocab_dir / "ggml-vocab-llama-spm.gguf"), vocab_only=True, verbose=False)
    text = b"Hello World"
    tokens = llama.tokenize(text)
    assert tokens[0] == llama.token_bos() and tokens == [1, 15043, 2787]
    assert llama.detokenize(tokens) == text
    assert llama.tokenize(text, add_bos=False) == [15043, 2787]
    assert llama.detokenize([15043, 2787]) != text
    assert llama.tokenize(b"Hello World</s>") == [1, 15043, 2787, 829, 29879, 29958]
    assert llama.tokenize(b"Hello World</s>", special=True) == [1, 15043, 2787, 2]
    assert llama.tokenize(b"", add_bos=True, special=True) == [llama.token_bos()]
    assert llama.detokenize([llama.token_bos()]) == b""
    assert llama.token_eos() == 2 and llama.n_vocab() == 32000
    with pytest.raises(lc.ArgumentTypeError):
        llama.tokenize("text, not bytes")
    llama.close()


def test_vocab_only_llama_keeps_a_context_that_runs_nothing(vocab_dir, tiny_model_path):
    """llama-cpp-python keeps a llama.cpp context even for a weightless model (its test reads
    ``llama._ctx.ctx``): here a VocabContext, which has no decode, memory or state call to misuse."""
    from llama_ctypes.core.vocab_context import VocabContext

    llama = Llama(model_path=str(vocab_dir / "ggml-vocab-llama-spm.gguf"), vocab_only=True, n_ctx=256, verbose=False)
    view = llama._ctx
    assert isinstance(view.ctx, VocabContext) and view.ctx is llama._ctx.ctx  # (one context, made once)
    assert view.n_ctx() == 256 == llama.n_ctx()
    for call in (lambda: llama("Hello", max_tokens=2), lambda: llama.eval([1, 15043]),
                 lambda: llama.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2)):
        with pytest.raises(lc.ContextCreationError, match="vocab_only"):
            call()
    assert llama.tokenize(b"Hello World") == [1, 15043, 2787]  # (the refused calls changed nothing)
    vocab_ctx = view.ctx
    llama.close()
    assert vocab_ctx.closed and vocab_ctx.freed  # (closed with the Llama, and its model with it)
    with pytest.raises(lc.ClosedError):
        llama._ctx
    # a held VocabContext keeps its model alive past the Llama's close
    model = lc.load_model(str(vocab_dir / "ggml-vocab-llama-spm.gguf"), vocab_only=True)
    held = VocabContext(model)
    model.close()
    assert not model.freed and held.n_ctx == 4096
    held.close()
    assert model.freed
    held.close()  # (idempotent)
    with lc.load_model(str(vocab_dir / "ggml-vocab-llama-spm.gguf"), vocab_only=True) as bare:
        with pytest.raises(lc.ContextCreationError, match="n_ctx"):  # (no training context to stand for 0)
            VocabContext(bare, lc.ContextParams(n_ctx=0))
    with lc.load_model(tiny_model_path) as weighted, pytest.raises(lc.InvalidArgumentError, match="has weights"):
        VocabContext(weighted)


def test_a_vocab_context_made_while_the_llama_closes_is_not_kept(vocab_dir, monkeypatch):
    """close() in one thread while another makes the vocab_only context: the new context is closed at once
    and that thread gets ClosedError (nothing open left behind the closed Llama)."""
    import threading

    from llama_ctypes.core.vocab_context import VocabContext
    from llama_ctypes.interfaces.compat import _session

    started, go, made = threading.Event(), threading.Event(), []

    class Slow(VocabContext):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
            started.set()  # (made, not yet kept by the session)
            go.wait(10)

    monkeypatch.setattr(_session, "VocabContext", Slow)
    llama = Llama(model_path=str(vocab_dir / "ggml-vocab-llama-spm.gguf"), vocab_only=True, n_ctx=256, verbose=False)
    errors = []

    def touch():
        try:
            llama._ctx
        except lc.ClosedError as error:
            errors.append(error)

    t = threading.Thread(target=touch)
    t.start()
    assert started.wait(10)
    llama.close()
    go.set()
    t.join(10)
    assert len(errors) == 1 and len(made) == 1 and made[0].closed


def test_context_options_are_checked_before_anything_is_sized_by_them(vocab_dir):
    for bad in (-5, 2**32):
        with pytest.raises(lc.InvalidArgumentError, match="n_ctx"):
            Llama(model_path=str(vocab_dir / "ggml-vocab-llama-spm.gguf"), vocab_only=True, n_ctx=bad, verbose=False)


def test_completion_shape_and_tokens_match_the_engine(llm, tiny_model):
    ref = _reference(tiny_model)
    out = llm(PROMPT, max_tokens=12, temperature=0, logprobs=3)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and isinstance(out["created"], int)
    assert out["model"] == llm.model_path
    choice = out["choices"][0]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"} and choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": ref.prompt_tokens, "completion_tokens": 12,
                            "total_tokens": ref.prompt_tokens + 12}
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 12
    assert lp["text_offset"][0] == 0 and all(b - a == len(t) for a, b, t in
                                             zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    assert all(lp["top_logprobs"][i][t] == lp["token_logprobs"][i] for i, t in enumerate(lp["tokens"]))
    ref_pieces, ref_top = _ref_pieces(ref)
    assert_same_greedy(lp["tokens"], ref_pieces, ref_top, what="compat vs lc.generate")


def test_streaming_gives_the_same_text_in_chunks(llm, tiny_model):
    ref = _reference(tiny_model)
    chunks = list(llm(PROMPT, max_tokens=12, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    clear = _clear_prefix(ref)
    assert text[:clear] == ref.text[:clear]


def test_sampling_options_reach_the_engine(llm, tiny_model):
    """A seed gives the engine's draw with the same options (both cold: the same computation); a grammar
    constrains; a stop string ends the text before it."""
    options = dict(max_tokens=10, top_k=20, top_p=0.9, min_p=0.0, seed=123)
    llm.reset()
    ours = llm(PROMPT, temperature=0.9, repeat_penalty=1.1, **options)
    ref = lc.generate(tiny_model, PROMPT, temp=0.9, penalty_repeat=1.1, penalty_last_n=64, cache_prompt=False,
                      n_ctx=512, n_batch=512, flash_attn="disabled", **options)
    assert ours["choices"][0]["text"] == ref.text
    # without a seed, each call draws the next from the Llama's (as there): two calls differ, a set_seed repeats
    llm.set_seed(5)
    first, second = (llm(PROMPT, max_tokens=10, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)["choices"][0]["text"]
                     for _ in range(2))
    llm.set_seed(5)
    assert llm(PROMPT, max_tokens=10, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)["choices"][0]["text"] == first
    assert first != second
    grammar = LlamaGrammar.from_string('root ::= ("yes" | "no") "."')
    assert llm(PROMPT, grammar=grammar, max_tokens=8, temperature=0)["choices"][0]["text"] in ("yes.", "no.")
    schema = LlamaGrammar.from_json_schema(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                       "required": ["n"]}))
    assert isinstance(json.loads(llm(PROMPT, grammar=schema, max_tokens=40, temperature=0)["choices"][0]["text"])["n"],
                      int)
    greedy = _reference(tiny_model)
    clear = _clear_prefix(greedy)
    if clear >= 4:  # (a stop inside the part every CPU agrees on)
        stop = greedy.text[2:4]
        stopped = llm(PROMPT, max_tokens=12, temperature=0, stop=stop)["choices"][0]
        assert stopped["finish_reason"] == "stop" and stopped["text"] == greedy.text[:greedy.text.index(stop)]


def test_max_tokens_none_or_zero_runs_to_the_context_and_echo_prepends_the_prompt(llm):
    out = llm("Hi", max_tokens=0, temperature=0)
    usage = out["usage"]
    assert usage["total_tokens"] == llm.n_ctx() or out["choices"][0]["finish_reason"] == "stop"
    echoed = llm(PROMPT, max_tokens=4, temperature=0, echo=True)["choices"][0]["text"]
    assert echoed.startswith(PROMPT)
    tokens = llm.tokenize(PROMPT.encode())
    assert llm(tokens, max_tokens=4, temperature=0)["usage"]["prompt_tokens"] == len(tokens)


def test_chat_completion_shapes_formats_and_tools(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = llm.create_chat_completion(messages, max_tokens=6, temperature=0)
    assert out["object"] == "chat.completion" and out["model"] == llm.model_path
    assert out["choices"][0]["message"]["role"] == "assistant" and isinstance(out["choices"][0]["message"]["content"],
                                                                                 str)
    assert out["usage"]["completion_tokens"] == 6
    chunks = list(llm.create_chat_completion(messages, max_tokens=6, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    formatted = llm.create_chat_completion(
        messages, max_tokens=40, temperature=0,
        response_format={"type": "json_object", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                           "required": ["a"]}})
    assert isinstance(json.loads(formatted["choices"][0]["message"]["content"])["a"], int)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}}}
    called = llm.create_chat_completion(messages, max_tokens=40, temperature=0, tools=[tool],
                                        tool_choice={"type": "function", "function": {"name": "lookup"}})
    call = called["choices"][0]["message"]["tool_calls"][0]
    assert called["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"])["q"] in ("a", "b")
    by_function = llm.create_chat_completion(messages, max_tokens=40, temperature=0, functions=[tool["function"]],
                                             function_call={"name": "lookup"})
    assert by_function["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"


def test_chat_completion_logprobs(llm):
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.create_chat_completion(messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 5
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
               and e["top_logprobs"][0]["token"] == e["token"] for e in content)
    assert llm.create_chat_completion(messages, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None
    chunks = list(llm.create_chat_completion(messages, max_tokens=5, temperature=0, logprobs=True, stream=True))
    streamed = [e for c in chunks if c["choices"][0].get("logprobs") for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    with pytest.raises(lc.InvalidArgumentError, match="top_logprobs"):
        llm.create_chat_completion(messages, max_tokens=2, logprobs=True, top_logprobs=-1)
    with pytest.raises(lc.InvalidArgumentError, match="logprobs with logits_processor"):
        llm.create_chat_completion(messages, max_tokens=2, logprobs=True, logits_processor=[lambda ids, s: s])


def test_a_model_without_a_chat_template_falls_back_to_llama_2(tiny_model_path):
    """As llama-cpp-python does for a model with no template in its metadata (Gemma 3 270M's Q4_K_M has
    none), where lc.chat would refuse; a format given is kept."""
    messages = [{"role": "user", "content": "Hi"}]
    with Llama(str(tiny_model_path), verbose=False) as plain, \
            Llama(str(tiny_model_path), verbose=False, chat_format="llama-2") as explicit:
        assert plain.chat_format == "llama-2"
        out = plain.create_chat_completion(messages, max_tokens=3, temperature=0)
        same = explicit.create_chat_completion(messages, max_tokens=3, temperature=0)
        assert out["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"] > 0
    with Llama(str(tiny_model_path), verbose=False, chat_format="chatml") as chatml:
        assert chatml.chat_format == "chatml"


def test_chat_as_openai_types(llm):
    import openai  # (a test dependency)

    out = llm.create_chat_completion_openai_v1([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert isinstance(out, openai.types.chat.ChatCompletion) and out.choices[0].message.role == "assistant"


def test_embeddings_shapes_and_usage(llm, tiny_model):
    one = llm.embed("hello")
    assert isinstance(one, list) and len(one) == llm.n_embd() and all(isinstance(x, float) for x in one)
    ref = lc.embed(tiny_model, "hello", normalize=False)
    assert one == pytest.approx(ref.tolist(), rel=1e-4, abs=1e-5)
    normalized = llm.embed(["hello", "world"], normalize=True)
    assert len(normalized) == 2 and sum(x * x for x in normalized[1]) == pytest.approx(1.0, rel=1e-4)
    out = llm.create_embedding(["hello", "world"])
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == len(llm.tokenize(b"hello")) + len(llm.tokenize(b"world"))
    with Llama(llm.model_path, verbose=False) as plain:
        with pytest.raises(RuntimeError, match="embedding=True"):
            plain.embed("hello")


def test_what_is_not_carried_over_is_refused_by_name(llm, tiny_model_path):
    for kwargs, name in (({"tfs_z": 0.9}, "tfs_z"), ({"echo": True, "logprobs": 2}, "logits_all=True")):
        with pytest.raises(lc.InvalidArgumentError, match=name):
            llm(PROMPT, max_tokens=2, **kwargs)
    with pytest.raises(lc.ArgumentTypeError, match="bogus"):
        Llama(str(tiny_model_path), bogus=1)
    for kwargs, name in (({"numa": True}, "numa"), ({"chat_format": "no-such-format"}, "chat_format")):
        with pytest.raises(lc.InvalidArgumentError, match=name):
            Llama(str(tiny_model_path), verbose=False, **kwargs)
    with pytest.raises(lc.ArgumentTypeError, match="draft_model"):
        Llama(str(tiny_model_path), verbose=False, draft_model=object())
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(lc.InvalidArgumentError, match="logits_processor"):
        llm.create_chat_completion([{"role": "user", "content": "Hi"}], logits_processor=[lambda i, s: s],
                                   tools=[tool])
    with pytest.raises(lc.ArgumentTypeError, match="logits_processor"):
        llm(PROMPT, max_tokens=2, logits_processor=42)


def test_logits_all_keeps_every_row_for_scores_sample_state_and_echo_logprobs(tiny_model_path):
    def log_softmax(row):
        row = row.astype(np.float64)
        return row - (row.max() + np.log(np.exp(row - row.max()).sum()))

    with Llama(str(tiny_model_path), verbose=False, logits_all=True, n_ctx=256, n_batch=4) as llm, \
            Llama(str(tiny_model_path), verbose=False, n_ctx=256) as plain:
        tokens = llm.tokenize(PROMPT.encode())
        assert len(tokens) > 4  # (decoded in runs of n_batch rows)
        llm.eval(tokens)
        rows = np.array(llm.scores)
        assert rows.shape == (len(tokens), llm.n_vocab()) and not llm.scores.flags.writeable
        for i in (0, 3, len(tokens) - 1):  # each row is the logits after that token, as a cold prefix gives
            plain.reset()
            plain.eval(tokens[:i + 1])
            np.testing.assert_allclose(rows[i], plain.scores[0], rtol=1e-3, atol=1e-3)
        assert llm.sample(temp=0.0, idx=3) == int(np.argmax(rows[3]))
        with pytest.raises(lc.InvalidArgumentError, match="idx"):
            llm.sample(temp=0.0, idx=len(tokens))
        state = llm.save_state()
        assert state.scores.shape == (len(tokens), llm.n_vocab())
        with Llama(str(tiny_model_path), verbose=False, logits_all=True, n_ctx=256, n_batch=4) as other:
            other.load_state(state)
            np.testing.assert_array_equal(other.scores, rows)
            plain.load_state(state)  # (a logits_all state into a Llama without: its last row)
            np.testing.assert_array_equal(plain.scores[0], rows[-1])
        llm.reset()
        out = llm(PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
        choice, lp = out["choices"][0], out["choices"][0]["logprobs"]
        assert choice["text"].startswith(PROMPT)
        shown = [t for t in tokens if t != llm.token_bos()]
        assert len(lp["tokens"]) == len(shown) + 4 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        held = np.array(llm.scores)  # (prompt and generated tokens: their rows)
        for j in range(1, len(shown)):
            i = tokens.index(shown[j], j)  # the token's position in the prompt
            assert lp["token_logprobs"][j] == pytest.approx(log_softmax(held[i - 1])[shown[j]], abs=1e-4)
            assert len(lp["top_logprobs"][j]) >= 2
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert all(v is not None for v in lp["token_logprobs"][len(shown):])
        streamed = list(llm(PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True))
        assert streamed[-1]["choices"][0]["logprobs"]["tokens"] == lp["tokens"]


def test_logits_all_that_cannot_fit_in_memory_is_refused(tiny_model_path, monkeypatch):
    from llama_ctypes.interfaces.compat import llama as compat_llama

    monkeypatch.setattr(compat_llama, "detect_system_memory", lambda: 64 << 20)
    with pytest.raises(lc.InvalidArgumentError, match="smaller n_ctx"):
        Llama(str(tiny_model_path), verbose=False, logits_all=True, n_ctx=2048)
    with Llama(str(tiny_model_path), verbose=False, logits_all=True, n_ctx=64) as small:  # (8 MiB of rows)
        assert small.n_ctx() == 64


def test_reset_set_cache_and_threads(llm, tiny_model):
    ref = _reference(tiny_model, max_tokens=8)
    clear = _clear_prefix(ref)
    llm.set_cache(LlamaRAMCache(1 << 20))
    llm.reset()
    results: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(llm(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 3
    assert all(r[:clear] == ref.text[:clear] for r in results)


_INSTALL = """
import sys
from llama_ctypes.compat import install_as_llama_cpp, Llama
install_as_llama_cpp()
import llama_cpp
from llama_cpp import Llama as L, LlamaGrammar
from llama_cpp.llama_types import ChatCompletionRequestMessage, CreateCompletionResponse
from llama_cpp.llama import Llama as L2
assert L is Llama is L2
try:
    import llama_cpp.llama_cpp
except ImportError as e:
    assert "not" in str(e) and "docs/compat.md" in str(e), e
else:
    raise SystemExit("llama_cpp.llama_cpp imported")
try:
    llama_cpp.llama_backend_init
except AttributeError as e:
    assert "docs/compat.md" in str(e)
else:
    raise SystemExit("no AttributeError")
print("ok")
"""


def test_install_as_llama_cpp_makes_import_llama_cpp_ours():
    proc = subprocess.run([sys.executable, "-c", _INSTALL], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    # never implicit: importing llama_ctypes alone registers nothing
    proc = subprocess.run([sys.executable, "-c", "import sys, llama_ctypes.compat; print('llama_cpp' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


def _greedy_ids(tiny_model, prompt_tokens, n):
    ref = lc.generate(tiny_model, prompt_tokens, max_tokens=n, temp=0, logprobs=3, cache_prompt=False, n_ctx=512,
                      n_batch=512, flash_attn="disabled")
    return ref, [e.token for e in ref.logprobs], [[(a.token, a.logprob) for a in e.top] for e in ref.logprobs]


def test_the_low_level_loop_eval_sample_generate(tiny_model_path, tiny_model):
    """llama-cpp-python's eval/sample/generate on the Llama's own context: greedy equals the engine's; a prompt
    already evaluated is not decoded again; a longer history is cut back to the prompt."""
    with Llama(str(tiny_model_path), verbose=False) as llm:
        tokens = llm.tokenize(PROMPT.encode())
        _, ref, ref_top = _greedy_ids(tiny_model, tokens, 4)
        import itertools
        got = list(itertools.islice(llm.generate(tokens, temp=0.0), 4))
        assert_same_greedy(got, ref, ref_top, what="generate vs lc.generate")
        assert llm.n_tokens == len(tokens) + 3
        llm.reset()
        assert llm.n_tokens == 0
        llm.eval(tokens)
        assert llm.n_tokens == len(tokens) and llm.input_ids[:len(tokens)].tolist() == tokens
        first = llm.sample(temp=0.0, idx=len(tokens) - 1)
        assert first == got[0]
        again = list(itertools.islice(llm.generate(tokens, temp=0.0), 3))  # (held, with its logits: no decode)
        assert again == got[:3] and llm.n_tokens == len(tokens) + 2
        llm.eval(llm.tokenize(b" and more", add_bos=False))
        assert list(itertools.islice(llm.generate(tokens, temp=0.0), 3)) == got[:3]
        with pytest.raises(lc.InvalidArgumentError, match="idx"):
            llm.sample(temp=0.0, idx=0)
        with pytest.raises(lc.TokenizationError):
            llm.eval([llm.n_vocab()])
        with pytest.raises(lc.ContextOverflowError):
            llm.eval(tokens * 200)
        assert llm.n_tokens == len(tokens) + 2  # (nothing lost by the refusals)
        # an unfinished generate() keeps the own context: the same thread gets an error, not a deadlock ...
        pending = llm.generate(tokens, temp=0.0)
        next(pending)
        with pytest.raises(lc.InvalidArgumentError, match="unfinished"):
            llm.eval(tokens)
        pending.close()
        # ... and a stream may be iterated from several threads (a thread pool), the lock released by the last
        stream = llm(PROMPT, max_tokens=4, temperature=0, stream=True, stopping_criteria=lambda ids, lg: False)
        pieces = [next(stream)]
        worker = threading.Thread(target=lambda: pieces.extend(stream))
        worker.start()
        worker.join(60)
        assert pieces[-1]["choices"][0]["finish_reason"] == "length"
        llm.eval(llm.tokenize(b" free again", add_bos=False))


def test_the_low_level_loop_on_recurrent_and_hybrid_models(tmp_path, vocab_dir, tiny_hybrid):
    """A recurrent state cannot drop a tail: a history longer than the prompt is decoded again from the start,
    and the tokens are those of a fresh Llama (the same computation)."""
    import itertools

    from tiny_models import write_tiny_mamba

    mamba = write_tiny_mamba(tmp_path / "mamba.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf")
    for path, recurrent, hybrid in ((mamba, True, False), (tiny_hybrid.path, False, True)):
        with Llama(str(path), verbose=False, n_ctx=64) as fresh, Llama(str(path), verbose=False, n_ctx=64) as used:
            assert (used._is_recurrent, used._is_hybrid) == (recurrent, hybrid)
            tokens = fresh.tokenize(PROMPT.encode())
            expected = list(itertools.islice(fresh.generate(tokens, temp=0.0), 3))
            used.eval(tokens + used.tokenize(b" jumps over", add_bos=False))
            assert list(itertools.islice(used.generate(tokens, temp=0.0), 3)) == expected
            state = fresh.save_state()
            used.reset()
            used.load_state(state)
            assert used.n_tokens == fresh.n_tokens
            assert used.sample(temp=0.0) == fresh.sample(temp=0.0)


def test_logits_processors_and_stopping_criteria_run_between_tokens(llm, tiny_model):
    target = llm.tokenize(b" rot", add_bos=False)[-1]
    seen: list[int] = []

    def only_target(input_ids, scores):
        seen.append(len(input_ids))
        out = np.full_like(scores, -np.inf)
        out[target] = 0.0
        return out

    out = llm(PROMPT, max_tokens=3, temperature=0.8, seed=1, logits_processor=LogitsProcessorList([only_target]))
    piece = llm.detokenize([target]).decode()
    assert out["choices"][0]["text"] == piece * 3 and out["usage"]["completion_tokens"] == 3
    n_prompt = out["usage"]["prompt_tokens"]
    assert seen == [n_prompt, n_prompt + 1, n_prompt + 2]  # (input_ids: the prompt and what was generated)
    stop_after_two = StoppingCriteriaList([lambda ids, logits: len(ids) >= n_prompt + 2])
    out = llm(PROMPT, max_tokens=10, temperature=0, stopping_criteria=stop_after_two)
    assert out["usage"]["completion_tokens"] == 2 and out["choices"][0]["finish_reason"] == "stop"
    chunks = list(llm(PROMPT, max_tokens=3, temperature=0, stream=True, logits_processor=only_target))
    assert "".join(c["choices"][0]["text"] for c in chunks) == piece * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with_lp = llm(PROMPT, max_tokens=2, temperature=0, logprobs=2, logits_processor=only_target)
    lp = with_lp["choices"][0]["logprobs"]
    assert lp["tokens"] == [piece, piece] and all(v <= 0 for v in lp["token_logprobs"])  # (raw logits: < 1)
    # a chat completion with a processor (outlines' chat mode): rendered as usual, the processor decides
    messages = [{"role": "user", "content": "Hi"}]
    chat = llm.create_chat_completion(messages, max_tokens=3, logits_processor=[only_target])
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == piece * 3
    plain = llm.create_chat_completion(messages, max_tokens=1, temperature=0)
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # (the same rendered prompt)
    deltas = list(llm.create_chat_completion(messages, max_tokens=3, logits_processor=only_target, stream=True))
    assert deltas[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in deltas) == piece * 3
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    eos = MinTokensLogitsProcessor(3, llm.token_eos())
    row = eos(np.arange(5), np.zeros(llm.n_vocab(), dtype=np.float32))
    assert row[llm.token_eos()] == -np.inf
    # a processor's bad answers are errors, not garbage or an abort
    for bad in (lambda i, s: s[:10], lambda i, s: np.full_like(s, np.nan), lambda i, s: np.full_like(s, -np.inf)):
        with pytest.raises(lc.LlamaError):
            llm(PROMPT, max_tokens=2, logits_processor=bad)
    assert llm(PROMPT, max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2


def test_save_and_load_state_and_the_caches(tiny_model_path, tmp_path):
    """A state restored into another Llama continues exactly as the one that saved it (same bytes, same
    computation after); the seed travels with it; a cache lets a second Llama skip the prompt."""
    import itertools
    with Llama(str(tiny_model_path), verbose=False) as a, Llama(str(tiny_model_path), verbose=False) as b:
        tokens = a.tokenize(PROMPT.encode())
        a.eval(tokens)
        state = a.save_state()
        assert isinstance(state, LlamaState) and state.n_tokens == len(tokens)
        expected = list(itertools.islice(a.generate(tokens, temp=0.0), 4))
        b.eval(a.tokenize(b"Something else entirely"))
        b.load_state(state)
        assert b.n_tokens == len(tokens) and b.input_ids[:len(tokens)].tolist() == tokens
        assert list(itertools.islice(b.generate(tokens, temp=0.0), 4)) == expected
        with pytest.raises(lc.InvalidArgumentError):
            b.load_state("not a state")
        # the seed: a draw, another, then back to the saved state repeats the first draw
        a.set_seed(1337)
        saved = a.save_state()
        draw = dict(max_tokens=6, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
        one, two = a(PROMPT, **draw)["choices"][0]["text"], a(PROMPT, **draw)["choices"][0]["text"]
        a.load_state(saved)
        assert a(PROMPT, **draw)["choices"][0]["text"] == one != two
        for cache in (LlamaRAMCache(), LlamaDiskCache(str(tmp_path / "disk"))):
            a.set_cache(cache)
            a.reset()
            written = a(tokens, max_tokens=3, temperature=0)
            assert tokens in cache and len(cache[tokens].input_ids) >= len(tokens)
            b.reset()
            b.set_cache(cache)
            loads = []
            original = b.load_state
            b.load_state = lambda s: (loads.append(s), original(s))[1]
            try:
                read = b(tokens, max_tokens=3, temperature=0)
            finally:
                del b.load_state
            assert len(loads) == 1 and read["choices"][0]["text"] == written["choices"][0]["text"]
            a.set_cache(None)
            b.set_cache(None)
        small = LlamaRAMCache(capacity_bytes=1)
        small[[1, 2]] = state
        small[[3, 4]] = state
        assert [3, 4] in small and [1, 2] not in small  # (least recently used dropped past the capacity)
        with pytest.raises(KeyError):
            small[[9]]


def test_chat_formatters_and_prompt_lookup():
    """llama-cpp-python's own test values for llama_chat_format and llama_speculative."""
    from llama_ctypes.interfaces.compat import llama_chat_format as fmt
    from llama_ctypes.interfaces.compat.llama_speculative import LlamaPromptLookupDecoding

    mistral = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
               "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "Instruction"}, {"role": "assistant", "content": "Model answer"},
                {"role": "user", "content": "Follow-up instruction"}]
    response = fmt.format_mistral_instruct(messages=messages)
    assert ("" if response.added_special else "<s>") + response.prompt == \
        "<s>[INST] Instruction [/INST]Model answer</s>[INST] Follow-up instruction [/INST]"
    config = {"chat_template": mistral, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    formatter = fmt.hf_tokenizer_config_to_chat_formatter(config)
    assert formatter(messages=[{"role": "user", "content": "Hello, world!"}]).prompt == \
        "<s>[INST] Hello, world! [/INST]</s>"
    jinja = fmt.Jinja2ChatFormatter(mistral, eos_token="</s>", bos_token="<s>", stop_token_ids=[2])
    out = jinja(messages=messages[:1])
    assert out.prompt == "<s>[INST] Instruction [/INST]" and out.added_special
    assert out.stopping_criteria(np.array([5, 2]), None) and not out.stopping_criteria(np.array([2, 5]), None)
    with pytest.raises(lc.LlamaError):  # (the sandbox's budgets hold here too)
        fmt.Jinja2ChatFormatter("{% for i in range(10**9) %}x{% endfor %}", "</s>", "<s>")(messages=messages)
    find = LlamaPromptLookupDecoding.find_candidate_pred_tokens
    assert find(np.array([1, 2, 3, 1, 2, 3, 1, 2, 3]), max_ngram_size=3, num_pred_tokens=2).tolist() == [1, 2]
    assert find(np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]), max_ngram_size=3, num_pred_tokens=2).tolist() == []
    assert LlamaPromptLookupDecoding(num_pred_tokens=3)(np.array([7, 8, 9, 7, 8])).tolist() == [9, 7, 8]


def test_an_embedding_model_refuses_to_generate_on_every_path(tmp_path, vocab_dir):
    """A BERT-like model's completion aborted the process in llama.cpp (every token's row in one encode);
    the own context's 'generation' sampled from all-zero logits. Both refuse; embeddings still work."""
    from tiny_models import write_tiny_bert

    bert = write_tiny_bert(tmp_path / "bert.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf")
    with Llama(str(bert), verbose=False, embedding=True) as llm:
        for hooks in ({}, {"logits_processor": lambda i, s: s}):
            with pytest.raises(lc.InvalidArgumentError, match="cannot generate"):
                llm("Hello", max_tokens=3, **hooks)
        with pytest.raises(lc.InvalidArgumentError, match="cannot generate"):
            llm.eval([1, 5, 6])
        assert len(llm.embed("Hello")) == llm.n_embd()
    model = lc.load_model(bert)
    try:
        with pytest.raises(lc.InvalidArgumentError, match="cannot generate"):
            lc.generate(model, "Hello", max_tokens=3)
    finally:
        model.close()


def test_a_bad_cache_entry_is_a_miss_and_a_forcing_bias_works_with_hooks(tiny_model_path, tmp_path, vocab_dir):
    """From a hostile review: a corrupt disk entry, a state of another model, and an unwritable cache made
    completions fail; a +inf logit_bias (forcing a token) failed on the hooked path only."""
    from tiny_models import write_tiny_llama

    other = write_tiny_llama(tmp_path / "other.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    disk = LlamaDiskCache(str(tmp_path / "disk"))
    with Llama(str(tiny_model_path), verbose=False) as a, Llama(str(other), verbose=False) as b:
        a.set_cache(disk)
        a(PROMPT, max_tokens=2, temperature=0)
        b.set_cache(disk)
        cold = Llama(str(other), verbose=False)
        try:
            assert b(PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"] == \
                cold(PROMPT, max_tokens=4, temperature=0, logits_processor=lambda i, s: s)["choices"][0]["text"]
        finally:
            cold.close()
        for path in (tmp_path / "disk").glob("*.llama_state"):
            path.write_bytes(b"garbage")
        a.reset()
        assert a(PROMPT, max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2
        a.set_cache(LlamaDiskCache(str(tmp_path / "ro")))
        os.chmod(tmp_path / "ro", 0o500)
        try:
            if not os.access(tmp_path / "ro", os.W_OK):  # (root writes anyway)
                assert a(PROMPT, max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2
        finally:
            os.chmod(tmp_path / "ro", 0o700)
        a.set_cache(None)
        forced = a(PROMPT, max_tokens=3, temperature=0, logit_bias={5: float("inf")},
                   logits_processor=lambda i, s: s)
        assert forced["usage"]["completion_tokens"] == 3  # (it raised GrammarError before)


def test_the_two_llama_h_functions_outlines_calls(llm):
    """llama.h's return convention (minus the size needed when the buffer is short); a pointer is refused, as
    its size says nothing of the memory behind it."""
    import ctypes

    from llama_ctypes.compat import llama_model_get_vocab, llama_token_to_piece

    vocab = llama_model_get_vocab(llm.model)
    tok = max(llm.tokenize(b"hello wonderful world", add_bos=False), key=lambda t: len(llm.detokenize([t])))
    piece = llm.detokenize([tok], special=True)
    assert len(piece) > 1
    buf = (ctypes.c_char * 32)()
    assert llama_token_to_piece(vocab, tok, buf, 32, 0, True) == len(piece) and buf.raw[:len(piece)] == piece
    short = len(piece) - 1
    assert llama_token_to_piece(vocab, tok, (ctypes.c_char * short)(), short, 0, True) == -len(piece)
    with pytest.raises(lc.ArgumentTypeError):
        llama_token_to_piece(vocab, tok, ctypes.c_char_p(b"xx"), 8, 0, True)
    with pytest.raises(lc.TokenizationError):
        llama_token_to_piece(vocab, llm.n_vocab(), buf, 32, 0, True)


def test_close_from_another_thread_while_the_own_context_is_used(tiny_model_path):
    """close() while another thread evaluates on the own context: that thread gets ClosedError (never a
    crash), and no context outlives the close, even one the other thread was creating at that moment."""
    for delay in (0.0, 0.001, 0.01):
        llm = Llama(str(tiny_model_path), verbose=False, n_ctx=256)
        tokens = llm.tokenize(b"one two three")
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(200):
                    llm.reset()
                    llm.eval(tokens)
            except lc.LlamaError as e:
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        time.sleep(delay)
        llm.close()
        t.join(30)
        assert not t.is_alive()
        assert llm._session._ctx is None
        assert all(isinstance(e, lc.ClosedError) for e in errors), errors
        with pytest.raises(lc.ClosedError):
            llm.eval(tokens)


def test_suffix_fills_in_the_middle_with_the_model_s_tokens_or_is_appended(tmp_path, vocab_dir, tiny_model_path):
    """llama-cpp-python 0.3 lays a suffix out with token 0 in place of the FIM tokens; the model's own ones
    here ([FIM_PRE] prompt [FIM_SUF] suffix [FIM_MID], suffix first with spm_infill). A model without them
    gets the suffix after the generated text, as llama-cpp-python documents."""
    from tiny_models import write_tiny_llama

    pre, suf, mid = 31990, 31991, 31992
    path = write_tiny_llama(tmp_path / "fim.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf",
                            fim_tokens=(pre, suf, mid))
    for spm in (False, True):
        with Llama(str(path), verbose=False, spm_infill=spm) as llm:
            seen: list[list[int]] = []

            def capture(ids, scores):
                if not seen:
                    seen.append([int(t) for t in ids])
                return scores

            out = llm.create_completion("def f(x):", suffix="    return y", max_tokens=4, temperature=0,
                                        logits_processor=capture)
            head = llm.tokenize(b"def f(x):", add_bos=False)
            tail = llm.tokenize(b"    return y", add_bos=False)
            parts = [[suf, *tail], [pre, *head]] if spm else [[pre, *head], [suf, *tail]]
            expected = [llm.token_bos(), *parts[0], *parts[1], mid]
            assert seen[0] == expected
            assert out["usage"]["prompt_tokens"] == len(expected)
            plain = llm.create_completion("def f(x):", suffix="    return y", max_tokens=4, temperature=0)
            assert plain["usage"]["prompt_tokens"] == len(expected)
            assert "return y" not in plain["choices"][0]["text"]
            echoed = llm.create_completion("def f(x):", suffix="    return y", max_tokens=4, temperature=0, echo=True)
            assert echoed["choices"][0]["text"].startswith("def f(x):")
            by_tokens = llm.create_completion(head, suffix="    return y", max_tokens=4, temperature=0, echo=True)
            shown = llm.detokenize(head).decode().lstrip()
            assert by_tokens["choices"][0]["text"].startswith(shown) and "return y" not in shown
    with Llama(str(tiny_model_path), verbose=False) as no_fim:
        out = no_fim.create_completion("Hello", suffix=" END", max_tokens=3, temperature=0)
        assert out["choices"][0]["text"].endswith(" END") and out["choices"][0]["finish_reason"] == "length"
        chunks = list(no_fim.create_completion("Hello", suffix=" END", max_tokens=3, temperature=0, stream=True))
        assert "".join(c["choices"][0]["text"] for c in chunks).endswith(" END")
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(lc.ArgumentTypeError):
            no_fim.create_completion("Hello", suffix=3)


def test_logprobs_seeds_and_states_are_checked_before_they_cost(llm, tiny_model_path):
    """From a hostile review: logprobs=10**9 with a logits processor kept a dict of the whole vocabulary per
    token (54 MB per token on Gemma); a state or seed set to anything failed later, in the sampler."""
    hook = [lambda ids, scores: scores]
    for extra in ({}, {"logits_processor": hook}):
        with pytest.raises(lc.InvalidArgumentError, match="0..20"):
            llm.create_completion("Hi", max_tokens=2, logprobs=21, **extra)
    with pytest.raises(lc.InvalidArgumentError, match="0..20"):
        llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True, top_logprobs=21)
    assert len(llm.create_completion("Hi", max_tokens=2, logprobs=20, logits_processor=hook)
               ["choices"][0]["logprobs"]["top_logprobs"][0]) == 20
    for seed in (2**70, -2, 1.5, True):
        with pytest.raises(lc.InvalidArgumentError, match="seed"):
            llm.set_seed(seed)
        with pytest.raises(lc.InvalidArgumentError, match="seed"):
            Llama(model_path=str(tiny_model_path), seed=seed, verbose=False)
        with pytest.raises(lc.InvalidArgumentError, match="seed"):  # (and the Llama keeps its own)
            llm.create_completion("Hi", max_tokens=1, seed=seed)
    assert len(llm.create_completion("Hi", max_tokens=2, seed=-1)["choices"]) == 1  # (-1: a random draw)
    llm.set_seed(7)
    llm.reset()
    llm.eval(llm.tokenize(b"Hello there"))
    good = llm.save_state()
    fields = dict(input_ids=good.input_ids, scores=good.scores, n_tokens=good.n_tokens,
                  llama_state=good.llama_state, llama_state_size=good.llama_state_size, seed=good.seed)
    bad = {"seed": 2**70, "scores": np.full(llm.n_vocab(), np.nan, dtype=np.float32), "n_tokens": 2**40,
           "input_ids": [10**9] * good.n_tokens}
    for name, value in bad.items():
        with pytest.raises(lc.LlamaError):
            llm.load_state(LlamaState(**{**fields, name: value}))
    llm.load_state(LlamaState(**{**fields, "scores": good.scores.tolist(), "input_ids": list(good.input_ids)}))
    assert llm.n_tokens == good.n_tokens
    assert 0 <= llm.sample() < llm.n_vocab()
