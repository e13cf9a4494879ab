"""The RPC backend's functions, found through ggml's backend registry (a linked backend or a module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import NativeLibraryError
from ...native import ggml_rpc_h as R

if TYPE_CHECKING:
    from ...native import NativeLibrary

__all__ = ["NO_RPC", "rpc_reg", "proc"]

NO_RPC = (
    "this build of the llama.cpp libraries has no RPC backend (GGML_RPC). A source build "
    "(`pip install .`, `python build_scripts/build_llama.py`) has it unless LLAMA_CMAKE_ARGS turns "
    "it off; with the prebuilt wheels, install the plugin: pip install 'llama_ctypes[rpc]' "
    "(llama-ctypes-rpc)"
)


def rpc_reg(lib: NativeLibrary) -> int:
    reg = lib.ggml_backend_reg_by_name(R.RPC_REG_NAME)
    if not reg:
        raise NativeLibraryError(NO_RPC)
    return reg


def proc(lib: NativeLibrary, name: str):
    """An RPC backend function, through ggml's registry (works for a linked backend and a module)."""
    address = lib.ggml_backend_reg_get_proc_address(rpc_reg(lib), name.encode())
    if not address:
        raise NativeLibraryError(f"the RPC backend in {lib.directory} does not export {name}")
    return R.PROC_PROTOTYPES[name](address)
