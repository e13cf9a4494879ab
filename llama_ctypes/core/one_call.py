"""The one-call API over a Model: ``lc.generate`` and ``lc.stream`` (a pooled context, a fresh sampler)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ArgumentTypeError, ClosedError, InvalidArgumentError, LlamaError, MediaError
from .context_pool import ContextPool
from .generation import Completion, GenerationParams, TextStream
from .media import MediaInput, MediaLimits
from .params import ContextParams, split_options
from .projector import MEDIA_MARKER, MediaPrompt, media_of
from .prompt import prompt_tokens
from .sampler import Sampler, SamplingParams

if TYPE_CHECKING:
    from .model import Model

__all__ = ["stream", "generate", "media_prompt"]


def stream(model: "Model", prompt: str | Sequence[int], *, media: Sequence[MediaInput] | None = None,
           **opts: Any) -> TextStream:
    """Stream generated text pieces for ``prompt`` (text, or token ids).

    ``media``: images and audio clips for a model with a projector (``load_model(..., mmproj=)``), one
    per :data:`MEDIA_MARKER` in the text prompt, in order; each a path, bytes, a ``data:`` URL, a numpy
    array or a PIL image (core/media.py). A :class:`MediaPrompt` (``Projector.tokenize``) is taken as is.

    Options: sampling (:class:`SamplingParams`: temp, top_k, top_p, seed, grammar, ...),
    generation (:class:`GenerationParams`: max_tokens=256, stop, logprobs, ...) and context
    (:class:`ContextParams`: n_ctx=4096, type_k, flash_attn, ...). Unknown
    options raise TypeError. The stream is lazy; see :class:`TextStream`.

    ``cache_prompt`` is on here (default True; False for a model on RPC workers): the call runs on the model's pooled context whose
    tokens share the longest prefix with ``prompt`` and decodes only the rest. The reused part was
    computed in other batch shapes, so a greedy result may differ from a cold run's where the top two
    tokens are nearly tied; ``cache_prompt=False`` starts from an empty context.
    """
    gen_opts, sampling_opts, ctx_opts = split_options(
        opts, GenerationParams, SamplingParams, ContextParams, where="unknown")
    # (a pooled context must not carry one call's adapters into the next)
    if gen_opts.get("lora") is None:
        gen_opts["lora"] = {}
    # A pooled context keeps its last call's tokens: a prompt that extends them (a chat loop's history)
    # decodes only what is new, as llama-cpp-python's Llama and llama-server do. Not yet on RPC workers:
    # a prefix kept on a worker that another model, freed meanwhile, shared failed its next read
    # (tests/test_rpc.py, the killed-worker test); cold runs there are known good.
    gen_opts.setdefault("cache_prompt", not model.uses_rpc)
    gparams = GenerationParams(**gen_opts)
    sparams = SamplingParams(**sampling_opts)
    if ctx_opts.get("embeddings"):
        # (an embeddings context outputs a row for every prompt token: n_batch rows of n_vocab logits)
        raise InvalidArgumentError("embeddings=True: generate and stream compute no embeddings; use lc.embed, or "
                                   "Context.create(model, embeddings=True) to read them beside the logits")
    # One logits row per decode is all a single sequence needs; llama.cpp's default reserves
    # n_batch rows (for Gemma's 262k vocabulary a 514 MiB compute buffer instead of 26 MiB).
    # It also reserves one row per sequence at creation, so never fewer than n_seq_max.
    n_seq = ctx_opts.get("n_seq_max", 1)
    ctx_opts.setdefault("n_outputs_max", n_seq if isinstance(n_seq, int) and not isinstance(n_seq, bool)
                        and n_seq > 1 else 1)
    cparams = ContextParams(**ctx_opts)
    if media is not None or isinstance(prompt, MediaPrompt):
        tokens = media_prompt(model, prompt, media or (), gparams)
    else:
        tokens = prompt_tokens(model, prompt, gparams, cparams.n_ctx or model.n_ctx_train)
    pool = ContextPool.of(model)
    sampler = Sampler(model, sparams, n_ctx=cparams.n_ctx or model.n_ctx_train)
    try:
        ctx = pool.checkout(model, cparams, tokens if gparams.cache_prompt else None)
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


def generate(model: "Model", prompt: str | Sequence[int], *, media: Sequence[MediaInput] | None = None,
             **opts: Any) -> Completion:
    """Generate a completion for ``prompt``; same options as :func:`stream`.

    Returns a :class:`Completion` (``str(completion)`` is the text) with the
    finish reason (``"stop"``, ``"length"`` or ``"eog"``) and timings.
    """
    return stream(model, prompt, media=media, **opts).completion()


def media_prompt(model: "Model", prompt: str | Sequence[int], media: Sequence[MediaInput],
                 params: GenerationParams, limits: MediaLimits | None = None) -> MediaPrompt:
    """A text prompt with :data:`MEDIA_MARKER` s and its media as a :class:`MediaPrompt` of ``model``'s
    projector (MediaError when the model has none)."""
    if model.closed:
        raise ClosedError("Model is closed")
    projector = model.projector
    if isinstance(prompt, MediaPrompt):
        if media:
            raise InvalidArgumentError("media= goes with a text prompt; this MediaPrompt has its media already")
        if projector is None or prompt.chunks.projector is not projector:
            raise InvalidArgumentError("this MediaPrompt was made by another model's projector")
        return prompt
    if projector is None or projector.closed:
        raise MediaError(f"{model.path.name} takes no images or audio: load a projector with "
                         "load_model(path, mmproj=...) or model.attach_projector(...)")
    if not isinstance(prompt, str):
        raise ArgumentTypeError("a prompt with media must be text, with one MEDIA_MARKER per image or audio clip")
    if isinstance(media, (str, bytes)) or not isinstance(media, Sequence):
        raise ArgumentTypeError("media must be a list (one item per MEDIA_MARKER)")
    items = media_of(media, projector, limits)
    text = prompt.replace(MEDIA_MARKER, projector.marker)
    return projector.tokenize(text, items, add_special=params.add_special, parse_special=params.parse_special,
                              limits=limits)
