"""llama.cpp's RPC backend: workers on other hosts as devices, and the worker itself.

Modules, lowest first: ``endpoints`` (validation and the probe; no native calls), ``procs``
(the backend's functions), ``watch`` (connection state), ``registration`` (what this process
registered; called by ``core.backend`` while listing devices), ``client`` (using workers from
this process) and ``worker`` (serving). This file imports none of them, so that
``core.backend`` can reach ``registration`` without importing ``client``, which imports it; the old
flat names (``core.rpc.probe``, ...) still resolve, with a DeprecationWarning, on first use.

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

import importlib as _importlib
import warnings as _warnings

# The names this was one module with, before the split: still reachable as ``core.rpc.NAME`` (deprecated).
_MOVED = {"client": ("add_rpc_servers", "connection_errors_supported", "registered_endpoints", "rpc_available",
                     "RPCUse", "use"),
          "endpoints": ("CONNECT_TIMEOUT_S", "DEFAULT_HOST", "DEFAULT_PORT", "parse_endpoint", "parse_endpoints",
                        "probe"),
          "watch": ("ConnectionWatch",),
          "registration": ("device_memory",),
          "worker": ("WorkerConfig", "default_cache_dir", "default_threads", "start_server")}
_HOME = {name: module for module, names in _MOVED.items() for name in names}


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(f"llama_ctypes.core.rpc.{name} moved to llama_ctypes.core.rpc.{module}.{name}",
                   DeprecationWarning, stacklevel=2)
    # (imported on first use, by name: a static import here would make this package import client,
    # which imports core.backend, which imports registration through this package)
    return getattr(_importlib.import_module(f"{__name__}.{module}"), name)
