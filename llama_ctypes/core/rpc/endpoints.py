"""RPC endpoints ("host:port"): validation and a probe that connects (and shakes hands) without ggml.

A leaf: nothing here touches the native libraries.
"""

from __future__ import annotations

import socket
import struct
from collections import Counter
from typing import Iterable

from ...errors import InvalidArgumentError, RPCConnectionError
from ...native import ggml_rpc_h as R

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "CONNECT_TIMEOUT_S", "parse_endpoint", "parse_endpoints", "split_endpoint",
           "probe"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
CONNECT_TIMEOUT_S = 3.0
"""Seconds to wait for a worker to accept a connection and answer the handshake."""

def parse_endpoint(value: object) -> str:
    """Validate ``"host:port"`` and return it normalized (``port`` without leading zeros).

    The host is an IPv4 address or a host name (ggml resolves names with
    ``gethostbyname``: IPv4 only); the port is 1..65535. Raises InvalidArgumentError.
    """
    if not isinstance(value, str):
        raise InvalidArgumentError(f"RPC endpoint {value!r}: expected a 'host:port' string")
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or ":" in host or any(c.isspace() for c in host):
        raise InvalidArgumentError(
            f"RPC endpoint {value!r}: expected 'host:port' with an IPv4 address or host name "
            "(ggml's RPC client does not take IPv6 addresses)"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"RPC endpoint {value!r}: the port must be 1..65535")
    return f"{host}:{int(port)}"


def parse_endpoints(values: Iterable[str] | str) -> tuple[str, ...]:
    """A list of endpoints (or one comma-separated string), validated, in order, without duplicates."""
    if isinstance(values, str):
        values = [v for v in values.split(",") if v.strip()]
    out = tuple(parse_endpoint(v) for v in values)
    dupes = sorted(e for e, n in Counter(out).items() if n > 1)
    if dupes:
        raise InvalidArgumentError(f"rpc_servers lists {', '.join(dupes)} more than once")
    return out


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of a normalized endpoint."""
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the connection was closed during the handshake")
        data += chunk
    return data


def probe(endpoint: str, timeout: float = CONNECT_TIMEOUT_S, *, handshake: bool = True) -> None:
    """Check that an RPC worker at ``endpoint`` ("host:port") is there; raise RPCConnectionError if not.

    Connects over IPv4 (as ggml does) within ``timeout`` seconds; with ``handshake``
    also sends the protocol's HELLO and checks the worker's version, within the same
    timeout. A worker serves one client at a time: one busy with another client accepts
    the connection but does not answer the handshake, which then times out.
    """
    endpoint = parse_endpoint(endpoint)
    host, port = split_endpoint(endpoint)
    what = "connect and handshake" if handshake else "connect"
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(infos[0][4])
            if not handshake:
                return
            sock.sendall(struct.pack("<BQ", R.RPC_CMD_HELLO, R.HELLO_REQUEST_SIZE) + bytes(R.HELLO_REQUEST_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != R.HELLO_RESPONSE_SIZE:
                raise RPCConnectionError(
                    f"{endpoint} is not a ggml RPC worker of protocol v{R.RPC_PROTO_MAJOR_VERSION} "
                    f"(handshake answer of {size} bytes)", endpoint=endpoint)
            major, minor, patch = _recv_exact(sock, size)[:3]
    except RPCConnectionError:
        raise
    except TimeoutError:
        busy = " (a worker serves one client at a time: is another process using it?)" if handshake else ""
        raise RPCConnectionError(
            f"RPC worker {endpoint} did not {what} within the {timeout:g} s timeout{busy}", endpoint=endpoint
        ) from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise RPCConnectionError(
            f"cannot reach RPC worker {endpoint}: {reason} (timeout {timeout:g} s); is "
            f"`llama-ctypes rpc-server --host {host} --port {port}` running there?", endpoint=endpoint
        ) from None
    if major != R.RPC_PROTO_MAJOR_VERSION or minor > R.RPC_PROTO_MINOR_VERSION:
        raise RPCConnectionError(
            f"RPC worker {endpoint} speaks protocol v{major}.{minor}.{patch}; this build needs "
            f"v{R.RPC_PROTO_MAJOR_VERSION}.x up to v{R.RPC_PROTO_MAJOR_VERSION}.{R.RPC_PROTO_MINOR_VERSION} "
            "(run the same llama_ctypes / llama.cpp version on both sides)", endpoint=endpoint)
