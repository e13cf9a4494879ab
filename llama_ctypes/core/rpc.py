"""llama.cpp's RPC backend: workers on other hosts as devices, and the worker itself.

A worker (``llama-ctypes rpc-server``, :func:`start_server`) offers its devices over TCP
through ggml's own server loop. A process that loads a model with
``rpc_servers=["host:port", ...]`` registers those workers' devices with ggml (once per
endpoint per process) and hands llama.cpp an explicit device list for that model: its
RPC devices, in the order given, then the local GPUs. ``tensor_split`` indexes that
list; the layers not offloaded (``n_gpu_layers``) stay on the local CPU.

Unpatched, ggml aborts the process (``GGML_ABORT``) when it cannot connect to a worker,
when the handshake fails, and when a worker dies while a call is in flight. The first two
are checked here before ggml is asked to connect: an unreachable or busy endpoint raises
:class:`~llama_ctypes.RPCConnectionError` naming the endpoint and the timeout. For the
third, this package builds ggml-rpc with a patch
(``build_scripts/patches/ggml-rpc-connection-errors.patch``): a connection that fails is
closed and stays failed, every later message on it completes at once without the network
(its output zeroed), and nothing aborts. :class:`ConnectionWatch` then tells a model or a
context that one of its connections failed: the decode (or load, or context creation) that
noticed it raises RPCConnectionError, and that model and its contexts refuse any further
use; the process, other models and new loads go on. Libraries built without the patch
(a ``LLAMA_CPP_DIR`` tree it does not apply to) keep ggml's abort (docs/scaling.md).

The protocol has no authentication or encryption: bind workers to 127.0.0.1 or a
private network only.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from ..errors import InvalidArgumentError, NativeLibraryError, RPCConnectionError, RPCError
from ..native import ggml_h
from ..native import ggml_rpc_h as R
from .backend import devices as list_devices
from .backend import init, registry_lock

if TYPE_CHECKING:
    from ..native import NativeLibrary
    from .backend import Device

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
CONNECT_TIMEOUT_S = 3.0
"""Seconds to wait for a worker to accept a connection and answer the handshake."""

_LOCAL_HOSTS = ("127.0.0.1", "localhost")
_NO_RPC = (
    "this build of the llama.cpp libraries has no RPC backend (GGML_RPC). A source build "
    "(`pip install .`, `python build_scripts/build_llama.py`) has it unless LLAMA_CMAKE_ARGS turns "
    "it off; with the prebuilt wheels, install the plugin: pip install 'llama_ctypes[rpc]' "
    "(llama-ctypes-rpc)"
)


# ---- endpoints ------------------------------------------------------------------------------
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


def _split(endpoint: str) -> tuple[str, int]:
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
    host, port = _split(endpoint)
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


# ---- the RPC backend in this process ------------------------------------------------------------
def _rpc_reg(lib: NativeLibrary) -> int:
    reg = lib.ggml_backend_reg_by_name(R.RPC_REG_NAME)
    if not reg:
        raise NativeLibraryError(_NO_RPC)
    return reg


def _proc(lib: NativeLibrary, name: str):
    """An RPC backend function, through ggml's registry (works for a linked backend and a module)."""
    address = lib.ggml_backend_reg_get_proc_address(_rpc_reg(lib), name.encode())
    if not address:
        raise NativeLibraryError(f"the RPC backend in {lib.directory} does not export {name}")
    return R.PROC_PROTOTYPES[name](address)


def rpc_available() -> bool:
    """Whether these libraries have ggml's RPC backend (``rpc_servers=`` and the worker need it)."""
    return bool(init().ggml_backend_reg_by_name(R.RPC_REG_NAME))


# Guarded by registry_lock: registered endpoints -> their device pointers (ggml's own cache
# is keyed by the same normalized string), and how many loads/models of this process use
# each endpoint now. While one does, this process holds a connection to the worker, which
# serves one client at a time: a handshake probe would wait behind it, so only the TCP
# connection is checked then.
_devices_of: dict[str, tuple[int, ...]] = {}
_in_use: Counter[str] = Counter()


def registered_endpoints() -> tuple[str, ...]:
    """The endpoints whose devices this process registered, in registration order."""
    with registry_lock:
        return tuple(_devices_of)


