"""Connection guards for uvicorn: deadlines for slow clients and a cap on open connections.

uvicorn bounds neither how long a client may take to send its request nor how long
a response may wait for a client that stops reading: 150 connections that each
sent half a header, or 50 bodies trickled a byte at a time, were all held open
(each one a file descriptor), and a stream whose reader never reads keeps its
connection and buffered text forever. :func:`guarded_protocol` returns a subclass
of uvicorn's HTTP protocol (the implementation uvicorn would pick) that enforces
:class:`ConnectionLimits`:

* a request's header block must arrive within ``header_timeout`` seconds of the
  connection (or, on a kept-alive connection, of the request's first byte); its
  body within ``body_timeout`` seconds of the headers (for a pipelined request, of
  the moment it is served). A deadline, not an idle timeout: trickling a byte at a
  time does not stretch it. The client gets a 408 and the connection is closed (the
  app sees a disconnect). A header block over :data:`MAX_HEADER_BYTES` gets a 431;
* a response whose writing stays paused for ``write_timeout`` seconds (the buffers
  are full: the client does not read), or whose last bytes are not all sent
  ``write_timeout`` seconds after it ended, aborts the connection; the app sees a
  disconnect, which cancels the requests behind it (llama-server's ``--timeout``,
  600 s by default, is the model for this one). A client that reads, however
  slowly, resumes the writing and is not cut off;
* beyond ``max_connections`` open connections a new one is answered 503 with
  Retry-After and closed at once, before it can hold a descriptor;
* ``keep_alive_timeout``: how long an idle connection is kept between requests
  (uvicorn's own timer).

It also writes each response's header names as llama-server spells them
(``Content-Type``, ``Access-Control-Allow-Origin``): Starlette and httptools write
them in lower case. Names are case-insensitive, but clients that keep headers in a
plain dict (llama.cpp's own server tests among them) look them up by that spelling.

Only uvicorn's protocol hooks are used (``connection_made``, ``data_received``,
``on_response_complete``, ``pause_writing``/``resume_writing``, ``connection_lost``)
and its per-connection ``cycle`` and ``transport``, which both of its HTTP/1.1
implementations (h11, httptools) have.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, fields
from typing import Any

from ...core.params import check_positive
from ...errors import InvalidArgumentError

logger = logging.getLogger(__name__)

__all__ = ["ConnectionLimits", "guarded_protocol"]


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take, and how many may be connected at once (seconds, counts)."""

    header_timeout: float = 10.0
    """Seconds for a request's whole header block."""
    body_timeout: float = 60.0
    """Seconds for a request's whole body, from the end of its headers (8 MiB at 140 KB/s)."""
    write_timeout: float = 600.0
    """Seconds a response may stay unable to write (a client that stops reading), as llama-server's ``--timeout``."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle kept-alive connection waits for its next request."""
    max_connections: int = 512
    """Open connections; the next one is answered 503 and closed."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self) if f.name != "max_connections"), integer=False)
        check_positive(self, "max_connections")


def _raw_response(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response in OpenAI's error shape, written straight to a transport (no app involved)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "unavailable_error", "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_TOO_MANY = _raw_response(503, "Service Unavailable", "too many open connections; retry later", "too_many_connections",
                          retry_after=1)
_HEADER_TIMEOUT = _raw_response(408, "Request Timeout", "the request headers did not arrive in time", "timeout")
_HEADERS_TOO_LARGE = _raw_response(431, "Request Header Fields Too Large", "the request headers are too large",
                                   "headers_too_large")
#: Most bytes of one request's header block (h11 stops at 16 KiB by itself; httptools keeps reading).
MAX_HEADER_BYTES = 64 << 10
_BODY_TIMEOUT = _raw_response(408, "Request Timeout", "the request body did not arrive in time", "timeout")


_SPELLED: dict[bytes, bytes] = {}


def _spelled(name: bytes) -> bytes:
    spelled = _SPELLED.get(name)
    if spelled is None:
        spelled = b"-".join(part.capitalize() for part in name.split(b"-"))
        if len(_SPELLED) < 512:  # (names are few; a client cannot grow this, only the app writes them)
            _SPELLED[name] = spelled
    return spelled


def _respelled_head(data: bytes) -> bytes:
    """``data`` (a status line and header block, maybe with body bytes after it) with each header name
    spelled ``Content-Type``."""
    end = data.find(b"\r\n\r\n")
    head, rest = (data, b"") if end < 0 else (data[:end], data[end:])
    lines = head.split(b"\r\n")
    for i in range(1, len(lines)):
        name, colon, value = lines[i].partition(b":")
        lines[i] = _spelled(name) + colon + value
    return b"\r\n".join(lines) + rest


class _SpellingTransport:
    """The connection's transport, with the header block of each response respelled (see the module docs).

    The first write of a response is its status line and headers (both uvicorn protocols write them in
    one piece); a ``100 Continue`` before it is passed over. Everything else goes to the transport as is.
    """

    __slots__ = ("_transport", "_head_written")

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._head_written = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        if not self._head_written:
            if isinstance(data, (bytes, bytearray)) and data.startswith(b"HTTP/1.1 "):
                if not data.startswith(b"HTTP/1.1 100 "):
                    self._head_written = True
                data = _respelled_head(bytes(data))
            else:
                self._head_written = True  # (not a head as expected: the rest goes out untouched)
        self._transport.write(data)

    def next_response(self) -> None:
        self._head_written = False


class _Guard:
    """The mixin (put before uvicorn's protocol class): see the module docs."""

    limits: ConnectionLimits = ConnectionLimits()
    _refused = False
    _read_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _reading: str | None = None  # "headers" or "body": which deadline runs
    _seen_cycle: Any = None  # the last request whose headers have arrived
    _guarded_cycle: Any = None  # the request being served, whose body deadline runs
    _write_mode: str | None = None  # "paused" (the buffer is over its high-water mark) or "tail" (a finished
    # response's last bytes still buffered)
    _header_bytes = 0  # bytes of an incomplete header block so far

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        open_now = len(self.connections)  # type: ignore[attr-defined]
        if open_now >= self.limits.max_connections:
            self._refused = True
            logger.warning("refusing a connection: %d are open (max_connections)", open_now)
            transport.write(_TOO_MANY)
            transport.close()
            return
        super().connection_made(_SpellingTransport(transport))  # type: ignore[misc]
        self._arm_read("headers", self.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading is None and (self.cycle is None or self.cycle.response_complete):  # type: ignore[attr-defined]
            # the first bytes of the next request on a kept-alive connection
            self._arm_read("headers", self.limits.header_timeout)
        super().data_received(data)  # type: ignore[misc]
        self._follow_request()
        if self._reading == "headers":  # (still no complete header block: all of it was header bytes)
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse_request(f"headers of more than {MAX_HEADER_BYTES} bytes", _HEADERS_TOO_LARGE)

    def _follow_request(self) -> None:
        """Start the deadlines of a request whose headers are in, once it is the one being served."""
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:
            return
        if cycle is not self._seen_cycle:  # a header block is complete
            self._seen_cycle = cycle
            if self._reading == "headers":
                self._disarm_read()
        if self._pipelined(cycle):
            # (behind a response still being sent: httptools parses it at once and holds it, and its body
            # cannot come before that response ends. Its body deadline starts when it is served.)
            return
        if cycle is not self._guarded_cycle:
            self._guarded_cycle = cycle
            if self._write_mode == "tail":
                self._disarm_write()  # (the client talks again; a stall of this response pauses writing)
            if cycle.more_body:
                self._arm_read("body", self.limits.body_timeout)
            else:
                self._disarm_read()
        elif self._reading == "body" and not cycle.more_body:
            self._disarm_read()

    def _pipelined(self, cycle: Any) -> bool:
        """Whether ``cycle`` waits behind another request's response (httptools' ``pipeline``)."""
        return any(entry[0] is cycle for entry in getattr(self, "pipeline", ()))

    def on_response_complete(self) -> None:
        self.transport.next_response()  # type: ignore[attr-defined]  # (before a pipelined request is taken up)
        super().on_response_complete()  # type: ignore[misc]
        transport = self.transport  # type: ignore[attr-defined]
        if self._write_mode is None and transport.get_write_buffer_size() > 0:
            # What is left of the response must still reach the client; uvicorn may already have called
            # close() (no keep-alive), which waits for a buffer that a client that does not read never drains.
            self._arm_write("tail")
        self._follow_request()  # (a pipelined request is taken up by the call above)

    def pause_writing(self) -> None:
        if self._refused:
            return
        super().pause_writing()  # type: ignore[misc]
        self._arm_write("paused")  # (afresh: a timer left from an earlier response says nothing of now)

    def resume_writing(self) -> None:
        if self._refused:
            return
        super().resume_writing()  # type: ignore[misc]
        if self._write_mode == "paused":
            self._disarm_write()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read()
        self._disarm_write()
        if self._refused:
            return
        super().connection_lost(exc)  # type: ignore[misc]

    # ---- timers ----
    def _loop(self) -> asyncio.AbstractEventLoop:
        return getattr(self, "loop", None) or asyncio.get_event_loop()

    def _arm_read(self, what: str, seconds: float) -> None:
        self._disarm_read()
        self._reading = what
        self._header_bytes = 0
        self._read_timer = self._loop().call_later(seconds, self._read_expired, what)

    def _disarm_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._reading = None

    def _read_expired(self, what: str) -> None:
        self._read_timer = None
        self._reading = None
        self._refuse_request(f"its request {what} did not arrive in time",
                             _HEADER_TIMEOUT if what == "headers" else _BODY_TIMEOUT)

    def _refuse_request(self, why: str, response: bytes) -> None:
        """Answer ``response`` (a complete HTTP response) and close, unless a response is under way (then
        only close: raw bytes would land inside it)."""
        self._disarm_read()
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing():
            return
        logger.info("closing a connection from %s: %s", _peer(self), why)
        cycle = getattr(self, "cycle", None)
        guarded = self._guarded_cycle
        under_way = getattr(self, "pipeline", None) or any(
            c is not None and c.response_started and not c.response_complete for c in (cycle, guarded))
        if not under_way:
            transport.write(response)
        transport.close()

    def _arm_write(self, mode: str) -> None:
        self._disarm_write()
        self._write_mode = mode
        self._write_timer = self._loop().call_later(self.limits.write_timeout, self._write_expired)

    def _disarm_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self._write_mode = None

    def _write_expired(self) -> None:
        mode = self._write_mode
        self._write_timer = None
        self._write_mode = None
        transport = self.transport  # type: ignore[attr-defined]
        if mode == "tail" and transport.get_write_buffer_size() == 0:
            return  # (the tail reached the client)
        # paused all along (resume_writing disarms), or a tail that did not drain in the whole period
        logger.info("aborting a connection from %s: what it was sent could not be written for %s s",
                    _peer(self), self.limits.write_timeout)
        transport.abort()  # (close() would wait for the buffer to drain, which it will not)


def _peer(protocol: Any) -> str:
    client = getattr(protocol, "client", None)
    return f"{client[0]}:{client[1]}" if client else "?"


def guarded_protocol(limits: ConnectionLimits, base: type | None = None) -> type:
    """uvicorn's HTTP protocol (``base``, default the one uvicorn picks: httptools when installed, else h11)
    with ``limits`` enforced; pass it as ``uvicorn.Config(http=...)``, with
    ``timeout_keep_alive=limits.keep_alive_timeout``."""
    if not isinstance(limits, ConnectionLimits):
        raise InvalidArgumentError(f"limits={limits!r}: expected a ConnectionLimits")
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(f"Guarded{base.__name__}", (_Guard, base), {"limits": limits})
