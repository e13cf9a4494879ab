"""Prefix caching in the server: reuse equals recompute, cross-slot sharing, sessions, RAM cache, instability."""

from __future__ import annotations

import threading

import pytest

import llama_ctypes as lc
from llama_ctypes.engines.server.prompt_cache import PromptCache
from llama_ctypes.engines.server.request import Channel, Request
from llama_ctypes.engines.server.scheduler import Scheduler
from llama_ctypes.engines.server.slots import CHECKPOINT_BACK, SlotPool
from llama_ctypes.engines.server.strategies import DecodeMaximal
from llama_ctypes.core.generation import GenerationParams
from fake_kv import FakeKV
from margins import assert_greedy_equivalent

SYSTEM = "You are a careful assistant who answers questions about geography and history in detail. " * 3


def _greedy(srv, prompt, **opts):
    return srv.generate(prompt, max_tokens=12, temp=0, ignore_eos=True, **opts)


def test_cached_continuation_equals_cold_run(tiny_model):
    prompt = SYSTEM + "Question one?"
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, cache_prompt=False) as cold_srv:
        cold = _greedy(cold_srv, prompt).tokens
        cold_followup = _greedy(cold_srv, prompt + " And a follow-up question?").tokens
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024) as srv:
        first = _greedy(srv, prompt)
        again = _greedy(srv, prompt)
        followup = _greedy(srv, prompt + " And a follow-up question?")
        stats = srv.stats()
    assert first.timings.cached_tokens == 0
    assert again.timings.cached_tokens == again.prompt_tokens - 1  # all but the token that must be decoded
    assert followup.timings.cached_tokens >= first.prompt_tokens - 1
    assert first.tokens == again.tokens == cold and followup.tokens == cold_followup
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 1


@pytest.mark.gemma
def test_gemma_cached_turn_equals_cold(gemma):
    prompt = "The days of the week are Monday, Tuesday,"
    with lc.Server(model=gemma, n_parallel=2, n_ctx=512, cache_prompt=False) as cold_srv:
        cold = _greedy(cold_srv, prompt + " Wednesday,", logprobs=2)
    with lc.Server(model=gemma, n_parallel=2, n_ctx=512) as srv:
        _greedy(srv, prompt)
        warm = _greedy(srv, prompt + " Wednesday,")
    assert warm.timings.cached_tokens > 5
    # the cached prefix was computed in other batch shapes: equal up to a near tie (margins.py)
    assert_greedy_equivalent(warm, cold, what="cached vs cold")


def test_shared_system_prompt_is_evaluated_once(tiny_model):
    suffixes = [f" Question {i}: where is city number {i}?" for i in range(4)]
    prompts = [SYSTEM + s for s in suffixes]
    n_tokens = [len(tiny_model.tokenize(p)) for p in prompts]
    # tokens of the system prompt every request shares (its last token may merge with the suffix)
    shared = len(lc.Tokenizer.encode(tiny_model, SYSTEM)) - 2
    with lc.Server(model=tiny_model, n_parallel=4, n_ctx=1024) as srv:
        first = srv.stream(prompts[0], max_tokens=400, temp=0, ignore_eos=True)
        next(first)  # slot 0 holds the system prompt and keeps running
        rest = [srv.stream(p, max_tokens=4, temp=0, ignore_eos=True) for p in prompts[1:]]
        done = [s.completion() for s in rest]
        first.close()
        stats = srv.stats()
    assert {s.request.seq_id for s in rest} | {first.request.seq_id} == {0, 1, 2, 3}
    assert stats["cache_adopted"] == 3
    assert all(d.timings.cached_tokens >= shared for d in done)
    # the system prompt was computed by the first request only
    assert stats["prompt_tokens_evaluated"] <= sum(n_tokens) - 3 * shared


def test_session_affinity_under_concurrency(tiny_model):
    with lc.Server(model=tiny_model, n_parallel=4, n_ctx=1024) as srv:
        seen: dict[str, set] = {f"s{i}": set() for i in range(3)}
        history = {k: SYSTEM + f" Conversation {k}." for k in seen}

        def converse(session):
            for turn in range(4):
                history[session] += f" Turn {turn} question?"
                stream = srv.stream(history[session], max_tokens=6, temp=0, ignore_eos=True, session=session)
                history[session] += stream.completion().text
                seen[session].add(stream.request.seq_id)

        threads = [threading.Thread(target=converse, args=(k,)) for k in seen]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(len(slots) == 1 for slots in seen.values()), seen
        assert len({next(iter(v)) for v in seen.values()}) == 3  # three sessions, three slots
        assert srv.stats()["cache_hits"] >= 9


