"""Memory a model and its context take, per device: estimated before loading, or measured.

Both come from llama.cpp's own accounting (``llama_get_memory_breakdown``): the
estimate loads the model and a context with ``no_alloc`` (nothing is read or
allocated, as ``common/fit.cpp`` does it), so it honours every placement option
(``n_gpu_layers``, ``split_mode``, ``tensor_split``, ``main_gpu``) and context
option (``n_ctx``, ``n_seq_max``, ``type_k``/``type_v``, ...) exactly as a real
load would. Figures are bytes.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import byref
from dataclasses import dataclass
from typing import Any, Union

from ..errors import ContextCreationError, ModelLoadError
from ..native.adapter_h import lcx_device_memory
from .backend import clear_native_error, devices, init, native_error
from .gguf_file import check_gguf_file
from .params import ContextParams, ModelParams, split_options
from .rpc import client as rpc

Pool = Union[str, tuple[str, Union[int, str]]]  # "ram", ("gpu", gpu_index) or ("rpc", "host:port")


@dataclass(frozen=True)
class DeviceMemory:
    """One device's share, bytes. Host buffers (system RAM, pinned memory included) are device "host"."""

    device: str  # "host", or ggml's device name ("CPU" for its own buffers, "CUDA0", ...)
    device_index: int | None  # position in lc.devices(); None for host buffers
    gpu_index: int | None  # the tensor_split / main_gpu index; None for host and CPU
    model: int  # weights
    context: int  # KV cache, recurrent state
    compute: int  # compute buffers
    endpoint: str | None = None  # the RPC worker ("host:port") holding the device; None when local

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute

    @property
    def pool(self) -> Pool:
        """The memory this comes out of: "ram", ("gpu", gpu_index), or ("rpc", endpoint) on a worker."""
        if self.endpoint is not None:
            return ("rpc", self.endpoint)
        return ("gpu", self.gpu_index) if self.gpu_index is not None else "ram"


@dataclass(frozen=True)
class MemoryUsage:
    """A model and context's memory on every device it touches."""

    devices: tuple[DeviceMemory, ...]

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    @property
    def model(self) -> int:
        return sum(d.model for d in self.devices)

    @property
    def context(self) -> int:
        return sum(d.context for d in self.devices)

    @property
    def compute(self) -> int:
        return sum(d.compute for d in self.devices)

    def by_pool(self) -> dict[Pool, int]:
        """Bytes per pool ("ram", ("gpu", i), ("rpc", endpoint)), the unit a memory budget counts in
        (a ModelManager budgets this machine only: not the "rpc" pools)."""
        pools: dict[Pool, int] = {}
        for d in self.devices:
            pools[d.pool] = pools.get(d.pool, 0) + d.total
        return pools

    def __str__(self) -> str:
        mib = 2**20
        lines = [f"{'device':<10}{'model':>12}{'context':>12}{'compute':>12}{'total':>12}  (MiB)"]
        for d in self.devices:
            lines.append(f"{d.device:<10}{d.model / mib:>12.1f}{d.context / mib:>12.1f}"
                         f"{d.compute / mib:>12.1f}{d.total / mib:>12.1f}")
        return "\n".join(lines)


DEVICE_ROWS = 64  # more devices than any machine has; the C side reports how many it found


def usage_from_rows(rows: ctypes.Array, n: int) -> MemoryUsage:
    """Turn the adapter's per-device rows into a MemoryUsage (device names and GPU indices)."""
    lib = init()
    known = devices()
    by_ptr = {}
    for dev in known:
        ptr = lib.ggml_backend_dev_get(dev.index)
        by_ptr[ptr] = dev
    out = []
    for row in rows[:n]:
        dev = by_ptr.get(row.dev) if row.dev else None
        out.append(DeviceMemory(
            device=dev.name if dev else "host",
            device_index=dev.index if dev else None,
            gpu_index=dev.gpu_index if dev else None,
            model=int(row.model), context=int(row.context), compute=int(row.compute),
            endpoint=dev.endpoint if dev else None,
        ))
    return MemoryUsage(tuple(out))


def estimate_memory(path: str | os.PathLike, **opts: Any) -> MemoryUsage:
    """What loading ``path`` with these options would take, per device, without loading it.

    Options are those of ``load_model`` (:class:`ModelParams`) and of a context
    (:class:`ContextParams`: ``n_ctx``, ``n_seq_max``, ``type_k``, ...). A missing
    file raises ``FileNotFoundError``; a model or context llama.cpp refuses raises
    :class:`ModelLoadError` / :class:`ContextCreationError`.
    """
    model_opts, ctx_opts = split_options(opts, ModelParams, ContextParams, where="estimate_memory: unknown")
    mparams, cparams = ModelParams(**model_opts), ContextParams(**ctx_opts)
    path = check_gguf_file(path)
    lib = init()
    workers = rpc.use(lib, mparams.rpc_servers, mparams.split_mode)
    try:
        native_m, keep_alive = mparams.to_native(lib, workers.devices)
        native_c = cparams.to_native()
        rows = (lcx_device_memory * DEVICE_ROWS)()
        clear_native_error()
        n = lib.lcx_estimate_memory(os.fsencode(path), byref(native_m), byref(native_c), rows, DEVICE_ROWS)
        del keep_alive
        lost = workers.watch.attach()  # a worker lost meanwhile answered nothing: no estimate
        if lost is not None:
            raise lost
    finally:
        workers.release()
    if n == -1:
        raise ModelLoadError(f"could not load {path}: {native_error('refused by llama.cpp')}")
    if n == -2:
        raise ContextCreationError(f"could not create a context for {path}: {native_error('refused by llama.cpp')}")
    if n < 0:
        raise ModelLoadError(f"estimating {path} failed: {native_error('an exception in llama.cpp')}")
    return usage_from_rows(rows, min(n, DEVICE_ROWS))


# Inside a container the cgroup limit, not the host's RAM, is what the OOM killer enforces.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def detect_system_memory() -> int | None:
    """Physical memory in bytes (``sysconf``), lowered to the cgroup memory limit where one applies.

    None where the platform cannot say (no ``os.sysconf``, e.g. Windows).
    """
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    if pages <= 0 or page_size <= 0:  # sysconf answers -1 when the value is indeterminate
        return None
    memory = pages * page_size
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        # "max" (v2) and v1's huge "no limit" value are not limits.
        if text.isdigit() and 0 < int(text) < memory:
            memory = int(text)
    return memory
