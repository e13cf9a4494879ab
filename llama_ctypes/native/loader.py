"""Find, load and check the native libraries; bind every prototype.

Search order: the folder named by ``LLAMA_CTYPES_LIB_DIR`` when set, else the
package's own ``llama_ctypes/lib``. The first folder holding the adapter
library wins; the error names every folder searched.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
import threading
from pathlib import Path

from ..errors import NativeLibraryError
from . import adapter_h, ggml_h, llama_h, mtmd_h
from .layout import check_layouts, native_layouts

logger = logging.getLogger(__name__)

LIB_DIR_ENV = "LLAMA_CTYPES_LIB_DIR"
PACKAGE_LIB_DIR = Path(__file__).resolve().parent.parent / "lib"

# Library base names; the platform adds prefix and suffix.
_ADAPTER = "llama_ctypes_adapter"
_LLAMA = "llama"
_GGML = "ggml"
_GGML_BASE = "ggml-base"
_MTMD = "mtmd"


def library_filename(name: str) -> str:
    if sys.platform == "win32":
        return f"{name}.dll"
    if sys.platform == "darwin":
        return f"lib{name}.dylib"
    return f"lib{name}.so"


def search_dirs() -> list[Path]:
    env = os.environ.get(LIB_DIR_ENV)
    return [Path(env).expanduser()] if env else [PACKAGE_LIB_DIR]


class NativeLibrary:
    """The loaded libraries, with every prototype bound as an attribute.

    ``lib.llama_decode(ctx, batch)`` calls the C function directly; attribute
    lookup is the only Python work on top of ctypes' own call overhead.
    """

    def __init__(self, directory: Path, structs_check: bool = True):
        self.directory = directory
        self.build_info: dict = {}
        info = directory / "build_info.json"
        if info.exists():
            try:
                self.build_info = json.loads(info.read_text())
            except (OSError, ValueError):
                logger.warning("unreadable %s", info)
        self._handles: dict[str, ctypes.CDLL] = {}
        for name in (_GGML_BASE, _GGML, _LLAMA, _ADAPTER):
            path = directory / library_filename(name)
            try:
                self._handles[name] = ctypes.CDLL(str(path))
            except OSError as exc:
                raise NativeLibraryError(f"cannot load {path}: {exc}") from exc
        self.missing: list[str] = []
        self._bind(llama_h.PROTOTYPES, (_LLAMA,))
        self._bind(ggml_h.PROTOTYPES, (_GGML, _GGML_BASE))
        self._bind(adapter_h.PROTOTYPES, (_ADAPTER,))
        if self.missing:
            raise NativeLibraryError(
                f"the libraries in {directory} lack {len(self.missing)} symbol(s) the prototypes declare "
                f"(built from a different llama.cpp version?): {', '.join(self.missing[:20])}"
            )
        abi = self.lcx_abi_version()
        if abi != adapter_h.ABI_VERSION:
            raise NativeLibraryError(
                f"adapter ABI {abi} in {directory}, this package expects {adapter_h.ABI_VERSION}; rebuild the libraries"
            )
        if structs_check:
            check_layouts(native_layouts(self),
                          {**llama_h.STRUCTS, **ggml_h.STRUCTS, **adapter_h.STRUCTS, **mtmd_h.STRUCTS})
        self._mtmd_lock = threading.Lock()
        self._mtmd_loaded = False

    def mtmd(self) -> "NativeLibrary":
        """Load libmtmd (images and audio) on first use and bind its prototypes onto this object.

        Separate from the other libraries so that a text-only program never maps it. Thread-safe;
        NativeLibraryError when this build has no libmtmd (or one that lacks a declared symbol).
        """
        if self._mtmd_loaded:
            return self
        with self._mtmd_lock:
            if not self._mtmd_loaded:
                path = self.directory / library_filename(_MTMD)
                try:
                    self._handles[_MTMD] = ctypes.CDLL(str(path))
                except OSError as exc:
                    raise NativeLibraryError(
                        f"images and audio need libmtmd, which this build lacks ({path}: {exc}); rebuild the "
                        "libraries from this version's sources") from exc
                missing_before = len(self.missing)
                self._bind(mtmd_h.PROTOTYPES, (_MTMD,))
                if len(self.missing) > missing_before:
                    lacking = self.missing[missing_before:]
                    del self.missing[missing_before:]
                    raise NativeLibraryError(f"{path} lacks {', '.join(lacking)} (built from another llama.cpp?)")
                self._mtmd_loaded = True
        return self

    def llama_build(self) -> str:
        """llama.cpp's build tag, as its tools print it: ``b<build number>-<commit>`` (``b0-unknown`` for a
        tree built outside git)."""
        try:  # (data symbols of llama.cpp's common library, which the adapter links)
            number = ctypes.c_int.in_dll(self._handles[_ADAPTER], "LLAMA_BUILD_NUMBER").value
            commit = ctypes.c_char_p.in_dll(self._handles[_ADAPTER], "LLAMA_COMMIT").value or b"unknown"
        except ValueError:
            return "b0-unknown"
        return f"b{number}-{commit.decode('utf-8', 'replace')}"

    def _bind(self, prototypes, libraries) -> None:
        for name, argtypes, restype in prototypes:
            for lib_name in libraries:
                try:
                    fn = getattr(self._handles[lib_name], name)
                except AttributeError:
                    continue
                fn.argtypes = argtypes
                fn.restype = restype
                setattr(self, name, fn)
                break
            else:
                self.missing.append(name)


_lock = threading.Lock()
_lib: NativeLibrary | None = None


def load() -> NativeLibrary:
    """Load the native libraries once per process (thread-safe) and return them."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            _lib = _load_first()
    return _lib


def _load_first() -> NativeLibrary:
    searched = []
    for directory in search_dirs():
        candidate = directory / library_filename(_ADAPTER)
        searched.append(str(candidate))
        if candidate.exists():
            return NativeLibrary(directory)
    hint = (
        "Build them with `pip install .` (or `python build_scripts/build_llama.py`) from a source "
        f"checkout, or point {LIB_DIR_ENV} at a folder that holds them."
    )
    raise NativeLibraryError("llama.cpp libraries not found; searched: " + ", ".join(searched) + ". " + hint)
