"""Native layer: library loading and ctypes prototypes mirroring the C headers.

One module per header (``llama_h``, ``ggml_h``, ``ggml_rpc_h``, ``adapter_h``), plus the
loader and the struct-layout check. No inference logic lives here.
"""

from .loader import LIB_DIR_ENV, NativeLibrary, load, search_dirs

__all__ = ["LIB_DIR_ENV", "NativeLibrary", "load", "search_dirs"]
