"""An RPC worker in this process: ggml's server loop offering local devices over TCP (``llama-ctypes rpc-server``)."""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InvalidArgumentError, NativeLibraryError, RPCError
from ...native import ggml_h
from ..backend import init
from .endpoints import DEFAULT_HOST, DEFAULT_PORT
from .procs import proc

if TYPE_CHECKING:
    from ...native import NativeLibrary

logger = logging.getLogger("llama_ctypes.core.rpc")

__all__ = ["WorkerConfig", "default_cache_dir", "default_threads", "start_server"]

_LOCAL_HOSTS = ("127.0.0.1", "localhost")


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


def worker_devices(lib: NativeLibrary, names: tuple[str, ...]) -> list[int]:
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
    serve = proc(lib, "ggml_backend_rpc_start_server")
    devs = worker_devices(lib, config.devices)
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
