"""KVRecord, the one owner of what a context's sequence 0 holds: pure bookkeeping, no model."""

from __future__ import annotations

import pytest

from llama_ctypes.core.kv_record import KVRecord


def test_attention_caches_cut_anywhere():
    record = KVRecord(n_rs_seq=0)
    record.decoded([1, 2, 3, 4])
    assert record.tokens == [1, 2, 3, 4] and all(record.can_cut(n) for n in range(5))
    record.cut(2)
    assert record.tokens == [1, 2] and record.can_cut(0) and record.can_cut(1)


def test_recurrent_cuts_stay_within_the_last_decode_once():
    record = KVRecord(n_rs_seq=3)
    record.decoded([1, 2, 3, 4, 5])  # a prompt chunk: its snapshots cover all but its first token, up to 3
    assert [record.can_cut(n) for n in range(6)] == [True, False, True, True, True, True]
    record.cut(3)
    assert record.tokens == [1, 2, 3]
    assert not record.can_cut(2) and record.can_cut(0) and record.can_cut(3)  # single-use; 0 = clear
    record.decoded([6, 7])
    assert record.can_cut(4) and not record.can_cut(3)  # within the run [6, 7]: drop 1 at most
    record.appended(8)  # a one-token decode leaves no snapshot
    assert not record.can_cut(5) and record.can_cut(6)  # (nothing to drop: always)
    record.forget_snapshots()  # a decode about to run: older snapshots are void
    record.reset([9, 9])
    assert record.tokens == [9, 9] and not record.can_cut(1)


def test_the_list_is_the_same_object_for_its_whole_life():
    record = KVRecord(n_rs_seq=0)
    live = record.tokens
    record.decoded([1, 2])
    record.reset([5])
    record.appended(6)
    record.cut(1)
    assert live is record.tokens and live == [5]
    record.cut(3)  # (cutting past the end changes nothing)
    assert live == [5]


def test_media_chunks_that_take_fewer_positions():
    """M-RoPE: a chunk of 6 entries on 2 positions puts every later entry 4 positions before its index."""
    from llama_ctypes.core.positions import PositionMap
    from llama_ctypes.errors import InvalidArgumentError

    record = KVRecord()
    record.decoded([1, 2])
    record.decoded_media([-5] * 6, 2)
    record.decoded([3, 4])
    assert len(record) == 10 and record.next_pos == 6
    assert [record.pos(n) for n in (0, 2, 8, 10)] == [0, 2, 4, 6]
    # a removal of positions p.. keeps the entries before p; the chunk's all sit at position 2
    assert [record.positions.entries_before(p) for p in (0, 1, 2, 3, 4, 5, 6, 9)] == [0, 1, 2, 8, 8, 9, 10, 13]
    with pytest.raises(InvalidArgumentError, match="inside a media chunk"):
        record.pos(5)
    with pytest.raises(InvalidArgumentError):
        record.cut(4)
    assert record.tokens == [1, 2, *[-5] * 6, 3, 4]  # a refused cut changes nothing
    record.cut(8)
    assert record.next_pos == 4
    record.cut(2)
    assert record.next_pos == 2 and not record.positions
    record.decoded_media([-6] * 3, 3)  # (as many positions as entries: nothing to record)
    assert not record.positions and record.next_pos == 5
    record.decoded_media([-7] * 4, 1)
    record.reset([1])
    assert record.next_pos == 1 and not record.positions

    class Span:
        def __init__(self, start, n_tokens, n_pos):
            self.start, self.n_tokens, self.n_pos, self.kind = start, n_tokens, n_pos, "image"
            self.end = start + n_tokens

    class Prompt(list):
        spans = (Span(1, 4, 2), Span(6, 3, 1))

    prompt = Prompt([0, -1, -1, -1, -1, 5, -2, -2, -2, 9])
    assert PositionMap.of(prompt, 5).shift == -2 and PositionMap.of(prompt, 10).shift == -4
    assert PositionMap.of(prompt, 10).pos(6) == 4 and PositionMap.of([1, 2, 3], 3).shift == 0
    with pytest.raises(InvalidArgumentError):
        PositionMap.of(prompt, 7)
    cut = PositionMap.of(prompt, 10)
    cut.cut(5)
    assert cut.shift == -2 and cut.pos(5) == 3