def _check(lib: NativeLibrary, endpoint: str, timeout: float) -> None:
    """Probe ``endpoint`` before ggml uses it. Caller holds registry_lock.

    While this process holds a live connection to the worker, only the TCP connection is
    probed (the worker serves one client: us), and the connection itself is exercised with
    a cheap command: one whose worker died or was restarted while it sat idle fails now
    (the models holding it learn it at their next use) instead of during the load. A failed
    connection is then dropped, so that ggml connects again (those holding it keep it, failed).
    """
    api = _connection_api(lib)
    if api is not None and _in_use[endpoint]:
        api.exercise(endpoint)
    failed = api is not None and api.current_failed(endpoint)
    probe(endpoint, timeout, handshake=_in_use[endpoint] == 0 or failed)
    if failed:
        api.reset(endpoint)


def _register(lib: NativeLibrary, endpoint: str, timeout: float) -> tuple[int, ...]:
    """Probe, then register (once) the worker's devices; their pointers. Caller holds registry_lock."""
    add_server = _proc(lib, "ggml_backend_rpc_add_server")  # a build without RPC says so first
    _check(lib, endpoint, timeout)
    if endpoint in _devices_of:
        return _devices_of[endpoint]
    api = _connection_api(lib)
    before = api.last_failure(endpoint)[0] if api is not None else 0
    reg = add_server(endpoint.encode())
    if not reg:
        if api is not None and api.last_failure(endpoint)[0] != before:
            raise _lost(endpoint, api.last_failure(endpoint)[1], "while asking for its devices")
        raise RPCConnectionError(f"RPC worker {endpoint} offers no device", endpoint=endpoint)
    lib.ggml_backend_register(reg)
    devs = tuple(lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg)))
    _devices_of[endpoint] = devs
    logger.info("RPC worker %s: %d device(s) registered", endpoint, len(devs))
    return devs


def add_rpc_servers(endpoints: Sequence[str] | str, timeout: float = CONNECT_TIMEOUT_S) -> list[Device]:
    """Register RPC workers' devices with ggml (idempotent) and return them as :class:`Device` rows.

    ``endpoints``: ``["host:port", ...]`` or ``"host:port,host:port"``. Each is probed
    first (connect and handshake within ``timeout`` seconds); an unreachable one raises
    :class:`~llama_ctypes.RPCConnectionError` and registers nothing more. Loading a model
    with ``rpc_servers=`` does this itself; call it to list the workers' memory first.
    """
    lib = init()
    wanted = parse_endpoints(endpoints)
    with registry_lock:
        pointers = [dev for e in wanted for dev in _register(lib, e, timeout)]
    rows = {lib.ggml_backend_dev_get(d.index): d for d in list_devices()}
    return [rows[p] for p in pointers if p in rows]


def _local_offload_devices(lib: NativeLibrary, split_mode: str) -> list[int]:
    """llama_model_load's default device list without RPC devices (src/llama.cpp, default selection).

    Tensor parallelism takes every non-CPU device; otherwise discrete GPUs, one per
    physical device id, and integrated GPUs only when there is no discrete one.
    """
    gpus: list[int] = []
    igpus: list[int] = []
    seen_ids: set[bytes] = set()
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        if reg and lib.ggml_backend_reg_name(reg) == R.RPC_REG_NAME:
            continue
        kind = lib.ggml_backend_dev_type(dev)
        if kind in (ggml_h.GGML_BACKEND_DEVICE_TYPE_CPU, ggml_h.GGML_BACKEND_DEVICE_TYPE_ACCEL):
            continue
        if split_mode == "tensor":
            gpus.append(dev)
        elif kind == ggml_h.GGML_BACKEND_DEVICE_TYPE_GPU:
            props = ggml_h.ggml_backend_dev_props()
            lib.ggml_backend_dev_get_props(dev, ctypes.byref(props))
            if props.device_id is None or props.device_id not in seen_ids:
                gpus.append(dev)
            if props.device_id is not None:
                seen_ids.add(props.device_id)
        elif kind == ggml_h.GGML_BACKEND_DEVICE_TYPE_IGPU:
            if not igpus or lib.ggml_backend_dev_backend_reg(igpus[-1]) == reg:
                igpus.append(dev)
    return gpus + (igpus if not gpus else [])


