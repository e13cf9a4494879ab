"""ModelManager: several resident models routed by id, within a memory budget.

Each model runs in one of two modes: ``server`` (a batching :class:`Server`,
the default for generative models) or ``direct`` (calls on the :class:`Model`,
the default for embedding and reranking models, whose calls make their own
contexts). Routing methods (``generate``, ``chat``, ``embed``, ...) take the id,
or ``"default"``. A direct-mode model's contexts are sized at load (context
options and ``n_batch`` given to ``load``) and budgeted; per-call context options
are refused, since each new set would make and keep another context. A generative
model in direct mode also embeds; in server mode it does not (its embedding
context would not be budgeted): load it a second time with ``mode="direct"``.

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
:class:`Model` gets ``ClosedError`` from it, never a dangling pointer. A model
unloaded while it loads (or whose queued load's Future is cancelled) leaves the
registry at once, as if never loaded; its load stops and frees what it made, and
raises :class:`LoadCancelledError` (a ``ClosedError``) to those waiting for it.

A model that lost an RPC worker (a use raised RPCConnectionError) becomes ``failed``
with that error (``info(id).error``; ``loaded(id)`` is False, routing raises
ModelNotReadyError). It keeps its memory until it is unloaded or loaded again under
the same id, which frees it first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Iterator, Literal, Mapping, Sequence

from ...core.backend import devices
from ...core.context_pool import ContextPool
from ...core.handle import Closeable
from ...core.memory import MemoryUsage, estimate_memory
from ...core.model import Model, load_model
from ...core.params import ContextParams, ModelParams, split_options
from ...core.target import GenerationTarget, LocalTarget, iterate_in_thread
from ...errors import (
    AlreadyLoadedError,
    ArgumentTypeError,
    ClosedError,
    InvalidArgumentError,
    LlamaError,
    RPCConnectionError,
)
from ...features import chat as _chat
from ...features import embeddings as _emb
from ...features import hub
from ...features.openai import chat as _openai_chat
from ..server.params import ServerParams
from ..server.server import Server
from .budget import BudgetPool, Footprint, MemoryBudget
from .plan import Capability, LoadPlan, Mode, adapter_bytes, charge

logger = logging.getLogger(__name__)

LoadStatus = Literal["loading", "ready", "failed"]

_WORKER_PREFIX = "llama_ctypes-load"
_CONTEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(ContextParams))


class ModelNotReadyError(LlamaError, RuntimeError):
    """The model id exists but failed to load, or lost an RPC worker since (``info(id).error`` says why)."""


class LoadCancelledError(ClosedError):
    """A load stopped because its id was unloaded (or its queued Future cancelled) before it finished:
    not a failure of the model, which is simply not loaded."""


@dataclass(frozen=True)
class ModelInfo:
    """A sanitised view of one managed model (no native handles). Memory figures are bytes per pool."""

    id: str
    source: str  # a path, "hub:<repo>/<file>", or "model:<path>" for a Model handed in
    status: LoadStatus
    mode: Mode | None
    capabilities: tuple[Capability, ...]
    placement: tuple[str, ...]  # devices holding part of it ("CPU", "CUDA0", ...)
    estimated: Mapping[BudgetPool, int]  # llama.cpp's dry-run figures, what the budget counts
    actual: Mapping[BudgetPool, int] | None  # measured after loading (None while loading, or direct mode)
    default: bool
    error: str | None = None  # why a failed load failed (or the RPC worker a loaded model lost)

    def __hash__(self) -> int:  # (the memory mappings are compared by value, so hashed by value)
        return hash((self.id, self.source, self.status, self.mode, self.capabilities, self.placement,
                     tuple(sorted(self.estimated.items(), key=repr)),
                     tuple(sorted(self.actual.items(), key=repr)) if self.actual is not None else None,
                     self.default, self.error))


@dataclass
class _Entry:
    id: str
    source: str
    status: LoadStatus = "loading"
    mode: Mode | None = None
    capabilities: tuple[Capability, ...] = ()
    estimate: MemoryUsage | None = None
    reserved: Footprint = field(default_factory=Footprint)
    actual: MemoryUsage | None = None
    model: Model | None = None
    server: Server | None = None
    owns_model: bool = True
    error: BaseException | None = None
    plan: LoadPlan | None = None  # set once the load knows its capabilities
    future: Future | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _capabilities(model: Model, overrides: Mapping[str, Any] | None = None) -> tuple[Capability, ...]:
    # (the model's metadata strings do not show overrides: they are passed along)
    pooling = _emb.declared_pooling(model, overrides)
    if pooling == "rank":
        return ("rerank",)
    if pooling is not None or (model.has_encoder and not model.has_decoder):
        return ("embed",)
    # (in direct mode a generative model also embeds, in a second budgeted context: see _load)
    return ("generate", "chat")


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
        self._releasing: list[_Entry] = []  # unloaded, still being freed: still counted
        self._default: str | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=_WORKER_PREFIX)
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
             wait: bool = True, mmproj: str | os.PathLike | None = None, mmproj_params: Any = None,
             **opts: Any) -> ModelInfo | Future:
        """Load ``source`` as ``id``; returns its :class:`ModelInfo` (or, with ``wait=False``, a Future of it).

        source: a GGUF path, ``("hub", repo, file)`` (file None: chosen in the worker as llama-server's
            ``-hf repo[:quant]`` chooses, the tag after the repository's name), or a loaded :class:`Model` (the
        manager then uses it but does not close it). Options: model options
        (``n_gpu_layers``, ``tensor_split``, ...), context options (``type_k``, ...), and
        in server mode the :class:`Server` settings (``n_parallel``, ``n_ctx``, ...).
        ``mmproj``: a multimodal projector to attach (images, audio; ``"auto"`` for a Hub source: the
        repository's ``mmproj-*.gguf`` when it has one), with ``mmproj_params`` (a ProjectorParams or its
        fields as a dict); the model's capabilities then include ``"multimodal"``. Its weights (the file's
        size) count in the budget, on GPU 0 unless ``use_gpu`` is off or there is none (libmtmd's
        placement); its compute buffer does not (libmtmd has no dry run).
        Raises AlreadyLoadedError for an id in use, InsufficientMemoryError over budget.
        """
        if not isinstance(id, str) or not id or id == "default":
            raise InvalidArgumentError(f"id={id!r}: expected a non-empty string other than 'default'")
        if mode not in (None, "server", "direct"):
            raise InvalidArgumentError(f"mode={mode!r}: expected 'server', 'direct' or None (by capability)")
        server_opts, model_opts, ctx_opts, defaults = self._split(opts)
        described = self._describe_source(source)
        if isinstance(source, Model) and model_opts:
            raise ArgumentTypeError(f"model options {sorted(model_opts)} need a path (the model is already loaded)")
        if model_opts.get("vocab_only") or (isinstance(source, Model) and source.params.vocab_only):
            raise InvalidArgumentError("vocab_only models have no weights to run; load them with lc.load_model")
        if mmproj is not None and isinstance(source, Model):
            raise ArgumentTypeError("mmproj= needs a path or Hub source (attach it to your Model yourself: "
                                    "model.attach_projector)")
        if mmproj == "auto" and not isinstance(source, tuple):
            raise InvalidArgumentError('mmproj="auto" finds the projector of a Hub source; give a path')
        projector = (mmproj, _projector_params(mmproj_params)) if mmproj is not None else None
        entry = _Entry(id=id, source=described, owns_model=not isinstance(source, Model))
        with self._lock:
            self._check_open()
            old = self._entries.get(id)
            if old is not None:
                self._note_lost(old)
            if old is not None and old.status != "failed":
                raise AlreadyLoadedError(f"a model with id {id!r} is already {old.status}", model_id=id)
            self._entries[id] = entry
            stale = old if old is not None and self._holds(old) else None
            if stale is not None:  # a model that lost an RPC worker: freed first (its memory counted till then)
                self._releasing.append(stale)
            if default or self._default is None:
                self._default = id
        if stale is not None:
            self._free_released(stale)
        try:
            future = self._executor.submit(self._load, entry, source, mode, server_opts, model_opts, ctx_opts,
                                           defaults, projector)
        except RuntimeError:  # the manager closed in between
            self._abandon(entry)
            raise ClosedError("the ModelManager is closed") from None
        entry.future = future
        # (a queued load cancelled through its Future never runs: nobody else would drop its entry)
        future.add_done_callback(lambda f: self._cancelled(entry) if f.cancelled() else None)
        if not wait:
            return future
        try:
            return future.result()
        except CancelledError:  # closed before the load started
            raise ClosedError("the ModelManager was closed before this load started") from None

    @staticmethod
    def _split(opts: dict[str, Any]) -> tuple[dict, dict, dict, dict]:
        """(server, model, context, request-default) options of a load; model and context options validated."""
        from ...core.generation import GenerationParams
        from ...core.sampler import SamplingParams

        server_opts, model_opts, ctx_opts, sampling_opts, gen_opts = split_options(
            opts, ServerParams, ModelParams, ContextParams, SamplingParams, GenerationParams,
            where="ModelManager.load: unknown")
        # (the server options are validated by the Server the load makes: on failure it closes a
        # Drafter handed over with speculative=, and the entry shows the failed load)
        ModelParams(**model_opts)
        ContextParams(**ctx_opts)
        return server_opts, model_opts, ctx_opts, {**sampling_opts, **gen_opts}

    @staticmethod
    def _describe_source(source: Any) -> str:
        if isinstance(source, Model):
            return f"model:{source.path}"
        if isinstance(source, (str, os.PathLike)):
            return str(Path(source))
        if isinstance(source, tuple) and len(source) == 3 and source[0] == "hub":
            _, repo, filename = source
            if filename is None:  # (the file is chosen by its quantization tag when the load runs)
                hub.split_repo_tag(repo)
                return f"hub:{repo}"
            hub.validate_repo(repo)
            hub.validate_filename(filename)
            return f"hub:{repo}/{filename}"
        raise ArgumentTypeError(f"source={source!r}: expected a path, ('hub', repo, file) or a Model")

    def _load(self, entry: _Entry, source: Any, mode: Mode | None, server_opts: dict, model_opts: dict,
              ctx_opts: dict, defaults: dict, projector: tuple[Any, Any] | None = None) -> ModelInfo:
        model = None
        try:
            self._check_live(entry)
            if isinstance(source, Model):
                model, path = source, source.path
            elif isinstance(source, tuple):
                repo, filename = (source[1], source[2]) if source[2] is not None else hub.find_model(source[1])
                source = ("hub", repo, filename)
                path = hub.download(repo, filename)
            else:
                path = Path(source)
            # The capabilities decide the mode, and the mode what to estimate.
            if model is None:
                # (with the user's metadata overrides: they may change the pooling type)
                overrides = {"kv_overrides": model_opts["kv_overrides"]} if model_opts.get("kv_overrides") else {}
                with load_model(path, vocab_only=True, **overrides) as probe:
                    caps = _capabilities(probe, model_opts.get("kv_overrides"))
            else:
                caps = _capabilities(model, model.params.kv_overrides)
            plan = LoadPlan.make(entry.id, caps, mode, server_opts, ctx_opts, defaults)
            params = model.params if model is not None else ModelParams(**model_opts)
            # llama.cpp's dry run of every context the plan makes (a Model handed in: its contexts only)
            runs = [estimate_memory(path, **_model_options(params), **opts) for opts in plan.context_runs()]
            mmproj = projector_params = None
            if projector is not None:  # (found and fetched before the budget check: its weights count)
                mmproj, projector_params = projector
                if mmproj == "auto":
                    name = hub.find_mmproj(source[1], source[2], required=False)
                    mmproj = hub.download(source[1], name) if name is not None else None
            estimate, required = charge(runs, weights=model is None,
                                        adapters=adapter_bytes(plan.server_opts.get("loras")),
                                        projector=_file_size(mmproj) if mmproj is not None else 0,
                                        projector_pool=("gpu", 0) if self.budget.n_gpus
                                        and getattr(projector_params, "use_gpu", True) else "ram")
            with self._budget_lock:
                self._check_live(entry)
                self.budget.check(required, self._used(), model_id=entry.id)
                entry.reserved = required  # counted from now on, before the native load
            entry.plan, entry.mode, entry.capabilities, entry.estimate = plan, plan.mode, plan.capabilities, estimate
            self._check_live(entry)
            if model is None:
                model = load_model(path, **model_opts)
            entry.model = model
            if mmproj is not None:
                model.attach_projector(mmproj, projector_params)
                entry.capabilities = (*entry.capabilities, "multimodal")
            if plan.mode == "server":
                entry.server = Server(model=model, **plan.server_opts, **plan.ctx_opts, **plan.defaults)
                entry.actual = entry.server.memory
            with self._lock:
                self._check_live(entry)
                entry.status = "ready"
        except BaseException as exc:
            entry.error = exc
            try:
                self._discard(entry, model)
            finally:
                with self._lock:
                    if self._entries.get(entry.id) is entry:
                        entry.status = "failed"
                        if self._default == entry.id:
                            self._default = self._first_usable()
                    if entry in self._releasing:
                        self._releasing.remove(entry)
                entry.done.set()
            if isinstance(exc, ClosedError):  # (unloaded meanwhile, or the manager closed: not a failure)
                logger.info("loading %r stopped: %s", entry.id, exc)
            else:
                logger.warning("loading %r from %s failed: %s", entry.id, entry.source, exc)
            raise
        entry.done.set()
        return self._info(entry)

    def _check_live(self, entry: _Entry) -> None:
        """Stop a load whose id was unloaded (or whose manager closed) meanwhile."""
        if self._closed:
            raise ClosedError("the ModelManager was closed")
        if self._entries.get(entry.id) is not entry:
            raise LoadCancelledError(f"model {entry.id!r} was unloaded while it loaded")

    @staticmethod
    def _holds(entry: _Entry) -> bool:
        """Whether a ready or failed entry still holds a model or a server (a failed one: it lost an RPC worker)."""
        return entry.status != "loading" and (entry.model is not None or entry.server is not None)

    def _note_lost(self, entry: _Entry) -> None:
        """A ready model whose RPC worker was lost becomes failed, with that error. Caller holds the lock.

        (Cheap: one native call for a model over RPC workers, nothing for a local one. It frees
        nothing: that is for unload() or a new load under the id, off the caller's thread.)
        """
        model = entry.model
        if entry.status != "ready" or model is None:
            return
        try:
            model.check_workers()
        except RPCConnectionError as exc:
            entry.status = "failed"
            entry.error = exc
            logger.error("model %r is unusable: %s", entry.id, exc)

    def _free_released(self, entry: _Entry) -> None:
        """Free an entry put in ``_releasing`` (its memory stays counted until then)."""
        try:
            self._discard(entry, entry.model)
        finally:
            with self._lock:
                if entry in self._releasing:
                    self._releasing.remove(entry)

    def _first_usable(self) -> str | None:
        return next((k for k, e in self._entries.items() if e.status != "failed"), None)

    def _used(self) -> Footprint:
        """Reserved bytes per pool: resident and loading models, and those still being freed."""
        total = Footprint()
        with self._lock:
            for e in (*self._entries.values(), *self._releasing):
                total = total + e.reserved
        return total

    def _discard(self, entry: _Entry, model: Model | None) -> None:
        """Free what a load made: its server, its contexts, and its model unless handed in."""
        try:
            if entry.server is not None:
                server, entry.server = entry.server, None
                server.close()
        finally:
            entry.model = None
            if model is not None:
                if entry.owns_model:
                    model.close()
                else:
                    ContextPool.of(model).close_idle()
            entry.reserved = Footprint()

    # ---- registry ------------------------------------------------------------------------------
    def unload(self, id: str) -> None:
        """Stop and free a model now (requests in flight end with ServerClosedError); KeyError if unknown.

        Its memory stays counted until it is freed. Unloading a model that is still
        loading stops the load; the load's caller gets ClosedError.
        """
        with self._lock:
            entry = self._entries.pop(self._resolve_id(id), None)
            if entry is None:
                raise KeyError(id)
            if self._default == entry.id:
                self._default = self._first_usable()
            if entry.status == "loading":
                self._releasing.append(entry)  # its worker frees it and drops it from here
                return
            if not self._holds(entry):  # a failed load freed what it made
                return
            self._releasing.append(entry)
        self._free_released(entry)

    def list(self) -> list[ModelInfo]:
        """Every managed model (loading, ready or failed), in load order."""
        with self._lock:
            entries = list(self._entries.values())
            for e in entries:
                self._note_lost(e)
        return [self._info(e) for e in entries]

    def info(self, id: str) -> ModelInfo:
        """The view of one model; KeyError if unknown."""
        entry = self._entry(id, wait=False)
        with self._lock:
            self._note_lost(entry)
        return self._info(entry)

    def loaded(self, id: str) -> bool:
        """True when ``id`` is loaded and ready (False once it lost an RPC worker)."""
        with self._lock:
            entry = self._entries.get(id if id != "default" else (self._default or ""))
            if entry is not None:
                self._note_lost(entry)
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

    def server(self, id: str = "default") -> Server:
        """The batching :class:`Server` of a server-mode model (for its asyncio API, ``stats()``, ...).

        Raises InvalidArgumentError for a direct-mode model; once unloaded the server is closed and
        raises ServerClosedError (a ClosedError) when used.
        """
        entry = self._ready(id, None)
        if entry.mode != "server":
            raise InvalidArgumentError(f"model {entry.id!r} is loaded in direct mode; it has no Server")
        return self._target(id, None)

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
        with self._lock:
            self._note_lost(entry)
        if isinstance(entry.error, ClosedError):
            raise ClosedError(f"model {entry.id!r} was unloaded")
        if isinstance(entry.error, RPCConnectionError) and entry.status == "failed" and self._holds(entry):
            raise ModelNotReadyError(f"model {entry.id!r} cannot be used: {entry.error}") from entry.error
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

    def _direct(self, id: str, capability: Capability, opts: Mapping[str, Any],
                allowed: tuple[str, ...] = ()) -> tuple[Model, _Entry]:
        """A direct-mode call's model and options: the context options are those given at load.

        Per-call context options would make (and keep) another, unbudgeted context.
        """
        entry = self._ready(id, capability)
        model = entry.model
        if model is None:
            raise ClosedError(f"model {entry.id!r} was unloaded")
        fixed = sorted(k for k in opts if k in _CONTEXT_FIELDS or (allowed and k not in allowed))
        if fixed:
            raise ArgumentTypeError(f"options {fixed} are fixed when model {entry.id!r} is loaded "
                                    f"(they size its budgeted context)")
        return model, entry

    def _generation_target(self, id: str, capability: Capability, opts: Mapping[str, Any]) -> GenerationTarget:
        """The model's Server (server mode), or a LocalTarget on its model with the context options fixed at
        load (direct mode: per-call context options are refused)."""
        entry = self._ready(id, capability)
        if entry.mode == "server":
            return self._target(id, capability)
        model, entry = self._direct(id, capability, opts)
        return LocalTarget(model, entry.plan.call_opts)

    def generate(self, id: str, prompt: str, **opts: Any):
        """A completion of ``prompt`` by model ``id`` (see :func:`llama_ctypes.generate`)."""
        return self._generation_target(id, "generate", opts).generate(prompt, **opts)

    def stream(self, id: str, prompt: str, **opts: Any):
        """Stream a completion of ``prompt`` by model ``id`` (see :func:`llama_ctypes.stream`)."""
        return self._generation_target(id, "generate", opts).stream(prompt, **opts)

    def chat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        """The assistant's answer (see :func:`llama_ctypes.chat`)."""
        return _chat.chat(self._generation_target(id, "chat", opts), messages, **opts)

    def stream_chat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        """Stream the assistant's answer (see :func:`llama_ctypes.stream_chat`)."""
        return _chat.stream_chat(self._generation_target(id, "chat", opts), messages, **opts)

    def chat_completion(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        """An OpenAI-shaped chat completion (see :func:`llama_ctypes.chat_completion`)."""
        return _openai_chat.chat_completion(self._generation_target(id, "chat", opts), messages, **opts)

    def stream_chat_completion(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any) -> Iterator:
        """OpenAI-shaped chat completion chunks (see :func:`llama_ctypes.stream_chat_completion`)."""
        return _openai_chat.stream_chat_completion(self._generation_target(id, "chat", opts), messages, **opts)

    def embed(self, id: str, texts: str | Sequence[str], **opts: Any):
        """Embeddings (see :func:`llama_ctypes.embed`); per call only ``normalize``, ``truncate`` and ``usage``."""
        model, entry = self._direct(id, "embed", opts, allowed=("normalize", "truncate", "usage"))
        plan = entry.plan
        return _emb.embed(model, texts, n_batch=plan.embed_batch, pooling=plan.embed_pooling,
                          **plan.embed_opts, **opts)

    def rerank(self, id: str, query: str, documents: Sequence[str], **opts: Any):
        """Relevance scores of documents for query (see :func:`llama_ctypes.rerank`)."""
        model, entry = self._direct(id, "rerank", opts, allowed=("normalize", "truncate", "usage"))
        plan = entry.plan
        forced = plan.embed_pooling == "rank"  # (pooling="rank" at load: llama-server's --reranking, any model)
        return _emb.rerank(model, query, documents, n_batch=plan.embed_batch, any_model=forced, **plan.embed_opts,
                           **opts)

    # async forms: looking the model up may wait for its load, so that happens in a worker
    # thread too; a server's own async API is used where it has one.
    async def agenerate(self, id: str, prompt: str, **opts: Any):
        target = await asyncio.to_thread(self._generation_target, id, "generate", opts)
        return await target.agenerate(prompt, **opts)

    async def astream(self, id: str, prompt: str, **opts: Any) -> AsyncIterator[str]:
        target = await asyncio.to_thread(self._generation_target, id, "generate", opts)
        async for piece in target.astream(prompt, **opts):
            yield piece

    async def achat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        return await asyncio.to_thread(self.chat, id, messages, **opts)

    async def achat_completion(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any):
        return await asyncio.to_thread(self.chat_completion, id, messages, **opts)

    async def astream_chat(self, id: str, messages: Sequence[Mapping[str, Any]], **opts: Any) -> AsyncIterator:
        async for piece in iterate_in_thread(await asyncio.to_thread(self.stream_chat, id, messages, **opts)):
            yield piece

    async def astream_chat_completion(self, id: str, messages: Sequence[Mapping[str, Any]],
                                      **opts: Any) -> AsyncIterator:
        chunks = await asyncio.to_thread(self.stream_chat_completion, id, messages, **opts)
        async for chunk in iterate_in_thread(chunks):
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
        """Unload every model; loads in flight stop and free what they made; queued ones never start."""
        with self._lock:
            if getattr(self, "_closed", True):
                return
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._default = None
        for entry in entries:
            if self._holds(entry):  # ready, or failed since (it lost an RPC worker)
                self._discard(entry, entry.model)
        # From one of our own workers (a future's callback), waiting for the workers would deadlock.
        in_worker = threading.current_thread().name.startswith(_WORKER_PREFIX)
        self._executor.shutdown(wait=not in_worker, cancel_futures=True)
        with self._lock:
            entries += [e for e in self._releasing if e not in entries]  # (unloaded while loading)
        for entry in entries:
            future = entry.future
            if entry.status == "loading" and not entry.done.is_set() and (future is None or future.cancelled()):
                # A load that never started (cancelled while queued, or closed out before it was queued;
                # unloaded or not): nobody else will wake those waiting for it.
                self._abandon(entry)

    def _cancelled(self, entry: _Entry) -> None:
        """A queued load whose Future was cancelled: it leaves the registry (the id is free again) and its
        waiters get LoadCancelledError."""
        with self._lock:
            if self._entries.get(entry.id) is entry:
                del self._entries[entry.id]
                if self._default == entry.id:
                    self._default = self._first_usable()
            if entry.error is None:
                entry.error = LoadCancelledError(f"the load of model {entry.id!r} was cancelled")
        self._abandon(entry)

    def _abandon(self, entry: _Entry) -> None:
        """End a load that will never run: its waiters get ClosedError."""
        with self._lock:
            if entry.error is None:
                entry.error = ClosedError("the ModelManager was closed")
            if entry in self._releasing:
                self._releasing.remove(entry)
        entry.done.set()


def _model_options(params: ModelParams) -> dict[str, Any]:
    """params as load_model options, for the dry run (no progress callback)."""
    fields = {f.name for f in dataclasses.fields(params)} - {"progress_callback"}
    defaults = ModelParams()
    return {k: getattr(params, k) for k in fields if getattr(params, k) != getattr(defaults, k)}


def _file_size(path: Any) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # (the attach reports a missing file)


def _projector_params(params: Any) -> Any:
    """``mmproj_params`` as a ProjectorParams (validated at the call, not in the load's worker)."""
    from ...core.projector import ProjectorParams

    if params is None or isinstance(params, ProjectorParams):
        return params
    if isinstance(params, Mapping):
        return ProjectorParams(**params)
    raise ArgumentTypeError(f"mmproj_params={params!r}: expected a ProjectorParams or a dict of its fields")