def test_ram_cache_restores_an_evicted_prefix_within_budget(tiny_model):
    a = SYSTEM + " First conversation about rivers and mountains?"
    b = "A completely different prompt about cooking pasta and tomatoes, with many words in it."
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, cache_prompt=False) as cold_srv:
        cold = _greedy(cold_srv, a + " More?").tokens
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_ram_mb=64) as srv:
        _greedy(srv, a)
        _greedy(srv, b)  # takes the only slot: a's KV is saved to RAM
        assert srv.stats()["ram_cache_entries"] == 1
        warm = _greedy(srv, a + " More?")
        stats = srv.stats()
    assert stats["cache_restored"] == 1 and warm.timings.cached_tokens > 20
    assert warm.tokens == cold
    # the byte budget holds: with room for about one entry, one is kept
    prompts = [f"Prompt {i}: " + SYSTEM for i in range(5)]
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_ram_mb=64) as srv:
        _greedy(srv, prompts[0])
        _greedy(srv, prompts[1])
        entry_bytes = srv.stats()["ram_cache_bytes"]
    budget = entry_bytes * 1.5
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_ram_mb=budget / 2**20) as srv:
        for p in prompts:
            _greedy(srv, p)
        stats = srv.stats()
    assert stats["ram_cache_entries"] == 1 and 0 < stats["ram_cache_bytes"] <= budget


def test_the_ram_tier_is_on_by_default_bounded_by_the_machine(tiny_model, monkeypatch):
    from llama_ctypes.engines.server import params

    expected = params.default_prompt_cache_ram_mb()
    assert 0 < expected <= params.LLAMA_SERVER_CACHE_RAM_MB
    a = SYSTEM + " First conversation about rivers and mountains?"
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024) as srv:  # (no prompt_cache_ram_mb given)
        assert srv.prompt_cache_ram_mb == expected
        _greedy(srv, a)
        _greedy(srv, "A completely different prompt about cooking pasta and tomatoes.")
        warm = _greedy(srv, a + " More?")
        assert srv.stats()["cache_restored"] == 1 and warm.timings.cached_tokens > 20
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_ram_mb=0) as off:
        assert off.prompt_cache_ram_mb == 0
        _greedy(off, a)
        _greedy(off, "A completely different prompt about cooking pasta and tomatoes.")
        assert off.stats()["ram_cache_entries"] == 0
    # llama-server's 8192 MiB, but never more than 1/8 of the machine's memory
    monkeypatch.setattr(params, "detect_system_memory", lambda: 16 * 2**30)
    assert params.default_prompt_cache_ram_mb() == 2048
    monkeypatch.setattr(params, "detect_system_memory", lambda: 256 * 2**30)
    assert params.default_prompt_cache_ram_mb() == 8192
    monkeypatch.setattr(params, "detect_system_memory", lambda: None)
    assert params.default_prompt_cache_ram_mb() == 1024


def test_prefix_instability_event_fires_when_history_is_rewritten(tiny_model):
    events = []
    lc.telemetry.attach("instab", ["server.prefix_instability"], lambda e, m, md: events.append((m, md)))
    try:
        with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024) as srv:
            turn1 = SYSTEM + " User: hello there. Assistant: <think>secret reasoning here</think> Hi!"
            _greedy(srv, turn1, session="conv")
            # the template strips the thinking block from history: the cached turn no longer matches
            turn2 = SYSTEM + " User: hello there. Assistant: Hi! User: next question?"
            _greedy(srv, turn2, session="conv")
            assert srv.stats()["prefix_instabilities"] == 1
    finally:
        lc.telemetry.detach("instab")
    assert len(events) == 1
    measurements, metadata = events[0]
    assert metadata["session"] == "conv" and 0 < measurements["common_tokens"] < measurements["cached_tokens"]


def test_chat_completion_through_the_server_reports_cached_tokens(tiny_model):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024) as srv:
        one = lc.chat_completion(srv, messages, chat_template="chatml", max_tokens=8, temp=0, session="c")
        messages += [one["choices"][0]["message"], {"role": "user", "content": "Tell me more."}]
        two = lc.chat_completion(srv, messages, chat_template="chatml", max_tokens=8, temp=0, session="c")
        chunks = list(lc.stream_chat_completion(srv, messages, chat_template="chatml", max_tokens=8, temp=0))
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > one["usage"]["prompt_tokens"] // 2
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == two["choices"][0]["message"]["content"]
    with pytest.raises(TypeError, match="session"):
        lc.chat(tiny_model, messages, chat_template="chatml", session="c")


