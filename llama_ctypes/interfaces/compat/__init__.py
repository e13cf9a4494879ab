"""llama-cpp-python's high-level API on llama_ctypes: ``Llama``, ``LlamaGrammar``, the ``llama_types``.

``from llama_ctypes.compat import Llama`` instead of ``from llama_cpp import Llama``; or call
:func:`install_as_llama_cpp` once, before anything imports ``llama_cpp``, so that code and frameworks
that ``import llama_cpp`` run on llama_ctypes unchanged. What is not carried over (the raw
``llama_cpp.llama_cpp`` ctypes module, ``_internals``, ...) raises ImportError/AttributeError saying
so; docs/compat.md lists it.
"""

from __future__ import annotations

import sys

from ..._version import __version__
from . import (_internals, llama_cache, llama_chat_format, llama_grammar, llama_speculative, llama_tokenizer,
               llama_types)
from .llama import (CHAT_FORMATS, Llama, LlamaState, LlamaTokenizer, LogitsProcessorList, MinTokensLogitsProcessor,
                    StoppingCriteriaList, llama_model_get_vocab, llama_token_to_piece)
from .llama_cache import BaseLlamaCache, LlamaCache, LlamaDiskCache, LlamaRAMCache
from .llama_grammar import LlamaGrammar
from .llama_types import *  # noqa: F401,F403 - llama-cpp-python exports its TypedDicts at the top too

__all__ = ["Llama", "LlamaGrammar", "LlamaState", "LogitsProcessorList", "StoppingCriteriaList",
           "MinTokensLogitsProcessor", "LlamaTokenizer", "llama_model_get_vocab", "llama_token_to_piece",
           "BaseLlamaCache", "LlamaCache", "LlamaRAMCache", "LlamaDiskCache",
           "CHAT_FORMATS", "install_as_llama_cpp", "__version__", *llama_types.__all__]

_SUBMODULES = ("llama", "llama_types", "llama_grammar", "llama_cache", "llama_chat_format", "llama_speculative",
               "llama_tokenizer", "_internals")


def install_as_llama_cpp() -> None:
    """Register this package as ``llama_cpp`` (and its modules as ``llama_cpp.llama``, ``.llama_types``,
    ``.llama_grammar``, ``.llama_cache``) in ``sys.modules``. Call it before ``llama_cpp`` is imported;
    a real llama-cpp-python already imported is left in place (RuntimeError)."""
    package = sys.modules[__name__]
    current = sys.modules.get("llama_cpp")
    if current is package:
        return
    if current is not None:
        raise RuntimeError("llama_cpp is already imported (the real llama-cpp-python?): call "
                           "install_as_llama_cpp() before anything imports it")
    sys.modules["llama_cpp"] = package
    for name in _SUBMODULES:
        sys.modules[f"llama_cpp.{name}"] = sys.modules[f"{__name__}.{name}"]


def __getattr__(name: str):
    raise AttributeError(f"llama_ctypes.compat (as llama_cpp) has no {name!r}: the low-level llama.cpp bindings of "
                         "llama-cpp-python are not carried over; see docs/compat.md")
