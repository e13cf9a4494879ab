"""``Llama(draft_model=...)`` and ``Llama(chat_handler=...)`` (issue 43): llama-cpp-python's plug-ins of a Llama.

Draft models are verified by our speculative session; projector chat handlers load the projector.

The invariant: greedy output with a draft model is the model's own greedy output (up to a near tie in the
reference: a verification batch rounds apart from one-token decodes), and the drafts are really used.
"""

from __future__ import annotations

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.compat import Llama
from llama_ctypes.interfaces.compat.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding
from margins import assert_same_greedy

# Repetitive text: prompt lookup finds what follows, so drafts are proposed and accepted.
PROMPT = "one two three four five six seven eight. one two three four five six seven eight. one two three"


def _check(out, model, n, what, **opts):
    """out (a compat completion with logprobs) against our plain greedy run, cold, with compat's context
    defaults (llama-cpp-python's flash_attn=False: flash attention alone moves Gemma's logits by ~0.2 nats)."""
    opts = {"n_ctx": 512, "n_batch": 512, "flash_attn": "disabled", **opts}
    ref = lc.generate(model, PROMPT, max_tokens=n, temp=0, logprobs=3, cache_prompt=False, **opts)
    pieces = out["choices"][0]["logprobs"]["tokens"]
    assert_same_greedy(pieces, [e.text for e in ref.logprobs],
                       [[(a.text, a.logprob) for a in e.top] for e in ref.logprobs], what=what)
    return ref


class Oracle(LlamaDraftModel):
    """Proposes the plain greedy run's next tokens (so drafts are accepted), recording what it was given."""

    def __init__(self, n_prompt: int, greedy: list[int], k: int = 6) -> None:
        self.n_prompt, self.greedy, self.k = n_prompt, greedy, k
        self.calls: list[np.ndarray] = []

    def __call__(self, input_ids, /, **kwargs):
        self.calls.append(np.array(input_ids))
        done = len(input_ids) - self.n_prompt
        return np.array(self.greedy[done:done + self.k], dtype=np.intc)


def test_greedy_with_a_draft_model_is_the_model_s_own_greedy(tiny_model_path, tiny_model):
    greedy = lc.generate(tiny_model, PROMPT, max_tokens=24, temp=0, cache_prompt=False, n_ctx=512,
                         flash_attn="disabled").tokens
    draft = Oracle(len(tiny_model.vocab.tokenize(PROMPT, add_special=True)), list(greedy))
    with Llama(str(tiny_model_path), verbose=False, draft_model=draft) as llm:
        assert llm.draft_model is draft
        out = llm(PROMPT, max_tokens=24, temperature=0, logprobs=1)
        assert draft.calls, "the draft model was never asked"
        ids = llm.tokenize(PROMPT.encode())
        # given every token held so far, prompt first, as llama-cpp-python passes input_ids
        assert draft.calls[0].dtype == np.intc and list(draft.calls[0][:len(ids)]) == ids
        assert len(draft.calls[-1]) > len(ids)
        stats = llm._spec.stats()
        assert stats.drafted > 0 and stats.accepted > 0, stats
        ref = _check(out, tiny_model, 24, "compat draft_model vs plain greedy")
        assert out["usage"]["completion_tokens"] == len(out["choices"][0]["logprobs"]["tokens"]) <= 24
        assert out["usage"]["prompt_tokens"] == len(ids) == ref.prompt_tokens
        # streamed: the same text as the whole call (same session, same greedy path)
        chunks = list(llm(PROMPT, max_tokens=24, temperature=0, stream=True))
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]
        # chat, JSON schema included, runs on the session too
        chat = llm.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
        assert chat["choices"][0]["message"]["role"] == "assistant"
        calls = len(draft.calls)
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        reply = llm.create_chat_completion([{"role": "user", "content": "a?"}], max_tokens=24, temperature=0,
                                           response_format={"type": "json_object", "schema": schema})
        assert len(draft.calls) > calls
        content = reply["choices"][0]["message"]["content"]
        assert content.startswith("{") and '"a"' in content


