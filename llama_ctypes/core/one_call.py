"""The one-call API over a Model: ``lc.generate`` and ``lc.stream`` (a pooled context, a fresh sampler)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..errors import LlamaError
from .context_pool import ContextPool
from .generation import Completion, GenerationParams, TextStream
from .params import ContextParams, split_options
from .prompt import prompt_tokens
from .sampler import Sampler, SamplingParams

if TYPE_CHECKING:
    from .model import Model

__all__ = ["stream", "generate"]


def stream(model: "Model", prompt: str | Sequence[int], **opts: Any) -> TextStream:
    """Stream generated text pieces for ``prompt`` (text, or token ids).

    Options: sampling (:class:`SamplingParams`: temp, top_k, top_p, seed, grammar, ...),
    generation (:class:`GenerationParams`: max_tokens=256, stop, logprobs, ...) and context
    (:class:`ContextParams`: n_ctx=4096, type_k, flash_attn, ...). Unknown
    options raise TypeError. The stream is lazy; see :class:`TextStream`.
    """
    gen_opts, sampling_opts, ctx_opts = split_options(
        opts, GenerationParams, SamplingParams, ContextParams, where="unknown")
    # (a pooled context must not carry one call's adapters into the next)
    if gen_opts.get("lora") is None:
        gen_opts["lora"] = {}
    gparams = GenerationParams(**gen_opts)
    sparams = SamplingParams(**sampling_opts)
    # One logits row per decode is all a single sequence needs; llama.cpp's default reserves
    # n_batch rows (for Gemma's 262k vocabulary a 514 MiB compute buffer instead of 26 MiB).
    ctx_opts.setdefault("n_outputs_max", 1)
    cparams = ContextParams(**ctx_opts)
    tokens = prompt_tokens(model, prompt, gparams, cparams.n_ctx or model.n_ctx_train)
    pool = ContextPool.of(model)
    sampler = Sampler(model, sparams, n_ctx=cparams.n_ctx or model.n_ctx_train)
    try:
        ctx = pool.checkout(model, cparams)
    except BaseException:
        sampler.close()
        raise

    def release() -> None:
        sampler.close()
        if ctx.loras or ctx.control_vector is not None:
            # An idle pooled context keeps no call's adapters: closing one would be refused as busy,
            # and the next call must start from the plain model.
            try:
                with ctx.lease() as lease:
                    lease.apply_loras(())
                    lease.set_control_vector(None)
            except LlamaError:  # (closed meanwhile: the pool drops it)
                pass
        pool.checkin(ctx)

    return TextStream(ctx, sampler, tokens, gparams, on_close=release)


def generate(model: "Model", prompt: str | Sequence[int], **opts: Any) -> Completion:
    """Generate a completion for ``prompt``; same options as :func:`stream`.

    Returns a :class:`Completion` (``str(completion)`` is the text) with the
    finish reason (``"stop"``, ``"length"`` or ``"eog"``) and timings.
    """
    return stream(model, prompt, **opts).completion()
