"""Exception hierarchy: every error raised by llama_ctypes derives from LlamaError.

Where a built-in exception says it better, the error also derives from it
(``ModelLoadError`` is not a ``FileNotFoundError``, but a missing file raises
the built-in one; ``ContextOverflowError`` is a ``ValueError``), so callers can
catch either the specific class, the library base, or the usual built-in.
"""

from __future__ import annotations


class LlamaError(Exception):
    """Base class of every llama_ctypes error."""


class NativeLibraryError(LlamaError, OSError):
    """The native llama.cpp libraries could not be found, loaded or trusted."""


class LayoutMismatchError(NativeLibraryError):
    """A ctypes struct mirror does not match the native library's layout."""


class RPCError(LlamaError, OSError):
    """llama.cpp's RPC backend failed: a worker cannot listen, or cannot be reached (also an ``OSError``)."""


class RPCConnectionError(RPCError, ConnectionError):
    """An RPC worker cannot be reached, does not answer in time, speaks another protocol version, or was lost.

    ``endpoint`` is the worker's ``"host:port"``. Raised before ggml is asked to connect (ggml
    aborts the process on a failed connection), so the process stays usable; and by the call
    that finds a worker lost while a model used it (the model and its contexts then refuse
    further use; the process goes on; docs/scaling.md).
    """

    def __init__(self, message: str, *, endpoint: str = ""):
        super().__init__(message)
        self.endpoint = endpoint

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, {"endpoint": self.endpoint}))


class ModelLoadError(LlamaError):
    """llama.cpp refused to load a model file (corrupt, truncated, unsupported)."""


class ContextCreationError(LlamaError):
    """llama.cpp could not create a context (out of memory, bad parameters)."""


class ContextOverflowError(LlamaError, ValueError):
    """A prompt (plus what must be generated) does not fit in the context window."""

    def __init__(self, message: str, *, n_tokens: int = 0, n_ctx: int = 0):
        super().__init__(message)
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


class DecodeError(LlamaError):
    """llama_decode/llama_encode failed; ``code`` is llama.cpp's return value."""

    def __init__(self, message: str, *, code: int = 0):
        super().__init__(message)
        self.code = code


class KVPoolFullError(DecodeError):
    """A server's slots share one KV pool (``share_kv``) and it filled up: the request that arrived
    last was stopped so that the others could go on (llama-server stops them all)."""


class TokenizationError(LlamaError, ValueError):
    """Text could not be tokenized or tokens could not be detokenized."""


class MediaError(LlamaError, ValueError):
    """An image or audio input cannot be used: unreadable, an unsupported format, corrupt, or a kind
    (image, audio) the model's projector does not take, or the model has no projector at all."""


class MediaTooLargeError(MediaError):
    """An image or audio input over a limit (bytes, pixels, seconds, media per prompt): ``MediaLimits``."""


class GrammarError(LlamaError, ValueError):
    """A GBNF grammar was rejected by llama.cpp."""


class SchemaError(LlamaError, ValueError):
    """A JSON schema is invalid or uses a feature that cannot be converted to a grammar."""


class SchemaTooLargeError(SchemaError):
    """A JSON schema (or a request's tool schemas together) exceeds a size bound (``SchemaLimits``), checked
    before it is compiled."""


class ClosedError(LlamaError, RuntimeError):
    """An operation was attempted on a closed Model, Context or Sampler."""


class BusyError(LlamaError, RuntimeError):
    """A Context is already in use by another thread."""


class CancelledError(LlamaError):
    """A request was cancelled before it finished."""


class InvalidArgumentError(LlamaError, ValueError):
    """An argument or option has a value the call cannot accept (also a ``ValueError``)."""


class ArgumentTypeError(LlamaError, TypeError):
    """An argument has the wrong type, or an unknown option was passed (also a ``TypeError``)."""


class IndexOutOfRangeError(LlamaError, IndexError):
    """An index (a batch row, an output row) is outside what exists (also an ``IndexError``)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist, or is not a file (also a ``FileNotFoundError``)."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def _pool_words(device) -> tuple[str, str]:
    """Where a pool is ("on GPU 3") and whose budget it is ("GPU 3's"), for messages."""
    if device == "total":
        return "in total", "the combined"
    if device == "ram":
        return "in RAM", "the RAM"
    if isinstance(device, tuple) and len(device) == 2 and device[0] == "gpu":
        return f"on GPU {device[1]}", f"GPU {device[1]}'s"
    return f"on {device!r}", f"{device!r}'s"


class InsufficientMemoryError(LlamaError, MemoryError):
    """A model does not fit in what is left of a memory budget (also a ``MemoryError``).

    ``device`` names the pool that does not fit: ``"total"`` (the combined budget),
    ``"ram"``, or ``("gpu", i)`` with ``i`` the GPU index (``Device.gpu_index``).
    ``required`` and ``available`` are bytes; ``available`` is the budget left after
    the models already resident, never negative. Raised before anything is allocated.
    """

    def __init__(self, message: str | None = None, *, device, required: int, available: int,
                 model_id: str | None = None):
        if message is None:
            where, whose = _pool_words(device)
            who = f"model {model_id!r}" if model_id is not None else "the model"
            message = (f"{who} needs {_gib(required)} {where} but only {_gib(available)} "
                       f"of {whose} budget is left")
        super().__init__(message)
        self.device = device
        self.required = required
        self.available = available
        self.model_id = model_id

    def __reduce__(self):
        # Keyword-only attributes: the default reduce would call cls(message) and fail to unpickle.
        return (_rebuild, (type(self), self.args, {"device": self.device, "required": self.required,
                                                   "available": self.available, "model_id": self.model_id}))


class AlreadyLoadedError(LlamaError, ValueError):
    """A model id is already taken (loaded or loading) in a model manager (also a ``ValueError``)."""

    def __init__(self, message: str | None = None, *, model_id: str):
        if message is None:
            message = f"model id {model_id!r} is already in use (loaded or loading); unload it first or pick another id"
        super().__init__(message)
        self.model_id = model_id

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, {"model_id": self.model_id}))


def _rebuild(cls, args, kwargs):
    return cls(*args, **kwargs)
