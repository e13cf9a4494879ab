"""Process-wide llama.cpp state: backend init, log routing, versions and devices."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from ctypes import byref, c_size_t
from dataclasses import dataclass
from typing import Literal

from .. import native
from ..native import ggml_h
from ..errors import NativeLibraryError
from ..native.backends import LoadedBackend, load_backends

logger = logging.getLogger("llama_ctypes")
logger.addHandler(logging.NullHandler())  # quiet unless the application configures logging
native_logger = logging.getLogger("llama_ctypes.llama_cpp")

_LEVELS = {
    ggml_h.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    # llama.cpp's INFO is chatty (tensor lists, buffer sizes): DEBUG for Python.
    ggml_h.GGML_LOG_LEVEL_INFO: logging.DEBUG,
    ggml_h.GGML_LOG_LEVEL_WARN: logging.WARNING,
    ggml_h.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}


class _LogRouter:
    """Collects llama.cpp log fragments into lines and hands them to ``logging``.

    llama.cpp logs in pieces (``GGML_LOG_LEVEL_CONT`` continues the previous
    message), from any thread. The ctypes callback object is kept on this
    instance for the life of the process: if it were collected, C would call
    freed memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer = ""
        self._level = logging.DEBUG
        self.errors = threading.local()  # last error lines logged by each thread (``last``, ``recent``)
        self.callback = ggml_h.ggml_log_callback(self._on_log)

    def _on_log(self, level: int, text: bytes, _user_data) -> None:
        try:
            piece = text.decode("utf-8", errors="replace") if text else ""
            with self._lock:
                if level != ggml_h.GGML_LOG_LEVEL_CONT:
                    self._level = _LEVELS.get(level, logging.DEBUG)
                self._buffer += piece
                if "\n" not in self._buffer:
                    return
                *lines, self._buffer = self._buffer.split("\n")
                py_level = self._level
            if py_level >= logging.ERROR:
                for line in lines:
                    if line.strip():
                        self.errors.last = line.strip()
                        recent = getattr(self.errors, "recent", None)
                        if recent is None:
                            recent = self.errors.recent = []
                        recent.append(line.strip())
                        del recent[:-4]
            if native_logger.isEnabledFor(py_level):
                for line in lines:
                    if line.strip():
                        native_logger.log(py_level, "%s", line)
        except Exception:  # an exception must never propagate into C
            pass


# Reentrant so that a backend plugin calling the public API during init() gets an
# error instead of a deadlock.
_init_lock = threading.RLock()
_initializing = False
_router: _LogRouter | None = None  # set once init() has finished
# The log callback C holds from the moment it is installed, even if init() then fails:
# a collected callback would be called after it is freed.
_installed_router: _LogRouter | None = None
_backends: tuple[LoadedBackend, ...] = ()
# ggml's device registry is a plain vector: adding RPC workers' devices (core/rpc/) and
# listing devices take this lock. Reentrant: listing an RPC device probes its worker.
registry_lock = threading.RLock()


def init() -> native.NativeLibrary:
    """Load the libraries, route llama.cpp logs into ``logging`` and init backends.

    Idempotent and thread-safe; every public entry point calls it, so calling
    it yourself is only needed to pay the start-up cost early. A failure (an
    unknown ``LLAMA_CTYPES_CPU_VARIANT``, a build without a CPU backend) raises
    NativeLibraryError, and a later call tries again.
    """
    global _router, _backends, _initializing, _installed_router
    lib = native.load()
    if _router is not None:
        return lib
    with _init_lock:
        if _router is None:
            if _initializing:
                raise NativeLibraryError(
                    "llama_ctypes was used while init() loads the backends (from a backend plugin?)"
                )
            _initializing = True
            try:
                if _installed_router is None:
                    _installed_router = _LogRouter()
                    lib.llama_log_set(_installed_router.callback, None)
                _backends = tuple(load_backends(lib))
                lib.llama_backend_init()
                atexit.register(_quiet_at_exit, lib)
                _router = _installed_router
            finally:
                _initializing = False
    return lib