def test_hybrid_model_gives_correct_output_with_the_cache_on(tiny_hybrid):
    assert tiny_hybrid.is_hybrid
    base = SYSTEM + " Hybrid question?"
    with lc.Server(model=tiny_hybrid, n_parallel=2, n_ctx=1024, cache_prompt=False) as cold_srv:
        first_cold = _greedy(cold_srv, base)
        base_tokens = tiny_hybrid.tokenize(base)
        continued = base_tokens + first_cold.tokens + tiny_hybrid.tokenize(" More?", add_special=False)
        diverged = base_tokens[:10] + tiny_hybrid.tokenize(" something else entirely", add_special=False)
        cold = {name: cold_srv.generate_tokens(toks, max_tokens=12, temp=0, ignore_eos=True).tokens
                for name, toks in (("base", base_tokens), ("continued", continued), ("diverged", diverged))}
    with lc.Server(model=tiny_hybrid, n_parallel=1, n_ctx=1024, prompt_cache_ram_mb=32) as srv:
        assert srv.generate_tokens(base_tokens, max_tokens=12, temp=0, ignore_eos=True).tokens == cold["base"]
        cont = srv.generate_tokens(continued, max_tokens=12, temp=0, ignore_eos=True)
        assert cont.tokens == cold["continued"]
        # the whole previous history (prompt + all but the last generated token) was resumed exactly
        assert cont.timings.cached_tokens == len(base_tokens) + 12 - 1
        div = srv.generate_tokens(diverged, max_tokens=12, temp=0, ignore_eos=True)
        assert div.tokens == cold["diverged"] and div.timings.cached_tokens == 0  # recomputed, not cut back
        again = srv.generate_tokens(base_tokens, max_tokens=12, temp=0, ignore_eos=True)
        assert again.tokens == cold["base"]
    # the single-context path too
    with lc.Context.create(tiny_hybrid, n_ctx=1024) as ctx, lc.Sampler.create(tiny_hybrid, temp=0) as smp:
        ctx.generate(smp, base_tokens, max_tokens=12, ignore_eos=True)
        assert ctx.generate(smp, diverged, max_tokens=12, ignore_eos=True, cache_prompt=True).tokens == cold["diverged"]


# ---- the pieces, without a model ---------------------------------------------------------------------

def _request(tokens, session=None, cache=True):
    return Request(list(tokens), GenerationParams(cache_prompt=cache), sampler=None, channel=Channel(),
                   session=session)


def test_hybrid_memory_reuses_only_exact_continuations():
    kv = FakeKV(partial=False)
    pool = SlotPool(1, kv, unified=True, partial_reuse=False)
    slot = pool.acquire(_request([1, 2, 3, 4]))
    slot.tokens = [1, 2, 3, 4, 9]  # prompt + a generated token
    pool.release(slot, keep=True)
    cont = _request([1, 2, 3, 4, 9, 7, 7])  # continues the whole history: reused
    assert pool.acquire(cont) is slot and cont.cached_tokens == 5
    slot.tokens = [1, 2, 3, 4, 9, 7, 7, 5]
    pool.release(slot, keep=True)
    diverged = _request([1, 2, 3, 8, 8])  # shares 3 tokens but diverges inside the history: recomputed
    assert pool.acquire(diverged) is slot and diverged.cached_tokens == 0
    assert ("forget", 0) in kv.calls and not any(c[0] == "truncate" for c in kv.calls)


def test_dense_memory_reuses_partial_prefixes_and_adopts_across_slots():
    kv = FakeKV()
    pool = SlotPool(2, kv, unified=True, partial_reuse=True)
    a = pool.acquire(_request([1, 2, 3, 4, 5]))
    a.tokens = [1, 2, 3, 4, 5, 6]
    # a keeps running; a new request sharing [1, 2, 3] adopts them from a's sequence
    b_req = _request([1, 2, 3, 9, 9])
    b = pool.acquire(b_req)
    assert b is not a and b_req.cached_tokens == 3 and ("copy", a.seq_id, b.seq_id, 3) in kv.calls
    pool.release(a, keep=True)
    c_req = _request([1, 2, 3, 4, 7])
    assert pool.acquire(c_req) is a and c_req.cached_tokens == 4 and ("truncate", a.seq_id, 4) in kv.calls


