"""llama-cpp-python's high-level API on llama_ctypes (see :mod:`llama_ctypes.interfaces.compat`)."""

from .interfaces.compat import *  # noqa: F401,F403
from .interfaces.compat import __all__, install_as_llama_cpp  # noqa: F401
