"""The generation-target protocol: a Model (through LocalTarget) and a Server are used the same way by
chat, tool calls, structured output and the manager."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from margins import assert_greedy_equivalent

import llama_ctypes as lc
from llama_ctypes.core.target import as_target


def test_a_model_and_a_server_are_targets(tiny_model):
    local = as_target(tiny_model)
    assert isinstance(local, lc.LocalTarget) and local.model is tiny_model
    assert isinstance(local, lc.GenerationTarget)
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=256) as server:
        assert isinstance(server, lc.GenerationTarget) and as_target(server) is server
        assert server.model is tiny_model
    for wrong in ("model.gguf", None, object()):
        with pytest.raises(lc.ArgumentTypeError):
            as_target(wrong)
    with pytest.raises(lc.ArgumentTypeError):
        lc.LocalTarget("model.gguf")


def test_local_target_is_the_one_call_api(tiny_model):
    target = lc.LocalTarget(tiny_model)
    expected = lc.generate(tiny_model, "Once upon", max_tokens=6, temp=0, ignore_eos=True, logprobs=2,
                           cache_prompt=False)
    # (the same path, but a later call reuses the prompt a pooled context holds: it decodes in other shapes)
    done = target.generate("Once upon", max_tokens=6, temp=0, ignore_eos=True)
    assert_greedy_equivalent(done, expected, what="LocalTarget.generate")
    ids = tiny_model.tokenize("Once upon")
    assert_greedy_equivalent(target.stream_tokens(ids, max_tokens=6, temp=0, ignore_eos=True).completion(), expected,
                             what="LocalTarget.stream_tokens")
    with pytest.raises(lc.ArgumentTypeError, match="session"):
        target.stream_tokens(ids, session="s1")

    async def both():  # (cold, as the first call ran: the same decode shapes, so the same tokens)
        whole = await target.agenerate("Once upon", max_tokens=6, temp=0, ignore_eos=True, cache_prompt=False)
        pieces = [p async for p in target.astream("Once upon", max_tokens=6, temp=0, ignore_eos=True,
                                                  cache_prompt=False)]
        return whole, pieces

    whole, pieces = asyncio.run(both())
    assert whole.tokens == expected.tokens and "".join(pieces) == whole.text


def test_local_target_options_come_before_the_calls(tiny_model):
    """The options a target is made with (a manager's fixed context size) apply to every call; a call's
    own options come after them."""
    small = lc.LocalTarget(tiny_model, {"n_ctx": 32, "max_tokens": 2})
    assert len(small.generate("Hi", temp=0, ignore_eos=True).tokens) == 2
    assert len(small.generate("Hi", temp=0, ignore_eos=True, max_tokens=3).tokens) == 3
    with pytest.raises(lc.ContextOverflowError):
        small.generate("word " * 1000)  # (llama.cpp pads a context to 256 tokens)


@dataclass
class Answer:
    ok: bool


@pytest.mark.gemma
def test_structured_output_and_chat_on_a_server(gemma):
    """response_model= and chat run on a Server as on a Model: the same functions, through the protocol."""
    with lc.Server(model=gemma, n_parallel=2, n_ctx=512) as server:
        answer = lc.generate(server, "Is the sky blue? Answer in JSON.", response_model=Answer, max_tokens=40, temp=0)
        assert isinstance(answer, Answer) and isinstance(answer.ok, bool)
        reply = lc.chat(server, [{"role": "user", "content": "Say hi."}], chat_template="gemma", max_tokens=4,
                        temp=0)
        assert isinstance(reply, lc.ChatReply) and reply.usage["completion_tokens"] == len(reply.tokens) > 0
        assert server.stats()["active_slots"] == 0