class RPCUse:
    """What one load (and then the loaded model) holds of the RPC workers it uses.

    ``devices`` is the explicit device list for ``llama_model_params.devices`` (None: leave
    llama.cpp's default, when this process registered no worker). ``watch`` follows the
    connections (see :class:`ConnectionWatch`: ``attach()`` once loaded). ``release()``
    (idempotent) ends the use, once the model (and so its connections) is freed.
    """

    def __init__(self, endpoints: tuple[str, ...], devices: list[int] | None,
                 watch: ConnectionWatch | None = None):
        self.endpoints = endpoints
        self.devices = devices
        self.watch = watch if watch is not None else ConnectionWatch(None, ())
        self._released = False

    def release(self) -> None:
        with registry_lock:
            if self._released:
                return
            self._released = True
            for e in self.endpoints:
                _in_use[e] -= 1
                if _in_use[e] <= 0:
                    del _in_use[e]


def use(lib: NativeLibrary, rpc_servers: Sequence[str] | None, split_mode: str,
        timeout: float = CONNECT_TIMEOUT_S) -> RPCUse:
    """Prepare a model load: probe and register ``rpc_servers`` and build its device list.

    Every worker is checked (a handshake, or just the connection while this process is
    connected to it) before llama.cpp is asked to connect; a failure raises
    RPCConnectionError before anything is registered for the failing endpoint.
    """
    endpoints = tuple(rpc_servers or ())
    with registry_lock:
        if not endpoints and not _devices_of:
            return RPCUse((), None)  # no worker in this process: llama.cpp's default devices
        remote = [dev for e in endpoints for dev in _register(lib, e, timeout)]
        for e in endpoints:
            _in_use[e] += 1
        return RPCUse(endpoints, remote + _local_offload_devices(lib, split_mode), ConnectionWatch(lib, endpoints))


def device_memory(lib: NativeLibrary, dev: int, endpoint: str) -> tuple[int, int] | None:
    """(free, total) bytes of an RPC device, or None when its worker cannot be reached now.

    ggml asks the worker over the network (and, unpatched, aborts if it cannot connect): probe first.
    """
    try:
        with registry_lock:
            _check(lib, endpoint, CONNECT_TIMEOUT_S)
    except RPCConnectionError as exc:
        logger.warning("%s", exc)
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


