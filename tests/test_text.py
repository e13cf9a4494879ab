"""The text pipeline shared by the plain, speculative and server paths (core/text.py), without a model."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_ctypes.core.text import RunControl, StopFilter, TextAssembler, assemble, partial_suffix
from llama_ctypes.errors import CancelledError, DecodeError


class Bytes:
    """Token ids are byte values: a multi-byte character arrives over several tokens."""

    def __init__(self):
        import codecs
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token):
        return self._utf8.decode(bytes([token]))

    def flush(self):
        return self._utf8.decode(b"", final=True)


class Run:
    finish_reason = None


def ids(text):
    return list(text.encode())


def test_partial_suffix_and_stop_filter():
    assert partial_suffix("abc<", ["<end>"]) == 1
    assert partial_suffix("abc<en", ["<end>", "x"]) == 3
    assert partial_suffix("abc", ["<end>"]) == 0
    f = StopFilter(["<end>"])
    assert f.feed("ab<e") == "ab"
    assert f.feed("x") == "<ex"
    assert f.feed("<en") == ""
    assert f.feed("d>tail") == "" and f.stopped



class _RescanStopFilter:
    """The former StopFilter (str.find and partial_suffix over the held-back text at every piece): the reference
    the linear one must agree with."""

    def __init__(self, stops):
        self.stops, self.pending, self.stopped, self.matched = tuple(stops), "", False, None

    def feed(self, piece):
        self.pending += piece
        hit, word = min(((i, s) for s, i in ((s, self.pending.find(s)) for s in self.stops) if i >= 0),
                        default=(-1, None))
        if word is not None:
            out, self.pending, self.stopped, self.matched = self.pending[:hit], "", True, word
            return out
        keep = partial_suffix(self.pending, self.stops)
        out, self.pending = (self.pending[:-keep], self.pending[-keep:]) if keep else (self.pending, "")
        return out


@settings(max_examples=400, deadline=None, derandomize=True)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4),
       pieces=st.lists(st.text("abc", max_size=5), max_size=30))
def test_stop_filter_agrees_with_rescanning(stops, pieces):
    new, old = StopFilter(stops), _RescanStopFilter(stops)
    for piece in pieces:
        assert new.feed(piece) == old.feed(piece)
        assert (new.stopped, new.matched, new.pending) == (old.stopped, old.matched, old.pending)
        if new.stopped:
            break


def test_a_long_stop_string_costs_no_more_per_piece():
    """Rescanning the held-back text at every piece cost the square of a stop string's length: a 400,000-character
    stop whose first 399,999 characters were generated, then one other character, took about 20 s in the
    scheduler thread (which every request of a model shares). Each piece now costs its own length."""
    stop = "ab" * 200_000 + "!"
    f = StopFilter([stop, "zzz"])
    start = time.monotonic()
    emitted = [f.feed(stop[i:i + 4]) for i in range(0, len(stop) - 1, 4)]
    assert "".join(emitted) == "" and len(f.pending) == len(stop) - 1  # all held back: it may be the stop
    assert f.feed("?") == stop[:-1] + "?" and not f.stopped
    assert f.feed("zz") == "" and f.feed("z.") == "" and f.stopped and f.matched == "zzz"
    assert time.monotonic() - start < 3

def test_assemble_stops_at_the_token_that_completes_a_stop_string():
    run, pieces = Run(), []
    closed = []

    def tokens():
        try:
            yield from ids("héllo STOP never")
        finally:
            closed.append(True)

    items = list(assemble(tokens(), TextAssembler(Bytes(), ["STOP"]), run, pieces, every_token=True))
    assert "".join(pieces) == "héllo "
    assert run.finish_reason == "stop"
    assert items[-1] == (None, "")  # the tail comes once, empty after a stop
    assert closed == [True]
    # the last token yielded is the one that completed the stop; nothing was read past it
    assert items[-2][0] == ord("P")
    # without every_token: the same text, as non-empty pieces only
    run2, pieces2 = Run(), []
    assert "".join(assemble(iter(ids("héllo STOP never")), TextAssembler(Bytes(), ["STOP"]), run2, pieces2)) == \
        "héllo " and run2.finish_reason == "stop" and pieces2 == pieces


def test_assemble_flushes_an_incomplete_character_and_a_held_back_prefix_at_the_end():
    run, pieces = Run(), []
    out = list(assemble(iter(ids("ok ST") + [0xC3]), TextAssembler(Bytes(), ["STOP"]), run, pieces,
                        every_token=True))
    assert out[-1] == (None, "ST\ufffd")
    assert "".join(pieces) == "ok ST\ufffd"
    assert run.finish_reason is None
    plain = list(assemble(iter(ids("ok ST") + [0xC3]), TextAssembler(Bytes(), ["STOP"]), Run(), []))
    assert plain[-1] == "ST\ufffd" and "" not in plain


def test_assemble_a_stop_string_completed_by_the_flush():
    # an incomplete character becomes U+FFFD only at the flush: a stop string ending in it is seen there
    run, pieces = Run(), []
    out = list(assemble(iter(ids("ab") + [0xC3]), TextAssembler(Bytes(), ["b\ufffd"]), run, pieces,
                        every_token=True))
    assert run.finish_reason == "stop"
    assert "".join(pieces) == "a" and out[-1] == (None, "")


def test_assemble_propagates_an_error_with_no_tail():
    def tokens():
        yield 65
        raise DecodeError("boom", code=-1)

    gen = assemble(tokens(), TextAssembler(Bytes()), Run(), [], every_token=True)
    assert next(gen) == (65, "A")
    with pytest.raises(DecodeError):
        next(gen)


def _run(control, tokens, run=None):
    run = run if run is not None else Run()
    with control.running(run):
        yield from tokens


def test_run_control_cancel_before_start_raises_and_never_aborts():
    aborts = []
    c = RunControl(lambda: aborts.append(1))
    c.cancel()
    with pytest.raises(CancelledError):
        list(_run(c, iter([1, 2])))
    assert aborts == [] and c.finished


def test_run_control_cancel_while_running_aborts_and_an_abort_becomes_cancelled_error():
    aborts = []
    c = RunControl(lambda: aborts.append(1))

    def loop():
        yield 1
        c.cancel()  # from "another thread", between two tokens: the decode in flight is aborted
        raise DecodeError("aborted", code=2)

    g = _run(c, loop())
    assert next(g) == 1
    with pytest.raises(CancelledError):
        next(g)
    assert aborts == [1]
    c.cancel()  # after the end: nothing
    assert aborts == [1]


def test_run_control_a_loop_that_returned_because_of_a_cancel_is_cancelled():
    c = RunControl(lambda: None)

    def loop():
        yield 1
        c.cancel()

    with pytest.raises(CancelledError):
        list(_run(c, loop()))
    run2 = Run()
    run2.finish_reason = "length"  # ended by itself before the cancel was seen: a finished run
    c2 = RunControl(lambda: None)

    def loop2():
        yield 1
        c2.cancel()

    assert list(_run(c2, loop2(), run2)) == [1]


def test_run_control_other_decode_errors_pass_through():
    c = RunControl(lambda: None)

    def loop():
        raise DecodeError("no KV slot", code=1)
        yield

    with pytest.raises(DecodeError):
        list(_run(c, loop()))
    assert c.finished and not c.active


def test_run_control_release_runs_once_in_order_and_reports_the_first_failure():
    c = RunControl(lambda: None)
    order = []
    c.defer(lambda: order.append("a"))
    c.defer(lambda: (_ for _ in ()).throw(RuntimeError("b failed")))
    c.defer(lambda: order.append("c"))
    with pytest.raises(RuntimeError, match="b failed"):
        c.release()
    assert order == ["a", "c"]
    c.release()
    assert order == ["a", "c"]
