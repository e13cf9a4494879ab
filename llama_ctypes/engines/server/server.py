"""Server: continuous batching over one model for many concurrent callers.

    with lc.Server(model_path="m.gguf", n_parallel=4) as server:
        text = server.generate("Once upon a time", max_tokens=100)
        for piece in server.stream("Tell me a story"): ...
        text = await server.agenerate("Hi")            # asyncio
        async for piece in server.astream("Hi"): ...

Every method is thread-safe. One scheduler thread owns the context and, each
tick, decodes one batch holding the next token of every running request plus
prompt chunks of new ones (see ``engine.py``). Each request has its own
sampler, seed, grammar, stop strings and limits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Mapping, Sequence

from ...core.context import Context
from ...core.generation import Completion, GenerationParams, LazyStream, StopFilter, check_prompt
from ...core.model import Model, load_model
from ...core.params import ContextParams, ModelParams, split_options
from ...core.sampler import Sampler, SamplingParams
from ...core.tokenizer import StreamDecoder, Tokenizer
from ...errors import ContextOverflowError
from .engine import Engine, QueueFullError, ServerClosedError
from .request import Channel, End, Request
from .strategies import DecodeMaximal, resolve

__all__ = ["Server", "ServerStream", "QueueFullError", "ServerClosedError"]

logger = logging.getLogger(__name__)

_RESERVED = ("n_seq_max", "embeddings")


class _Consumer:
    """Turns a request's channel items into text: UTF-8 assembly, stop strings, the end or an error."""

    def __init__(self, server: "Server", request: Request):
        self.server = server
        self.request = request
        self.decoder = StreamDecoder(server.model, special=request.params.special)
        self.stops = StopFilter(request.params.stop)
        self.pieces: list[str] = []
        self.finish_reason: str | None = None

    def handle(self, item: Any) -> str:
        """Text for one item ("" if none yet); sets finish_reason at the end; raises the request's error."""
        if isinstance(item, int):
            out = self.stops.feed(self.decoder.push(item))
            if self.stops.stopped:
                self.finish_reason = "stop"
                self.server._engine.cancel(self.request, "stop")  # frees the slot at the next tick
        elif isinstance(item, End):
            self.finish_reason = item.finish_reason
            out = self.stops.feed(self.decoder.flush())
            if self.stops.stopped:
                self.finish_reason = "stop"
            else:
                out += self.stops.flush()
        else:
            raise item
        if out:
            self.pieces.append(out)
        return out

    def end(self) -> None:
        """Cancel the request if the consumer leaves before its end."""
        if not self.request.status.done and self.finish_reason is None:
            self.server._engine.cancel(self.request)

    def completion(self) -> Completion:
        return Completion("".join(self.pieces), list(self.request.generated), self.finish_reason or "length",
                          len(self.request.prompt), self.request.timings())


class ServerStream(LazyStream):
    """A lazy stream of a server request's text pieces.

    Breaking out, ``close()``, or dropping the stream cancels the request: its
    slot and KV are freed at the next tick. After the end, ``finish_reason``,
    ``tokens`` and ``text`` describe the result; ``request`` identifies it for
    :meth:`Server.cancel`.
    """

    def __init__(self, server: "Server", request: Request):
        self.request = request
        self._consumer = _Consumer(server, request)
        self._gen = self._generate()

    @property
    def finish_reason(self) -> str | None:
        return self._consumer.finish_reason

    @property
    def tokens(self) -> list[int]:
        return self.request.generated

    @property
    def text(self) -> str:
        return "".join(self._consumer.pieces)

    @property
    def timings(self):
        return self.request.timings()

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    def _generate(self):
        consumer, channel = self._consumer, self.request.channel
        try:
            while consumer.finish_reason is None:
                out = consumer.handle(channel.get())
                if out:
                    yield out
        finally:
            consumer.end()

    def close(self) -> None:
        """Stop the request (if still running)."""
        self._gen.close()
        self._consumer.end()

    def completion(self) -> Completion:
        """Run to the end and return the :class:`Completion`."""
        for _ in self._gen:
            pass
        return self._consumer.completion()


