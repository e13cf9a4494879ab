"""The text side of every generation path (plain, speculative, server).

``TextAssembler`` turns token ids into UTF-8-safe text pieces with stop strings
applied; ``assemble`` drives one over a token iterator and records where the text
stopped; ``RunControl`` is one single-sequence run's cancel state and the holds
that keep its resources alive. The server's scheduler uses the assembler per
request; its own run state is the request's status (engines/server/request.py).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from ..errors import CancelledError, DecodeError
from .decode_status import ABORTED
from .tokenizer import StreamDecoder

if TYPE_CHECKING:
    from .vocab import Vocab

__all__ = ["partial_suffix", "StopFilter", "Detokenizer", "TextAssembler", "assemble", "RunControl"]


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``.

    Streaming code holds that much text back: it may be the start of a stop string or a marker.
    """
    best = 0
    for stop in markers:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def _borders(word: str) -> list[int]:
    """KMP's failure function: ``out[i]`` is the length of the longest proper prefix of ``word[:i + 1]`` that
    is also its suffix."""
    out = [0] * len(word)
    k = 0
    for i in range(1, len(word)):
        while k and word[i] != word[k]:
            k = out[k - 1]
        if word[i] == word[k]:
            k += 1
        out[i] = k
    return out


class StopFilter:
    """Applies stop strings to streamed text: emits what is safe, holds back a possible stop prefix.

    Each stop string is followed by a Knuth-Morris-Pratt automaton, so a piece costs time in proportion to its
    own length whatever the stop strings' length: rescanning the held-back text for every token (as
    ``str.find`` plus :func:`partial_suffix` did) cost the square of a long stop string per token, in the
    scheduler thread that every request of the model shares.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that appeared
        self._borders = [_borders(s) for s in self.stops]
        # per stop: the longest prefix of it the text ends with (never more than the held-back text)
        self._states = [0] * len(self.stops)

    def feed(self, piece: str) -> str:
        """Text that can be emitted now; sets ``stopped`` when a stop string appears (it is dropped)."""
        if not self.stops:
            return piece
        base = len(self.pending)
        self.pending += piece
        hit: tuple[int, str] | None = None  # (where in pending the earliest stop string starts, which one)
        states = self._states
        for k, stop in enumerate(self.stops):
            n, state, borders = len(stop), states[k], self._borders[k]
            if n == 0:  # (an empty stop string matches at once, as str.find says)
                candidate = (0, stop)
                hit = candidate if hit is None or candidate < hit else hit
                continue
            for pos, c in enumerate(piece):
                while state and stop[state] != c:
                    state = borders[state - 1]
                if stop[state] == c:
                    state += 1
                    if state == n:  # its first occurrence ends here; the earliest start wins, then the shortest
                        candidate = (base + pos + 1 - n, stop)
                        hit = candidate if hit is None or candidate < hit else hit
                        break
            states[k] = state
        if hit is not None:
            out, self.pending, self.stopped, self.matched = self.pending[:hit[0]], "", True, hit[1]
            return out
        keep = max(states)
        out, self.pending = (self.pending[:-keep], self.pending[-keep:]) if keep else (self.pending, "")
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        self._states = [0] * len(self.stops)
        return out


class Detokenizer(Protocol):
    """Token ids to UTF-8-safe text pieces (:class:`StreamDecoder`; scheduler tests use fakes)."""

    def push(self, token: int) -> str: ...
    def flush(self) -> str: ...


class TextAssembler:
    """One generation's text as its tokens are produced: incremental detokenization, then stop strings.

    Not thread-safe: one per generation, fed by the thread that samples (so a run
    ends at the token that completes a stop string however slowly its consumer reads).
    """

    __slots__ = ("_decoder", "_stops", "push")

    def __init__(self, decoder: Detokenizer, stops: Sequence[str] = ()):
        self._decoder = decoder
        self._stops = StopFilter(stops) if stops else None
        #: ``push(token) -> str``: the text that can be shown after ``token`` ("" while a character
        #: or a possible stop string is incomplete). Without stops it is the decoder's own push.
        self.push: Callable[[int], str] = self._push_with_stops if stops else decoder.push

    @classmethod
    def for_vocab(cls, vocab: "Vocab", special: bool = False, stops: Sequence[str] = ()) -> "TextAssembler":
        """An assembler over ``vocab``'s pieces (``special``: render special tokens)."""
        return cls(StreamDecoder(vocab, special=special), stops)

    def _push_with_stops(self, token: int) -> str:
        return self._stops.feed(self._decoder.push(token))  # type: ignore[union-attr]

    @property
    def stopped(self) -> bool:
        """A stop string appeared (it is not part of the text)."""
        return self._stops is not None and self._stops.stopped

    @property
    def stop_word(self) -> str | None:
        """The stop string that ended the text (None while none has appeared)."""
        return None if self._stops is None else self._stops.matched

    def flush(self) -> str:
        """The rest of the text at a natural end (eog, length); may complete a stop (see ``stopped``)."""
        out = self._decoder.flush()
        if self._stops is None:
            return out
        out = self._stops.feed(out)
        return out if self._stops.stopped else out + self._stops.flush()


