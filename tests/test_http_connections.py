"""The connection guards (interfaces/http/connections.py) on both of uvicorn's HTTP/1.1 protocols.

An in-process uvicorn server with a small ASGI app (no model) and short limits, driven by raw
sockets: a response's tail that a client never reads, a reader that keeps reading across two
responses, a request pipelined behind a stream (httptools parses it at once), an endless header.
The listening socket's send buffer is small, so what a client does not read stays in the server's
transport buffer, where the guards see it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llama_ctypes.interfaces.http.connections import ConnectionLimits, guarded_protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools comes with uvicorn[standard]
    HttpToolsProtocol = None

BASES = [H11Protocol] + ([HttpToolsProtocol] if HttpToolsProtocol is not None else [])


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/big":
        n = int(scope["query_string"] or 30000)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(n).encode())]})
        await send({"type": "http.response.body", "body": b"x" * n})
    elif scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for _ in range(60):
            await send({"type": "http.response.body", "body": b"z" * 2000, "more_body": True})
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"END"})
    elif scope["path"] == "/head":  # a body that looks like a header block: it must go out as it is
        body = b"HTTP/1.1 200 OK\r\nx-body-header: 1\r\n\r\n"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"access-control-allow-origin", b"*"),
                                (b"x-request-id", b"a:b")]})
        await send({"type": "http.response.body", "body": body})
    else:  # echo the body's length
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        text = str(size).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(text)).encode())]})
        await send({"type": "http.response.body", "body": text})


class _Running:
    """uvicorn serving ``_app`` on a thread of its own, with ``limits`` on the protocol ``base``."""

    def __init__(self, base: type, limits: ConnectionLimits):
        config = uvicorn.Config(_app, host="127.0.0.1", port=0, http=guarded_protocol(limits, base),
                                log_level="warning", lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # (accepted sockets inherit it)
        self.listener.bind(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.listener])),
                                       daemon=True)

    def __enter__(self) -> "_Running":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    def client(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", self.port))
        return s


def _read_all(s: socket.socket, timeout: float) -> tuple[bytes, str]:
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
        return data, "eof"
    except socket.timeout:
        return data, "timeout"
    except ConnectionResetError:
        return data, "reset"


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_a_tail_nobody_reads_is_aborted_also_without_keep_alive(base):
    """A finished response whose last bytes sit in the buffer of a client that never reads: uvicorn's
    close() (Connection: close) waits for them forever. Aborted after write_timeout."""
    with _Running(base, ConnectionLimits(write_timeout=1.0)) as srv:
        socks = []
        for size in (50000, 70000, 90000):  # (tails of 5-50 KB past the kernel buffers: under the high-water mark)
            s = srv.client(rcvbuf=4096)
            s.sendall(b"GET /big?%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % size)
            socks.append(s)
        time.sleep(0.5)
        assert srv.open_connections() == 3  # the tails wait
        deadline = time.monotonic() + 5
        while srv.open_connections() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.open_connections() == 0
        for s in socks:
            s.close()


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_a_client_that_reads_is_not_cut_off_by_a_previous_responses_timer(base):
    """The first response leaves a tail (a timer runs for it); the client reads it, then reads a second,
    streamed response slower than it is written, for longer than write_timeout: it gets all of it. (While
    writing is paused, a reader must drain the buffer to its low-water mark, 48 KB, within write_timeout.)"""
    with _Running(base, ConnectionLimits(write_timeout=4.0)) as srv:
        s = srv.client(rcvbuf=4096)
        s.sendall(b"GET /big?60000 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)  # not reading yet
        got = b""
        while got.count(b"x") < 60000:
            got += s.recv(65536)
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        total, t0 = b"", time.monotonic()
        while b"END" not in total[-32:]:  # (then the chunked encoding's last chunk)
            chunk = s.recv(1000)  # ~20 KB/s, under the 40 KB/s the stream makes
            assert chunk, f"cut off after {len(total)} bytes, {time.monotonic() - t0:.1f} s"
            total += chunk
            time.sleep(0.05)
        assert time.monotonic() - t0 > 4.0 and total.count(b"z") == 120000
        s.close()


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_a_request_pipelined_behind_a_stream_waits_for_it(base):
    """httptools parses a pipelined request at once and holds it: its body deadline must not run (and no
    408 may be written into the stream in front of it) until it is served."""
    with _Running(base, ConnectionLimits(body_timeout=1.0)) as srv:
        s = srv.client()
        body = b"y" * 300_000
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                  + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        s.settimeout(10)
        while not data.endswith(b"\r\n\r\n300000"):
            chunk = s.recv(65536)
            assert chunk, data[-300:]
            data += chunk
        assert b"408" not in data and data.count(b"HTTP/1.1 200") == 2 and data.count(b"z") == 120000
        s.close()


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_an_endless_header_is_refused(base):
    """h11 stops at 16 KiB by itself; httptools kept reading (127 MB of RSS in 9 s). Refused past 64 KiB."""
    with _Running(base, ConnectionLimits()) as srv:
        s = srv.client()
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(64):
                s.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, how = _read_all(s, 5)
        assert how in ("eof", "reset") and (data == b"" or data.split(b" ")[1] in (b"400", b"431")), data[:80]
        s.close()


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_header_names_are_spelled_as_llama_server_spells_them(base):
    """Each response's header names, and only those, are respelled: on pipelined requests, after a
    ``100 Continue``, and never in a body that looks like a header block."""
    with _Running(base, ConnectionLimits()) as srv:
        s = srv.client()
        s.sendall(b"GET /head HTTP/1.1\r\nHost: x\r\n\r\nGET /head HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n"
                  b"Connection: close\r\n\r\n")
        time.sleep(0.3)
        s.sendall(b"abc")
        data, how = _read_all(s, 5)
        assert how == "eof", data
        body = b"HTTP/1.1 200 OK\r\nx-body-header: 1\r\n\r\n"
        assert data.count(b"\r\nAccess-Control-Allow-Origin: *\r\n") == 2 and data.count(body) == 2
        assert data.count(b"\r\nX-Request-Id: a:b\r\n") == 2 and b"access-control" not in data
        last = data.rsplit(b"HTTP/1.1 200 OK\r\n", 1)[1]
        assert b"\r\nContent-Length: 1\r\n" in b"\r\n" + last and last.endswith(b"\r\n\r\n3")