class WindowKV(FakeKV):
    """A sliding-window cache: sequence ``seq`` still holds cells from ``pos_min[seq]`` on."""

    def __init__(self, n_swa, pos_min):
        super().__init__()
        self.n_swa, self.pos_min = n_swa, pos_min

    def complete(self, seq, n):
        return self.pos_min.get(seq, 0) <= max(0, n - self.n_swa)

    def cut_floor(self, seq):
        pos_min = self.pos_min.get(seq, 0)
        return pos_min + self.n_swa if pos_min > 0 else 0


def test_sliding_window_prefixes_are_reused_only_while_their_window_is_held():
    kv = WindowKV(n_swa=4, pos_min={0: 6, 1: 0})
    pool = SlotPool(2, kv, unified=True, partial_reuse=True)
    a = pool.acquire(_request(range(1, 11)))
    a.tokens = list(range(1, 13))  # seq 0 grew to 12 tokens; cells below position 6 are gone
    pool.release(a, keep=True)
    short = _request(list(range(1, 6)) + [99, 98])  # shares 5 tokens: the window before 5 is gone
    got = pool.acquire(short)
    assert short.cached_tokens == 0 and not any(c[0] == "copy" for c in kv.calls)
    pool.release(got, keep=False)
    long = _request(list(range(1, 13)) + [50, 51])  # continues the whole history: its window is there
    assert pool.acquire(long) is a and long.cached_tokens == 12


class WindowStateKV(WindowKV):
    """A sliding-window cache whose saved states carry their window: restoring one brings its ``pos_min``."""

    def __init__(self, n_swa, pos_min):
        super().__init__(n_swa, pos_min)
        self.windowed = True

    def save(self, seq):
        return str(self.pos_min.get(seq, 0)).encode().ljust(100)

    def restore(self, seq, state):
        self.pos_min[seq] = int(state.strip())
        return True

    def forget(self, seq):
        super().forget(seq)
        self.pos_min[seq] = 0


def test_a_conversation_resumes_from_its_prompt_checkpoint_on_a_sliding_window_cache():
    """More conversations than slots on a sliding-window cache: the state saved when a conversation's slot is
    taken over holds its reply too, and cut back to where the next turn differs it no longer has the window
    before the cut. The prompt's own state, kept as it was read (a checkpoint, as llama-server's), is restored
    whole instead."""
    kv = WindowStateKV(n_swa=4, pos_min={})
    pool = SlotPool(1, kv, unified=True, partial_reuse=True, ram_cache=PromptCache(10**6))
    first = list(range(1, 21))
    a = pool.acquire(_request(first))
    a.tokens, kv.pos_min[0] = list(first), 16  # the prompt read: its window is positions 16..19
    pool.checkpoint(a)
    a.tokens, kv.pos_min[0] = first + [200, 201, 202], 19  # the reply generated
    pool.release(a, keep=True)
    b = pool.acquire(_request(list(range(100, 121))))  # another conversation takes the slot (A's state saved)
    b.tokens = list(range(100, 121))
    pool.release(b, keep=True)
    assert pool.stats.checkpoints == 1 and len(pool.ram) == 2
    # A's next turn: its reply read back a little differently at the end, then a new question
    turn = _request(first + [200, 201, 203, 300, 301])
    assert pool.acquire(turn) is a and turn.cached_tokens == len(first) and pool.stats.restored == 1
    # without a window (or without a RAM tier, or with cache_prompt off), no prompt is checkpointed
    plain = SlotPool(1, FakeKV(), unified=True, partial_reuse=True, ram_cache=PromptCache(10**6))
    assert plain.checkpoint_at(_request(first)) is None
    assert SlotPool(1, kv, unified=True, partial_reuse=True).checkpoint_at(_request(first)) is None
    assert pool.checkpoint_at(_request(first, cache=False)) is None
    assert pool.checkpoint_at(_request(first)) == len(first) - CHECKPOINT_BACK