def assemble(tokens: Iterator[int], text: TextAssembler, run: Any, pieces: list[str],
             every_token: bool = False) -> Iterator[Any]:
    """The text of ``tokens``: each non-empty piece (``every_token``: ``(token, text it releases)``
    per token, then ``(None, tail)`` once at the end).

    Every non-empty text goes to ``pieces`` before it is yielded. A stop string ends the run
    (``run.finish_reason = "stop"``). ``tokens`` is closed before the tail is yielded, so
    whatever it holds is released before the last item; an exception from it (a cancel, a
    decode error) propagates with no tail.
    """
    push, keep = text.push, pieces.append
    try:
        for tok in tokens:  # (the hot loop of every single-sequence generation: kept flat)
            out = push(tok)
            if out:
                keep(out)
                if not every_token:
                    yield out
            if every_token:
                yield tok, out
            if text.stopped:
                run.finish_reason = "stop"
                break
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
    tail = ""
    if not text.stopped:
        tail = text.flush()
        if text.stopped:
            run.finish_reason = "stop"
        if tail:
            keep(tail)
    if every_token:
        yield None, tail
    elif tail:
        yield tail


class RunControl:
    """One single-sequence run's cancel state, and what to release when it ends.

    ``cancel()`` works from any thread: before the run starts it marks it (the start
    then raises ``CancelledError``); while it runs it also calls ``abort`` (which stops
    a decode in flight); after the end it does nothing. ``defer(fn)`` registers what
    :meth:`release` undoes, in order, once.
    """

    def __init__(self, abort: Callable[[], None]) -> None:
        self._abort = abort
        self._lock = threading.Lock()
        self._releases: list[Callable[[], None]] = []
        self.cancelled = False
        self.active = False  # the resources are claimed: a cancel must also abort
        self.finished = False

    def defer(self, release: Callable[[], None]) -> None:
        self._releases.append(release)

    def release(self) -> None:
        """Run the deferred releases (idempotent; the first failure propagates after the rest ran)."""
        releases, self._releases = self._releases, []
        error: BaseException | None = None
        for fn in releases:
            try:
                fn()
            except BaseException as exc:  # release everything else first
                error = error or exc
        if error is not None:
            raise error

    def cancel(self) -> None:
        with self._lock:
            if self.finished:
                return
            self.cancelled = True
            if self.active:
                self._abort()

    @contextlib.contextmanager
    def running(self, run: Any) -> Iterator[None]:
        """The run's decoding, its resources already claimed by the caller (``with control.running(run):``).

        A cancel before the start, an abort caused by :meth:`cancel`, or a loop that returned
        early because of one (``run.finish_reason`` still None) raise ``CancelledError``; the
        run is finished when the block ends. (A context manager, not a wrapping generator: it
        costs nothing per token.)
        """
        with self._lock:
            self.active = not self.cancelled
        try:
            if not self.active:
                raise CancelledError("the generation was cancelled")
            try:
                yield
            except DecodeError as exc:
                if self.cancelled and exc.code == ABORTED:
                    raise CancelledError("the generation was cancelled") from None
                raise
            if self.cancelled and run.finish_reason is None:
                raise CancelledError("the generation was cancelled")
        finally:
            with self._lock:
                self.active = False
                self.finished = True
