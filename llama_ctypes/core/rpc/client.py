"""Using RPC workers from this process: register their devices, build a model's device list, release them."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

from ...native import ggml_h
from ...native import ggml_rpc_h as R
from ..backend import devices as list_devices
from ..backend import init, registry_lock
from .endpoints import CONNECT_TIMEOUT_S, parse_endpoints
from .registration import devices_of, in_use, register
from .watch import ConnectionWatch, connection_api

if TYPE_CHECKING:
    from ...native import NativeLibrary
    from ..backend import Device

__all__ = ["rpc_available", "connection_errors_supported", "registered_endpoints", "add_rpc_servers", "RPCUse", "use"]


def rpc_available() -> bool:
    """Whether these libraries have ggml's RPC backend (``rpc_servers=`` and the worker need it)."""
    return bool(init().ggml_backend_reg_by_name(R.RPC_REG_NAME))


def connection_errors_supported() -> bool:
    """Whether a worker lost while in use raises RPCConnectionError here (else ggml aborts the process).

    True for libraries built by this package (with ``build_scripts/patches``); False for a
    llama.cpp tree the patch does not apply to, and without RPC.
    """
    return connection_api(init()) is not None


def registered_endpoints() -> tuple[str, ...]:
    """The endpoints whose devices this process registered, in registration order."""
    with registry_lock:
        return tuple(devices_of)


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
        pointers = [dev for e in wanted for dev in register(lib, e, timeout)]
    rows = {lib.ggml_backend_dev_get(d.index): d for d in list_devices()}
    return [rows[p] for p in pointers if p in rows]


def local_offload_devices(lib: NativeLibrary, split_mode: str) -> list[int]:
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
                in_use[e] -= 1
                if in_use[e] <= 0:
                    del in_use[e]


def use(lib: NativeLibrary, rpc_servers: Sequence[str] | None, split_mode: str,
        timeout: float = CONNECT_TIMEOUT_S) -> RPCUse:
    """Prepare a model load: probe and register ``rpc_servers`` and build its device list.

    Every worker is checked (a handshake, or just the connection while this process is
    connected to it) before llama.cpp is asked to connect; a failure raises
    RPCConnectionError before anything is registered for the failing endpoint.
    """
    endpoints = tuple(rpc_servers or ())
    with registry_lock:
        if not endpoints and not devices_of:
            return RPCUse((), None)  # no worker in this process: llama.cpp's default devices
        remote = [dev for e in endpoints for dev in register(lib, e, timeout)]
        for e in endpoints:
            in_use[e] += 1
        return RPCUse(endpoints, remote + local_offload_devices(lib, split_mode), ConnectionWatch(lib, endpoints))