# ---- connection state (patched ggml-rpc) ------------------------------------------------------
class _ConnectionAPI:
    """The patch's connection-state functions (``native/ggml_rpc_h.py``)."""

    _REASON = 512

    def __init__(self, lib: NativeLibrary):
        self.connection_id = _proc(lib, "ggml_backend_rpc_connection_id")
        self.failure_count = _proc(lib, "ggml_backend_rpc_failure_count")
        self._failed = _proc(lib, "ggml_backend_rpc_connection_failed")
        self._last_failure = _proc(lib, "ggml_backend_rpc_last_failure")
        self._reset = _proc(lib, "ggml_backend_rpc_reset_connection")
        # (newer than the others: libraries built with an older version of the patch lack it)
        reg = _rpc_reg(lib)
        self._exercise = (_proc(lib, "ggml_backend_rpc_check_connection")
                          if lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_check_connection") else None)

    def failed(self, conn_id: int) -> str | None:
        """The reason connection ``conn_id`` failed, or None while it has not."""
        buf = ctypes.create_string_buffer(self._REASON)
        if not self._failed(conn_id, buf, self._REASON):
            return None
        return buf.value.decode("utf-8", "replace")

    def last_failure(self, endpoint: str) -> tuple[int, str]:
        """(id, reason) of the last connection to ``endpoint`` that failed; (0, "") if none has."""
        buf = ctypes.create_string_buffer(self._REASON)
        conn_id = int(self._last_failure(endpoint.encode(), buf, self._REASON))
        return conn_id, buf.value.decode("utf-8", "replace")

    def current_failed(self, endpoint: str) -> bool:
        """Whether the connection ggml would use for ``endpoint`` now is a failed one."""
        conn_id = int(self.connection_id(endpoint.encode()))
        return conn_id != 0 and self.failed(conn_id) is not None

    def reset(self, endpoint: str) -> bool:
        return bool(self._reset(endpoint.encode()))

    def exercise(self, endpoint: str) -> bool:
        """Send a cheap command over ``endpoint``'s open connection, if any (connects nothing).

        Returns whether that connection is a failed one now; a connection whose worker went
        away while it sat idle (nothing noticed yet) fails here. The command waits behind
        whatever the connection is doing.
        """
        if self._exercise is None:
            return self.current_failed(endpoint)
        return bool(self._exercise(endpoint.encode()))


_apis: dict[int, _ConnectionAPI | None] = {}


def _connection_api(lib: NativeLibrary | None) -> _ConnectionAPI | None:
    """The connection-state functions of these libraries; None when they lack the patch (or RPC)."""
    if lib is None:
        return None
    key = id(lib)
    if key not in _apis:
        reg = lib.ggml_backend_reg_by_name(R.RPC_REG_NAME)
        has = bool(reg) and bool(lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_failure_count"))
        _apis[key] = _ConnectionAPI(lib) if has else None
    return _apis[key]


def connection_errors_supported() -> bool:
    """Whether a worker lost while in use raises RPCConnectionError here (else ggml aborts the process).

    True for libraries built by this package (with ``build_scripts/patches``); False for a
    llama.cpp tree the patch does not apply to, and without RPC.
    """
    return _connection_api(init()) is not None


def _lost(endpoint: str, reason: str, when: str = "") -> RPCConnectionError:
    return RPCConnectionError(
        f"RPC worker {endpoint} was lost{' ' + when if when else ''}: {reason}. A model (and its "
        "contexts) that used it cannot be used any more: close it and load it again (once the worker "
        "is back); other models are not affected", endpoint=endpoint)


class ConnectionWatch:
    """The connections to RPC workers a model or a context depends on, and whether one failed.

    Made just before the native call that connects (a model load, a context creation):
    a connection to one of ``endpoints`` that fails from then on counts. ``attach()``,
    after that call, records the connections the model or context now uses and returns
    the error of one that failed meanwhile. ``failure()`` (cheap: one native call while
    no connection of the process fails) returns the error of a failed one, or that of
    ``parent`` (the model of a context), and keeps returning it. Without the patch (or
    without endpoints) it watches nothing.
    """

    __slots__ = ("endpoints", "_api", "_parent", "_baseline", "_conns", "_seen", "_error")

    def __init__(self, lib: NativeLibrary | None, endpoints: Sequence[str],
                 parent: ConnectionWatch | None = None):
        self.endpoints = tuple(endpoints)
        self._api = _connection_api(lib) if self.endpoints else None
        self._parent = parent
        self._baseline = {e: self._api.last_failure(e)[0] for e in self.endpoints} if self._api else {}
        self._conns: tuple[tuple[str, int], ...] = ()
        self._seen = -1
        self._error: RPCConnectionError | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything to watch (RPC endpoints, and a patched build)."""
        return self._api is not None or (self._parent is not None and self._parent.active)

    def child(self, lib: NativeLibrary | None) -> ConnectionWatch:
        """A watch for a context of the model this watch follows (same endpoints; this one as parent)."""
        return ConnectionWatch(lib, self.endpoints, parent=self)

    def attach(self) -> RPCConnectionError | None:
        """Record the connections in use now; the error of one that failed since this watch was made."""
        api = self._api
        if api is None:
            return self.failure()
        for e in self.endpoints:
            conn_id, reason = api.last_failure(e)
            if conn_id != self._baseline[e]:
                self._error = _lost(e, reason)
                return self._error
        self._conns = tuple((e, c) for e in self.endpoints if (c := int(api.connection_id(e.encode()))))
        return self.failure()

    def failure(self) -> RPCConnectionError | None:
        """The error of a failed connection this watch (or its parent) depends on, else None."""
        if self._error is not None:
            return self._error
        parent = self._parent
        if parent is not None and (error := parent.failure()) is not None:
            self._error = error
            return error
        api = self._api
        if api is None or not self._conns:
            return None
        count = int(api.failure_count())
        if count == self._seen:
            return None
        for endpoint, conn_id in self._conns:
            reason = api.failed(conn_id)
            if reason is not None:
                self._error = _lost(endpoint, reason)
                return self._error
        self._seen = count
        return None

    def check(self) -> None:
        """Raise the error of :meth:`failure`, if any."""
        error = self.failure()
        if error is not None:
            raise error


# ---- the worker -------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where llama.cpp's rpc-server keeps its tensor cache: ``$LLAMA_CACHE/rpc``, else the user cache dir."""
    env = os.environ.get("LLAMA_CACHE")
    if env:
        return Path(env) / "rpc"
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llama.cpp" / "rpc"


def default_threads() -> int:
    """rpc-server's default: half the hardware threads, at least 1."""
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's settings, validated (see :func:`start_server`)."""

    host: str = DEFAULT_HOST
    """IPv4 address to listen on (ggml's server takes no host names); 0.0.0.0 for every interface."""
    port: int = DEFAULT_PORT
    """TCP port, 1..65535."""
    n_threads: int | None = None
    """CPU threads of a CPU device; None = half the hardware threads."""
    cache_dir: str | None = None
    """Folder of the worker's tensor cache (large tensors are then sent once, by hash); None = no cache."""
    devices: tuple[str, ...] = ()
    """ggml device names to offer ("CUDA0", ...); empty = every GPU, else the CPU (as rpc-server)."""

    def __post_init__(self) -> None:
        try:
            ipaddress.IPv4Address(self.host)
        except ValueError:
            raise InvalidArgumentError(
                f"host={self.host!r}: ggml's RPC server listens on an IPv4 address (e.g. 127.0.0.1, 0.0.0.0)"
            ) from None
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise InvalidArgumentError(f"port={self.port!r}: expected 1..65535")
        if self.n_threads is not None and (not isinstance(self.n_threads, int) or self.n_threads < 1):
            raise InvalidArgumentError(f"n_threads={self.n_threads!r}: expected an integer >= 1 or None")
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def _worker_devices(lib: NativeLibrary, names: tuple[str, ...]) -> list[int]:
    """The devices a worker offers, chosen as llama.cpp's rpc-server chooses them."""
    if names:
        chosen = []
        for name in names:
            dev = lib.ggml_backend_dev_by_name(name.encode())
            if not dev:
                available = ", ".join(
                    (lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i)) or b"").decode()
                    for i in range(lib.ggml_backend_dev_count()))
                raise InvalidArgumentError(f"unknown device {name!r}; available: {available}")
            chosen.append(dev)
        return chosen
    every = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    accelerators = [d for d in every if lib.ggml_backend_dev_type(d) not in (
        ggml_h.GGML_BACKEND_DEVICE_TYPE_CPU, ggml_h.GGML_BACKEND_DEVICE_TYPE_ACCEL)]
    if accelerators:
        return accelerators
    cpu = [d for d in every if lib.ggml_backend_dev_type(d) == ggml_h.GGML_BACKEND_DEVICE_TYPE_CPU]
    if not cpu:
        raise NativeLibraryError("no device to offer: the build has no CPU backend")
    return cpu[:1]