class Faulty(LlamaDraftModel):
    """Proposes what llama.cpp must never see: ids out of the vocabulary, negative ids, floats."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.n = 0

    def __call__(self, input_ids, /, **kwargs):
        self.n += 1
        kind = self.n % 4
        if kind == 0:
            return np.array([int(input_ids[-1]), self.n_vocab + 5], dtype=np.int64)
        if kind == 1:
            return np.array([-1, 3], dtype=np.int64)
        if kind == 2:
            return np.array([1.5, 2.0])
        return [2 ** 40]


def test_a_faulty_draft_model_cannot_reach_llama_cpp_and_its_errors_surface(tiny_model_path, tiny_model):
    with Llama(str(tiny_model_path), verbose=False, draft_model=Faulty(tiny_model.n_vocab)) as llm:
        out = llm(PROMPT, max_tokens=16, temperature=0, logprobs=1)
        _check(out, tiny_model, 16, "faulty drafts")

    class Raising(LlamaDraftModel):
        def __call__(self, input_ids, /, **kwargs):
            raise RuntimeError("draft model broke")

    with Llama(str(tiny_model_path), verbose=False, draft_model=Raising()) as llm:
        with pytest.raises(RuntimeError, match="draft model broke"):
            llm(PROMPT, max_tokens=8, temperature=0)
        # the session is free again: the hooked path and another call still work
        with pytest.raises(RuntimeError, match="draft model broke"):
            llm(PROMPT, max_tokens=8, temperature=0)
        assert llm(PROMPT, max_tokens=3, temperature=0, logits_processor=[lambda i, s: s])["choices"][0]["text"]


def test_a_stream_left_open_does_not_block_the_next_call_and_close_waits_for_it(tiny_model_path):
    llm = Llama(str(tiny_model_path), verbose=False, draft_model=LlamaPromptLookupDecoding())
    stream = llm(PROMPT, max_tokens=32, temperature=0, stream=True)
    next(stream)
    calls = llm._spec.stats().calls
    # the session is held by the open stream: this call runs on the pooled contexts, without drafts
    assert llm(PROMPT, max_tokens=4, temperature=0)["usage"]["completion_tokens"] >= 1
    assert llm._spec.stats().calls == calls
    llm.close()  # the running stream keeps what it needs until it ends
    rest = list(stream)
    assert rest and rest[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    with pytest.raises(lc.ClosedError):
        llm(PROMPT, max_tokens=4)


def test_the_session_reuses_the_prompt_prefix_as_the_pool_does(tiny_model_path):
    with Llama(str(tiny_model_path), verbose=False, draft_model=LlamaPromptLookupDecoding()) as llm:
        target = llm._target()
        assert target is llm._spec
        opts = llm._run_options(target)
        first = target.generate(PROMPT, max_tokens=2, temp=0, **opts)
        again = target.generate(PROMPT + " four five", max_tokens=2, temp=0, **llm._run_options(target))
        n_prompt = len(llm.tokenize(PROMPT.encode()))
        assert first.timings.cached_tokens == 0 and again.timings.cached_tokens >= n_prompt - 1
        llm.reset()  # llama-cpp-python's reset: the next call starts cold
        assert llm._run_options(target)["cache_prompt"] is False


def test_draft_length_follows_the_draft_model_and_the_micro_batch(tiny_model_path):
    with Llama(str(tiny_model_path), verbose=False, n_ubatch=4,
               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)) as llm:
        assert llm._spec.n_draft == 3
    with pytest.raises(lc.InvalidArgumentError, match="n_ubatch"):
        Llama(str(tiny_model_path), verbose=False, n_ubatch=1, draft_model=LlamaPromptLookupDecoding())


@pytest.mark.gemma
def test_gemma_greedy_with_prompt_lookup_is_its_own_greedy(gemma_path, gemma):
    with Llama(str(gemma_path), verbose=False, n_ctx=1024,
               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8)) as llm:
        out = llm(PROMPT, max_tokens=24, temperature=0, logprobs=1)
        _check(out, gemma, 24, "Gemma draft_model vs plain greedy", n_ctx=1024)
        assert llm._spec.stats().accepted > 0


# ---- chat_handler (in this file: both are llama-cpp-python's plug-ins of a Llama) --------------------------


def test_a_projector_chat_handler_loads_it_and_images_reach_the_model(tmp_path, tiny_model_path):
    import base64

    from llama_ctypes.interfaces.compat.llama_chat_format import Llava15ChatHandler, Qwen25VLChatHandler
    from media_files import png
    from tiny_models import write_tiny_mmproj

    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf")
    image = np.random.default_rng(3).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                               {"type": "image_url", "image_url": {"url": url}}]}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is"}]}]
    assert issubclass(Qwen25VLChatHandler, Llava15ChatHandler)
    with Llama(str(tiny_model_path), verbose=False, chat_format="chatml",
               chat_handler=Llava15ChatHandler(clip_model_path=str(mmproj))) as llm:
        reply = llm.create_chat_completion(with_image, max_tokens=3, temperature=0)
        plain = llm.create_chat_completion(text_only, max_tokens=3, temperature=0)
        ref = lc.load_model(tiny_model_path, mmproj=mmproj)
        try:
            ours = lc.chat(ref, with_image, chat_template="chatml", max_tokens=3, temp=0, n_ctx=512)
        finally:
            ref.close()
        # the image's embeddings are in the prompt, as lc.chat on a model with that projector puts them
        assert reply["usage"]["prompt_tokens"] == ours.prompt_tokens > plain["usage"]["prompt_tokens"] + 8
        with pytest.raises(lc.InvalidArgumentError, match="image or audio"):  # (never dropped silently)
            llm.create_chat_completion(with_image, max_tokens=3, logits_processor=[lambda i, s: s])
    with pytest.raises(lc.LlamaError):
        Llama(str(tiny_model_path), verbose=False, chat_handler=Llava15ChatHandler(str(tmp_path / "missing.gguf")))


def test_any_other_chat_handler_is_called_with_the_llama_and_the_arguments(tiny_model_path):
    seen = {}

    def handler(*, llama, messages, **kwargs):
        seen.update(kwargs, llama=llama, messages=messages)
        # a handler that formats its own prompt and completes it, as llama-cpp-python's formatter handlers do
        out = llama.create_completion("[user] " + messages[-1]["content"] + "\n[assistant]",
                                      max_tokens=kwargs["max_tokens"], temperature=kwargs["temperature"])
        return {"id": "chat" + out["id"], "object": "chat.completion", "created": out["created"],
                "model": out["model"], "usage": out["usage"],
                "choices": [{"index": 0, "finish_reason": out["choices"][0]["finish_reason"],
                             "message": {"role": "assistant", "content": out["choices"][0]["text"]}}]}

    with Llama(str(tiny_model_path), verbose=False, chat_handler=handler) as llm:
        reply = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
                                           top_k=7)
        assert seen["llama"] is llm and seen["messages"][-1]["content"] == "Hi"
        assert seen["top_k"] == 7 and seen["stream"] is False and seen["tools"] is None
        assert 1 <= reply["usage"]["completion_tokens"] <= 4
    with pytest.raises(lc.ArgumentTypeError, match="chat_handler"):
        Llama(str(tiny_model_path), verbose=False, chat_handler="chatml")
