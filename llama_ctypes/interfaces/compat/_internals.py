"""``llama_cpp._internals``: llama-cpp-python's internal wrappers are not carried over."""

raise ImportError("llama_ctypes.compat does not provide llama_cpp._internals (llama-cpp-python's internal "
                  "wrappers); use llama_ctypes' own API (llama_ctypes.Model, Context, ...) for low-level work; "
                  "see docs/compat.md")
