"""From OpenAI request fields to server requests, and from their results back to OpenAI fields.

Shared by the chat and text completion endpoints: the sampling options, the
submission of ``n`` requests (one per choice, cancelled together), how a
finished request is counted, and the two logprobs shapes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Sequence

from ...engines.server import Server
from .schemas import SamplingFields

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
    if req.logit_bias:
        # OpenAI: -100 bans the token (llama.cpp: a bias of -inf)
        opts["logit_bias"] = {int(k): (float("-inf") if v <= -100 else v) for k, v in req.logit_bias.items()}
    return opts


def merge_options(user: dict[str, Any], required: dict[str, Any]) -> dict[str, Any]:
    """The request's options plus what the chat format requires (its stop strings add to the user's)."""
    out = {**user, **required}
    if "stop" in user and "stop" in required:
        out["stop"] = [*user["stop"], *required["stop"]]
    return out


def submit(server: Server, prompt: Sequence[int], opts: dict[str, Any], n: int) -> list[Any]:
    """Submit ``n`` requests (one per choice); with a seed, choice ``i`` uses ``seed + i``.

    All or none: if one is refused (QueueFullError, a bad option), those already queued are cancelled.
    """
    streams: list[Any] = []
    try:
        for i in range(n):
            choice_opts = dict(opts)
            if n > 1 and "seed" in opts:
                choice_opts["seed"] = (opts["seed"] + i) % _SEED_MOD
            streams.append(server.asubmit(prompt, **choice_opts))
    except BaseException:
        cancel_all(streams)
        raise
    return streams


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


def _entry(lp: Any) -> dict[str, Any]:
    return {"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.bytes)}


def chat_logprobs(lps: Sequence[Any]) -> dict[str, Any]:
    """Chat completions' ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": [{**_entry(lp), "top_logprobs": [_entry(alt) for alt in lp.top]} for lp in lps],
            "refusal": None}


def completion_logprobs(lps: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """Text completions' ``logprobs``: parallel lists of tokens, logprobs, top alternatives, text offsets."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": [lp.text for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{alt.text: alt.logprob for alt in lp.top} for lp in lps], "text_offset": offsets}
