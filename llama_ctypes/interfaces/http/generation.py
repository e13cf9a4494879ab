"""From OpenAI request fields to server requests, and from their results back to OpenAI fields.

Shared by the chat and text completion endpoints: the sampling options, the
submission of ``n`` requests per prompt (one per choice, queued and cancelled as
one unit), how a finished request is counted, and the two logprobs shapes.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Sequence

import anyio
from starlette.requests import Request

from ...engines.server import Server
from ...errors import CancelledError
from ...features.openai.shapes import timings
from .errors import BadRequest
from .json_answer import json_response
from .schemas import SamplingFields
from .streaming import EventStream, until_disconnect

_SEED_MOD = 0xFFFFFFFF  # SamplingParams seeds lie in [0, 2**32 - 1)


def sampling_options(req: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    """The server options for the sampling fields a request sets (unset fields keep the server's defaults)."""
    opts: dict[str, Any] = {}
    if req.temperature is not None:
        opts["temp"] = req.temperature
    for name in ("top_p", "top_k", "min_p"):
        value = getattr(req, name)
        if value is not None:
            opts[name] = value
    if max_tokens is not None:
        opts["max_tokens"] = max_tokens
    if req.stop is not None:
        opts["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.seed is not None:
        opts["seed"] = req.seed % _SEED_MOD
    if req.presence_penalty is not None:
        opts["penalty_present"] = req.presence_penalty
    if req.frequency_penalty is not None:
        opts["penalty_freq"] = req.frequency_penalty
    if req.repeat_penalty is not None:
        opts["penalty_repeat"] = req.repeat_penalty
    if req.ignore_eos is not None:
        opts["ignore_eos"] = req.ignore_eos
    if req.cache_prompt is not None:
        opts["cache_prompt"] = req.cache_prompt
    if req.backend_sampling is not None:
        opts["backend_sampling"] = req.backend_sampling
    if req.id_slot is not None:
        opts["id_slot"] = req.id_slot
    lora_option(req.lora, opts)
    if req.return_progress and req.stream:
        opts["progress"] = True
    if req.logit_bias:
        # OpenAI: -100 bans the token (llama.cpp: a bias of -inf)
        opts["logit_bias"] = {int(k): (float("-inf") if v <= -100 else v) for k, v in req.logit_bias.items()}
    return opts


def lora_option(entries: Sequence[Any] | None, opts: dict[str, Any]) -> None:
    """A request's ``lora`` list (:class:`~.schemas.LoraEntry`) as the ``lora`` option; an empty or
    absent list keeps the server's scales, as llama-server."""
    if entries:
        keys = [e.key for e in entries]
        if len(set(keys)) != len(keys):
            raise BadRequest("lora: an adapter is listed twice", param="lora")
        opts["lora"] = {e.key: e.scale for e in entries}


#: llama-server's ``stop_type`` for a finish reason.
_STOP_TYPES = {"eog": "eos", "stop": "word", "length": "limit"}


def progress_json(p: Any) -> dict[str, Any]:
    """llama-server's ``prompt_progress`` object of a :class:`~llama_ctypes.engines.server.request.Progress`."""
    return {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms}


def progress_timings(p: Any) -> dict[str, Any]:
    """llama-server's ``timings`` while a prompt is read (``timings_per_token`` with ``return_progress``):
    the prompt so far, nothing predicted yet."""
    done = p.processed - p.cache
    return {"cache_n": p.cache, "prompt_n": done, "prompt_ms": p.time_ms,
            "prompt_per_token_ms": p.time_ms / done if done > 0 else 0.0,
            "prompt_per_second": done * 1e3 / p.time_ms if done > 0 and p.time_ms > 0 else 0.0,
            "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}


def items(stream: Any, progress: bool) -> Any:
    """A stream's text pieces, and with ``progress`` its prompt progress reports between them."""
    return stream.events() if progress else stream


def verbose_fields(stream: Any, prompt_text: str, text: str) -> dict[str, Any]:
    """llama-server's ``__verbose`` object of a finished request: the prompt as rendered, the raw output,
    token counts, how it stopped, its timings."""
    return {"prompt": prompt_text, "content": text, "tokens": list(stream.tokens),
            "tokens_predicted": len(stream.tokens), "tokens_evaluated": stream.prompt_tokens,
            "tokens_cached": stream.timings.cached_tokens,
            "stop_type": _STOP_TYPES.get(stream.finish_reason or "", "none"), "stopping_word": stream.stop_word or "",
            "truncated": False, "timings": timings(stream.timings)}


def merge_options(user: dict[str, Any], required: dict[str, Any]) -> dict[str, Any]:
    """The request's options plus what the chat format requires (its stop strings add to the user's)."""
    out = {**user, **required}
    if "stop" in user and "stop" in required:
        out["stop"] = [*user["stop"], *required["stop"]]
    return out


class _Submission:
    """A group being submitted from a worker thread, and the client that may leave meanwhile.

    Whichever comes second cancels the group: a client that leaves after the group was queued
    cancels its streams; a group queued after the client left is cancelled by the worker."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abort = threading.Event()  # stops the building (Server.asubmit_many)
        self.streams: list[Any] = []

    def client_left(self) -> None:
        with self.lock:
            self.abort.set()
            streams = self.streams
        cancel_all(streams)

    def queued(self, streams: list[Any]) -> None:
        with self.lock:
            if not self.abort.is_set():
                self.streams = streams
                return
        cancel_all(streams)
        raise CancelledError("the client left while its requests were being submitted")


async def submit(request: Request, server: Server, prompts: Sequence[Sequence[int]], opts: dict[str, Any],
                 n: int) -> list[Any]:
    """Submit ``n`` requests (one per choice) per prompt as one unit, in a worker thread; with a seed, choice
    ``i`` of a prompt uses ``seed + i``. Returns their async streams, prompt by prompt.

    A submission validates the options, builds the request's sampler and compiles its grammar
    (tens of milliseconds for a large JSON schema, per choice): on the event loop that would stall
    every other request. All or none (:meth:`Server.asubmit_many`): QueueFullError when the group does
    not fit in the queue, before any work. A client that leaves meanwhile stops the building, and
    whatever was queued is cancelled (:class:`ClientGone`).
    """
    loop = asyncio.get_running_loop()
    job = _Submission()

    def work() -> list[Any]:
        streams = server.asubmit_many(list(prompts), n=n, loop=loop, abort=job.abort, **opts)
        job.queued(streams)
        return streams

    return await until_disconnect(request.receive, anyio.to_thread.run_sync(work), job.client_left)


async def respond(request: Request, streams: Sequence[Any], stream: bool, events: Callable[[], Any],
                  complete: Callable[[], Awaitable[Any]], shape: str = "openai") -> Any:
    """The response of a generation whose requests are ``streams``: ``events()`` as SSE in ``shape``, or
    ``await complete()`` as JSON. Either way the requests are cancelled when the client leaves."""
    if stream:
        return EventStream(events(), on_close=lambda: cancel_all(streams), shape=shape)
    return await json_response(await until_disconnect(request.receive, complete(), lambda: cancel_all(streams)))


def cancel_all(streams: Sequence[Any]) -> None:
    for s in streams:
        s.cancel()


async def gather_all(works: Sequence[Awaitable[Any]], streams: Sequence[Any]) -> list[Any]:
    """Run the choices together; the first failure (or a cancellation) cancels every request."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        cancel_all(streams)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def new_logprobs(stream: Any, sent: int) -> tuple[list[Any], int]:
    """The stream's token logprobs not yet sent (``sent`` of them were), and the new count."""
    lps = stream.logprobs
    if not lps or len(lps) <= sent:
        return [], sent
    return list(lps[sent:]), len(lps)
