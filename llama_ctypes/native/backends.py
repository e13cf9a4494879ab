"""Load ggml's backend modules: the best CPU variant, and backends from plugin packages.

A run-time-dispatched build (``GGML_BACKEND_DL``, what the wheels carry) links no
backend into ``libggml``: the CPU kernels ship as one module per instruction-set
level (``libggml-cpu-x64.so`` ... ``libggml-cpu-zen4.so``) beside the other
libraries, and GPU backends come from plugin distributions (``llama-ctypes-cuda12``,
``llama-ctypes-rpc``) installed beside the base package. A single-CPU build
(``pip install .`` from source, ``-march=native``) has its backends linked in,
and only plugins are loaded on top.

Selection of the CPU variant: each variant's ``ggml_backend_score()`` says
whether this CPU runs it (0: it would fault) and how good it is; the highest
wins, as in ggml's own ``ggml_backend_load_all``. ``LLAMA_CTYPES_CPU_VARIANT=haswell``
forces one (an unknown name, or one this CPU cannot run, raises).

Plugins announce themselves through the ``llama_ctypes.backends`` entry point
group; the entry point is a function returning the paths of the backend modules
to load, after making their runtime libraries loadable (the CUDA plugin preloads
cuBLAS and cudart from NVIDIA's wheels). A plugin built for another version of
this package, or whose module cannot load (no driver, no GPU), is skipped with a
warning and the CPU path keeps working. ``LLAMA_CTYPES_NO_PLUGINS=1`` skips them all.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from ..errors import NativeLibraryError

if TYPE_CHECKING:
    from .loader import NativeLibrary

logger = logging.getLogger(__name__)

CPU_VARIANT_ENV = "LLAMA_CTYPES_CPU_VARIANT"
NO_PLUGINS_ENV = "LLAMA_CTYPES_NO_PLUGINS"
ENTRY_POINT_GROUP = "llama_ctypes.backends"

# Libraries of a build that are not backend modules.
_NOT_MODULES = ("ggml", "ggml-base", "llama", "llama-common", "llama_ctypes_adapter")
# Backends with no device until told about one (RPC: servers added at model load).
_DEVICELESS = ("RPC",)


@dataclass(frozen=True)
class LoadedBackend:
    """One backend registered with ggml, and where it came from."""

    name: str  # ggml's registry name: "CPU", "CUDA", "RPC", ...
    devices: int  # devices it found (0: loaded, but nothing to run on)
    origin: str  # "linked" (built into libggml), "package" (a module beside it) or "plugin <dist> <version>"
    path: str | None = None  # the module file; None when linked
    variant: str | None = None  # the CPU variant ("icelake"), for a CPU module


_LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")


def _stem(path: Path) -> str:
    """Library name without prefix and suffix: libggml-cpu-armv8.2_1.so -> ggml-cpu-armv8.2_1."""
    name = path.name
    for suffix in _LIBRARY_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name[3:] if name.startswith("lib") and sys.platform != "win32" else name


def _is_library(path: Path) -> bool:
    return path.is_file() and path.suffix in _LIBRARY_SUFFIXES


def cpu_variant_files(directory: Path) -> dict[str, Path]:
    """The CPU modules in directory, by variant name ("haswell" -> path).

    A run-time-dispatched build for a platform without variants has one CPU
    module, ``libggml-cpu``: its variant name is "default".
    """
    found = {}
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            stem = _stem(path)
            if _is_library(path) and stem.startswith("ggml-cpu-"):
                found[stem[len("ggml-cpu-"):]] = path
            elif _is_library(path) and stem == "ggml-cpu":
                found["default"] = path
    return found


def _other_modules(directory: Path) -> list[Path]:
    """Backend modules in directory other than the CPU ones (none in a base wheel today)."""
    return [
        path for path in sorted(directory.iterdir())
        if _is_library(path) and _stem(path).startswith("ggml-")
        and _stem(path) not in _NOT_MODULES and not _stem(path).startswith("ggml-cpu")
    ]


def is_module_build(lib: NativeLibrary) -> bool:
    """Whether the libraries were built with GGML_BACKEND_DL (backends are modules, not linked)."""
    info = lib.build_info
    if "backend_dl" in info:
        return bool(info["backend_dl"])
    if "cmake_args" in info:
        return "-DGGML_BACKEND_DL=ON" in info["cmake_args"]
    return any(name != "default" for name in cpu_variant_files(lib.directory))


# Instructions a variant is compiled with beyond what its ggml score checks: the
# sapphirerapids variant adds AVX512-FP16 (build_scripts/CMakeLists.txt), which every
# AMX CPU has, but a hypervisor may hide one and not the other.
_EXTRA_CPU_FLAGS = {"sapphirerapids": ("avx512_fp16", "avx_vnni")}


def _cpu_flags() -> set[str] | None:
    """The CPU flags Linux reports, or None where /proc/cpuinfo does not exist."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def variant_score(path: Path, extra_flags: Mapping[str, tuple[str, ...]] = _EXTRA_CPU_FLAGS) -> int:
    """ggml_backend_score() of a CPU variant module: 0 when this CPU cannot run it.

    The module is opened privately and closed again; only the chosen one is
    loaded for good through ggml.
    """
    needed = extra_flags.get(_stem(path)[len("ggml-cpu-"):], ())
    flags = _cpu_flags() if needed else None
    if flags is not None and not set(needed) <= flags:
        return 0
    try:
        handle = ctypes.CDLL(str(path), mode=getattr(os, "RTLD_LOCAL", 0))
    except OSError as exc:  # truncated, foreign or stale file: not a candidate
        logger.warning("ignoring CPU module %s: %s", path, exc)
        return 0
    try:
        fn = handle.ggml_backend_score
        fn.argtypes = []
        fn.restype = ctypes.c_int
        return int(fn())
    except AttributeError:  # no score: no requirement, as ggml reads it
        return 1
    finally:
        _close(handle)