def start_server(config: WorkerConfig) -> threading.Thread:
    """Start ggml's RPC server loop for ``config`` in a daemon thread and return the thread.

    Checks before ggml runs: the RPC backend is there (else NativeLibraryError), the
    devices exist (InvalidArgumentError), the address can be bound (RPCError). Logs a
    warning when listening beyond 127.0.0.1: the protocol has no authentication. The loop
    serves one client at a time and never returns; the thread ends only if ggml fails to
    start it (then the reason is on stderr). Stop it by ending the process.
    """
    lib = init()
    serve = _proc(lib, "ggml_backend_rpc_start_server")
    devs = _worker_devices(lib, config.devices)
    if config.host not in _LOCAL_HOSTS:
        logger.warning(
            "RPC worker listening on %s: the RPC protocol has no authentication or encryption; anyone who "
            "can reach this port can run code on its devices and read its memory. Use it on a private "
            "network only.", config.endpoint)
    # ggml binds with SO_REUSEADDR and reports a failure on stderr only: try it here first.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((config.host, config.port))
        except OSError as exc:
            raise RPCError(f"cannot listen on {config.endpoint}: {exc.strerror or exc}") from None
    cache = None
    if config.cache_dir is not None:
        Path(config.cache_dir).mkdir(parents=True, exist_ok=True)
        cache = os.fsencode(str(config.cache_dir))
    array = (ctypes.c_void_p * len(devs))(*devs)
    threads = config.n_threads or default_threads()
    endpoint = config.endpoint.encode()

    def run() -> None:
        # The arguments stay referenced by this frame for as long as C runs.
        serve(endpoint, cache, threads, len(devs), array)
        logger.error("the RPC server on %s stopped (see ggml's message on stderr)", config.endpoint)

    thread = threading.Thread(target=run, name=f"rpc-server {config.endpoint}", daemon=True)
    thread.start()
    return thread


__all__ = [
    "CONNECT_TIMEOUT_S",
    "ConnectionWatch",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "RPCUse",
    "WorkerConfig",
    "add_rpc_servers",
    "connection_errors_supported",
    "default_cache_dir",
    "device_memory",
    "parse_endpoint",
    "parse_endpoints",
    "probe",
    "registered_endpoints",
    "rpc_available",
    "start_server",
    "use",
]
