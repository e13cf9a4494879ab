"""VocabContext: the llama.cpp context of a model loaded with ``vocab_only=True``.

llama.cpp makes a context over a weightless model on purpose (no backends, no KV memory, no
graph): it carries the context's parameters and nothing to run. llama-cpp-python's ``Llama``
keeps one for a tokenizer-only model, and code written for it reads it. Here it is a separate
class, not a :class:`~llama_ctypes.Context`, so that no decode, memory or state call can ever
reach a context without memory (llama.cpp would dereference the missing memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ContextCreationError, InvalidArgumentError
from .backend import clear_native_error, native_error
from .handle import NativeHandle
from .params import ContextParams

if TYPE_CHECKING:
    from .model import Model


class VocabContext(NativeHandle):
    """A context over a ``vocab_only`` model: its sizes, and nothing to decode.

    ``n_ctx`` (tokens) is the requested size as llama.cpp rounds it (up to a multiple of 256), or the
    model's training context for 0 (a ContextCreationError where the vocabulary file names none). Keeps its
    Model alive; ``close()`` is idempotent. Tokenize with ``model.tokenize`` / ``ctx.model.vocab``.
    """

    _kind = "VocabContext"

    def __init__(self, model: "Model", params: ContextParams | None = None):
        super().__init__()
        self._ptr = None
        self.model = model
        self.params = params or ContextParams()
        self._lib = model._lib
        if not model.params.vocab_only:
            self._mark_dead()
            raise InvalidArgumentError(f"{model.path.name} has weights: make a Context for it, not a VocabContext")
        model._acquire()
        try:
            native = self.params.to_native()
            clear_native_error()
            ptr = self._lib.llama_init_from_model(model._ptr, native)
            if not ptr:
                raise ContextCreationError(f"could not create a context over the vocabulary of {model.path.name}: "
                                           f"{native_error('options llama.cpp refused')}")
        except BaseException:
            self._mark_dead()
            model._release()
            raise
        self._ptr = ptr
        self.n_ctx = int(self._lib.llama_n_ctx(ptr))
        self.n_batch = int(self._lib.llama_n_batch(ptr))
        self.n_ubatch = int(self._lib.llama_n_ubatch(ptr))
        self.n_seq_max = int(self._lib.llama_n_seq_max(ptr))

    def _free(self) -> None:
        if self._ptr:
            self._lib.llama_free(self._ptr)
            self._ptr = None
        self.model._release()

    def __repr__(self) -> str:
        return f"<VocabContext n_ctx={self.n_ctx} {'closed' if self._closed else 'open'}>"