def test_a_prompt_checkpoint_is_taken_before_its_end_and_restored_whole():
    """On a sliding-window cache the scheduler reads a prompt up to CHECKPOINT_BACK tokens before its end, keeps
    that state (llama-server's offset), then reads the rest. A saved state holds only its window, so none is
    ever cut back: once another request took the slot, a conversation's next turn restores the deepest state
    that is a prefix of it as a whole (the one saved with the reply), and the same prompt again the checkpoint."""
    kv = SavedWindowKV(n_swa=4, pos_min={})
    pool = SlotPool(1, kv, unified=True, partial_reuse=True, ram_cache=PromptCache(10**6))
    sched = Scheduler(pool, DecodeMaximal(), 64, 128, is_eog=lambda t: False)

    def run(prompt, replies):
        replies = list(replies)
        request = Request(list(prompt), GenerationParams(max_tokens=len(replies), cache_prompt=True), sampler=None,
                          channel=Channel())
        sched.submit(request)
        chunks = []
        while not request.status.done:
            with sched.cond:
                sched.take()
            sched.admit()
            plan = sched.schedule()
            chunks.append(sum(len(step.tokens) for step in plan.steps))
            step = plan.steps[0]
            kv.last[0] = len(step.slot.tokens) + len(step.tokens) - 1
            sched.update_from_output(plan, [replies.pop(0) for _ in range(plan.n_outputs)])
        return request, chunks

    prompt = list(range(1, 41))
    first, chunks = run(prompt, [301, 302])
    assert chunks == [40 - CHECKPOINT_BACK, CHECKPOINT_BACK, 1] and first.cached_tokens == 0
    assert pool.stats.checkpoints == 1
    assert pool.ram.lookup(prompt, exact_only=True, tag=first.kv_tag)[1] == 40 - CHECKPOINT_BACK
    run(list(range(100, 140)), [303])  # takes the slot: the first one's state (with its reply) saved
    turn, chunks = run(prompt + [301, 302, 77, 78, 79], [301])
    assert turn.cached_tokens == 41 and chunks[0] == 4
    run(list(range(100, 140)), [303])
    again, chunks = run(prompt, [301])
    assert again.cached_tokens == 40 - CHECKPOINT_BACK and chunks[0] == CHECKPOINT_BACK


def test_an_entry_whose_window_cannot_serve_the_cut_is_not_restored():
    """(From a review) A RAM entry sharing more of the prompt than the slot does, but whose window slid past the
    point where the prompt parts from it, was restored anyway, failed, and took the slot's own prefix with it."""
    kv = WindowStateKV(n_swa=4, pos_min={})
    pool = SlotPool(1, kv, unified=True, partial_reuse=True, ram_cache=PromptCache(10**6))
    system = list(range(1, 11))
    conv_a = system + list(range(100, 140))
    a = pool.acquire(_request(conv_a))
    a.tokens, kv.pos_min[0] = list(conv_a), 40  # grew past its window: complete from 44 tokens on
    pool.release(a, keep=True)
    b = pool.acquire(_request(system + list(range(500, 520))))  # takes the slot: A's state saved (floor 44)
    b.tokens, kv.pos_min[0] = system + list(range(500, 520)), 0
    pool.release(b, keep=True)
    kv.calls.clear()
    c = _request(conv_a[:30] + [900, 901, 902])  # 30 tokens shared with A, 10 with the slot's own prefix
    assert pool.acquire(c) is b and c.cached_tokens == 10 and pool.stats.restored == 0
    assert ("forget", 0) not in kv.calls


class SavedWindowKV(WindowStateKV):
    """As llama.cpp's: a saved state holds only the window before the sequence's last position (``last``), whatever
    older cells the live sequence still has."""

    def __init__(self, n_swa, pos_min):
        super().__init__(n_swa, pos_min)
        self.last: dict[int, int] = {}

    def _saved_min(self, seq):
        return max(self.pos_min.get(seq, 0), self.last.get(seq, -1) - self.n_swa + 1)

    def save(self, seq):
        return str(self._saved_min(seq)).encode().ljust(100)

    def cut_floor(self, seq):
        pos_min = self._saved_min(seq)
        return pos_min + self.n_swa if pos_min > 0 else 0

    def truncate(self, seq, keep):
        self.last[seq] = keep - 1
        return super().truncate(seq, keep)