class Server:
    """A continuous-batching server over one model (see the module docs).

    Args:
        model_path: GGUF file to load (the server then owns and closes the model), or
        model: an already loaded :class:`Model` (shared; not closed by the server).
        n_parallel: requests decoded together (slots), default 4.
        n_ctx: context tokens per slot (default 4096); the context holds ``n_ctx * n_parallel``.
        n_batch: most tokens per tick (decode tokens + prompt chunks), default 512.
        batch_strategy: :class:`DecodeMaximal` (default), :class:`PrefillPriority` or :class:`Balanced`.
        max_queue: most requests waiting for a slot (0 = unbounded); beyond it, submitting raises
            :class:`QueueFullError` at once.
        cache_prompt: keep finished requests' KV and reuse the longest common prefix (default True;
            per-request override with ``cache_prompt=``).
        prompt_cache_ram_mb: RAM for a second-level cache of evicted prefixes (0 = off).
        kv_unified: one KV buffer for all slots (default True), so a prefix computed by one slot is
            adopted by another with a metadata-only copy.
        **opts: model options (when loading), context options (type_k, flash_attn, ...), and default
            sampling/generation options for every request (temp, top_p, max_tokens, stop, ...).
    """

    def __init__(self, model_path: str | None = None, *, model: Model | None = None, n_parallel: int = 4,
                 n_ctx: int = 4096, n_batch: int = 512, batch_strategy: Any = DecodeMaximal, max_queue: int = 0,
                 cache_prompt: bool = True, prompt_cache_ram_mb: float = 0, kv_unified: bool = True, **opts: Any):
        if (model_path is None) == (model is None):
            raise TypeError("pass exactly one of model_path or model")
        for name in _RESERVED:
            if name in opts:
                raise TypeError(f"the server sets {name} itself")
        if not isinstance(n_parallel, int) or n_parallel < 1:
            raise ValueError(f"n_parallel={n_parallel!r}: expected an integer >= 1")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r}: expected an integer >= 0")
        if not isinstance(prompt_cache_ram_mb, (int, float)) or prompt_cache_ram_mb < 0:
            raise ValueError(f"prompt_cache_ram_mb={prompt_cache_ram_mb!r}: expected a number >= 0")
        model_opts, ctx_opts, sampling_opts, gen_opts = split_options(
            opts, ModelParams, ContextParams, SamplingParams, GenerationParams, where="Server: unknown")
        SamplingParams(**sampling_opts)  # validate the defaults now
        GenerationParams(**gen_opts)
        self._defaults = {"cache_prompt": bool(cache_prompt), **sampling_opts, **gen_opts}
        strategy = resolve(batch_strategy)
        if model is None:
            model = load_model(model_path, **model_opts)
            self._owns_model = True
        else:
            if model_opts:
                raise TypeError(f"model options {sorted(model_opts)} need model_path (the model is already loaded)")
            self._owns_model = False
        self.model = model
        try:
            self._ctx = Context(model, ContextParams(**{
                "n_ctx": n_ctx * n_parallel, "n_batch": n_batch, "n_ubatch": min(n_batch, 512),
                "n_seq_max": n_parallel, "kv_unified": kv_unified, **ctx_opts}))
            self._ctx._begin_exclusive()  # the scheduler thread is its only user from now on
        except BaseException:
            if self._owns_model:
                model.close()
            raise
        self.n_parallel = n_parallel
        self.n_ctx = min(n_ctx, self._ctx.n_ctx_seq)
        self.batch_strategy = strategy
        self._engine = Engine(self._ctx, strategy, max_queue, n_ctx_seq=self.n_ctx,
                              prompt_cache_bytes=int(prompt_cache_ram_mb * 2**20))
        self._engine.thread.start()
        self._closed = False

    # ---- submission ------------------------------------------------------------------------
    def _request(self, prompt: str | Sequence[int], opts: Mapping[str, Any],
                 loop: asyncio.AbstractEventLoop | None) -> Request:
        if self._closed:
            raise ServerClosedError("the server is closed")
        opts = dict(opts)
        session = opts.pop("session", None)
        merged = {**self._defaults, **opts}
        sampling_opts, gen_opts = split_options(merged, SamplingParams, GenerationParams, where="unknown request")
        params = GenerationParams(**gen_opts)
        if isinstance(prompt, str):
            tokens = Tokenizer.encode(self.model, prompt, add_special=params.add_special,
                                      parse_special=params.parse_special)
        else:
            tokens = [int(t) for t in prompt]
        check_prompt(self._ctx, tokens)
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"prompt of {len(tokens)} tokens does not fit a server slot of {self.n_ctx} tokens "
                "(at least one token must be generated); use a larger n_ctx", n_tokens=len(tokens), n_ctx=self.n_ctx)
        sampler = Sampler(self.model, SamplingParams(**sampling_opts))
        request = Request(tokens, params, sampler, Channel(loop), session=session)
        self._engine.submit(request)
        return request

    def stream(self, prompt: str, **opts: Any) -> ServerStream:
        """Stream text pieces for ``prompt``. Per-request options: sampling (temp, seed, grammar,
        json_schema, ...) and generation (max_tokens, stop, ...); ``session`` is accepted for
        affinity. Raises QueueFullError at once when the queue is full."""
        return ServerStream(self, self._request(prompt, opts, None))

    def stream_tokens(self, tokens: Sequence[int], **opts: Any) -> ServerStream:
        """Like :meth:`stream`, for a pre-tokenized prompt (tokenize outside, with :meth:`get_model`)."""
        return ServerStream(self, self._request(list(tokens), opts, None))

    def generate(self, prompt: str, **opts: Any) -> Completion:
        """Generate to completion; returns a :class:`Completion` (a ``str``)."""
        return self.stream(prompt, **opts).completion()

    def generate_tokens(self, tokens: Sequence[int], **opts: Any) -> Completion:
        """Like :meth:`generate`, for a pre-tokenized prompt."""
        return self.stream_tokens(tokens, **opts).completion()

    async def astream(self, prompt: str | Sequence[int], **opts: Any) -> AsyncIterator[str]:
        """Async iterator of text pieces; waiting never blocks the event loop.

        Cancelling the consuming task (or closing the iterator) cancels the request.
        """
        consumer = _Consumer(self, self._request(prompt, opts, asyncio.get_running_loop()))
        channel = consumer.request.channel
        try:
            while consumer.finish_reason is None:
                out = consumer.handle(await channel.aget())
                if out:
                    yield out
        finally:
            consumer.end()

    async def agenerate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        """Generate to completion without blocking the event loop (cancelling the task cancels the request)."""
        consumer = _Consumer(self, self._request(prompt, opts, asyncio.get_running_loop()))
        channel = consumer.request.channel
        try:
            while consumer.finish_reason is None:
                consumer.handle(await channel.aget())
        finally:
            consumer.end()
        return consumer.completion()

    # ---- control ------------------------------------------------------------------------------
    def cancel(self, request: Request | ServerStream) -> None:
        """Cancel a request (or the request of a stream); its slot is freed at the next tick."""
        if isinstance(request, ServerStream):
            request = request.request
        self._engine.cancel(request)

    def get_model(self) -> Model:
        """The model, for tokenizing outside the server (see :meth:`generate_tokens`)."""
        return self.model

    def stats(self) -> dict[str, Any]:
        """Slots in use, queue length, ticks, tokens per tick, and prefix-cache counters so far."""
        engine = self._engine
        cache = engine.pool.stats
        ram = engine.pool.ram
        return {
            "n_parallel": self.n_parallel,
            "active_slots": len(engine.pool.active),
            "queue_length": engine.queue_length(),
            "ticks": engine.ticks,
            "avg_batch_tokens": engine.batch_tokens / engine.ticks if engine.ticks else 0.0,
            "prompt_tokens_evaluated": engine.prompt_tokens_evaluated,
            "cache_hits": cache.hits,
            "cache_misses": cache.misses,
            "cached_tokens": cache.cached_tokens,
            "cache_adopted": cache.adopted,
            "cache_restored": cache.restored,
            "prefix_instabilities": cache.instabilities,
            "ram_cache_entries": len(ram) if ram else 0,
            "ram_cache_bytes": ram.used if ram else 0,
        }

    def kv_positions(self) -> list[int]:
        """Largest KV position held by each slot's sequence (-1 = empty); for tests and debugging."""
        lib, mem = self._ctx._lib, self._ctx._mem
        return [int(lib.llama_memory_seq_pos_max(mem, s)) for s in range(self.n_parallel)]

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the server: requests still waiting or running end with ServerClosedError."""
        if self._closed:
            return
        self._closed = True
        self._engine.close(timeout)
        if self._engine.thread.is_alive():
            # Still inside a decode after the timeout: freeing the context under it would crash
            # the process, so it is left to the thread (and leaked if the thread never ends).
            logger.warning("server scheduler did not stop within %s s; its context is not freed", timeout)
            return
        self._ctx._end_exclusive()
        self._ctx.close()
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
