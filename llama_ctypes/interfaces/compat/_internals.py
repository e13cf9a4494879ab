"""``llama_cpp._internals``: llama-cpp-python's internal wrappers are not carried over. The module
imports (so that code importing it for one optional use still loads); each name raises."""


def __getattr__(name: str):
    raise AttributeError(f"llama_ctypes.compat does not provide llama_cpp._internals.{name} (llama-cpp-python's "
                         "internal wrappers); use llama_ctypes' own API (llama_ctypes.Model, Context, Sampler) for "
                         "low-level work; see docs/compat.md")