def _close(handle: ctypes.CDLL) -> None:
    try:
        import _ctypes

        if hasattr(_ctypes, "dlclose"):
            _ctypes.dlclose(handle._handle)
        elif hasattr(_ctypes, "FreeLibrary"):
            _ctypes.FreeLibrary(handle._handle)
    except OSError:
        pass


def _register(lib: NativeLibrary, path: Path) -> int | None:
    """ggml_backend_load(path): the registry handle, or None when it refused."""
    # ggml reads the path as narrow text: UTF-8 elsewhere, the ANSI code page on Windows.
    encoded = str(path).encode("mbcs") if sys.platform == "win32" else os.fsencode(path)
    reg = lib.ggml_backend_load(encoded)
    return reg or None


def _describe(lib: NativeLibrary, reg: int, origin: str, path: Path | None, variant: str | None = None) -> LoadedBackend:
    return LoadedBackend(
        name=(lib.ggml_backend_reg_name(reg) or b"").decode(),
        devices=int(lib.ggml_backend_reg_dev_count(reg)),
        origin=origin,
        path=str(path) if path else None,
        variant=variant,
    )


def _load_cpu_variant(lib: NativeLibrary, variants: dict[str, Path]) -> LoadedBackend:
    # A build that kept the AMX kernels compiled its sapphirerapids variant as ggml does.
    extra = {} if "-DLLAMA_CTYPES_AMX=ON" in lib.build_info.get("cmake_args", ()) else _EXTRA_CPU_FLAGS
    forced = os.environ.get(CPU_VARIANT_ENV, "").strip()
    if forced:
        if forced not in variants:
            raise NativeLibraryError(
                f"{CPU_VARIANT_ENV}={forced!r}: no such CPU variant in {lib.directory}; "
                f"available: {', '.join(variants)}"
            )
        if variant_score(variants[forced], extra) == 0:
            raise NativeLibraryError(f"{CPU_VARIANT_ENV}={forced!r}: this CPU lacks that variant's instructions")
        name, path = forced, variants[forced]
    else:
        scores = {name: variant_score(path, extra) for name, path in variants.items()}
        name = max(scores, key=lambda n: scores[n])
        if scores[name] == 0:
            raise NativeLibraryError(f"no CPU variant in {lib.directory} runs on this CPU (scores {scores})")
        path = variants[name]
    reg = _register(lib, path)
    if reg is None:
        raise NativeLibraryError(f"ggml could not load the CPU backend {path} (see the llama.cpp log)")
    logger.info("CPU backend: variant %s from %s", name, path)
    return _remember(reg, _describe(lib, reg, "package", path, variant=name))


# What this process registered, by registry handle: an init() retried after a failure
# must neither register a module twice nor describe it as linked.
_registered: dict[int, LoadedBackend] = {}


def _remember(reg: int, backend: LoadedBackend) -> LoadedBackend:
    _registered[reg] = backend
    return backend


def _registry_handles(lib: NativeLibrary) -> list[int]:
    return [lib.ggml_backend_reg_get(i) for i in range(lib.ggml_backend_reg_count())]


