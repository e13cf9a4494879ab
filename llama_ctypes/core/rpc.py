"""llama.cpp's RPC backend: workers on other hosts as devices, and the worker itself.

A worker (``llama-ctypes rpc-server``, :func:`start_server`) offers its devices over TCP
through ggml's own server loop. A process that loads a model with
``rpc_servers=["host:port", ...]`` registers those workers' devices with ggml (once per
endpoint per process) and hands llama.cpp an explicit device list for that model: its
RPC devices, in the order given, then the local GPUs. ``tensor_split`` indexes that
list; the layers not offloaded (``n_gpu_layers``) stay on the local CPU.

ggml aborts the process (``GGML_ABORT``) when it cannot connect to a worker, when the
handshake fails, and when a worker dies while a call is in flight. The first two are
checked here before ggml is asked to connect: an unreachable or busy endpoint raises
:class:`~llama_ctypes.RPCConnectionError` naming the endpoint and the timeout. The
third cannot be caught without patching ggml: a worker that dies while a model uses it
takes the client process down (docs/scaling.md).

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


def _check(endpoint: str, timeout: float) -> None:
    probe(endpoint, timeout, handshake=_in_use[endpoint] == 0)


def _register(lib: NativeLibrary, endpoint: str, timeout: float) -> tuple[int, ...]:
    """Probe, then register (once) the worker's devices; their pointers. Caller holds registry_lock."""
    add_server = _proc(lib, "ggml_backend_rpc_add_server")  # a build without RPC says so first
    _check(endpoint, timeout)
    if endpoint in _devices_of:
        return _devices_of[endpoint]
    reg = add_server(endpoint.encode())
    if not reg:
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
    llama.cpp's default, when this process registered no worker). ``release()`` (idempotent)
    ends the use, once the model (and so its connections) is freed.
    """

    def __init__(self, endpoints: tuple[str, ...], devices: list[int] | None):
        self.endpoints = endpoints
        self.devices = devices
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
        return RPCUse(endpoints, remote + _local_offload_devices(lib, split_mode))


def device_memory(lib: NativeLibrary, dev: int, endpoint: str) -> tuple[int, int] | None:
    """(free, total) bytes of an RPC device, or None when its worker cannot be reached now.

    ggml asks the worker over the network, and aborts if it cannot connect: probe first.
    """
    try:
        with registry_lock:
            _check(endpoint, CONNECT_TIMEOUT_S)
    except RPCConnectionError as exc:
        logger.warning("%s", exc)
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


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
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "RPCUse",
    "WorkerConfig",
    "add_rpc_servers",
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
