"""KVRecord, the one owner of what a context's sequence 0 holds: pure bookkeeping, no model."""

from __future__ import annotations

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
