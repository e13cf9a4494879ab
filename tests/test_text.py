"""The text pipeline shared by the plain, speculative and server paths (core/text.py), without a model."""

import pytest

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