def test_where_two_prompts_part_the_shared_prefix_is_kept_for_a_third():
    """A saved sliding-window state holds only its window, so no RAM entry can be cut back to a shorter shared
    prefix. When a slot's own sequence is cut back for a prompt that parts from it (a shared system prompt,
    then another question), the cut state is kept: a third prompt sharing that prefix restores it whole, even
    after the slot went on to something else."""
    kv = SavedWindowKV(n_swa=4, pos_min={})
    pool = SlotPool(1, kv, unified=True, partial_reuse=True, ram_cache=PromptCache(10**6))
    system = list(range(1, 21))
    a = pool.acquire(_request(system + [100, 101, 102]))
    a.tokens, kv.pos_min[0], kv.last[0] = system + [100, 101, 102, 103], 0, 23  # computed here: every cell kept
    pool.release(a, keep=True)
    b = pool.acquire(_request(system + [200, 201, 202]))
    assert b is a and b.tokens == system and pool.ram.lookup(system + [300], exact_only=True, tag=b.kv_tag)[1] == 20
    b.tokens, kv.pos_min[0], kv.last[0] = list(range(500, 540)), 36, 39  # the slot went on to an unrelated prompt
    pool.release(b, keep=True)
    c = _request(system + [300, 301])
    pool.acquire(c)
    assert c.cached_tokens == len(system)


def test_the_lookup_prefers_an_entry_that_can_be_cut_back():
    cache = PromptCache(10**6)
    cache.put([1, 2, 3, 4, 5, 6, 7, 8], b"reply" * 10, floor=8)  # (a window that slid to its end)
    cache.put([1, 2, 3, 4, 5, 6], b"prompt" * 10, floor=3)
    entry, n = cache.lookup([1, 2, 3, 4, 9])
    assert n == 4 and entry.tokens == (1, 2, 3, 4, 5, 6)
    entry, n = cache.lookup([1, 2, 9])  # (nothing can be cut back to 2: one of them all the same)
    assert n == 2 and entry is not None


@pytest.mark.gemma
def test_gemma_conversations_outnumbering_slots_resume_from_checkpoints(gemma):
    """Gemma 3's sliding window (512) on one slot, two conversations taking turns: each turn restores its
    conversation's prompt checkpoint (the whole previous prompt comes from RAM), and gives the tokens of a
    cold run (top-1 margin checked)."""
    system = "You are a careful assistant who answers in one short sentence. " * 60  # (past the window)
    turns = {"a": ["Name a red fruit.", "Name a yellow one."], "b": ["Name a big city.", "Name a small one."]}
    opts = dict(temp=0, max_tokens=8, ignore_eos=True)
    history = {k: system for k in turns}
    with lc.Server(model=gemma, n_parallel=1, n_ctx=2048) as srv, \
            lc.Server(model=gemma, n_parallel=1, n_ctx=2048, cache_prompt=False) as cold:
        last = {}
        for i in range(2):
            for k in ("a", "b"):
                prompt = history[k] + "\nQ: " + turns[k][i] + "\nA:"
                out = srv.generate(prompt, **opts)
                ref = cold.generate(prompt, logprobs=5, **opts)
                assert_greedy_equivalent(out, ref, what=f"{k} turn {i}")
                if i == 1:  # (the previous prompt came from its checkpoint, taken 4 tokens before its end)
                    assert out.timings.cached_tokens >= len(srv.model.tokenize(last[k])) - CHECKPOINT_BACK, \
                        (k, out.timings)
                last[k] = prompt
                history[k] = prompt + out.text
        stats = srv.stats()
    assert stats["cache_checkpoints"] >= 4 and stats["cache_restored"] >= 2, stats


def test_prompt_cache_lru_budget_and_longest_prefix():
    cache = PromptCache(budget_bytes=250_000)
    assert cache.put([1, 2, 3], b"a" * 100_000)
    assert cache.put([1, 2, 4, 5], b"b" * 100_000)
    entry, n = cache.lookup([1, 2, 4, 5, 6])
    assert entry.tokens == (1, 2, 4, 5) and n == 4
    partial, n = cache.lookup([1, 2, 9])  # partial: some entry under [1, 2] (now the most recently used)
    assert partial is not None and n == 2
    assert cache.lookup([1, 2, 9], exact_only=True) == (None, 0)
    other = (1, 2, 4, 5) if partial.tokens == (1, 2, 3) else (1, 2, 3)
    assert cache.put([7, 7, 7], b"c" * 100_000)  # over budget: the least recently used entry goes
    assert len(cache) == 2 and cache.used <= 250_000
    assert cache.lookup(list(other), exact_only=True)[0] is None
    assert cache.lookup(list(partial.tokens), exact_only=True)[0] is partial
    assert not cache.put([8], b"d" * 300_000)  # larger than the whole budget
    assert cache.lookup([9]) == (None, 0)
