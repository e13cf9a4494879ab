"""Server-sent events, and what happens when a client leaves.

:class:`EventStream` sends ``data: {json}\\n\\n`` events and a final
``data: [DONE]``. It watches the connection while it streams: when the client
disconnects, the event generator is cancelled and closed, and ``on_close``
cancels the requests behind it, so their slots are free at the next tick
(uvicorn's ``send`` does not fail after a disconnect: without the watch, a
stream would run to its end for nobody). :func:`until_disconnect` does the same
for a non-streamed reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.types import Receive, Scope, Send

from .errors import Unavailable, from_exception

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]


def event(data: Any) -> bytes:
    """One SSE event holding ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


#: shape: (events named by their type, a final [DONE], Anthropic's error shape)
_SHAPES = {"openai": (False, True, False), "responses": (True, False, False), "anthropic": (True, False, True),
           "native": (False, False, False)}


class EventStream:
    """An ASGI response streaming ``events`` (dicts) as SSE; ``on_close()`` runs however it ends.

    ``shape="openai"`` (chat and text completions): ``data:`` lines and a final ``data: [DONE]``;
    an exception from the events after the first byte is sent as an ``{"error": ...}`` event
    (OpenAI's clients raise it), then ``[DONE]``. ``"responses"`` (OpenAI's Responses API): each
    event is also named by its ``type`` (``event: response.created``), no ``[DONE]``.
    ``"anthropic"``: named events, no ``[DONE]``, an error is Anthropic's ``error`` event.
    ``"native"`` (llama-server's /completion): ``data:`` lines, no ``[DONE]``.
    """

    def __init__(self, events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None], *,
                 shape: str = "openai"):
        if shape not in _SHAPES:
            raise ValueError(f"shape={shape!r}: expected one of {sorted(_SHAPES)}")
        self.events = events
        self.on_close = on_close
        self.named, self.done, self.anthropic = _SHAPES[shape]

    def _event(self, data: dict[str, Any]) -> bytes:
        if self.named:
            return b"event: " + str(data.get("type", "message")).encode() + b"\n" + event(data)
        return event(data)

    def _error(self, error: Any) -> bytes:
        body = error.anthropic_body() if self.anthropic else error.body()
        if self.named and not self.anthropic:
            body = {"type": "error", **body}  # (a Responses stream's events are named by their type)
        return self._event(body)

    def _done(self) -> bytes:
        return b"data: [DONE]\n\n" if self.done else b""


    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def body(data: bytes, more: bool = True) -> None:
            try:
                await send({"type": "http.response.body", "body": data, "more_body": more})
            except OSError:  # (servers of ASGI spec 2.4 raise it when the client has gone)
                raise _Gone from None

        started = ended = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
                    started = True
                    try:
                        async for data in self.events:
                            await body(self._event(data))
                    except _Gone:
                        raise
                    except Exception as exc:  # (cancellation is not an Exception: it passes)
                        await body(self._error(from_exception(exc)))
                    await body(self._done(), more=False)
                    ended = True
                except (_Gone, OSError):
                    pass
                tg.cancel_scope.cancel()
        except asyncio.CancelledError:
            # Cancelled from outside (a client's leaving is this task group's own scope, which
            # ends quietly): the server's graceful shutdown timed out. The requests go (on_close,
            # below); the client is told, and the stream ends properly rather than cut mid-event.
            self.on_close()
            if started and not ended:
                with anyio.move_on_after(1, shield=True):
                    try:
                        await body(self._error(Unavailable("the server is shutting down")))
                        await body(self._done(), more=False)
                    except Exception:  # (gone, or the server refuses to send any more)
                        pass
        finally:
            self.on_close()  # synchronous: it must run even while this task is being cancelled
            await _aclose_quietly(self.events)


class _Gone(Exception):
    """The client disconnected while its stream was being sent."""


async def _aclose_quietly(gen: Any) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is None:
        return
    try:
        with anyio.CancelScope(shield=True):
            await aclose()
    except Exception:
        logger.debug("closing an event stream failed", exc_info=True)


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) reply was ready."""


async def until_disconnect(receive: Receive, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await ``work`` (a reply computed while the client waits); if the client leaves first, call
    ``on_disconnect()`` and raise :class:`ClientGone`.

    Only for after the body has been read: the next ASGI message is then the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_next_disconnect(receive))
    gone = True
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        gone = not task.done()
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this task is being cancelled)
            on_disconnect()
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})  # let the work run its cleanup
    if gone:
        if not task.cancelled():
            task.exception()  # (retrieved: whatever the work raised once its client had gone is moot)
        raise ClientGone()
    return task.result()


async def _next_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they come (for ``n`` > 1 streamed choices).

    The first exception ends the merge (and is raised); leaving early cancels every pump.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield item
        finally:
            await _aclose_quietly(iterators[0])
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((item, None))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((None, exc))
            return
        await queue.put((done, None))

    tasks = [asyncio.ensure_future(pump(it)) for it in iterators]
    try:
        left = len(tasks)
        while left:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                left -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # (inside a cancelled anyio scope every await is cancelled)
            await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await _aclose_quietly(it)
