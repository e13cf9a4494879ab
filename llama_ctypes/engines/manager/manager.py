"""ModelManager: several resident models routed by id, within a memory budget.

Each model runs in one of two modes: ``server`` (a batching :class:`Server`,
the default for generative models) or ``direct`` (calls on the :class:`Model`,
the default for embedding and reranking models, whose calls make their own
contexts). Routing methods (``generate``, ``chat``, ``embed``, ...) take the id,
or ``"default"``.

Concurrency: the registry lock guards only dictionary updates, never a load.
Loading runs in a worker thread (Hub download, memory estimate, native load),
so ``list()``, ``info()``, ``unload()`` and routing to other models proceed
meanwhile; ``load()`` waits for its own result (``wait=False`` returns a
``concurrent.futures.Future``). The budget check and the reservation of a
model's memory happen together under one lock before the native load, so
concurrent loads always see each other's memory. Every method may be called
from any thread.

Unloading is deterministic: the server is closed (requests in flight end with
``ServerClosedError``), then the model; a caller still holding the
:class:`Model` gets ``ClosedError`` from it, never a dangling pointer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Iterator, Literal, Mapping, Sequence

from ...core.backend import devices
from ...core.generation import generate as _generate, stream as _stream
from ...core.handle import Closeable
from ...core.memory import MemoryUsage, estimate_memory
from ...core.model import Model, load_model
from ...core.params import ContextParams, ModelParams, split_options
from ...errors import AlreadyLoadedError, ArgumentTypeError, ClosedError, InvalidArgumentError, LlamaError
from ...features import chat as _chat
from ...features import embeddings as _emb
from ...features import hub
from ..server.server import Server
from .budget import Footprint, MemoryBudget, Pool

logger = logging.getLogger(__name__)

Mode = Literal["server", "direct"]
Status = Literal["loading", "ready", "failed"]
Capability = Literal["generate", "chat", "embed", "rerank"]

_SERVER_OPTIONS = ("n_parallel", "n_ctx", "n_batch", "batch_strategy", "max_queue", "cache_prompt",
                   "prompt_cache_ram_mb", "kv_unified")
# The context embed()/rerank() create (features/embeddings.py), for the memory estimate.
_DIRECT_CONTEXT = {"n_ctx": 2048, "n_batch": 2048, "n_ubatch": 2048, "n_seq_max": _emb.MAX_SEQUENCES,
                   "kv_unified": True, "embeddings": True, "flash_attn": "disabled"}


class ModelNotReadyError(LlamaError, RuntimeError):
    """The model id exists but failed to load (``info(id).error`` says why)."""


@dataclass(frozen=True)
class ModelInfo:
    """A sanitised view of one managed model (no native handles). Memory figures are bytes per pool."""

    id: str
    source: str  # a path, "hub:<repo>/<file>", or "model:<path>" for a Model handed in
    status: Status
    mode: Mode | None
    capabilities: tuple[Capability, ...]
    placement: tuple[str, ...]  # devices holding part of it ("CPU", "CUDA0", ...)
    estimated: Mapping[Pool, int]  # llama.cpp's dry-run figures, what the budget counts
    actual: Mapping[Pool, int] | None  # measured after loading (None while loading, or direct mode)
    default: bool
    error: str | None = None  # why a failed load failed


@dataclass
class _Entry:
    id: str
    source: str
    status: Status = "loading"
    mode: Mode | None = None
    capabilities: tuple[Capability, ...] = ()
    estimate: MemoryUsage | None = None
    reserved: Footprint = field(default_factory=Footprint)
    actual: MemoryUsage | None = None
    model: Model | None = None
    server: Server | None = None
    owns_model: bool = True
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _capabilities(model: Model) -> tuple[Capability, ...]:
    raw = model.meta(f"{model.architecture}.pooling_type")
    pooling = _emb.model_pooling(model) if raw is not None else None
    if pooling == "rank":
        return ("rerank",)
    if pooling is not None or (model.has_encoder and not model.has_decoder):
        return ("embed",)
    # A generative model embeds too (mean pooling over its last hidden states, in its own context).
    return ("generate", "chat", "embed")


class ModelManager(Closeable):
    """Several resident models, routed by id, within a memory budget.

    Args:
        memory_budget: None (no limit, default), bytes (one pool over all devices),
            ``"auto"`` (80 % of RAM, each GPU's free memory now), or
            ``{"ram": ..., "vram": [b0, b1, ...] | {gpu_index: bytes}}`` with per-pool
            ``"auto"``/None. Over-budget loads raise :class:`InsufficientMemoryError`.
        models: loaded at construction, each a dict of :meth:`load` arguments
            (``{"id": "chat", "source": "model.gguf", "n_ctx": 8192}``).
        workers: loads that may run at once (default 2).
    """

    def __init__(self, memory_budget: Any = None, models: Iterable[Mapping[str, Any]] = (), *, workers: int = 2):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise InvalidArgumentError(f"workers={workers!r}: expected an integer >= 1")
        self._devices = devices()
        self.budget = MemoryBudget.parse(memory_budget).resolve(self._devices)
        self._lock = threading.Lock()  # the registry and the default id
        self._budget_lock = threading.Lock()  # a budget check and its reservation, together
        self._entries: dict[str, _Entry] = {}
        self._default: str | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="llama_ctypes-load")
        try:
            for spec in models:
                if not isinstance(spec, Mapping) or "id" not in spec or "source" not in spec:
                    raise ArgumentTypeError(f"models: expected dicts with 'id' and 'source', got {spec!r}")
                self.load(**spec)
        except BaseException:
            self.close()
            raise

    # ---- loading -------------------------------------------------------------------------------
    def load(self, id: str, source: Any, *, mode: Mode | None = None, default: bool = False,
             wait: bool = True, **opts: Any) -> ModelInfo | Future:
        """Load ``source`` as ``id``; returns its :class:`ModelInfo` (or, with ``wait=False``, a Future of it).

        source: a GGUF path, ``("hub", repo, file)``, or a loaded :class:`Model` (the
        manager then uses it but does not close it). Options: model options
        (``n_gpu_layers``, ``tensor_split``, ...), context options (``type_k``, ...), and
        in server mode the :class:`Server` settings (``n_parallel``, ``n_ctx``, ...).
        Raises AlreadyLoadedError for an id in use, InsufficientMemoryError over budget.
        """
        if not isinstance(id, str) or not id or id == "default":
            raise InvalidArgumentError(f"id={id!r}: expected a non-empty string other than 'default'")
        if mode not in (None, "server", "direct"):
            raise InvalidArgumentError(f"mode={mode!r}: expected 'server', 'direct' or None (by capability)")
        server_opts = {k: opts.pop(k) for k in _SERVER_OPTIONS if k in opts}
        model_opts, ctx_opts, defaults = self._split(opts)
        described = self._describe_source(source)
        if isinstance(source, Model) and model_opts:
            raise ArgumentTypeError(f"model options {sorted(model_opts)} need a path (the model is already loaded)")
        entry = _Entry(id=id, source=described, owns_model=not isinstance(source, Model))
        with self._lock:
            self._check_open()
            old = self._entries.get(id)
            if old is not None and old.status != "failed":
                raise AlreadyLoadedError(f"a model with id {id!r} is already {old.status}", model_id=id)
            self._entries[id] = entry
            if default or self._default is None:
                self._default = id
        future = self._executor.submit(self._load, entry, source, mode, server_opts, model_opts, ctx_opts, defaults)
        return future.result() if wait else future

    @staticmethod
    def _split(opts: dict[str, Any]) -> tuple[dict, dict, dict]:
        from ...core.generation import GenerationParams
        from ...core.sampler import SamplingParams

        model_opts, ctx_opts, sampling_opts, gen_opts = split_options(
            opts, ModelParams, ContextParams, SamplingParams, GenerationParams, where="ModelManager.load: unknown")
        ModelParams(**model_opts)
        ContextParams(**ctx_opts)
        return model_opts, ctx_opts, {**sampling_opts, **gen_opts}

    @staticmethod
    def _describe_source(source: Any) -> str:
        if isinstance(source, Model):
            return f"model:{source.path}"
        if isinstance(source, (str, os.PathLike)):
            return str(Path(source))
        if isinstance(source, tuple) and len(source) == 3 and source[0] == "hub":
            _, repo, filename = source
            hub.validate_repo(repo)
            hub.validate_filename(filename)
            return f"hub:{repo}/{filename}"
        raise ArgumentTypeError(f"source={source!r}: expected a path, ('hub', repo, file) or a Model")

    def _load(self, entry: _Entry, source: Any, mode: Mode | None, server_opts: dict, model_opts: dict,
              ctx_opts: dict, defaults: dict) -> ModelInfo:
        model = None
        try:
            if isinstance(source, Model):
                model, path = source, source.path
                model_opts = {}
            elif isinstance(source, tuple):
                path = hub.download(source[1], source[2])
            else:
                path = Path(source)
            # The estimate needs the capabilities (they decide the mode): read them cheaply first.
            if model is None:
                with load_model(path, vocab_only=True) as probe:
                    caps = _capabilities(probe)
            else:
                caps = _capabilities(model)
            chosen: Mode = mode or ("direct" if "generate" not in caps else "server")
            if chosen == "server" and "generate" not in caps:
                raise InvalidArgumentError(f"model {entry.id!r} ({', '.join(caps)}) cannot run in server mode")
            est_ctx = (Server.context_options(**{k: v for k, v in server_opts.items() if k in
                                                 ("n_parallel", "n_ctx", "n_batch", "kv_unified")}, **ctx_opts)
                       if chosen == "server" else {**_DIRECT_CONTEXT, **ctx_opts})
            params = model.params if model is not None else ModelParams(**model_opts)
            estimate = estimate_memory(path, **_model_options(params), **est_ctx)
            required = Footprint(estimate.by_pool())
            with self._budget_lock:
                self.budget.check(required, self._used(), model_id=entry.id)
                entry.reserved = required  # counted from now on, before the native load
            entry.mode, entry.capabilities, entry.estimate = chosen, caps, estimate
            if model is None:
                model = load_model(path, **model_opts)
            if chosen == "server":
                entry.server = Server(model=model, **server_opts, **ctx_opts, **defaults)
                entry.actual = entry.server.memory
            elif defaults or server_opts:
                raise ArgumentTypeError(f"options {sorted({**defaults, **server_opts})} apply to server mode only")
            entry.model = model
            with self._lock:
                if self._entries.get(entry.id) is not entry:  # unloaded (or the manager closed) meanwhile
                    raise ClosedError(f"model {entry.id!r} was unloaded while it loaded")
                entry.status = "ready"
        except BaseException as exc:
            self._discard(entry, model)
            entry.error = exc
            with self._lock:
                if self._entries.get(entry.id) is entry:
                    entry.status = "failed"
                if self._default == entry.id:
                    self._default = next((k for k, e in self._entries.items() if e.status != "failed"), None)
            entry.done.set()
            logger.warning("loading %r from %s failed: %s", entry.id, entry.source, exc)
            raise
        entry.done.set()
        return self._info(entry)

    def _used(self) -> Footprint:
        total = Footprint()
        with self._lock:
            for e in self._entries.values():
                total = total + e.reserved
        return total

    def _discard(self, entry: _Entry, model: Model | None) -> None:
        """Free what a load made: its server, and its model unless handed in."""
        if entry.server is not None:
            entry.server.close()
            entry.server = None
        if model is not None and entry.owns_model:
            model.close()
        entry.model = None
        entry.reserved = Footprint()

    # ---- registry ------------------------------------------------------------------------------
    def unload(self, id: str) -> None:
        """Stop and free a model now (requests in flight end with ServerClosedError); KeyError if unknown."""
        with self._lock:
            entry = self._entries.pop(self._resolve_id(id), None)
            if entry is None:
                raise KeyError(id)
            if self._default == entry.id:
                self._default = next(iter(self._entries), None)
        if entry.status == "ready":
            self._discard(entry, entry.model)
        # A load still in flight sees its entry gone and frees what it made itself.

    def list(self) -> list[ModelInfo]:
        """Every managed model (loading, ready or failed), in load order."""
        with self._lock:
            entries = list(self._entries.values())
        return [self._info(e) for e in entries]

    def info(self, id: str) -> ModelInfo:
        """The view of one model; KeyError if unknown."""
        return self._info(self._entry(id, wait=False))

    def loaded(self, id: str) -> bool:
        """True when ``id`` is loaded and ready."""
        with self._lock:
            entry = self._entries.get(id if id != "default" else (self._default or ""))
        return entry is not None and entry.status == "ready"

    def set_default(self, id: str) -> None:
        """Route ``"default"`` to ``id`` (which must exist)."""
        with self._lock:
            if id not in self._entries:
                raise KeyError(id)
            self._default = id

    def used(self) -> Footprint:
        """Bytes per pool the resident (and loading) models take, as the budget counts them."""
        return self._used()

    def describe(self) -> str:
        """The budget per pool: capacity, used by the models here, left."""
        return self.budget.describe(self._used())

    @property
    def default(self) -> str | None:
        """The id ``"default"`` routes to (the first model loaded, unless set)."""
        return self._default

    def model(self, id: str = "default") -> Model:
        """The :class:`Model` behind ``id`` (closed, and raising ClosedError, once unloaded)."""
        return self._target(id, None, direct=True)

    def _resolve_id(self, id: str) -> str:
        if id == "default":
            if self._default is None:
                raise KeyError("default (no model is loaded)")
            return self._default
        return id

    def _entry(self, id: str, wait: bool) -> _Entry:
        if not isinstance(id, str):
            raise ArgumentTypeError(f"id={id!r}: expected a string")
        with self._lock:
            self._check_open()
            entry = self._entries.get(self._resolve_id(id))
        if entry is None:
            raise KeyError(id)
        if wait:
            entry.done.wait()
        return entry

    def _ready(self, id: str, capability: Capability | None) -> _Entry:
        entry = self._entry(id, wait=True)
        if entry.status != "ready":
            raise ModelNotReadyError(f"model {entry.id!r} failed to load: {entry.error}")
        if capability is not None and capability not in entry.capabilities:
            raise InvalidArgumentError(
                f"model {entry.id!r} cannot {capability}: its capabilities are {', '.join(entry.capabilities)}")
        return entry

    def _info(self, e: _Entry) -> ModelInfo:
        est = e.estimate
        return ModelInfo(
            id=e.id, source=e.source, status=e.status, mode=e.mode, capabilities=e.capabilities,
            placement=tuple(dict.fromkeys(d.device for d in est.devices if d.total)) if est else (),
            estimated=dict(est.by_pool()) if est else {},
            actual=dict(e.actual.by_pool()) if e.actual else None,
            default=(e.id == self._default), error=str(e.error) if e.error else None,
        )

    # ---- routing -------------------------------------------------------------------------------
    def _target(self, id: str, capability: Capability | None, direct: bool = False):
        """The Server (server mode) or Model to call. Once unloaded, either raises ClosedError when used."""
        entry = self._ready(id, capability)
        target = entry.model if direct or entry.mode == "direct" else entry.server
        if target is None:  # unloaded between the lookup and here
            raise ClosedError(f"model {entry.id!r} was unloaded")
        return target

    def generate(self, id: str, prompt: str, **opts: Any):
        """A completion of ``prompt`` by model ``id`` (see :func:`llama_ctypes.generate`)."""
        target = self._target(id, "generate")
        return target.generate(prompt, **opts) if isinstance(target, Server) else _generate(target, prompt, **opts)

    def stream(self, id: str, prompt: str, **opts: Any):
        """Stream a completion of ``prompt`` by model ``id`` (see :func:`llama_ctypes.stream`)."""
        target = self._target(id, "generate")
        return target.stream(prompt, **opts) if isinstance(target, Server) else _stream(target, prompt, **opts)

    def chat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        """The assistant's answer (see :func:`llama_ctypes.chat`)."""
        return _chat.chat(self._target(id, "chat"), messages, **opts)

    def stream_chat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        """Stream the assistant's answer (see :func:`llama_ctypes.stream_chat`)."""
        return _chat.stream_chat(self._target(id, "chat"), messages, **opts)

    def chat_completion(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        """An OpenAI-shaped chat completion (see :func:`llama_ctypes.chat_completion`)."""
        return _chat.chat_completion(self._target(id, "chat"), messages, **opts)

    def stream_chat_completion(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any) -> Iterator:
        """OpenAI-shaped chat completion chunks (see :func:`llama_ctypes.stream_chat_completion`)."""
        return _chat.stream_chat_completion(self._target(id, "chat"), messages, **opts)

    def embed(self, id: str, texts: str | Sequence[str], **opts: Any):
        """Embeddings (see :func:`llama_ctypes.embed`)."""
        return _emb.embed(self._target(id, "embed", direct=True), texts, **opts)

    def rerank(self, id: str, query: str, documents: Sequence[str], **opts: Any):
        """Relevance scores of documents for query (see :func:`llama_ctypes.rerank`)."""
        return _emb.rerank(self._target(id, "rerank", direct=True), query, documents, **opts)

    # async forms: the server's own async API where it has one, else a worker thread
    async def agenerate(self, id: str, prompt: str, **opts: Any):
        target = self._target(id, "generate")
        if isinstance(target, Server):
            return await target.agenerate(prompt, **opts)
        return await asyncio.to_thread(_generate, target, prompt, **opts)

    async def astream(self, id: str, prompt: str, **opts: Any) -> AsyncIterator[str]:
        target = self._target(id, "generate")
        if isinstance(target, Server):
            async for piece in target.astream(prompt, **opts):
                yield piece
        else:
            async for piece in _iterate_in_thread(_stream(target, prompt, **opts)):
                yield piece

    async def achat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        return await asyncio.to_thread(self.chat, id, messages, **opts)

    async def achat_completion(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        return await asyncio.to_thread(self.chat_completion, id, messages, **opts)

    async def astream_chat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any) -> AsyncIterator:
        async for piece in _iterate_in_thread(self.stream_chat(id, messages, **opts)):
            yield piece

    async def astream_chat_completion(self, id: str, messages: Sequence[Mapping[str, Any]],
                                      **opts: Any) -> AsyncIterator:
        async for chunk in _iterate_in_thread(self.stream_chat_completion(id, messages, **opts)):
            yield chunk

    async def aembed(self, id: str, texts: str | Sequence[str], **opts: Any):
        return await asyncio.to_thread(self.embed, id, texts, **opts)

    async def arerank(self, id: str, query: str, documents: Sequence[str], **opts: Any):
        return await asyncio.to_thread(self.rerank, id, query, documents, **opts)

    # ---- lifetime ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the ModelManager is closed")

    def close(self) -> None:
        """Unload every model (loads in flight free what they made) and stop the workers."""
        with self._lock:
            if getattr(self, "_closed", True):
                return
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._default = None
        for entry in entries:
            if entry.status == "ready":
                self._discard(entry, entry.model)
        self._executor.shutdown(wait=True)


def _model_options(params: ModelParams) -> dict[str, Any]:
    """The placement-relevant model options of params, for the memory estimate."""
    return {k: getattr(params, k) for k in ("n_gpu_layers", "split_mode", "main_gpu", "tensor_split")
            if getattr(params, k) is not None}


async def _iterate_in_thread(iterator: Any) -> AsyncIterator:
    """Drive a blocking stream from a worker thread; leaving early cancels it."""
    done = object()
    try:
        while True:
            item = await asyncio.to_thread(next, iterator, done)
            if item is done:
                return
            yield item
    finally:
        cancel = getattr(iterator, "cancel", None) or getattr(iterator, "close", None)
        if cancel is not None:
            cancel()