_mtmd_lock = threading.Lock()
_mtmd_ready = False


def init_mtmd() -> native.NativeLibrary:
    """:func:`init`, then libmtmd (images and audio) loaded once, its log routed like llama.cpp's."""
    global _mtmd_ready
    lib = init()
    if _mtmd_ready:
        return lib
    with _mtmd_lock:
        if not _mtmd_ready:
            lib.mtmd()
            lib.mtmd_helper_log_set(_installed_router.callback, None)
            atexit.register(_quiet_mtmd_at_exit, lib)
            _mtmd_ready = True
    return lib


def _quiet_mtmd_at_exit(lib: native.NativeLibrary) -> None:
    lib.mtmd_helper_log_set(ggml_h.ggml_log_callback(lib.lcx_quiet_log()), None)


def clear_native_error() -> None:
    """Forget the last llama.cpp error logged by this thread (call before a native call)."""
    if _router is not None:
        _router.errors.last = None
        _router.errors.recent = []


def native_error(default: str = "", lines: int = 1) -> str:
    """The last error line(s) llama.cpp logged in this thread (up to ``lines``, since the last
    :func:`clear_native_error`), for exception messages."""
    if _router is None:
        return default
    if lines > 1:
        recent = getattr(_router.errors, "recent", None) or []
        return f"llama.cpp: {' '.join(recent[-lines:])}" if recent else default
    last = getattr(_router.errors, "last", None)
    return f"llama.cpp: {last}" if last else default


def _quiet_at_exit(lib: native.NativeLibrary) -> None:
    # Static destructors in ggml may log after the interpreter is gone.
    lib.lcx_log_set_quiet()


def loaded_backends() -> list[LoadedBackend]:
    """The backends registered with ggml: name, device count, origin, module file, CPU variant."""
    init()
    return list(_backends)


def system_info() -> str:
    """llama.cpp's description of the CPU features, then one line per backend and where it came from."""
    lines = [init().llama_print_system_info().decode().strip()]
    for b in _backends:
        variant = f" variant {b.variant}," if b.variant else ""
        where = f" from {b.path}" if b.path else ""
        lines.append(f"backend {b.name}:{variant} {b.devices} device(s), {b.origin}{where}")
    return "\n".join(lines)


@dataclass(frozen=True)
class VersionInfo:
    """Versions of this package and of the llama.cpp build it runs on."""

    package: str
    llama_cpp: str  # llama.cpp's own version string
    llama_cpp_source: str  # which source tree was built (the pin or a custom tree)
    backend: str  # cpu | cuda | metal | vulkan
    cmake_args: tuple[str, ...]
    cpu_variant: str | None = None  # the CPU module chosen at run time (wheels); None when built in
    llama_cpp_build: str = "b0-unknown"  # llama.cpp's build tag, ``b<number>-<commit>`` as its tools print it

    @property
    def build_info(self) -> str:
        """One line for llama-server's ``build_info``: its build tag first, as llama-server writes it."""
        return f"{self.llama_cpp_build} (llama_ctypes {self.package}, llama.cpp {self.llama_cpp})"


def version_info() -> VersionInfo:
    from .._version import __version__

    lib = init()
    info = lib.build_info
    return VersionInfo(
        package=__version__,
        llama_cpp=(lib.llama_version() or b"").decode(),
        llama_cpp_source=info.get("llama_cpp_source", "unknown"),
        backend=info.get("backend", "unknown"),
        cmake_args=tuple(info.get("cmake_args", ())),
        cpu_variant=next((b.variant for b in _backends if b.variant), None),
        llama_cpp_build=lib.llama_build(),
    )


DeviceType = Literal["cpu", "gpu", "igpu", "accel", "meta"]
_DEVICE_TYPES: dict[int, DeviceType] = {
    ggml_h.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu",
    ggml_h.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
    ggml_h.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu",
    ggml_h.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
    ggml_h.GGML_BACKEND_DEVICE_TYPE_META: "meta",
}


