"""``llama_cpp.llama_cpp``: llama-cpp-python's raw ctypes bindings are not carried over."""

raise ImportError("llama_ctypes.compat does not provide llama_cpp.llama_cpp (llama-cpp-python's raw ctypes "
                  "bindings); use llama_ctypes' own API (llama_ctypes.Model, Context, ...) for low-level work; "
                  "see docs/compat.md")
