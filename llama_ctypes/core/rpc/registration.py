"""Which workers this process registered with ggml and how many loads use each (the state ``client`` and
``core.backend`` share). Every function here expects the caller to hold ``core.backend.registry_lock``:
this module does not import the backend, which calls :func:`device_memory` while listing devices.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from typing import TYPE_CHECKING

from ...errors import RPCConnectionError
from .endpoints import CONNECT_TIMEOUT_S, probe
from .procs import proc
from .watch import connection_api, lost

if TYPE_CHECKING:
    from ...native import NativeLibrary

logger = logging.getLogger("llama_ctypes.core.rpc")

__all__ = ["devices_of", "in_use", "check_endpoint", "register", "device_memory"]

# Guarded by registry_lock: registered endpoints -> their device pointers (ggml's own cache
# is keyed by the same normalized string), and how many loads/models of this process use
# each endpoint now. While one does, this process holds a connection to the worker, which
# serves one client at a time: a handshake probe would wait behind it, so only the TCP
# connection is checked then.
devices_of: dict[str, tuple[int, ...]] = {}
in_use: Counter[str] = Counter()


def check_endpoint(lib: NativeLibrary, endpoint: str, timeout: float) -> None:
    """Probe ``endpoint`` before ggml uses it. Caller holds registry_lock.

    While this process holds a live connection to the worker, only the TCP connection is
    probed (the worker serves one client: us), and the connection itself is exercised with
    a cheap command: one whose worker died or was restarted while it sat idle fails now
    (the models holding it learn it at their next use) instead of during the load. A failed
    connection is then dropped, so that ggml connects again (those holding it keep it, failed).
    """
    api = connection_api(lib)
    if api is not None and in_use[endpoint]:
        api.exercise(endpoint)
    failed = api is not None and api.current_failed(endpoint)
    probe(endpoint, timeout, handshake=in_use[endpoint] == 0 or failed)
    if failed:
        api.reset(endpoint)


def register(lib: NativeLibrary, endpoint: str, timeout: float) -> tuple[int, ...]:
    """Probe, then register (once) the worker's devices; their pointers. Caller holds registry_lock."""
    add_server = proc(lib, "ggml_backend_rpc_add_server")  # a build without RPC says so first
    check_endpoint(lib, endpoint, timeout)
    if endpoint in devices_of:
        return devices_of[endpoint]
    api = connection_api(lib)
    before = api.last_failure(endpoint)[0] if api is not None else 0
    reg = add_server(endpoint.encode())
    if not reg:
        if api is not None and api.last_failure(endpoint)[0] != before:
            raise lost(endpoint, api.last_failure(endpoint)[1], "while asking for its devices")
        raise RPCConnectionError(f"RPC worker {endpoint} offers no device", endpoint=endpoint)
    lib.ggml_backend_register(reg)
    devs = tuple(lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg)))
    devices_of[endpoint] = devs
    logger.info("RPC worker %s: %d device(s) registered", endpoint, len(devs))
    return devs


def device_memory(lib: NativeLibrary, dev: int, endpoint: str) -> tuple[int, int] | None:
    """(free, total) bytes of an RPC device, or None when its worker cannot be reached now.

    ggml asks the worker over the network (and, unpatched, aborts if it cannot connect): probe first.
    Caller holds registry_lock (``core.backend.devices`` does, while it lists the devices).
    """
    try:
        check_endpoint(lib, endpoint, CONNECT_TIMEOUT_S)
    except RPCConnectionError as exc:
        logger.warning("%s", exc)
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)
