"""Prompt reuse across one-call API calls on a Model (core/context_pool.py, core/one_call.py).

A pooled context keeps its last call's tokens; the next call on the model runs on the idle context whose
tokens share the longest prefix with its prompt and decodes only the rest. Invariants: the same greedy
tokens as a cold context (top-1 margin checked), a different prompt never sees stale cells, and threads
using the pool at once each keep their own history.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

import llama_ctypes as lc
from llama_ctypes.core import context_pool
from llama_ctypes.core.context_pool import ContextPool
from margins import assert_greedy_equivalent

# (about 1,100 tokens on Gemma: past its 512-token sliding window and its 1,024-cell window cache, so the
# reused prefix's window must still be there)
SYSTEM = "".join(f"Rule {i}: you are a careful assistant for a small bakery; you answer questions about bread, cakes, "
                 f"opening hours and orders, briefly and kindly. " for i in range(40))
TURNS = ["What time do you open on Saturdays?", "Do you sell rye bread?", "Can I order a cake for Sunday?",
         "How much is a baguette?"]


# ---- the pool's choice, with stand-in contexts (no model) ------------------------------------------------------

@dataclass(eq=False)
class _FakeContext:
    tokens: list[int]
    params: str = "p"
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def test_checkout_takes_the_longest_shared_prefix_and_keeps_the_peak(monkeypatch):
    pool = ContextPool()
    a, b, c = _FakeContext([1, 2, 3, 4]), _FakeContext([1, 2, 9]), _FakeContext([7, 8])
    made = iter([a, b, c])
    monkeypatch.setattr("llama_ctypes.core.context.Context", lambda model, params: next(made))
    got = [pool.checkout(None, "p", [1]) for _ in range(3)]  # three at once: a peak of 3
    assert got == [a, b, c]
    for ctx in got:
        pool.checkin(ctx)
    assert pool.n_idle == 3
    assert pool.checkout(None, "p", [1, 2, 9, 9]) is b
    pool.checkin(b)
    assert pool.checkout(None, "p", [1, 2, 3, 4, 5]) is a
    pool.checkin(a)
    assert pool.checkout(None, "p", [7, 8, 1]) is c
    pool.checkin(c)
    # no prompt, or no shared prefix: the most recently used
    assert pool.checkout(None, "p") is c
    pool.checkin(c)
    assert pool.checkout(None, "p", [5]) is c
    pool.checkin(c)
    assert not any(x.closed for x in (a, b, c))


def test_the_pool_keeps_no_more_than_were_in_use_at_once_and_at_most_its_cap(monkeypatch):
    pool = ContextPool()
    made = [_FakeContext([i]) for i in range(10)]
    it = iter(made)
    monkeypatch.setattr("llama_ctypes.core.context.Context", lambda model, params: next(it))
    one = pool.checkout(None, "p", [0])
    pool.checkin(one)
    again = pool.checkout(None, "p", [5])
    assert again is one  # a single caller keeps reusing one context
    pool.checkin(again)
    assert pool.n_idle == 1
    many = [pool.checkout(None, "p", [0]) for _ in range(context_pool.MAX_IDLE_PER_PARAMS + 2)]
    assert len({id(x) for x in many}) == len(many)
    for ctx in many:
        pool.checkin(ctx)
    assert pool.n_idle == context_pool.MAX_IDLE_PER_PARAMS
    assert [x.closed for x in many] == [True, True] + [False] * context_pool.MAX_IDLE_PER_PARAMS  # the least recent
    pool.close()
    assert all(x.closed for x in many) and pool.n_idle == 0
    late = _FakeContext([1])
    pool.checkin(late)
    assert late.closed


# ---- on a real model ------------------------------------------------------------------------------------------

def _turn_prompts(model: lc.Model) -> list[list[int]]:
    """Token prompts of a growing conversation (each the previous one, a reply and a question)."""
    enc = lambda s: lc.Tokenizer.encode(model, s, add_special=False)  # noqa: E731
    prompts = [lc.Tokenizer.encode(model, SYSTEM) + enc("\nUser: " + TURNS[0] + "\nAssistant:")]
    for q in TURNS[1:]:
        prompts.append(prompts[-1] + enc(" We will see.\nUser: " + q + "\nAssistant:"))
    return prompts


@pytest.mark.gemma
def test_a_growing_prompt_decodes_only_its_new_tokens_with_the_cold_greedy_tokens(gemma):
    prompts = _turn_prompts(gemma)
    opts = dict(max_tokens=12, temp=0, ignore_eos=True, n_ctx=4096)
    ContextPool.of(gemma).close_idle()
    for i, prompt in enumerate(prompts):
        warm = lc.generate(gemma, prompt, **opts)
        # everything the previous call's prompt held is reused (its reply is not in this prompt, unless by chance
        # its first token)
        expected = len(prompts[i - 1]) if i else 0
        assert expected <= warm.timings.cached_tokens < len(prompt), (i, warm.timings.cached_tokens, expected)
        cold = lc.generate(gemma, prompt, cache_prompt=False, logprobs=2, **opts)
        assert cold.timings.cached_tokens == 0
        assert_greedy_equivalent(warm, cold, what=f"turn {i}")
        # the cold run left `prompt` + its reply in the pooled context; the next turn extends `prompt`


@pytest.mark.gemma
def test_a_chat_loop_reuses_its_history(gemma):
    """lc.chat with a growing message list: each turn's prompt extends the last one's, reply included."""
    messages = [{"role": "system", "content": SYSTEM}]
    ContextPool.of(gemma).close_idle()
    cached = []
    for q in TURNS[:3]:
        messages.append({"role": "user", "content": q})
        reply = lc.chat(gemma, messages, max_tokens=16, temp=0, n_ctx=4096, chat_template="gemma")
        cached.append((reply.timings.cached_tokens, reply.prompt_tokens))
        messages.append({"role": "assistant", "content": reply.content})
    assert cached[0][0] == 0
    for (hit, total), (_, before) in zip(cached[1:], cached):
        # the whole previous prompt, but for a token or two where the reply's text merges with what follows it
        assert before - 2 <= hit < total, cached


def test_a_different_prompt_never_sees_stale_cells(tiny_model):
    """After a long prompt, a shorter unrelated one and a prefix of the first get what a cold context gives."""
    opts = dict(max_tokens=8, temp=0, ignore_eos=True, n_ctx=512)
    long = lc.Tokenizer.encode(tiny_model, "one two three four five six seven eight nine ten " * 4)
    other = lc.Tokenizer.encode(tiny_model, "a completely different start")
    for prompt in (long, other, long[:len(long) // 2], long, long):
        warm = lc.generate(tiny_model, prompt, **opts)
        cold = lc.generate(tiny_model, prompt, cache_prompt=False, logprobs=2, **opts)
        assert_greedy_equivalent(warm, cold)
        lc.generate(tiny_model, long, **opts)  # what the pooled context holds before the next prompt
    again = lc.generate(tiny_model, long, **opts)
    assert again.timings.cached_tokens == len(long) - 1  # (the last prompt token is decoded again for its logits)


def test_a_prompt_whose_logits_are_still_there_decodes_nothing(tiny_model):
    """A call that stopped right after its prompt (max_tokens=1, a stream left after its first token) leaves
    the prompt's logits in the context: the same prompt again samples from them and decodes nothing (as
    llama-cpp-python does), with a cold run's tokens. After a longer generation, or with an in-graph
    sampler on either side, the last prompt token is decoded again."""
    opts = dict(temp=0, ignore_eos=True, n_ctx=512)
    prompt = lc.Tokenizer.encode(tiny_model, "one two three four five six seven eight")
    ContextPool.of(tiny_model).close_idle()
    lc.generate(tiny_model, prompt, max_tokens=1, **opts)
    again = lc.generate(tiny_model, prompt, max_tokens=8, logprobs=2, **opts)
    assert again.timings.cached_tokens == len(prompt)
    cold = lc.generate(tiny_model, prompt, max_tokens=8, cache_prompt=False, logprobs=2, **opts)
    assert_greedy_equivalent(again, cold)
    assert lc.generate(tiny_model, prompt, max_tokens=8, **opts).timings.cached_tokens == len(prompt) - 1
    stream = lc.stream(tiny_model, prompt, max_tokens=8, **opts)
    next(iter(stream))
    stream.close()
    third = lc.generate(tiny_model, prompt, max_tokens=8, logprobs=2, **opts)
    assert third.timings.cached_tokens == len(prompt)
    assert_greedy_equivalent(third, cold)
    # a different prompt's logits are never taken for this one's
    lc.generate(tiny_model, prompt[:-1], max_tokens=1, **opts)
    assert lc.generate(tiny_model, prompt, max_tokens=1, **opts).timings.cached_tokens == len(prompt) - 1
    # an in-graph sampler (the CPU backend takes one), before or now: its rows are not plain logits
    for first, then in (({"backend_sampling": True}, {}), ({}, {"backend_sampling": True})):
        ContextPool.of(tiny_model).close_idle()
        lc.generate(tiny_model, prompt, max_tokens=1, **first, **opts)
        out = lc.generate(tiny_model, prompt, max_tokens=8, **then, **opts)
        assert out.timings.cached_tokens == len(prompt) - 1, (first, then)


def test_threads_keep_their_own_histories(tiny_model):
    """Four threads, each a conversation of growing prompts, at once: each call gets what a cold context gives,
    and after the first turn each thread finds its own history in the pool."""
    opts = dict(max_tokens=6, temp=0, ignore_eos=True, n_ctx=1024)
    pool = ContextPool.of(tiny_model)
    pool.close_idle()
    n_threads, n_turns = 4, 4
    barrier = threading.Barrier(n_threads)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def conversation(k: int) -> None:
        try:
            prompt = lc.Tokenizer.encode(tiny_model, f"conversation {k}: " + "word " * (20 + 7 * k))
            out = []
            for _ in range(n_turns):
                barrier.wait(30)  # every turn of every thread at the same time: four contexts in use
                warm = lc.generate(tiny_model, prompt, **opts)
                out.append((list(prompt), warm))
                prompt = prompt + warm.tokens + lc.Tokenizer.encode(tiny_model, f" more {k}", add_special=False)
            results[k] = out
        except BaseException as e:  # (reported below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=conversation, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert pool.n_idle == n_threads
    for k, turns in results.items():
        for i, (prompt, warm) in enumerate(turns):
            cold = lc.generate(tiny_model, prompt, cache_prompt=False, logprobs=2, **opts)
            assert_greedy_equivalent(warm, cold, what=f"thread {k} turn {i}")
            if i:
                # its own previous prompt and reply (all but the reply's last token, never decoded)
                assert warm.timings.cached_tokens >= len(turns[i - 1][0]), (k, i, warm.timings.cached_tokens)


def test_the_pool_keeps_at_most_max_idle_over_all_parameter_sets(monkeypatch):
    """A caller varying n_ctx from call to call kept one idle context (and its KV) per value until the model closed."""
    pool = ContextPool()
    made = []

    def make(model, params):
        made.append(_FakeContext([1], params=params))
        return made[-1]

    monkeypatch.setattr("llama_ctypes.core.context.Context", make)
    for i in range(3 * context_pool.MAX_IDLE):
        pool.checkin(pool.checkout(None, f"n_ctx={256 + 32 * i}", [1]))
    assert pool.n_idle == context_pool.MAX_IDLE
    assert [c.closed for c in made] == [True] * (2 * context_pool.MAX_IDLE) + [False] * context_pool.MAX_IDLE