@dataclass(frozen=True)
class Device:
    """One compute device known to ggml. Memory figures are in bytes, read when listed."""

    index: int  # position in ggml's device list
    name: str  # e.g. "CPU", "CUDA0"
    description: str
    type: DeviceType
    backend: str  # the registering backend, e.g. "CPU", "CUDA"
    memory_total: int
    memory_free: int
    # Index among local offload GPUs, the index space of tensor_split and main_gpu of a model
    # loaded without rpc_servers; None for others (the CPU, RPC devices).
    gpu_index: int | None
    # "host:port" of the worker holding an RPC device; None for local devices.
    endpoint: str | None = None


def devices() -> list[Device]:
    """List ggml's devices with their current memory (bytes).

    RPC devices (workers registered with ``rpc_servers=`` or ``add_rpc_servers``) are
    asked for their memory over the network; a worker that cannot be reached now is
    listed with 0 bytes (and a warning logged) instead of aborting the process.
    """
    lib = init()
    listed = []
    with registry_lock:
        for i in range(lib.ggml_backend_dev_count()):
            listed.append(_describe_device(lib, i))
    order = _offload_order(listed)
    return [
        dataclasses.replace(dev, gpu_index=order.index(dev.index)) if dev.index in order else dev
        for _, dev in listed
    ]


def _describe_device(lib: native.NativeLibrary, i: int) -> tuple[bytes | None, Device]:
    dev = lib.ggml_backend_dev_get(i)
    reg = lib.ggml_backend_dev_backend_reg(dev)
    backend = (lib.ggml_backend_reg_name(reg) or b"").decode() if reg else ""
    if backend == "RPC":
        # The props and memory of an RPC device come from its worker: ggml aborts when it
        # cannot connect, so the worker is probed first (core/rpc/registration.py).
        from .rpc.registration import device_memory

        endpoint = (lib.ggml_backend_dev_description(dev) or b"").decode()
        memory = device_memory(lib, dev, endpoint) or (0, 0)
        return None, Device(
            index=i, name=(lib.ggml_backend_dev_name(dev) or b"").decode(), description=endpoint,
            type=_DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "accel"), backend=backend,
            memory_total=memory[1], memory_free=memory[0], gpu_index=None, endpoint=endpoint,
        )
    props = ggml_h.ggml_backend_dev_props()
    lib.ggml_backend_dev_get_props(dev, byref(props))
    free, total = c_size_t(), c_size_t()
    lib.ggml_backend_dev_memory(dev, byref(free), byref(total))
    return props.device_id, Device(
        index=i,
        name=(props.name or b"").decode(),
        description=(props.description or b"").decode(),
        type=_DEVICE_TYPES.get(props.type, "accel"),
        backend=backend,
        memory_total=int(total.value),
        memory_free=int(free.value),
        gpu_index=None,
    )


def _offload_order(listed: list[tuple[bytes | None, Device]]) -> list[int]:
    """Local device indices in the order llama.cpp numbers offload devices (main_gpu, tensor_split).

    Mirrors llama_model_load's default device list without its RPC devices: discrete GPUs
    (one per physical device id), and integrated GPUs only when there is no discrete one.
    RPC devices get no gpu_index: once a process registers workers, each model gets an
    explicit list (its own workers' devices, then these GPUs, see core/rpc/client.py), so local
    GPUs keep the same numbers whether or not workers are registered.
    """
    gpus, igpus, seen_ids = [], [], set()
    for device_id, dev in listed:
        if dev.backend == "RPC":
            continue
        if dev.type == "gpu":
            if device_id is None or device_id not in seen_ids:
                gpus.append(dev.index)
            if device_id is not None:
                seen_ids.add(device_id)
        elif dev.type == "igpu" and (not igpus or listed[igpus[-1]][1].backend == dev.backend):
            igpus.append(dev.index)
    return gpus + (igpus if not gpus else [])
