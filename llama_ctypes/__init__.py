"""llama_ctypes: local LLM inference over llama.cpp, from pure Python."""
from ._version import __version__
