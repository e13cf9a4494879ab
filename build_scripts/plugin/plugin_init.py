"""A llama_ctypes backend plugin: one of ggml's backends as a loadable module.

llama_ctypes finds this package through its ``llama_ctypes.backends`` entry point
and calls :func:`backend_libraries` once, at ``init()``. Nothing to configure:
install the plugin beside the same version of llama_ctypes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = json.loads((HERE / "plugin.json").read_text())
logger = logging.getLogger(__name__)

# Preloaded runtime libraries stay referenced for the life of the process.
_preloaded: list[ctypes.CDLL] = []


def _runtime_candidates(rel_dir: str, name: str) -> list[Path]:
    """Where a runtime library from NVIDIA's wheels sits: <site-packages>/<rel_dir>/<name>."""
    top, _, sub = rel_dir.partition("/")
    spec = importlib.util.find_spec(top)
    roots = list(spec.submodule_search_locations or []) if spec else []
    return [Path(root) / sub / name for root in roots]


def _preload_runtime() -> None:
    """Load the backend's runtime libraries (cudart, cuBLAS) from their wheels, globally.

    The backend module then resolves them by soname, without LD_LIBRARY_PATH or a
    system CUDA install. A library not found here is left to the system loader.
    """
    for rel_dir, name in CONFIG["runtime"]:
        for path in _runtime_candidates(rel_dir, name):
            if path.is_file():
                _preloaded.append(ctypes.CDLL(str(path), mode=getattr(os, "RTLD_GLOBAL", 0)))
                break
        else:
            logger.debug("%s not found in the installed wheels; relying on the system loader", name)


def backend_libraries() -> list[str]:
    """The backend module files to hand to ggml, after their runtime is loadable."""
    if not _preloaded:
        _preload_runtime()
    return [str(HERE / "lib" / name) for name in CONFIG["modules"]]
