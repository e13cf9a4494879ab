"""The consumer side of a server request: :class:`ServerStream` (threads) and :class:`AsyncServerStream` (asyncio).

Both read the request's :class:`~.request.Channel` through a :class:`_Consumer`, which
collects the text pieces and logprob entries, ends on ``End`` and raises the request's
error. Neither the consumer nor the generator of a ``ServerStream`` refers back to the
stream object, so dropping a stream frees it at once by reference counting and cancels
its request (see ``core.generation.LazyStream``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from ...core.generation import Completion, LazyStream, Timings
from ...core.logprobs import TokenLogprob
from ...errors import CancelledError
from .request import End, Progress, Request

if TYPE_CHECKING:
    from .server import Server

__all__ = ["ServerStream", "AsyncServerStream"]


class _Consumer:
    """The consumer's end of a request: collects its text pieces (and logprob entries), ends on End,
    raises its error."""

    __slots__ = ("server", "engine", "request", "pieces", "logprobs", "finish_reason", "error", "progress")

    def __init__(self, server: "Server", request: Request):
        self.server = server  # a stream keeps its server alive (the server never refers to its streams)
        self.engine = server._engine
        self.request = request
        self.pieces: list[str] = []
        # The entries received so far: in step with ``pieces`` (the request's own list runs ahead).
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.progress: Progress | None = None  # the last prompt progress report (when asked for)

    def handle(self, item: Any) -> str:
        """The text of one channel item ("" at the end); sets finish_reason at the end; raises errors."""
        if item.__class__ is str:
            self.pieces.append(item)
            return item
        if item.__class__ is TokenLogprob:
            self.logprobs.append(item)  # type: ignore[union-attr]
            return ""
        if isinstance(item, End):
            self.finish_reason = item.finish_reason
            return ""
        if item.__class__ is Progress:
            self.progress = item
            return ""
        self.error = item
        raise item

    def end(self) -> None:
        """Cancel the request if the consumer leaves before its end."""
        if self.finish_reason is None and self.error is None and not self.request.status.done:
            self.engine.cancel(self.request)

    def completion(self) -> Completion:
        request = self.request
        entries = request.logprobs
        return Completion("".join(self.pieces), list(request.generated), self.finish_reason or "length",
                          len(request.prompt), request.timings(), None if entries is None else list(entries))


def _pieces(consumer: _Consumer) -> Iterator[str]:
    """A stream's text pieces. It refers to the consumer, never to the stream, so dropping the stream
    frees it at once by reference counting (closing this generator cancels the request)."""
    get = consumer.request.channel.get
    try:
        while consumer.finish_reason is None:
            out = consumer.handle(get())
            if out:
                yield out
    finally:
        consumer.end()


class _RequestResults:
    """What a request's stream shows of it: ``self.request`` and its consumer ``self._consumer``."""

    request: Request
    _consumer: _Consumer

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"eog"`` after a natural end; None before it (or when cancelled)."""
        return self._consumer.finish_reason

    def piece_tokens(self, index: int) -> list[int]:
        """The generated tokens behind text piece ``index`` (0 = the first piece read): those after the
        previous piece's, up to and including the one that completed it."""
        ends = self.request.piece_ends
        start = ends[index - 1] if index > 0 else 0
        return self.request.generated[start:ends[index]]

    @property
    def stop_word(self) -> str | None:
        """The stop string that ended the request (``finish_reason == "stop"``); None otherwise."""
        text = self.request.text
        return None if text is None else text.stop_word

    @property
    def tokens(self) -> list[int]:
        """Token ids generated so far (the scheduler's view: may run ahead of ``text``)."""
        return self.request.generated

    @property
    def text(self) -> str:
        """The text read so far."""
        return "".join(self._consumer.pieces)

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.request.prompt)

    @property
    def timings(self) -> Timings:
        """Timings so far (milliseconds); frozen at the end."""
        return self.request.timings()

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Entries of the tokens behind the text read so far (None unless requested with ``logprobs=``);
        after the end, one per token of ``tokens``."""
        return self._consumer.logprobs


class ServerStream(_RequestResults, LazyStream):
    """A lazy stream of a server request's text pieces.

    Breaking out of the loop and dropping the stream, ``close()``, or leaving a
    ``with`` block cancels the request: its slot and KV are freed at the next
    tick, with no wait for the garbage collector. ``cancel()`` may be called
    from any thread, also while another thread iterates: the iterating thread
    then gets :class:`~llama_ctypes.CancelledError` (after the pieces already
    produced). ``close()`` from another thread cancels too: a thread waiting in
    ``next()`` gets CancelledError, a later ``next()`` ends the iteration.
    After the end, ``finish_reason``, ``tokens``, ``text``, ``logprobs`` and
    ``timings`` describe the result (frozen); ``request`` identifies it for
    :meth:`Server.cancel`.
    """

    def __init__(self, server: "Server", request: Request):
        self.request = request
        self._consumer = _Consumer(server, request)
        self._gen = _pieces(self._consumer)

    def cancel(self) -> None:
        """Cancel the request (any thread): a waiting one leaves the queue at once, a running one ends
        at the next tick. The iterating thread gets CancelledError."""
        self._consumer.engine.cancel(self.request)

    def _after_close(self) -> None:
        self._consumer.end()  # an unstarted generator's ``finally`` never runs

    def completion(self) -> Completion:
        """Run to the end and return the :class:`Completion`."""
        for _ in self:
            pass
        return self._consumer.completion()


class AsyncServerStream(_RequestResults):
    """An asyncio stream of a server request's text pieces, with its metadata (:meth:`Server.asubmit`).

    ``async for piece in stream`` yields ``str`` pieces; waiting never blocks the event
    loop. Cancelling the consuming task, :meth:`aclose`, leaving an ``async with`` block
    or dropping the stream cancels the request: its slot and KV are freed at the next
    tick. :meth:`cancel` works from any thread; the iterating task then gets
    :class:`~llama_ctypes.CancelledError` (after the pieces already produced). The
    request's error (e.g. a failed decode) is raised in the iterating task. After the
    end, ``finish_reason``, ``tokens``, ``text``, ``logprobs`` and ``timings`` describe
    the result (frozen); ``request`` identifies it for :meth:`Server.cancel`.
    """

    def __init__(self, server: "Server", request: Request):
        self.request = request
        self._consumer = _Consumer(server, request)
        self._closed = False

    # ---- iteration ----------------------------------------------------------------------------
    def __aiter__(self) -> "AsyncServerStream":
        return self

    async def __anext__(self) -> str:
        return await self._next(False)  # type: ignore[return-value]

    async def events(self) -> AsyncIterator[str | Progress]:
        """The text pieces, and the prompt's :class:`~.request.Progress` reports between them (a request
        submitted with ``progress=True``)."""
        while True:
            try:
                yield await self._next(True)
            except StopAsyncIteration:
                return

    async def _next(self, with_progress: bool) -> str | Progress:
        consumer = self._consumer
        channel = self.request.channel
        if asyncio.get_running_loop() is not channel.loop:
            # The scheduler delivers items through the submitting loop (call_soon_threadsafe); a
            # task of another loop waiting on them would never be woken: refuse instead of hanging.
            raise RuntimeError("this AsyncServerStream belongs to the event loop that called asubmit(); "
                               "iterate it there (aclose() and cancel() work from anywhere)")
        aget = channel.aget
        # (after End, an error or aclose() nothing more arrives: waiting would hang)
        while consumer.finish_reason is None and consumer.error is None and not self._closed:
            try:
                item = await aget()
            except BaseException:  # the consuming task was cancelled: the request goes with it
                consumer.end()
                raise
            out = consumer.handle(item)  # raises the request's error
            if out:
                return out
            if with_progress and item.__class__ is Progress:
                return item
        raise StopAsyncIteration

    async def completion(self) -> Completion:
        """Run to the end (if not done) and return the :class:`Completion`.

        Raises the request's error (CancelledError when it was cancelled, also by closing the
        stream before its end).
        """
        async for _ in self:
            pass
        consumer = self._consumer
        if consumer.finish_reason is None:
            if consumer.error is not None:  # raised once already by the iteration; raised again here
                raise consumer.error
            raise CancelledError("the stream was closed before the request finished")
        return consumer.completion()

    def cancel(self) -> None:
        """Cancel the request (any thread): a waiting one leaves the queue at once, a running one ends
        at the next tick."""
        self._consumer.engine.cancel(self.request)

    async def aclose(self) -> None:
        """Stop reading; cancel the request if it has not finished (idempotent). Does not wait for the
        slot: it is freed at the next tick."""
        self._closed = True
        self._consumer.end()

    async def __aenter__(self) -> "AsyncServerStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # ``async for`` does not close a plain async iterator it leaves (``break``): dropping the
        # stream must still free the slot. (The consumer never refers back to the stream.)
        try:
            self._consumer.end()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"<AsyncServerStream request={self.request.id} status={self.request.status.name.lower()} "
                f"tokens={len(self.request.generated)}>")
