"""The scheduler without a model: plans from the batch strategies, finish conditions, cancellation, the queue.

A fake KV stands in for the context and synthetic sampled tokens for the decode
(vLLM's v1 scheduler tests do the same), so every case is exact and fast.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from fake_kv import FakeKV

from llama_ctypes.core.generation import GenerationParams
from llama_ctypes.core.text import TextAssembler
from llama_ctypes.engines.server.request import Channel, End, Request, Status
from llama_ctypes.engines.server.scheduler import (PENDING, QueueFullError, Scheduler, ServerClosedError, Step,
                                                   TickPlan)
from llama_ctypes.engines.server.slots import SlotPool
from llama_ctypes.engines.server.strategies import Balanced, DecodeMaximal, PrefillPriority
from llama_ctypes.errors import CancelledError, ClosedError, DecodeError, GrammarError, KVPoolFullError

EOG = 99


class Letters:
    """Token t is the letter chr(ord('a') + t); token 50 is the first half of a two-token character."""

    def __init__(self):
        self.held = ""

    def push(self, tok):
        if tok == 50:
            self.held = "é"
            return ""
        out, self.held = self.held + chr(ord("a") + tok), ""
        return out

    def flush(self):
        out, self.held = self.held, ""
        return out


class FakeSampler:
    closed = False

    def close(self):
        self.closed = True


def make(n_parallel=2, strategy=None, budget=8, n_ctx=64, max_queue=0):
    pool = SlotPool(n_parallel, FakeKV(), unified=True, partial_reuse=True)
    return Scheduler(pool, strategy or DecodeMaximal(), budget, n_ctx, max_queue=max_queue,
                     is_eog=lambda t: t == EOG)


def req(prompt, *, max_tokens=8, stop=(), ignore_eos=False, cache=False):
    params = GenerationParams(max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, cache_prompt=cache)
    return Request(list(prompt), params, FakeSampler(), Channel(), text=TextAssembler(Letters(), params.stop))


def plan(sched):
    with sched.cond:
        sched.take()
    sched.admit()
    return sched.schedule()


def items(request):
    out = []
    while not request.channel.sync.empty():
        out.append(request.channel.get())
    return out


def tick(sched, *tokens):
    """Schedule, then apply ``tokens`` as the sampled outputs; returns the plan."""
    p = plan(sched)
    assert p.n_outputs == len(tokens), p.steps
    sched.update_from_output(p, list(tokens))
    return p


# ---- plans ------------------------------------------------------------------------------------------

def test_prompt_is_chunked_then_decoded_one_token_per_tick():
    s = make(n_parallel=1, budget=8)
    r = req(range(20))
    s.submit(r)
    chunks = []
    for _ in range(2):
        p = plan(s)
        (step,) = p.steps
        assert step.sample == ()  # a chunk that does not finish the prompt samples nothing
        chunks.append(step.tokens)
        s.update_from_output(p, [])
    p = plan(s)
    assert p.steps[0].tokens == list(range(16, 20)) and p.steps[0].sample == (3,)
    s.update_from_output(p, [2])
    assert chunks == [list(range(8)), list(range(8, 16))]
    assert r.n_prefilled == 20 and r.generated == [2] and s.prompt_tokens_evaluated == 20
    p = plan(s)
    assert [(st.tokens, st.sample) for st in p.steps] == [([2], (0,))] and p.n_decode == 1
    s.update_from_output(p, [3])
    assert r.generated == [2, 3] and s.pool.slots[0].tokens == list(range(20)) + [2]
    assert items(r) == ["c", "d"]


@pytest.mark.parametrize("strategy, expect_decode, expect_prefill", [
    (DecodeMaximal(), 3, [5]),        # every decoding slot first; the prompt gets the rest
    (PrefillPriority(), 0, [8]),      # the prompt first: running requests pause
    (Balanced(), 3, [5]),             # half the budget reserved for prompts, decoding needs only 3
])
def test_strategies_spend_the_token_budget(strategy, expect_decode, expect_prefill):
    s = make(n_parallel=4, strategy=strategy, budget=8)
    running = [req([i, i]) for i in range(3)]
    for r in running:
        s.submit(r)
    tick(s, 1, 1, 1)  # the three short prompts prefill together, each samples its first token
    s.submit(req(range(30)))
    p = plan(s)
    assert p.n_decode == expect_decode
    assert [len(st.tokens) for st in p.steps[p.n_decode:]] == expect_prefill
    assert p.n_tokens <= 8
    assert all(st.sample == (0,) for st in p.steps[:p.n_decode])


def test_balanced_caps_decoding_when_prompts_wait():
    s = make(n_parallel=6, strategy=Balanced(), budget=8)
    for i in range(5):
        s.submit(req([i]))
    tick(s, *[1] * 5)
    s.submit(req(range(30)))
    p = plan(s)
    assert p.n_decode == 4 and len(p.steps[-1].tokens) == 4


# ---- finish conditions ---------------------------------------------------------------------------------

def test_eog_ends_without_counting_the_token():
    s = make()
    r = req([1, 2, 3])
    s.submit(r)
    tick(s, 0)
    tick(s, EOG)
    assert r.status is Status.FINISHED and r.finish_reason == "eog" and r.generated == [0]
    assert items(r) == ["a", End("eog")]
    assert all(slot.free for slot in s.pool.slots) and r.sampler.closed


def test_ignore_eos_counts_eog_tokens():
    s = make()
    r = req([1], max_tokens=2, ignore_eos=True)
    s.submit(r)
    tick(s, EOG)
    tick(s, EOG)
    assert r.generated == [EOG, EOG] and r.finish_reason == "length"


def test_length_ends_at_max_tokens_and_at_a_full_slot():
    s = make(n_ctx=6)
    a, b = req([1, 2], max_tokens=3), req([1, 2, 3, 4], max_tokens=50)
    s.submit(a)
    s.submit(b)
    tick(s, 0, 0)
    tick(s, 1, 1)  # b: 4 prompt + 1 generated token in KV
    assert b.status is Status.RUNNING
    tick(s, 2, 2)  # b's slot now holds 6 tokens: full, as the single-sequence loop counts it
    assert a.generated == [0, 1, 2] and a.finish_reason == "length"
    assert b.generated == [0, 1, 2] and b.finish_reason == "length"


def test_stop_string_ends_at_the_token_that_completes_it():
    s = make()
    r = req([1], stop=["cd"], max_tokens=50)
    s.submit(r)
    for tok in (0, 1, 2, 3):
        tick(s, tok)
    assert r.finish_reason == "stop" and r.generated == [0, 1, 2, 3]
    assert "".join(i for i in items(r) if isinstance(i, str)) == "ab"
    assert s.pool.n_active == 0 and plan(s).steps == []


def test_stop_completed_by_the_final_flush():
    s = make()
    r = req([1], stop=["é"], max_tokens=2)
    s.submit(r)
    tick(s, 0)
    tick(s, 50)  # "é" is held back by the decoder until the end
    assert r.finish_reason == "stop" and r.generated == [0, 50]
    assert items(r) == ["a", End("stop")]


def test_timings_and_tokens_are_frozen_at_the_end():
    s = make()
    r = req([1], max_tokens=2)
    s.submit(r)
    tick(s, 0)
    tick(s, 1)
    first = r.timings()
    assert r.timings() == first and first.generated_tokens == 2


# ---- cancellation and the queue ----------------------------------------------------------------------

def test_cancel_running_frees_its_slot_at_the_next_tick():
    s = make(n_parallel=1)
    r = req([1, 2, 3], max_tokens=50)
    s.submit(r)
    tick(s, 0)
    s.cancel(r)
    p = plan(s)
    assert p.steps == [] and [sl.request for sl in p.cancelled] == [r]
    s.update_from_output(p, [])
    assert r.status is Status.CANCELLED and s.pool.slots[0].free and ("forget", 0) in s.pool.kv.calls
    assert isinstance(items(r)[-1], CancelledError) and r.sampler.closed


def test_cancelled_waiting_requests_leave_the_queue_at_once():
    s = make(n_parallel=1, max_queue=2)
    running = req([1], max_tokens=50)
    s.submit(running)
    tick(s, 0)
    waiting = [req([2]), req([3])]
    for r in waiting:
        s.submit(r)
    with pytest.raises(QueueFullError):
        s.submit(req([4]))
    for r in waiting:
        s.cancel(r)
        assert r.status is Status.CANCELLED and isinstance(items(r)[-1], CancelledError)
    assert s.queue_length() == 0
    s.submit(req([5]))  # room again
    s.cancel(waiting[0])  # cancelling twice is harmless
    assert s.queue_length() == 1


def test_a_request_cancelled_while_being_admitted_never_takes_a_slot():
    s = make(n_parallel=1)
    r = req([1])
    s.submit(r)
    with s.cond:
        s.take()
    s.cancel(r)  # taken from the queue, not yet in a slot: the scheduler thread ends it
    s.admit()
    assert r.status is Status.CANCELLED and s.pool.n_active == 0


def test_refused_requests_close_their_sampler():
    s = make(n_parallel=1, max_queue=1)
    s.submit(req([1]))
    full = req([2])
    with pytest.raises(QueueFullError):
        s.submit(full)
    assert full.sampler.closed
    s.close()
    late = req([3])
    with pytest.raises(ServerClosedError) as info:
        s.submit(late)
    assert late.sampler.closed and isinstance(info.value, ClosedError) and isinstance(info.value, CancelledError)


def test_an_unreachable_consumer_cancels_its_request():
    s = make(n_parallel=1)
    class Gone(Channel):
        def put(self, item):
            return False  # its event loop was closed

    r = req([1], max_tokens=50)
    r.channel = Gone()
    s.submit(r)
    tick(s, 0)
    assert r.cancel_requested
    s.update_from_output(plan(s), [])
    assert r.status is Status.CANCELLED and s.pool.n_active == 0


def test_a_failed_decode_fails_only_the_planned_requests():
    s = make(n_parallel=2, budget=2)
    a, b = req([1], max_tokens=50), req(range(10), max_tokens=50)
    s.submit(a)
    tick(s, 0)
    s.submit(b)
    p = plan(s)
    s.update_from_output(p, None, DecodeError("boom", code=1))
    assert a.status is b.status is Status.FAILED and isinstance(items(a)[-1], DecodeError)
    assert s.pool.n_active == 0


def test_a_full_kv_fails_the_last_arrival_and_replans_the_others():
    s = make(n_parallel=3, budget=8)
    first, second = req([1], max_tokens=50), req([2], max_tokens=50)
    s.submit(first)
    tick(s, 0)
    s.submit(second)
    tick(s, 0, 1)
    held = [list(sl.tokens) for sl in s.pool.slots]
    p = plan(s)
    assert s.kv_full(p, capacity=4) is second  # nothing of the plan was decoded
    assert second.status is Status.FAILED and first.status is Status.RUNNING
    err = items(second)[-1]
    assert isinstance(err, KVPoolFullError) and isinstance(err, DecodeError)
    assert "context size has been exceeded" in str(err).lower() and "4 tokens" in str(err)
    assert [list(sl.tokens) for sl in s.pool.slots][0] == held[0]  # the survivor's KV is untouched
    assert ("forget", second.seq_id) in s.pool.kv.calls  # the victim's cells are freed
    again = plan(s)  # the survivor is planned again from where it was
    assert [st.request for st in again.steps] == [first] and again.steps[0].tokens == [first.generated[-1]]
    s.update_from_output(again, [2])
    assert first.generated == [0, 0, 2] and second.generated == [1]


def test_a_full_kv_with_a_cancelled_request_fails_nobody():
    s = make(n_parallel=2, budget=8)
    a, b = req([1], max_tokens=50), req([2], max_tokens=50)
    s.submit(a)
    s.submit(b)
    tick(s, 0, 0)
    s.cancel(b)
    p = plan(s)
    assert s.kv_full(p, capacity=4) is None  # the cancelled request's cells make the room
    assert b.status is Status.CANCELLED and a.status is Status.RUNNING


def test_a_full_kv_sends_a_request_without_output_back_to_the_queue_and_holds_admission():
    s = make(n_parallel=3, budget=8)
    old = req([1], max_tokens=50)
    s.submit(old)
    tick(s, 0)
    late, later = req(range(6), max_tokens=5), req([7], max_tokens=5)
    s.submit(late)
    p = plan(s)  # old decodes, late's prompt goes in
    assert [st.request for st in p.steps] == [old, late]
    s.submit(later)
    assert s.kv_full(p, capacity=8) is None  # nobody fails
    assert late.status is Status.WAITING and late.n_prefilled == 0 and s.queue_length() == 2
    assert s.kv_hold and not items(late)  # (its consumer saw nothing)
    for _ in range(3):  # while held, only the running request is planned; nothing is admitted
        assert [st.request for st in tick(s, 0).steps] == [old]
    s.cancel(old)
    s.update_from_output(plan(s), [])  # a request ended: admission goes on, the oldest waiting first
    assert not s.kv_hold and old.status is Status.CANCELLED
    p = plan(s)
    assert [st.request for st in p.steps] == [late, later]


def test_a_full_kv_drops_drafts_first_and_counts_late_cancellations():
    s = make(n_parallel=2, budget=8)
    a, b = req([1], max_tokens=50), req([2], max_tokens=50)
    s.submit(a)
    s.submit(b)
    tick(s, 0, 0)
    p = plan(s)
    p.steps[0].n_draft = 2  # (as if the step carried drafts)
    s.n_draft = 4
    assert s.kv_full(p, capacity=4) is None and s.kv_hold and s.draft_asks() == []
    assert a.status is b.status is Status.RUNNING
    s.kv_hold = False
    assert len(s.draft_asks()) == 2  # (drafts come back once a request ends)
    s.kv_hold = True
    b.cancel_requested = True  # asked while the failing decode ran: not in the plan's cancelled list
    assert s.kv_full(plan(s), capacity=4) is None
    assert b.status is Status.CANCELLED and a.status is Status.RUNNING


def test_fail_all_ends_waiting_and_running_requests():
    s = make(n_parallel=1)
    running, waiting = req([1], max_tokens=50), req([2])
    s.submit(running)
    tick(s, 0)
    s.submit(waiting)
    s.fail_all(ServerClosedError("closed"))
    for r in (running, waiting):
        assert r.status is Status.FAILED and isinstance(items(r)[-1], ServerClosedError)
    with pytest.raises(ServerClosedError):
        s.submit(req([3]))


# ---- several tokens per step (the shape speculative decoding needs) --------------------------------

def test_a_step_may_carry_several_sampled_tokens():
    s = make(n_parallel=2)
    a, b = req([1], max_tokens=50), req([2], max_tokens=50)
    s.submit(a)
    s.submit(b)
    tick(s, 0, 0)
    a_slot, b_slot = s.pool.slots[a.seq_id], s.pool.slots[b.seq_id]
    # a verifies two draft tokens (three rows sampled), b decodes one token
    p = TickPlan([Step(a_slot, [0, 5, 6], (0, 1, 2)), Step(b_slot, [0], (0,))], [], 2)
    s.update_from_output(p, [5, EOG, 7, 4])  # a ends at its second output; its third is ignored
    assert a.generated == [0, 5] and a.finish_reason == "eog"
    assert b.generated == [0, 4] and b_slot.tokens == [2, 0]
    assert a_slot.free and not b_slot.free


# ---- logprobs ---------------------------------------------------------------------------------------

def entry(tok):
    from llama_ctypes.core.logprobs import TokenLogprob

    return TokenLogprob(tok, bytes([97 + tok]), -0.5 - tok)


def test_logprob_entries_follow_their_tokens():
    s = make(n_parallel=2)
    params = GenerationParams(max_tokens=50, logprobs=1)
    a = Request([1], params, FakeSampler(), Channel(), text=TextAssembler(Letters()))
    b = req([2], max_tokens=50)  # no logprobs asked: entries for it are ignored
    assert a.logprobs == [] and b.logprobs is None
    s.submit(a)
    s.submit(b)
    s.update_from_output(plan(s), [0, 1], logprobs=[entry(0), None])
    assert a.generated == [0] and a.logprobs == [entry(0)] and b.logprobs is None
    # the entry goes out before the text its token completes
    assert items(a) == [entry(0), "a"]
    # a speculative-shaped step: the entry of an end-of-generation token, and of a token after the end,
    # are dropped with their tokens
    a_slot = s.pool.slots[a.seq_id]
    p = TickPlan([Step(a_slot, [0, 5, 6], (0, 1, 2))], [], 1)
    s.update_from_output(p, [5, EOG, 7], logprobs=[entry(5), entry(EOG), entry(7)])
    assert a.generated == [0, 5] and a.logprobs == [entry(0), entry(5)]
    assert items(a) == [entry(5), "f", End("eog")]
    # synthetic outputs without entries (no logprobs list) leave the list as it is
    c = Request([3], params, FakeSampler(), Channel())
    s.submit(c)
    tick(s, 9, 4)  # b decodes, c completes its prompt
    assert c.generated == [4] and c.logprobs == []


def test_pinned_requests_wait_for_their_slot_without_holding_up_others():
    sched = make(n_parallel=2)
    first, second = req([1, 2], max_tokens=2), req([3, 4], max_tokens=2)
    first.pin = second.pin = 0
    free = req([5, 6], max_tokens=2)
    sched.submit_all([first, second, free])
    tick(sched, 7, 7)  # the first pinned one in slot 0; the unpinned one takes slot 1, ahead of the second
    assert (first.seq_id, free.seq_id, second.seq_id) == (0, 1, None) and second.queued
    tick(sched, 8, 8)  # both end (two tokens each)
    assert first.status is Status.FINISHED and free.status is Status.FINISHED
    tick(sched, 9)
    assert second.seq_id == 0 and sched._pinned == 0
    # a pinned request that leaves the queue is no longer counted
    late = req([1], max_tokens=4)
    late.pin = 0
    sched.submit(late)
    blocked = req([2], max_tokens=4)
    blocked.pin = 0
    sched.submit(blocked)
    sched.cancel(blocked)
    assert sched._pinned == 1 and blocked.status is Status.CANCELLED


def test_progress_reports_the_prompt_chunk_by_chunk():
    sched = make(n_parallel=1, strategy=PrefillPriority(), budget=4)
    r = req(list(range(1, 11)), max_tokens=1)
    r.progress = True
    sched.submit(r)
    while r.status is not Status.FINISHED:
        p = plan(sched)
        sched.update_from_output(p, [5] * p.n_outputs)
    reports = [i for i in items(r) if type(i).__name__ == "Progress"]
    assert [p.processed for p in reports] == [0, 4, 8, 10] and all(p.total == 10 for p in reports)


# ---- LoRA sets: one set per tick, a quantum, no starvation ---------------------------------------

def _with_set(request, loras, alora_start=None):
    request.loras, request.alora_start = loras, alora_start
    return request


A, B = (("adapter-a", 1.0),), (("adapter-b", 1.0),)  # (stand-ins: the scheduler only compares sets)


def test_a_tick_decodes_one_lora_set_and_every_set_gets_its_turn():
    sched = make(n_parallel=4, budget=16)
    sched.lora_quantum = 2
    requests = [_with_set(req([1, 2], max_tokens=20, ignore_eos=True), s) for s in ((), A, B, A)]
    for r in requests:
        sched.submit(r)
    sets = []
    for _ in range(12):
        p = plan(sched)
        assert len({step.request.loras for step in p.steps}) == 1  # one set per decode
        assert all(step.request.loras == p.loras for step in p.steps)
        sets.append(p.loras)
        sched.update_from_output(p, [3] * p.n_outputs)
    # the oldest request's set first, at most `quantum` ticks in a row while another waits, round the sets
    assert sets[:10] == [(), (), A, A, B, B, (), (), A, A]
    assert sched.lora_switches == 5  # ((): the set before any switch)
    # the two requests of A ran in the same ticks
    assert all(r.n_prefilled == 2 for r in requests)
    assert len(requests[1].generated) == len(requests[3].generated)


def test_an_activated_loras_prompt_is_read_in_two_parts_under_two_sets():
    sched = make(n_parallel=1, budget=16)
    r = sched_r = _with_set(req([1, 2, 3, 4, 5, 6], max_tokens=2, ignore_eos=True), A, alora_start=4)
    sched.submit(sched_r)
    first = plan(sched)
    assert first.loras == () and [len(s.tokens) for s in first.steps] == [4] and first.n_outputs == 0
    sched.update_from_output(first, [])
    second = plan(sched)
    assert second.loras == A and second.steps[0].tokens == [5, 6] and second.n_outputs == 1
    sched.update_from_output(second, [7])
    assert r.kv_tag == ((0, ()), (4, A))
    assert sched.pool.slots[0].kv_tag == r.kv_tag


def test_a_prefix_is_reused_only_where_the_adapters_agree():
    from llama_ctypes.engines.server.slots import agreement

    base, with_a, alora = ((0, ()),), ((0, A),), ((0, ()), (4, A))
    assert agreement(base, base) > 1000 and agreement(base, with_a) == 0
    assert agreement(alora, base) == 4 and agreement(alora, ((0, ()), (6, A))) == 4
    sched = make(n_parallel=1, budget=16)
    done = _with_set(req([1, 2, 3, 4, 5, 6], max_tokens=1, ignore_eos=True, cache=True), A, alora_start=4)
    sched.submit(done)
    for _ in range(2):
        tick_plan = plan(sched)
        sched.update_from_output(tick_plan, [9] * tick_plan.n_outputs)
    assert done.status == Status.FINISHED
    plain = req([1, 2, 3, 4, 5, 6, 7], max_tokens=1, cache=True)
    sched.submit(plain)
    plan(sched)
    assert plain.cached_tokens == 4  # (the part read without the adapter)


# ---- images and audio (a MediaPrompt: placeholder entries decoded from embeddings) ------------------
def media_req(prefix, n_media, suffix, *, media_id="img", cache=False, max_tokens=4, n_pos=None):
    """A request whose prompt is ``prefix`` + one media span of ``n_media`` placeholders + ``suffix``;
    ``n_pos``: the positions the span takes (fewer than ``n_media`` on an M-RoPE model)."""
    import numpy as np

    from llama_ctypes.core.projector import MediaPrompt, MediaSpan, placeholder_id

    prompt = MediaPrompt([*prefix, *[placeholder_id(media_id)] * n_media, *suffix])
    prompt.spans = (MediaSpan(len(prefix), n_media, n_media if n_pos is None else n_pos, "image", media_id, 1),)
    prompt.encoded, prompt.encoding, prompt.chunks = {}, set(), None
    r = req([], max_tokens=max_tokens, cache=cache)
    r.prompt, r.has_media = prompt, True
    return r, prompt, np.zeros((n_media, 4), np.float32)


def test_media_span_waits_for_its_encode_and_goes_alone():
    sched = make(n_parallel=2, budget=64)
    r, prompt, embd = media_req([1, 2, 3], 5, [4, 5])
    text = req([7, 8, 9])
    sched.submit(r)
    sched.submit(text)
    p = plan(sched)
    # the text before the image is read while the image's encode starts; the other request goes on as usual
    assert [s.tokens for s in p.steps if s.request is r] == [[1, 2, 3]] and not p.media and not p.blocked
    assert [(req_, span.start) for req_, span in p.encode] == [(r, 3)]
    sched.update_from_output(p, [1])
    p = plan(sched)  # at the image, not encoded yet: the request waits, nothing of it is decoded
    assert [(req_, span.start) for req_, span in p.encode] == [(r, 3)] and p.blocked == 1 and not p.media
    assert all(s.request is not r for s in p.steps)
    prompt.encoding.add(3)  # (the engine started it)
    sched.update_from_output(p, [1] * p.n_outputs)
    p = plan(sched)
    assert not p.encode and p.blocked == 1  # asked again only while it was not started
    sched.update_from_output(p, [1] * p.n_outputs)
    prompt.encoding.discard(3)
    prompt.encoded[3] = embd
    p = plan(sched)  # encoded: the span is one media step, outside the batch
    (step,) = p.media
    assert step.request is r and step.tokens == prompt[3:8] and step.sample == ()
    assert all(s.request is not r for s in p.steps)
    sched.update_from_output(p, [1] * p.n_outputs)
    assert r.n_prefilled == 8 and sched.pool.slots[r.seq_id].tokens == list(prompt[:8])
    p = plan(sched)  # the text after it, sampled at its end
    (step,) = [s for s in p.steps if s.request is r]
    assert step.tokens == [4, 5] and step.sample == (1,)


def test_one_media_step_per_tick_oldest_first():
    sched = make(n_parallel=3, budget=64)
    reqs = [media_req([], 4, [9], media_id=f"m{i}") for i in range(2)]
    for r, prompt, embd in reqs:
        prompt.encoded[0] = embd
        sched.submit(r)
    p = plan(sched)
    assert [s.request for s in p.media] == [reqs[0][0]]
    sched.update_from_output(p, [])
    p = plan(sched)
    assert [s.request for s in p.media] == [reqs[1][0]]
    assert [s.tokens for s in p.steps] == [[9]]


def test_failed_encode_fails_only_its_request():
    sched = make(n_parallel=2, budget=64)
    r, prompt, _ = media_req([1], 3, [2])
    other = req([5, 6])
    sched.submit(r)
    sched.submit(other)
    tick(sched, 1)  # r reads [1]; other reads its prompt and samples
    from llama_ctypes.errors import MediaError

    prompt.encoded[1] = MediaError("the image could not be encoded")
    p = plan(sched)
    error = items(r)[-1]
    assert r.status is Status.FAILED and isinstance(error, MediaError) and error is not prompt.encoded[1]
    assert other.status is Status.RUNNING and [s.request for s in p.steps] == [other]


def test_cached_prefix_never_splits_a_media_span():
    sched = make(n_parallel=1, budget=64)
    first, prompt, embd = media_req([1, 2], 4, [3], cache=True, max_tokens=1)
    prompt.encoded[2] = embd
    sched.submit(first)
    tick(sched)  # [1, 2]
    p = plan(sched)
    sched.update_from_output(p, [])  # the image
    tick(sched, 7)  # [3] -> 7, max_tokens 1: done, the slot keeps its tokens
    slot = sched.pool.slots[0]
    assert first.status is Status.FINISHED and len(slot.tokens) == 7
    # a slot cut inside the image (its tail dropped) gives back the text before it, never part of it
    sched.pool.kv.truncate(0, 4)
    del slot.tokens[4:]
    cut, _, _ = media_req([1, 2], 4, [8], cache=True)
    sched.submit(cut)
    p = plan(sched)
    assert cut.cached_tokens == 2 and p.encode and not p.media
    sched.cancel(cut)
    sched.update_from_output(plan(sched), [])


def test_cached_media_prefix_reused_whole():
    sched = make(n_parallel=1, budget=64)
    first, prompt, embd = media_req([1, 2], 4, [3], cache=True, max_tokens=1)
    prompt.encoded[2] = embd
    sched.submit(first)
    tick(sched)
    sched.update_from_output(plan(sched), [])
    tick(sched, 7)
    # the same image, then other text: the whole image is reused, nothing to encode
    again, _, _ = media_req([1, 2], 4, [8], cache=True)
    sched.submit(again)
    p = plan(sched)
    assert again.cached_tokens == 6 and [s.tokens for s in p.steps] == [[8]] and not p.encode
    sched.update_from_output(p, [1])
    sched.cancel(again)
    tick(sched)


def test_mrope_media_moves_a_slots_positions():
    """An image of 6 embeddings on 2 positions (M-RoPE): the slot's next position is 4 behind its token
    count after it, and cuts of its cache land at positions, not token counts."""
    sched = make(n_parallel=2, budget=64)
    first, prompt, embd = media_req([1, 2], 6, [3, 4], cache=True, max_tokens=2, n_pos=2)
    prompt.encoded[2] = embd
    sched.submit(first)
    tick(sched)  # [1, 2]
    slot = sched.pool.slots[first.seq_id]
    assert slot.next_pos == 2
    sched.update_from_output(plan(sched), [])  # the image
    assert slot.n_past == 8 and slot.next_pos == 4
    p = plan(sched)
    (step,) = p.steps
    assert step.tokens == [3, 4] and step.slot.next_pos == 4  # (the engine decodes them at 4, 5)
    sched.update_from_output(p, [7])
    tick(sched, 8)  # 7 -> 8: max_tokens 2, done; the slot keeps [1, 2, img x 6, 3, 4, 7]
    assert first.status is Status.FINISHED and slot.n_past == 11 and slot.next_pos == 7
    kv = sched.pool.kv
    kv.calls.clear()
    # the same image and other text: its cache is cut after the image, at position 4 (entry 8)
    again, _, _ = media_req([1, 2], 6, [9], cache=True, n_pos=2, max_tokens=1)
    sched.submit(again)
    p = plan(sched)
    assert again.cached_tokens == 8 and ("truncate", slot.seq_id, 4) in kv.calls
    assert slot.next_pos == 4 and [s.tokens for s in p.steps] == [[9]]
    sched.update_from_output(p, [5])
    assert again.status is Status.FINISHED and slot.next_pos == 5
    # another image at the same place: the cut lands before the image, at position 2
    kv.calls.clear()
    other, _, _ = media_req([1, 2], 6, [9], media_id="other", cache=True, n_pos=2)
    sched.submit(other)
    plan(sched)
    assert other.cached_tokens == 2 and ("truncate", slot.seq_id, 2) in kv.calls and slot.next_pos == 2


# ---- draws that outlast their tick (engines/server/detached.py) -------------------------------------------

def test_a_pending_row_sits_out_the_plans_until_its_token_is_delivered():
    """A row whose draw still runs (PENDING, the request's ``pending`` set) adds nothing; its request is not
    planned (the plan counts it as blocked) while the others go on; the delivered token is counted as a
    sampled one, and the request decodes it at the next tick."""
    s = make(n_parallel=2, budget=8)
    slow, fast = req([1, 2], max_tokens=3), req([3], max_tokens=4)
    s.submit(slow)
    s.submit(fast)
    p = plan(s)
    assert [st.request for st in p.steps] == [slow, fast]
    future: concurrent.futures.Future = concurrent.futures.Future()
    slow.pending = future
    s.update_from_output(p, [PENDING, 5])
    assert slow.generated == [] and slow.first_token is None and fast.generated == [5]
    assert list(s.pool.slots[slow.seq_id].tokens) == [1, 2]  # (its prompt is in the KV)
    for expect in ([6], [7]):
        p = plan(s)
        assert [st.request for st in p.steps] == [fast] and p.blocked == 1
        s.update_from_output(p, expect)
    future.set_result(4)
    s.deliver(s.pool.slots[slow.seq_id], slow, 4)
    assert slow.pending is None and slow.generated == [4] and "".join(items(slow)) == "e"
    p = plan(s)
    assert [(st.request, st.tokens) for st in p.steps] == [(slow, [4]), (fast, [7])]
    s.update_from_output(p, [0, EOG])
    assert fast.status is Status.FINISHED and slow.generated == [4, 0]


def _one_pending():
    """A one-slot scheduler whose only request's first draw still runs: (scheduler, request, its future)."""
    s = make(n_parallel=1, budget=8)
    r = req([1], max_tokens=9)
    s.submit(r)
    p = plan(s)
    r.pending = future = concurrent.futures.Future()
    s.update_from_output(p, [PENDING])
    return s, r, future


def test_a_pending_request_ends_only_after_its_draw():
    """Cancelled while its draw runs: cancelled once the draw ended (the draw uses its sampler). A failed draw
    fails it alone; ending it otherwise (the server closing) waits for the draw first."""
    s = make(n_parallel=2, budget=8)
    r, other = req([1], max_tokens=9), req([2], max_tokens=9)
    s.submit(r)
    s.submit(other)
    p = plan(s)
    r.pending = future = concurrent.futures.Future()
    s.update_from_output(p, [PENDING, 0])
    s.cancel(r)
    p = plan(s)
    assert p.cancelled == [] and [st.request for st in p.steps] == [other]
    assert r.status is Status.RUNNING and not r.sampler.closed
    future.set_result(3)
    s.deliver(s.pool.slots[r.seq_id], r, 3)  # (its token does not go out: it was cancelled)
    assert r.status is Status.CANCELLED and r.sampler.closed and r.generated == []
    assert isinstance(items(r)[-1], CancelledError) and s.pool.slots[0].free

    s, r, _ = _one_pending()
    error = GrammarError("grammar too broad")
    s.deliver(s.pool.slots[0], r, error=error)
    assert r.status is Status.FAILED and items(r)[-1] is error and s.pool.slots[0].free

    s, r, future = _one_pending()
    timer = threading.Timer(0.2, future.set_result, (1,))
    timer.start()
    s.fail_all(ServerClosedError("closed"))  # waits for the draw, then ends the request
    assert future.done() and r.status is Status.FAILED and r.sampler.closed and r.pending is None


def test_a_full_kv_fails_a_pending_request_that_arrived_last_after_its_draw():
    """A request whose draw runs cannot go back to the queue unchanged (its sampler takes a token): when it is
    the last to arrive, a full KV fails it (once the draw has ended), and the one before goes on."""
    s = make(n_parallel=2, budget=8)
    first, second = req([1], max_tokens=9), req([2], max_tokens=9)
    s.submit(first)
    s.submit(second)
    p = plan(s)
    second.pending = future = concurrent.futures.Future()
    s.update_from_output(p, [0, PENDING])
    p = plan(s)
    assert [st.request for st in p.steps] == [first]
    timer = threading.Timer(0.2, future.set_result, (1,))
    timer.start()
    assert s.kv_full(p, capacity=4) is second
    assert future.done() and second.status is Status.FAILED and second.sampler.closed
    assert first.status is Status.RUNNING
