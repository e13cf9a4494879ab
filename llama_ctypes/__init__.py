"""llama_ctypes: local LLM inference over llama.cpp, from pure Python (ctypes).

Layers, lowest first (a layer imports only those below it; tests/test_layers.py checks it):

* ``llama_ctypes.native``  library loading, ctypes prototypes (one module per C header), backend registration
* ``llama_ctypes.core``    Model, Context, Batch, Sampler, Tokenizer, generation, the generation-target protocol
* ``llama_ctypes.features``  chat, OpenAI shapes, tool calls, grammars, schemas, structured output, embeddings,
  the Hub client
* ``llama_ctypes.engines``   the continuous-batching server, speculative decoding, the model manager
* ``llama_ctypes.interfaces``  the ``llama-ctypes`` command line, the HTTP server, Ray Serve
"""

from . import telemetry
from ._version import __version__
from .core.backend import Device, LoadedBackend, VersionInfo, devices, init, loaded_backends, system_info, version_info
from .core.batch import Batch
from .core.context import Context, ContextLease
from .core.budget import ReasoningBudget
from .core.generation import Completion, GenerationParams, TextStream, Timings
from .core.logprobs import TokenLogprob
from .core.control_vector import ControlVector, load_control_vector
from .core.lora import LoraAdapter
from .core.memory import DeviceMemory, MemoryUsage, estimate_memory
from .core.model import Model, load_model
from .core.one_call import stream
from .core.media import MediaLimits
from .core.projector import MEDIA_MARKER, MediaPrompt, Projector, ProjectorParams
from .core.params import ContextParams, ModelParams
from .core.rpc.client import add_rpc_servers
from .core.sampler import Sampler, SamplingParams
from .core.target import GenerationTarget, LocalTarget
from .core.tokenizer import StreamDecoder, Tokenizer
from .core.vocab import Vocab
from .engines.manager import ModelInfo, ModelManager, ModelNotReadyError
from .engines.server import (
    AsyncServerStream,
    Balanced,
    DecodeMaximal,
    PrefillPriority,
    QueueFullError,
    Server,
    ServerClosedError,
    ServerParams,
    ServerStream,
)
from .engines.speculative import (
    MTP,
    Drafter,
    DraftModel,
    MTPDraft,
    NgramDraft,
    SpeculativeEvent,
    SpeculativeEventStream,
    SpeculativeSession,
    SpeculativeStats,
    SpeculativeStream,
)
from .errors import (
    AlreadyLoadedError,
    ArgumentTypeError,
    BusyError,
    CancelledError,
    ClosedError,
    ContextCreationError,
    ContextOverflowError,
    DecodeError,
    GrammarError,
    IndexOutOfRangeError,
    InsufficientMemoryError,
    InvalidArgumentError,
    KVPoolFullError,
    LayoutMismatchError,
    LlamaError,
    MediaError,
    MediaTooLargeError,
    ModelLoadError,
    ModelNotFoundError,
    NativeLibraryError,
    RPCConnectionError,
    RPCError,
    SchemaError,
    SchemaTooLargeError,
    TokenizationError,
)
from .features import grammar, hub, schema
from .features.chat import ChatParams, ChatReply, ChatStream, chat, stream_chat
from .features.chat_template import ChatTemplate, ChatTemplateError
from .features.embeddings import EmbeddingError, embed, rerank
from .features.hub import (
    HubError,
    HubIntegrityError,
    HubNotFoundError,
    HubOfflineError,
    HubUnauthorizedError,
    load_model_from_hub,
)
from .features.openai.chat import chat_completion, stream_chat_completion
from .features.schema import ResponseValidationError
from .features.structured import generate

__all__ = [
    "__version__",
    # backend
    "init", "system_info", "version_info", "devices", "Device", "VersionInfo", "loaded_backends", "LoadedBackend",
    "add_rpc_servers",
    # core objects
    "Model", "load_model", "LoraAdapter", "ControlVector", "load_control_vector", "estimate_memory", "MemoryUsage", "DeviceMemory", "ModelParams", "Context", "ContextLease", "ContextParams", "Batch", "Vocab",
    "Sampler", "SamplingParams", "Tokenizer", "StreamDecoder",
    # generation
    "generate", "stream", "GenerationParams", "ReasoningBudget", "Completion", "TextStream", "Timings", "TokenLogprob",
    "GenerationTarget", "LocalTarget",
    # images and audio
    "MEDIA_MARKER", "MediaLimits", "MediaPrompt", "Projector", "ProjectorParams",
    # chat
    "chat", "stream_chat", "chat_completion", "stream_chat_completion", "ChatParams", "ChatReply", "ChatStream",
    "ChatTemplate", "ChatTemplateError",
    # server
    "ModelManager", "ModelInfo", "ModelNotReadyError",
    "Server", "ServerParams", "ServerStream", "AsyncServerStream", "DecodeMaximal", "PrefillPriority", "Balanced", "QueueFullError",
    "ServerClosedError", "telemetry",
    # speculative decoding
    "SpeculativeSession", "SpeculativeStream", "SpeculativeEventStream", "SpeculativeEvent", "SpeculativeStats",
    "Drafter", "DraftModel", "NgramDraft", "MTP", "MTPDraft",
    # hub
    "hub", "load_model_from_hub", "HubError", "HubNotFoundError", "HubUnauthorizedError", "HubOfflineError",
    "HubIntegrityError",
    # embeddings
    "embed", "rerank", "EmbeddingError",
    # structured output
    "grammar", "schema", "ResponseValidationError",
    # errors
    "LlamaError", "NativeLibraryError", "LayoutMismatchError", "ModelLoadError", "ContextCreationError",
    "ContextOverflowError", "DecodeError", "KVPoolFullError", "TokenizationError", "GrammarError", "SchemaError",
    "SchemaTooLargeError", "ClosedError", "BusyError", "CancelledError", "InvalidArgumentError", "ArgumentTypeError",
    "IndexOutOfRangeError", "ModelNotFoundError", "InsufficientMemoryError", "AlreadyLoadedError",
    "RPCError", "RPCConnectionError", "MediaError", "MediaTooLargeError",
]