def _plugin_entry_points() -> list:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def _load_plugin(
    lib: NativeLibrary, ep, package_version: str, seen_paths: set[str], seen_names: set[str]
) -> list[LoadedBackend]:
    try:
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else ep.name
        dist_version = dist.version if dist is not None else "?"
    except Exception as exc:  # broken metadata: skip it like any other broken plugin
        logger.warning("skipping backend entry point %s: %s: %s", getattr(ep, "name", ep), type(exc).__name__, exc)
        return []
    label = f"plugin {dist_name} {dist_version}"
    if dist is not None and dist_version != package_version:
        logger.warning(
            "skipping backend %s: it was built for llama_ctypes %s, this is %s (install matching versions)",
            label, dist_version, package_version,
        )
        return []
    try:
        provider: Callable[[], Iterable[str | os.PathLike]] = ep.load()
        paths = _module_paths(provider())
    except Exception as exc:  # a broken plugin must not take the CPU path down with it
        logger.warning("skipping backend %s: %s: %s", label, type(exc).__name__, exc)
        return []
    loaded = []
    for path in paths:
        if str(path) in seen_paths:
            continue
        seen_paths.add(str(path))
        known = set(_registry_handles(lib))
        reg = _register(lib, path)
        if reg is None:
            logger.warning(
                "backend %s: could not load %s (see the llama.cpp error above); models run on the CPU", label, path
            )
            continue
        if reg in known:  # ggml handed back a backend registered already (the same module): keep it as is
            continue
        backend = _describe(lib, reg, label, path)
        if backend.name in seen_names:
            # Two CUDA backends (cuda12 and cuda13, or a plugin over a CUDA build) would
            # show every GPU twice: llama.cpp would split a model over one GPU "twice".
            lib.ggml_backend_unload(reg)
            logger.warning("backend %s from %s is already registered; ignoring %s", backend.name, label, path)
            continue
        seen_names.add(backend.name)
        _remember(reg, backend)
        if backend.devices == 0 and backend.name not in _DEVICELESS:
            logger.warning("backend %s (%s) found no device; models run on the CPU", backend.name, label)
        else:
            logger.info("backend %s (%s): %d device(s) from %s", backend.name, label, backend.devices, path)
        loaded.append(backend)
    return loaded


def _module_paths(returned) -> list[Path]:
    """Validate what a plugin's entry point returned: absolute paths of existing files."""
    if isinstance(returned, (str, bytes, os.PathLike)):
        raise TypeError(f"expected a list of module paths, got one {type(returned).__name__}")
    paths = []
    for item in returned:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"module path {item!r} is not a str or path")
        path = Path(item)
        if not path.is_absolute() or not path.is_file():
            raise ValueError(f"module path {item!r} is not an absolute path to a file")
        paths.append(path.resolve())
    return paths


def load_backends(lib: NativeLibrary) -> list[LoadedBackend]:
    """Register every backend this process uses with ggml (call once, before llama_backend_init)."""
    from .._version import __version__

    # Backends registered before: linked into libggml, or loaded by an earlier init() that
    # then failed (described as they were, and not loaded twice).
    loaded = [_registered.get(reg) or _describe(lib, reg, "linked", None) for reg in _registry_handles(lib)]
    if is_module_build(lib):
        variants = cpu_variant_files(lib.directory)
        if variants and not any(b.variant for b in loaded):
            loaded.append(_load_cpu_variant(lib, variants))
        for path in _other_modules(lib.directory):
            if any(b.path == str(path) for b in loaded):
                continue
            reg = _register(lib, path)
            if reg is None:
                logger.warning("could not load the backend module %s (see the llama.cpp log)", path)
            else:
                loaded.append(_remember(reg, _describe(lib, reg, "package", path)))
    elif os.environ.get(CPU_VARIANT_ENV):
        logger.warning("%s is ignored: the libraries in %s have one CPU backend built in", CPU_VARIANT_ENV, lib.directory)
    if os.environ.get(NO_PLUGINS_ENV) != "1":
        seen_paths = {b.path for b in loaded if b.path}
        seen_names = {b.name for b in loaded}
        try:
            entry_points = _plugin_entry_points()
        except Exception as exc:  # unreadable installed metadata must not stop the CPU path
            logger.warning("could not list backend plugins: %s: %s", type(exc).__name__, exc)
            entry_points = []
        for ep in entry_points:
            loaded.extend(_load_plugin(lib, ep, __version__, seen_paths, seen_names))
    if not any(b.name == "CPU" for b in loaded):
        raise NativeLibraryError(f"no CPU backend in {lib.directory}: the build is incomplete")
    return loaded
