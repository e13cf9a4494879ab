"""Server: continuous batching over one model for many concurrent callers.

    with lc.Server(model_path="m.gguf", n_parallel=4) as server:
        text = server.generate("Once upon a time", max_tokens=100)
        for piece in server.stream("Tell me a story"): ...
        text = await server.agenerate("Hi")            # asyncio
        async for piece in server.astream("Hi"): ...
        async with server.asubmit("Hi", logprobs=2) as s:   # asyncio, with the request's metadata
            async for piece in s: ...
            s.finish_reason, s.tokens, s.logprobs

Every method is thread-safe. One scheduler thread owns the context and, each
tick, decodes one batch holding the next token of every running request plus
prompt chunks of new ones (see ``engine.py``). Each request has its own
sampler, seed, grammar, stop strings and limits. With ``speculative=`` (a
drafter: ``NgramDraft``, ``DraftModel``) running requests also carry drafted
tokens, verified in the same batch (see ``speculation.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from ..._version import __version__
from ...core.context import Context
from ...core.control_vector import load_control_vector
from ...core.generation import Completion, GenerationParams
from ...core.lease_media import check_media_prompt
from ...core.lora import LoraAdapter, activation_start
from ...core.model import Model, load_model
from ...core.one_call import media_prompt
from ...core.params import ContextParams, ModelParams, split_options
from ...core.prompt import check_prompt, prompt_tokens
from ...core.sampler import Sampler, SamplingParams
from ...core.text import TextAssembler
from ...errors import ArgumentTypeError, BusyError, CancelledError, InvalidArgumentError, MediaError
from ..speculative.drafters import Drafter, DraftModel, NgramDraft, rollback_snapshots
from ..speculative.mtp import MTPDraft
from .adapters import ServedAdapters
from .engine import Engine
from .params import DEFAULT_MAX_QUEUE, ServerParams, default_prompt_cache_ram_mb
from .prompt_cache_disk import DiskPromptCache, key_for
from .request import Channel, Request
from .scheduler import QueueFullError, ServerClosedError
from .speculation import SlotDrafter, slot_drafter
from .strategies import resolve
from .streams import AsyncServerStream, ServerStream

__all__ = ["Server", "SlotInfo", "ServerStream", "AsyncServerStream", "QueueFullError", "ServerClosedError",
           "ServerParams", "DEFAULT_MAX_QUEUE"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SlotInfo:
    """One slot of a :class:`Server` at one moment (``Server.slots()``); token counts."""

    id: int
    n_ctx: int  # context tokens of the slot
    speculative: bool  # the server drafts for it
    is_processing: bool  # a request runs in it
    request_id: int | None = None
    n_prompt_tokens: int = 0
    n_prompt_tokens_processed: int = 0  # prompt tokens computed (not taken from a cache)
    n_prompt_tokens_cache: int = 0  # prompt tokens reused from a cache
    n_decoded: int = 0  # tokens generated so far
    n_remaining: int = -1  # tokens the request may still generate (-1: until its end or the context's)
    n_cached: int = 0  # tokens whose KV the slot holds


_RESERVED = ("n_seq_max", "embeddings")
#: The one source of the Server's defaults (its signature and ``context_options`` read them).
_DEFAULTS = ServerParams()
_SEED_MOD = 0xFFFFFFFF  # SamplingParams seeds lie in [0, 2**32 - 1)


class Server:
    """A continuous-batching server over one model (see the module docs); a
    :class:`~llama_ctypes.GenerationTarget`, so chat, tool calls and ``response_model=`` run on it.

    Args:
        model_path: GGUF file to load (the server then owns and closes the model), or
        model: an already loaded :class:`Model` (shared; not closed by the server).
        n_parallel: requests decoded together (slots), default 4.
        n_ctx: context tokens per slot (default 4096); the context holds ``n_ctx * n_parallel``.
        n_batch: most tokens per tick (decode tokens + prompt chunks), default 512.
        batch_strategy: :class:`DecodeMaximal` (default), :class:`PrefillPriority` or :class:`Balanced`.
        max_queue: most requests waiting for a slot (default :data:`DEFAULT_MAX_QUEUE`; 0 = unbounded);
            beyond it, submitting raises :class:`QueueFullError` at once. A group (:meth:`submit_many`)
            is queued whole or not at all.
        cache_prompt: keep finished requests' KV and reuse the longest common prefix (default True;
            per-request override with ``cache_prompt=``).
        prompt_cache_ram_mb: RAM (MiB) for a second-level cache of the prefixes evicted from the slots;
            default None: llama-server's 8192, at most 1/8 of the machine's memory
            (:func:`default_prompt_cache_ram_mb`; taken only as prefixes are evicted); 0 = off.
        prompt_cache_dir: a directory where the states that go to the RAM tier (and, at close, the
            slots' own) are also written, so that a later server on the same model file and context
            settings starts with them (default None: no disk tier). Up to ``prompt_cache_disk_mb`` MiB
            (default 10240), least recently used files removed first. Not with a control vector; states
            under LoRA adapters or of prompts with media stay in RAM only. See ``docs/server.md``.
        kv_unified: one KV buffer for all slots (default True), so a prefix computed by one slot is
            adopted by another with a metadata-only copy.
        share_kv: let every slot fill the whole KV pool (``n_ctx * n_parallel`` tokens, at most the
            model's training context), as llama-server's ``--kv-unified`` (default False: each slot holds
            ``n_ctx``). When the pool is full, idle slots' cached prefixes are dropped, drafts
            skipped and requests with no output yet sent back to the queue; only then does the
            running request that arrived last fail with :class:`KVPoolFullError` (the others go on).
            Needs ``kv_unified``.
        control_vector: a :class:`ControlVector` (``lc.load_control_vector``) every request runs with, or
            ``{"files": ..., "layer_range": ...}`` to load one.
        loras: LoRA adapters to load now (:meth:`load_lora`): paths, ``(path, name)`` pairs, or
            adapters already loaded over the model. Requests choose theirs with ``lora=``; a tick
            decodes the requests of one adapter set (see ``docs/lora.md``).
        speculative: a drafter (:class:`NgramDraft`, :class:`DraftModel`, :class:`MTPDraft` (the model's
            own MTP head; load it with ``load_mtp=True``), or a stateless :class:`Drafter` of your own;
            or ``"ngram"``, ``"mtp"``, or a draft GGUF path) to draft up to ``n_draft``
            tokens (1..32, default 4) per running request and tick; the server owns it from then on
            (closes it). Drafts are verified by the
            request's own sampler in the tick's batch, so every request's output is what it would be
            without speculation. Per request, ``speculative=False`` opts out.
        **opts: model options (when loading), context options (type_k, flash_attn, ...), and default
            sampling/generation options for every request (temp, top_p, max_tokens, stop, ...).
    """

    def __init__(self, model_path: str | None = None, *, model: Model | None = None,
                 n_parallel: int = _DEFAULTS.n_parallel, n_ctx: int = _DEFAULTS.n_ctx,
                 n_batch: int = _DEFAULTS.n_batch, batch_strategy: Any = _DEFAULTS.batch_strategy,
                 max_queue: int = _DEFAULTS.max_queue, cache_prompt: bool = _DEFAULTS.cache_prompt,
                 prompt_cache_ram_mb: float | None = _DEFAULTS.prompt_cache_ram_mb,
                 prompt_cache_dir: str | os.PathLike | None = None,
                 prompt_cache_disk_mb: float = _DEFAULTS.prompt_cache_disk_mb, kv_unified: bool = _DEFAULTS.kv_unified,
                 share_kv: bool = _DEFAULTS.share_kv, speculative: Drafter | str | os.PathLike | None = None,
                 n_draft: int = _DEFAULTS.n_draft,
                 loras: Sequence[Any] = (), control_vector: Any = None, **opts: Any):
        self._drafter: SlotDrafter | None = None
        if isinstance(speculative, (DraftModel, MTPDraft)) and speculative.context is not None:
            # (before taking it over: it is someone else's, and must stay open)
            raise InvalidArgumentError("this DraftModel already serves a session or server; create one per user")
        try:
            if (model_path is None) == (model is None):
                raise ArgumentTypeError("pass exactly one of model_path or model")
            params = ServerParams(n_parallel=n_parallel, n_ctx=n_ctx, n_batch=n_batch, batch_strategy=batch_strategy,
                                  max_queue=max_queue, cache_prompt=cache_prompt,
                                  prompt_cache_ram_mb=prompt_cache_ram_mb, prompt_cache_dir=prompt_cache_dir,
                                  prompt_cache_disk_mb=prompt_cache_disk_mb, kv_unified=kv_unified,
                                  share_kv=share_kv, speculative=speculative, n_draft=n_draft,
                                  control_vector=control_vector)
            self._build(model_path, model, params, opts)
            self._served = ServedAdapters(self.model)
        except BaseException:
            if isinstance(speculative, Drafter):  # the server took it over: a failed server closes it
                speculative.close()
            raise
        if isinstance(loras, (str, os.PathLike)) or not isinstance(loras, Sequence):
            self.close()
            raise ArgumentTypeError(f"loras={loras!r}: expected a list of paths, (path, name) pairs or adapters")
        try:
            for item in loras:
                if isinstance(item, LoraAdapter):
                    self.add_lora(item)
                elif isinstance(item, tuple) and len(item) in (2, 3):
                    self.load_lora(*item)
                else:
                    self.load_lora(item)
        except BaseException:
            self.close()
            raise

    def _build(self, model_path, model, params: ServerParams, opts) -> None:
        for name in _RESERVED:
            if name in opts:
                raise ArgumentTypeError(f"the server sets {name} itself")
        n_parallel, n_ctx, n_batch, kv_unified = params.n_parallel, params.n_ctx, params.n_batch, params.kv_unified
        speculative, n_draft = params.speculative, params.n_draft
        n_out = opts.get("n_outputs_max", n_parallel)
        if isinstance(n_out, int) and not isinstance(n_out, bool) and 0 < n_out < n_parallel:
            raise InvalidArgumentError(f"n_outputs_max={n_out}: a server needs at least one logits row per slot "
                                       f"(n_parallel={n_parallel}); 0 means n_batch")
        model_opts, ctx_opts, sampling_opts, gen_opts = split_options(
            opts, ModelParams, ContextParams, SamplingParams, GenerationParams, where="Server: unknown")
        SamplingParams(**sampling_opts)  # validate the defaults now
        GenerationParams(**gen_opts)
        self._defaults = {"cache_prompt": bool(params.cache_prompt), **sampling_opts, **gen_opts}
        strategy = resolve(params.batch_strategy)
        if model is None:
            if speculative == "mtp" or isinstance(speculative, MTPDraft):
                model_opts.setdefault("load_mtp", True)  # (llama.cpp skips the MTP layers otherwise)
            model = load_model(model_path, **model_opts)
            self._owns_model = True
        else:
            if model_opts:
                raise ArgumentTypeError(f"model options {sorted(model_opts)} need model_path (the model is already loaded)")
            self._owns_model = False
        self.model = model
        ctx = lease = None
        try:
            copts = self.context_options(n_parallel, n_ctx, n_batch, kv_unified, **ctx_opts)
            if speculative is not None:
                copts = self._speculative_options(model, copts, n_parallel, n_draft, ctx_opts)
            ctx = self._ctx = Context(model, ContextParams(**copts))
            # Buffers are sized at creation: what the context holds now is what it will hold.
            self.memory = ctx.memory()
            if speculative is not None:
                n_draft = self._rollback_depth(ctx, n_draft)
                if isinstance(speculative, (str, os.PathLike)):
                    speculative = NgramDraft() if speculative == "ngram" else MTPDraft() \
                        if speculative == "mtp" else DraftModel(speculative)
                dopts = {"n_ctx": n_ctx * n_parallel, "n_batch": n_batch, "n_ubatch": min(n_batch, 512),
                         "kv_unified": kv_unified, **ctx_opts}
                self._drafter = slot_drafter(speculative, model, n_parallel, n_draft, dopts, ctx)
            lease = self._lease = ctx.lease()  # the scheduler thread is its only user from now on
            cvec = params.control_vector
            if isinstance(cvec, Mapping):
                cvec = load_control_vector(**cvec)
            if cvec is not None:
                lease.set_control_vector(cvec)  # (every request runs with it: a prefix cache stays valid)
            self.control_vector = cvec
            self.n_parallel = n_parallel
            # (shared: the whole pool, as llama-server's n_ctx_slot(), capped at the training context)
            self.n_ctx = min(ctx.n_ctx_seq, model.n_ctx_train or ctx.n_ctx_seq) if params.share_kv \
                else min(n_ctx, ctx.n_ctx_seq)
            self.n_batch = n_batch
            self.prompt_cache_ram_mb = params.prompt_cache_ram_mb if params.prompt_cache_ram_mb is not None \
                else default_prompt_cache_ram_mb()
            self.batch_strategy = strategy
            self.speculative = speculative
            self.n_draft = n_draft if speculative is not None else 0
            disk = None
            if params.prompt_cache_dir is not None:
                settings = {"context": _state_settings(ctx.params), "model": repr(model.params),
                            "version": __version__}
                disk = DiskPromptCache(params.prompt_cache_dir, int(params.prompt_cache_disk_mb * 2**20),
                                       key_for(model.path, settings))
            self._engine = Engine(lease, strategy, params.max_queue, n_ctx_seq=self.n_ctx,
                                  prompt_cache_bytes=int(self.prompt_cache_ram_mb * 2**20), prompt_cache_disk=disk,
                                  drafter=self._drafter, n_draft=self.n_draft)
        except BaseException:
            if lease is not None:
                lease.release()
            if self._drafter is not None:
                self._drafter.close()
            elif isinstance(speculative, Drafter):
                speculative.close()
            if ctx is not None:
                ctx.close()
            if self._owns_model:
                model.close()
            raise
        self._close_lock = threading.Lock()
        self._closed = False
        self._engine.thread.start()

    @staticmethod
    def context_options(n_parallel: int = _DEFAULTS.n_parallel, n_ctx: int = _DEFAULTS.n_ctx,
                        n_batch: int = _DEFAULTS.n_batch, kv_unified: bool = _DEFAULTS.kv_unified,
                        **ctx_opts: Any) -> dict[str, Any]:
        """The context options a server with these settings creates its context with.

        (For sizing it before creating it: ``lc.estimate_memory(path, **Server.context_options(...))``.)
        """
        return {
            "n_ctx": n_ctx * n_parallel, "n_batch": n_batch, "n_ubatch": min(n_batch, 512),
            "n_seq_max": n_parallel, "kv_unified": kv_unified,
            # one logits row per slot per tick (llama.cpp's default reserves n_batch rows)
            "n_outputs_max": n_parallel, **ctx_opts,
        }

    @staticmethod
    def _speculative_options(model: Model, copts: dict[str, Any], n_parallel: int, n_draft: int,
                             user: dict[str, Any]) -> dict[str, Any]:
        """Context options for verifying drafts: a logits row per drafted token, and memories that
        can drop rejected drafts."""
        if model.has_encoder:
            raise InvalidArgumentError(f"{model.path.name} is an encoder model; speculative decoding "
                                       "needs a decoder-only model")
        copts = dict(copts)
        if "n_outputs_max" not in user:
            # (never under one row per sequence: llama.cpp asserts on that)
            copts["n_outputs_max"] = max(n_parallel, min(n_parallel * (n_draft + 1), copts["n_batch"]))
        if model.is_recurrent or model.is_hybrid:
            # A snapshot per drafted token; llama.cpp keeps n_rs_seq + 1 tokens in one micro-batch.
            copts.setdefault("n_rs_seq", rollback_snapshots(n_draft, copts))
        if model.n_swa > 0:
            copts.setdefault("swa_full", True)  # a rollback must not lose window cells the prefix needs
        return copts

    @staticmethod
    def _rollback_depth(ctx: Context, n_draft: int) -> int:
        """``n_draft`` capped by the drafts a recurrent memory can drop (a server cannot recompute a slot)."""
        model = ctx.model
        if not (model.is_recurrent or model.is_hybrid):
            return n_draft
        if ctx.n_rs_seq < 1:
            raise InvalidArgumentError(
                f"{model.path.name} cannot roll its recurrent state back (llama.cpp keeps no per-token snapshots "
                "for this architecture, or n_rs_seq=0, or n_ubatch < 3): a Server cannot verify drafts on it")
        if ctx.n_rs_seq < n_draft:
            logger.info("n_draft %d capped at %d: the recurrent state keeps that many snapshots", n_draft, ctx.n_rs_seq)
        return min(n_draft, ctx.n_rs_seq)

    # ---- submission ------------------------------------------------------------------------
    def _with_media(self, prompt: Any, opts: Mapping[str, Any]) -> tuple[Any, Mapping[str, Any]]:
        """``media=`` (images, audio for a model with a projector) and a text prompt with its markers, as one
        MediaPrompt (read and prepared once, whatever the number of choices)."""
        if "media" not in opts:
            return prompt, opts
        opts = dict(opts)
        media = opts.pop("media")
        if media is None:
            return prompt, opts
        gen_opts = {k: v for k, v in {**self._defaults, **opts}.items() if k in ("add_special", "parse_special")}
        return media_prompt(self.model, prompt, media, GenerationParams(**gen_opts)), opts

    def _request(self, prompt: str | Sequence[int], opts: Mapping[str, Any],
                 loop: asyncio.AbstractEventLoop | None) -> Request:
        prompt, opts = self._with_media(prompt, opts)
        request = self._build_request(prompt, opts, loop)
        try:
            self._engine.submit(request)  # closes the sampler when it refuses the request
        finally:
            self._queued((request,))
        return request

    def _requests(self, prompts: Sequence[str | Sequence[int]], n: int, opts: Mapping[str, Any],
                  loop: asyncio.AbstractEventLoop | None, abort: threading.Event | None) -> list[Request]:
        """Build ``len(prompts) * n`` requests and queue them as one unit (see :meth:`submit_many`)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ArgumentTypeError("prompts must be a list of prompts (texts or token id lists)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"n={n!r}: expected an integer >= 1")
        if abort is not None and not isinstance(abort, threading.Event):
            raise ArgumentTypeError(f"abort={abort!r}: expected a threading.Event")
        total = len(prompts) * n
        scheduler = self._engine.scheduler
        if scheduler.max_queue and total > scheduler.max_queue:  # (waiting would never help: not a QueueFullError)
            raise InvalidArgumentError(f"a group of {total} requests is larger than the whole queue "
                                       f"(max_queue={scheduler.max_queue}): it could never be queued; submit it "
                                       f"in parts, or raise max_queue (0: no bound)")
        room = scheduler.room()
        if room is not None and total > room:  # before building anything (samplers, grammars)
            raise QueueFullError(scheduler.queue_full_message(total, self._engine.queue_length()))
        if "media" in opts:
            media_opts = opts
            prompts = [self._with_media(prompt, media_opts)[0] for prompt in prompts]
            opts = {k: v for k, v in opts.items() if k != "media"}
        seed = opts.get("seed")
        built: list[Request] = []
        try:
            for prompt in prompts:
                for i in range(n):
                    if abort is not None and abort.is_set():
                        raise CancelledError("the submission was cancelled before it was queued")
                    # (choice 0 keeps the seed as given, so an invalid one is refused as for n=1)
                    choice = opts if i == 0 or not isinstance(seed, int) or isinstance(seed, bool) \
                        else {**opts, "seed": (seed + i) % _SEED_MOD}
                    built.append(self._build_request(prompt, choice, loop))
        except BaseException:
            for request in built:
                request.sampler.close()
            self._queued(built)
            raise
        try:
            self._engine.scheduler.submit_all(built, abort.is_set if abort is not None else None)
        finally:
            self._queued(built)
        return built

    def _build_request(self, prompt: str | Sequence[int], opts: Mapping[str, Any],
                       loop: asyncio.AbstractEventLoop | None) -> Request:
        """A request, validated, tokenized and with its sampler, not yet queued."""
        if self._closed:
            raise ServerClosedError("the server is closed")
        if threading.current_thread() is self._engine.thread:
            # (e.g. from a telemetry handler): the scheduler would wait for itself
            raise InvalidArgumentError("requests cannot be submitted from the server's own scheduler thread")
        opts = dict(opts)
        session = opts.pop("session", None)
        pin = opts.pop("id_slot", None)
        progress = opts.pop("progress", False)
        if not isinstance(progress, bool):
            raise ArgumentTypeError(f"progress={progress!r}: expected True or False")
        if pin is not None and (isinstance(pin, bool) or not isinstance(pin, int)):
            raise ArgumentTypeError(f"id_slot={pin!r}: expected a slot number")
        if pin is not None and pin < 0:
            pin = None  # (llama-server: -1 = any slot)
        if pin is not None and pin >= self.n_parallel:
            raise InvalidArgumentError(f"id_slot={pin}: this server has slots 0 to {self.n_parallel - 1}")
        speculative = opts.pop("speculative", True)
        if not isinstance(speculative, bool):
            raise ArgumentTypeError(f"speculative={speculative!r}: expected a bool (per request: opt out with False)")
        try:
            hash(session)
            if not isinstance(session == session, bool):
                raise TypeError
        except TypeError:
            raise ArgumentTypeError(f"session={session!r}: expected a hashable value such as a str") from None
        merged = {**self._defaults, **opts}
        sampling_opts, gen_opts = split_options(merged, SamplingParams, GenerationParams, where="unknown request")
        params = GenerationParams(**gen_opts)
        if params.control_vector is not None:
            raise InvalidArgumentError("a Server applies one control vector to every request: "
                                       "Server(control_vector=...), not per request")
        vocab = self._ctx.vocab  # the context's: it keeps working after the shared Model is closed
        media = getattr(prompt, "spans", None) is not None  # a MediaPrompt (Projector.tokenize): images, audio
        if media:
            if self._drafter is not None:
                raise MediaError("a speculative Server does not take images or audio (its drafter follows "
                                 "token ids); serve the model without speculative=")
            check_media_prompt(self._ctx, prompt)
            speculative = False
            tokens = prompt
        else:
            # (a text too long for a slot is refused before it is tokenized)
            tokens = prompt_tokens(vocab, prompt, params, self.n_ctx)
        check_prompt(self._ctx, tokens, self.n_ctx)
        sampler = Sampler(self.model, SamplingParams(**sampling_opts), n_ctx=self.n_ctx, holder=self._ctx)
        loras: Any = ()
        try:
            text = TextAssembler.for_vocab(vocab, params.special, params.stop)
            loras = self._served.resolve(params.lora)
            start = activation_start(loras, tokens)
            if start is not None and start >= len(tokens):
                self._served.unresolve([loras])
                loras, start = (), None  # (no invocation in the prompt: the activated LoRA stays off)
            budget = params.reasoning_budget.start(vocab) if params.reasoning_budget is not None else None
            # (no drafts for a budgeted request: a forced token is not the sampler's, so no draft verifies it)
            request = Request(tokens, params, sampler, Channel(loop), session=session, text=text,
                              speculative=speculative and budget is None, pin=pin, progress=progress,
                              has_media=media, loras=loras, alora_start=start or None, budget=budget)
        except BaseException:
            self._served.unresolve([loras])
            sampler.close()
            raise
        return request

    def stream(self, prompt: str, **opts: Any) -> ServerStream:
        """Stream text pieces for ``prompt``. Per-request options: sampling (temp, seed, grammar,
        json_schema, ...) and generation (max_tokens, stop, logprobs, ...); ``session`` is accepted
        for affinity; ``id_slot=N`` runs it in slot N (waiting for that slot; -1: any); ``progress=True``
        reports the prompt's reading (``AsyncServerStream.events()``); ``media=[...]``: images and audio, one
        per ``lc.MEDIA_MARKER`` in the text (a model with a projector). Raises QueueFullError at once when the
        queue is full."""
        return ServerStream(self, self._request(prompt, opts, None))

    def stream_tokens(self, tokens: Sequence[int], **opts: Any) -> ServerStream:
        """Like :meth:`stream`, for a pre-tokenized prompt (tokenize outside, with ``server.model``)."""
        return ServerStream(self, self._request(_token_list(tokens), opts, None))

    def generate(self, prompt: str, **opts: Any) -> Completion:
        """Generate to completion; returns a :class:`Completion` (a ``str``)."""
        return self.stream(prompt, **opts).completion()

    def generate_tokens(self, tokens: Sequence[int], **opts: Any) -> Completion:
        """Like :meth:`generate`, for a pre-tokenized prompt."""
        return self.stream_tokens(tokens, **opts).completion()

    def asubmit(self, prompt: str | Sequence[int], *, loop: asyncio.AbstractEventLoop | None = None,
                **opts: Any) -> AsyncServerStream:
        """Submit a request whose pieces an asyncio event loop reads; returns its :class:`AsyncServerStream`.

        Synchronous: the request is validated and queued at once, so invalid options,
        QueueFullError and ServerClosedError are raised here, as :meth:`stream` raises them.
        Same options as :meth:`stream`; ``prompt`` is text or token ids. ``loop``: the loop that
        will iterate the stream (default: the running one), so a worker thread can submit for it
        (validation and grammar compilation then stay off the loop). Without either, RuntimeError.
        """
        return AsyncServerStream(self, self._request(prompt, opts, self._loop_for(loop)))

    @staticmethod
    def _loop_for(loop: asyncio.AbstractEventLoop | None) -> asyncio.AbstractEventLoop:
        if loop is None:
            try:
                return asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("Server.asubmit needs a running asyncio event loop or loop= (use stream() "
                                   "from synchronous code)") from None
        if not isinstance(loop, asyncio.AbstractEventLoop):
            raise ArgumentTypeError(f"loop={loop!r}: expected an asyncio event loop")
        return loop

    def submit_many(self, prompts: Sequence[str | Sequence[int]], *, n: int = 1,
                    abort: threading.Event | None = None, **opts: Any) -> list[ServerStream]:
        """Submit ``n`` requests per prompt as one unit; returns their streams, prompt by prompt
        (choice ``j`` of prompt ``p`` at ``p * n + j``).

        All or none: the group must fit in the queue (else :class:`QueueFullError` before any work; a
        group larger than ``max_queue`` itself is an InvalidArgumentError, since it never could),
        every request is validated and built (tokenizing, samplers, grammars) before any is queued,
        and a failure queues none. With a ``seed``, choice ``j`` uses ``seed + j``. ``abort``: set
        it from another thread to stop a submission still being built; nothing is queued after it
        is set (CancelledError). Cancel the group with ``for s in streams: s.cancel()``.
        """
        return [ServerStream(self, r) for r in self._requests(prompts, n, opts, None, abort)]

    def asubmit_many(self, prompts: Sequence[str | Sequence[int]], *, n: int = 1,
                     loop: asyncio.AbstractEventLoop | None = None, abort: threading.Event | None = None,
                     **opts: Any) -> list[AsyncServerStream]:
        """:meth:`submit_many` for streams an asyncio event loop reads (``loop`` as in :meth:`asubmit`)."""
        loop = self._loop_for(loop)
        return [AsyncServerStream(self, r) for r in self._requests(prompts, n, opts, loop, abort)]

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, n: int = 1, **opts: Any) -> list[Completion]:
        """Generate ``n`` completions per prompt, submitted as one unit (:meth:`submit_many`), decoded together
        in the slots; returns them prompt by prompt. The first failure cancels the others and is raised."""
        streams = self.submit_many(prompts, n=n, **opts)
        try:
            return [s.completion() for s in streams]
        finally:
            for s in streams:
                s.cancel()  # (no-op for the finished ones)

    async def astream(self, prompt: str | Sequence[int], **opts: Any) -> AsyncIterator[str]:
        """Async iterator of text pieces; waiting never blocks the event loop.

        The request is submitted at the first iteration. Cancelling the consuming task (or closing
        the iterator) cancels the request. :meth:`asubmit` gives the pieces with the request's metadata.
        """
        stream = self.asubmit(prompt, **opts)
        try:
            async for piece in stream:
                yield piece
        finally:
            stream._consumer.end()  # (not ``await aclose()``: an async generator being closed may not wait)

    async def agenerate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        """Generate to completion without blocking the event loop (cancelling the task cancels the request)."""
        stream = self.asubmit(prompt, **opts)
        try:
            return await stream.completion()
        finally:
            stream._consumer.end()

    # ---- control ------------------------------------------------------------------------------
    def cancel(self, request: Request | ServerStream | AsyncServerStream) -> None:
        """Cancel a request (or the request of a stream), from any thread: a waiting request leaves the
        queue at once, a running one ends at the next tick, freeing its slot. Its consumer gets
        CancelledError."""
        if isinstance(request, (ServerStream, AsyncServerStream)):
            request = request.request
        self._engine.cancel(request)

    def end_reasoning(self, request: Request | ServerStream | AsyncServerStream) -> bool:
        """Force the end of a running request's reasoning block now (llama-server's ``reasoning_end``
        control): its next tokens are the block's end marker, then the answer. False when the request
        has no reasoning budget, or its block is not open (not started, or over). Any thread."""
        if isinstance(request, (ServerStream, AsyncServerStream)):
            request = request.request
        budget = request.budget
        if budget is None:
            return False
        return bool(self._engine.call(budget.force_end))  # (between two ticks: the budget is the tick's)

    def get_model(self) -> Model:
        """The model (the same as ``server.model``), for tokenizing outside the server (see :meth:`generate_tokens`)."""
        return self.model

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def load_lora(self, path: str | os.PathLike, name: str | None = None, scale: float = 0.0) -> LoraAdapter:
        """Load a LoRA adapter over the server's model while it serves; requests name it with
        ``lora={name: scale}``. ``scale``: what requests that name no adapter get (0: none; llama-server's
        ``--lora`` is 1, with ``--lora-init-without-apply`` 0). Closed with the server (or by
        :meth:`unload_lora`). Raises InvalidArgumentError when the name is taken, ModelLoadError for an
        adapter of another model."""
        if self._closed:
            raise ServerClosedError("the server is closed")
        adapter = self.model.load_lora(path, name)
        try:
            self.add_lora(adapter, owned=True, scale=scale)
        except BaseException:
            adapter.close()
            raise
        return adapter

    def add_lora(self, adapter: LoraAdapter, *, owned: bool = False, scale: float = 0.0) -> int:
        """Serve an adapter already loaded over the model under its name (closed with the server only
        when ``owned``; ``scale`` as for :meth:`load_lora`). Returns its id: a number never reused by
        this server (llama-server's ids, which requests may name instead of the name)."""
        return self._served.add(adapter, owned, scale)

    def lora_scales(self) -> dict[str, float]:
        """The scale each adapter gets in requests that name none (llama-server's global adapter scales)."""
        return self._served.scales()

    def lora_table(self) -> list[tuple[int, LoraAdapter, float]]:
        """(id, adapter, default scale) of each adapter served, by id (llama-server's ``/lora-adapters``)."""
        return self._served.table()

    def set_lora_scales(self, scales: Mapping[Any, float]) -> None:
        """Set the scales of requests that name no adapter, as llama-server's ``POST /lora-adapters``:
        ``{name or id: scale}``; adapters not listed get 0. Running requests keep theirs."""
        self._served.set_scales(scales)

    @property
    def loras(self) -> dict[str, LoraAdapter]:
        """The adapters requests may name, by name (a copy)."""
        return self._served.by_name()

    def unload_lora(self, name: str, timeout: float | None = None) -> None:
        """Stop serving an adapter: new requests naming it are refused at once; this waits (up to
        ``timeout`` seconds, None: no limit) for the requests that use it, then drops the prefixes
        computed under it and closes it if the server loaded it (once nothing applies it any more).
        Raises InvalidArgumentError for an unknown name, TimeoutError when the requests did not end in
        time (the adapter stays out of service, and a later call finishes the unload)."""
        adapter = self._served.begin_unload(name)
        engine = self._engine
        scheduler = engine.scheduler
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closed:
            # (requests resolved but not queued yet, then those queued or running: the latter are read
            # on the scheduler thread, which alone moves requests between its queues)
            try:
                if not self._served.resolving(adapter) and not engine.call(lambda: scheduler.uses_adapter(adapter)):
                    engine.call(lambda: engine.drop_adapter(adapter))
                    break
            except ServerClosedError:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"requests still use the LoRA adapter {name!r}")
            time.sleep(0.02)
        if self._served.end_unload(name, adapter):
            adapter.close_when_unused()  # (a one-call generation may still apply it: freed after it)

    def _queued(self, requests: Sequence[Request]) -> None:
        """``requests`` are in the scheduler's queue now (or were refused): no longer merely resolved."""
        self._served.unresolve([r.loras for r in requests])

    def stats(self) -> dict[str, Any]:
        """Slots in use, queue length, ticks, tokens per tick, prefix-cache counters, where the
        scheduler thread's time went (``tick_seconds``) and, with ``speculative=``, draft tokens
        verified and accepted so far."""
        engine = self._engine
        cache = engine.pool.stats
        ram = engine.pool.ram
        return {
            "n_parallel": self.n_parallel,
            "active_slots": len(engine.pool.active),
            "queue_length": engine.queue_length(),
            "ticks": engine.ticks,
            "avg_batch_tokens": engine.batch_tokens / engine.ticks if engine.ticks else 0.0,
            "max_batch_tokens": engine.max_batch_tokens,
            "avg_busy_slots": engine.slot_steps / engine.ticks if engine.ticks else 0.0,
            "generated_tokens": engine.scheduler.generated,
            "prompt_tokens_evaluated": engine.prompt_tokens_evaluated,
            "cache_hits": cache.hits,
            "cache_misses": cache.misses,
            "cached_tokens": cache.cached_tokens,
            "cache_adopted": cache.adopted,
            "cache_restored": cache.restored,
            "cache_checkpoints": cache.checkpoints,
            "prefix_instabilities": cache.instabilities,
            "ram_cache_entries": len(ram) if ram is not None else 0,
            "ram_cache_bytes": ram.used if ram is not None else 0,
            # (the disk tier, with prompt_cache_dir: files indexed, their bytes, states read back from them)
            "disk_cache_entries": len(ram.disk) if ram is not None and ram.disk is not None else 0,
            "disk_cache_bytes": ram.disk.used if ram is not None and ram.disk is not None else 0,
            "disk_cache_hits": ram.disk.hits if ram is not None and ram.disk is not None else 0,
            "draft_tokens": engine.scheduler.drafted,
            "draft_accepted": engine.scheduler.accepted,
            "drafts": engine.scheduler.drafts,
            "draft_acceptance": engine.scheduler.accepted / engine.scheduler.drafted
            if engine.scheduler.drafted else 0.0,
            "lora_switches": engine.scheduler.lora_switches,
            # requests that asked for backend_sampling: sampled in the graph, and those that could not
            # be, by reason (grammar, logprobs, speculative, a sampler the graph lacks, ...)
            "in_graph_requests": engine.in_graph,
            "in_graph_fallbacks": dict(engine.in_graph_fallbacks),
            # rows drawn by native chains on several threads at once (engine._sample_concurrently)
            "concurrent_sampled_rows": engine.concurrent_rows,
            # rows drawn on a worker whose draw outlasted its tick (a slow grammar; engines/server/detached.py)
            "late_sampled_rows": engine.late_rows,
            # where the scheduler thread's time went, in seconds (engine.TickSplit; text and handoff
            # are parts of update)
            "tick_seconds": {**{name: getattr(engine.split, name) for name in engine.split.__slots__},
                             "text": engine.scheduler.text_s, "handoff": engine.scheduler.handoff_s},
        }

    @property
    def defaults(self) -> dict[str, Any]:
        """The request defaults given at construction (sampling and generation options), a copy."""
        return dict(self._defaults)

    def slots(self) -> list[SlotInfo]:
        """What each slot is doing now (llama-server's ``/slots``), read on the scheduler thread between
        two ticks. Raises ServerClosedError after :meth:`close`."""
        if self._closed:
            raise ServerClosedError("the server is closed")
        engine, n_ctx, speculative = self._engine, self.n_ctx, self._drafter is not None

        def read() -> list[SlotInfo]:
            out = []
            for slot in engine.pool.slots:
                r = slot.request
                if r is None:
                    out.append(SlotInfo(slot.seq_id, n_ctx, speculative, False, n_cached=slot.n_past))
                    continue
                remaining = r.params.max_tokens - len(r.generated) if r.params.max_tokens > 0 else -1
                out.append(SlotInfo(slot.seq_id, n_ctx, speculative, True, request_id=r.id,
                                    n_prompt_tokens=len(r.prompt),
                                    n_prompt_tokens_processed=max(0, r.n_prefilled - r.cached_tokens),
                                    n_prompt_tokens_cache=r.cached_tokens, n_decoded=len(r.generated),
                                    n_remaining=remaining, n_cached=slot.n_past))
            return out

        return engine.call(read)

    def _no_cvec_files(self) -> None:
        if self.control_vector is not None:
            raise InvalidArgumentError("this server applies a control vector; slot files carry no "
                                       "control-vector information, so they are not written or read")

    def save_slot(self, slot_id: int, path: str | os.PathLike) -> int:
        """Write the tokens and KV state an idle slot holds to ``path`` (llama.cpp's sequence state file,
        as llama-server's ``/slots/{id}?action=save``); returns the number of tokens saved.

        Raises InvalidArgumentError for an unknown slot, BusyError while the slot serves a request."""
        self._no_cvec_files()
        return self._slot_call(slot_id, lambda slot: self._engine.pool.save_file(slot, path))

    def restore_slot(self, slot_id: int, path: str | os.PathLike) -> int:
        """Load a file written by :meth:`save_slot` (or by llama-server) into an idle slot: a later request
        whose prompt starts with the same tokens reuses that KV. Returns the number of tokens restored.

        Raises InvalidArgumentError when the file is not a sequence state of this model."""
        self._no_cvec_files()
        return self._slot_call(slot_id, lambda slot: self._engine.pool.restore_file(slot, path, self._ctx.n_vocab))

    def erase_slot(self, slot_id: int) -> int:
        """Drop what an idle slot holds (its tokens and KV); returns how many tokens it held."""
        return self._slot_call(slot_id, self._engine.pool.erase)

    def _slot_call(self, slot_id: int, fn: Callable[[Any], int]) -> int:
        if self._closed:
            raise ServerClosedError("the server is closed")
        if isinstance(slot_id, bool) or not isinstance(slot_id, int) or not 0 <= slot_id < self.n_parallel:
            raise InvalidArgumentError(f"slot {slot_id!r}: this server has slots 0 to {self.n_parallel - 1}")
        pool = self._engine.pool

        def run() -> int:
            slot = pool.slots[slot_id]
            if not slot.free:
                raise BusyError(f"slot {slot_id} is serving a request")
            return fn(slot)

        return self._engine.call(run)

    def kv_positions(self) -> list[int]:
        """Largest KV position held by each slot's sequence (-1 = empty); for tests and debugging.

        Asked on the scheduler thread between two ticks; raises ServerClosedError (a ClosedError)
        after :meth:`close`."""
        if self._closed:
            raise ServerClosedError("the server is closed")
        lease, n = self._lease, self.n_parallel
        return self._engine.call(lambda: [lease.seq_pos_max(s) for s in range(n)])

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the server: requests still waiting or running end with ServerClosedError.

        Waits up to ``timeout`` seconds for the scheduler thread to finish its tick. If it has not
        (a decode still running), the thread frees the context (and the model, when the server
        loaded it) itself as it ends: freeing them under a running decode would crash the process.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._drafter is not None:
            self._drafter.abort()  # a draft in flight ends now: the tick finishes without it
        if not self._engine.close(timeout, on_exit=self._free_native) \
                and threading.current_thread() is not self._engine.thread:
            logger.warning("server scheduler did not stop within %s s; it frees its context when it ends",
                           timeout)

    def _free_native(self) -> None:
        """Free the context (and an owned model) once the scheduler thread has ended."""
        self._lease.release()
        if self._drafter is not None:
            self._drafter.close()
        self._ctx.close()
        for adapter in self._served.clear():
            adapter.close_when_unused()  # (the context let go of it above)
        if self._owns_model:
            self.model.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=5.0)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<Server {self.model.path.name!r} n_parallel={self.n_parallel} {self.batch_strategy!r}>"


def _state_settings(params: ContextParams) -> dict[str, Any]:
    """The context settings a saved state depends on (what its cells hold, how it is laid out): all but the
    threads and the batch sizes, which change neither."""
    skip = {"n_threads", "n_threads_batch", "n_batch", "n_ubatch", "n_outputs_max"}
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name not in skip}


def _token_list(tokens: Sequence[int]) -> list[int]:
    """A prompt's token ids as a list; a MediaPrompt (a list already) stays itself, with its media."""
    return tokens if getattr(tokens, "spans", None) is not None else list(tokens)
