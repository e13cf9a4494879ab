"""Single-sequence generation, in three layers (after mlx-lm's generate.py):

``token_loop`` yields token ids → ``TextStream`` turns them into UTF-8-safe text
pieces and applies stop strings → ``generate`` collects a :class:`Completion`.
The module functions ``generate``/``stream`` wrap these for a Model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Sequence

from ..errors import ContextOverflowError, DecodeError
from .handle import Closeable
from .params import ContextParams, split_options
from .sampler import Sampler, SamplingParams
from .tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

FinishReason = Literal["stop", "length", "eog"]


@dataclass(frozen=True)
class GenerationParams:
    """When generation ends and how text is produced."""

    max_tokens: int = 256
    """Most tokens to generate; -1 = until end-of-generation or a full context."""
    stop: Sequence[str] = ()
    """Strings that end generation; they are not included in the output."""
    ignore_eos: bool = False
    """Keep generating past end-of-generation tokens."""
    add_special: bool = True
    """Add BOS/EOS when tokenizing a text prompt, as the model's metadata asks."""
    parse_special: bool = True
    """Turn special-token text in a text prompt (e.g. ``<|im_start|>``) into special tokens."""
    special: bool = False
    """Render special tokens in the output text."""
    cache_prompt: bool = False
    """Reuse the KV cache of the longest common prefix with the context's previous prompt.

    Faster for repeated prefixes, but the reused part was computed in other batch
    shapes, so greedy output may differ from a cold run where the top two tokens
    are nearly tied. Off by default: the same input gives the same output."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < -1 or self.max_tokens == 0:
            raise ValueError(f"max_tokens={self.max_tokens!r}: expected a positive integer or -1")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r}: expected non-empty strings")
        object.__setattr__(self, "stop", stop)


@dataclass
class Timings:
    """Where the time of one generation went. Times in milliseconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not recomputed
    generated_tokens: int = 0
    prompt_ms: float = 0.0  # prefill wall time
    ttft_ms: float = 0.0  # start of the call to the first token
    generation_ms: float = 0.0  # first token to the last
    decode_ms: float = 0.0  # inside llama_decode during generation
    sample_ms: float = 0.0  # inside the native sampler during generation

    @property
    def prompt_tokens_per_s(self) -> float:
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second, after the first token."""
        n = self.generated_tokens - 1
        return n / (self.generation_ms / 1e3) if self.generation_ms > 0 and n > 0 else 0.0

    @property
    def outside_decode_us_per_token(self) -> float:
        """Time per generated token spent outside llama_decode (sampling included), in microseconds."""
        n = self.generated_tokens - 1
        return max(0.0, self.generation_ms - self.decode_ms) * 1e3 / n if n > 0 else 0.0

    @property
    def python_us_per_token(self) -> float:
        """Time per generated token spent outside llama_decode and the sampler, in microseconds."""
        n = self.generated_tokens - 1
        if n <= 0:
            return 0.0
        return max(0.0, self.generation_ms - self.decode_ms - self.sample_ms) * 1e3 / n


class Completion(str):
    """Generated text (a ``str``) carrying how it was produced.

    ``lc.generate(...)`` returns one, so it can be used as the text directly;
    ``tokens``, ``finish_reason`` (``"stop"``, ``"length"`` or ``"eog"``),
    ``prompt_tokens`` and ``timings`` describe the run.
    """

    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    timings: Timings

    def __new__(cls, text: str, tokens: list[int], finish_reason: FinishReason, prompt_tokens: int,
                timings: Timings) -> "Completion":
        self = super().__new__(cls, text)
        self.tokens = tokens
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.timings = timings
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Completion({str.__repr__(self)}, finish_reason={self.finish_reason!r}, tokens={len(self.tokens)})"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Run:
    """State of one generation: what the token loop reports to the layers above."""

    def __init__(self) -> None:
        self.finish_reason: FinishReason | None = None
        self.timings = Timings()
        self.tokens: list[int] = []


def check_prompt(ctx: "Context", prompt: Sequence[int]) -> None:
    """Raise if ``prompt`` is empty, holds unknown token ids, or leaves no room to generate."""
    if ctx.encoder_only:
        raise ValueError(f"{ctx.model.path.name} is an encoder-only model: it embeds (lc.embed), it cannot generate")
    n_ctx = ctx.n_ctx_seq
    if not prompt:
        raise ValueError("the prompt is empty (no tokens)")
    if len(prompt) >= n_ctx:
        raise ContextOverflowError(
            f"prompt of {len(prompt)} tokens does not fit the context window of {n_ctx} tokens "
            "(at least one token must be generated); use a larger n_ctx or a shorter prompt",
            n_tokens=len(prompt), n_ctx=n_ctx,
        )
    bad = [t for t in prompt if not 0 <= t < ctx.n_vocab]
    if bad:
        raise ValueError(f"prompt holds token ids outside the vocabulary [0, {ctx.n_vocab}): {bad[:5]}")


def _prefill(ctx: "Context", prompt: list[int], run: _Run, cache_prompt: bool) -> None:
    """Bring the KV cache of sequence 0 to ``prompt`` (reusing the common prefix when asked)."""
    check_prompt(ctx, prompt)
    lib, mem = ctx._lib, ctx._mem
    common = common_prefix(ctx.tokens, prompt) if cache_prompt else 0
    if common == len(prompt):
        common -= 1  # the last prompt token must be decoded again to get its logits
    if common < len(ctx.tokens) and not lib.llama_memory_seq_rm(mem, 0, common, -1):
        # Recurrent and hybrid memories cannot drop a tail: start over.
        ctx._clear()
        common = 0
    del ctx.tokens[common:]
    run.timings.prompt_tokens = len(prompt)
    run.timings.cached_tokens = common
    batch = ctx._batch
    pos = common
    try:
        while pos < len(prompt):
            chunk = prompt[pos:pos + ctx.n_batch]
            batch.clear()
            batch.add_sequence(chunk, pos, 0, output_last=pos + len(chunk) == len(prompt))
            ctx._decode(batch)
            ctx.tokens.extend(chunk)
            pos += len(chunk)
    except BaseException:
        # A failed or interrupted decode leaves the cache state uncertain.
        ctx._clear()
        raise


def token_loop(ctx: "Context", sampler: Sampler, prompt: list[int], params: GenerationParams,
               run: _Run) -> Iterator[int]:
    """Yield generated token ids; the caller holds ``ctx`` exclusively.

    Each token is yielded before the next decode starts, so a consumer that
    stops iterating costs no extra decode.
    """
    t0 = time.perf_counter()
    _prefill(ctx, prompt, run, params.cache_prompt)
    timings = run.timings
    timings.prompt_ms = (time.perf_counter() - t0) * 1e3
    lib, ctx_ptr, vocab = ctx._lib, ctx._ptr, ctx.model._vocab
    decode, native_is_eog = lib.llama_decode, lib.llama_vocab_is_eog
    eog_cache = ctx.model._eog_cache  # token id -> bool, so the hot loop skips a ctypes call
    eog_get = eog_cache.get
    sample = sampler.sample_fn(ctx)
    batch = ctx._batch
    native_batch = batch.native
    tokens, ctx_tokens = run.tokens, ctx.tokens
    max_tokens, n_ctx, ignore_eos = params.max_tokens, ctx.n_ctx_seq, params.ignore_eos
    clock = time.perf_counter
    decode_s = sample_s = 0.0
    t_first = None
    try:
        while True:
            ts = clock()
            tok = sample(-1)
            te = clock()
            sample_s += te - ts
            if t_first is None:
                t_first = te
                timings.ttft_ms = (te - t0) * 1e3
                sample_s = 0.0  # count generation from the first token on
            if not ignore_eos:
                eog = eog_get(tok)
                if eog is None:
                    eog = eog_cache[tok] = bool(native_is_eog(vocab, tok))
                if eog:
                    run.finish_reason = "eog"
                    return
            tokens.append(tok)
            timings.generated_tokens = len(tokens)
            yield tok
            if len(tokens) == max_tokens or len(ctx_tokens) >= n_ctx:
                run.finish_reason = "length"
                return
            batch.token[0] = tok
            batch.pos[0] = len(ctx_tokens)
            batch.logits[0] = 1
            native_batch.n_tokens = 1
            batch.n_tokens = 1
            ts = clock()
            rc = decode(ctx_ptr, native_batch)
            decode_s += clock() - ts
            if rc != 0:
                ctx._clear()
                raise DecodeError(f"llama_decode failed with {rc} during generation", code=rc)
            ctx_tokens.append(tok)
    finally:
        if t_first is not None:
            timings.generation_ms = (clock() - t_first) * 1e3
            timings.decode_ms = decode_s * 1e3
            timings.sample_ms = sample_s * 1e3


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``.

    Streaming code holds that much text back: it may be the start of a stop string or a marker.
    """
    best = 0
    for stop in markers:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class StopFilter:
    """Applies stop strings to streamed text: emits what is safe, holds back a possible stop prefix."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Text that can be emitted now; sets ``stopped`` when a stop string appears (it is dropped)."""
        if not self.stops:
            return piece
        self.pending += piece
        hit = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self.pending, self.stopped = self.pending[:hit], "", True
            return out
        keep = partial_suffix(self.pending, self.stops)
        out, self.pending = (self.pending[:-keep], self.pending[-keep:]) if keep else (self.pending, "")
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class LazyStream(Closeable):
    """Iteration and lifetime shared by text streams: subclasses set ``_gen`` and define ``close()``.

    Leaving a ``with`` block or dropping the stream closes it, which stops the generation.
    """

    _gen: Iterator[str]

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._gen)


class TextStream(LazyStream):
    """A lazy stream of generated text pieces (``for piece in stream: ...``).

    Decoding starts at the first ``next()``; breaking out of the loop, calling
    ``close()`` or dropping the stream stops decoding at once and releases the
    context. After the stream ends, ``finish_reason``, ``timings``,
    ``tokens`` and ``text`` describe the run.
    """

    def __init__(self, ctx: "Context", sampler: Sampler, prompt: list[int], params: GenerationParams,
                 on_close: Callable[[], None] | None = None):
        self._ctx = ctx
        self._sampler = sampler
        self._prompt = prompt
        self._params = params
        self._on_close = on_close
        self._run = _Run()
        self._pieces: list[str] = []
        self._gen = self._generate()
        try:
            check_prompt(ctx, prompt)  # fail at the call, not at the first next()
        except BaseException:
            self.close()
            raise

    # results
    @property
    def finish_reason(self) -> FinishReason | None:
        return self._run.finish_reason

    @property
    def timings(self) -> Timings:
        return self._run.timings

    @property
    def tokens(self) -> list[int]:
        return self._run.tokens

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._pieces)

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt)

    def close(self) -> None:
        """Stop generating and release the context (idempotent)."""
        self._gen.close()
        self._release()

    def _release(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def completion(self) -> Completion:
        """Run to the end (if not done) and return the :class:`Completion`."""
        for _ in self._gen:
            pass
        return Completion(self.text, list(self.tokens), self.finish_reason or "length", len(self._prompt),
                          self.timings)

    def _generate(self) -> Iterator[str]:
        ctx, run, params = self._ctx, self._run, self._params
        pieces = self._pieces
        ctx._begin_exclusive()
        try:
            decoder = StreamDecoder(ctx.model, special=params.special)
            stops = StopFilter(params.stop)
            for tok in token_loop(ctx, self._sampler, self._prompt, params, run):
                out = stops.feed(decoder.push(tok))
                if out:
                    pieces.append(out)
                    yield out
                if stops.stopped:
                    run.finish_reason = "stop"
                    break
            if not stops.stopped:
                out = stops.feed(decoder.flush())
                if stops.stopped:
                    run.finish_reason = "stop"
                else:
                    out += stops.flush()
                if out:
                    pieces.append(out)
                    yield out
        finally:
            ctx._end_exclusive()
            self._release()


def generate_with(ctx: "Context", sampler: Sampler, prompt: list[int], params: GenerationParams) -> Completion:
    """Generate to completion with an existing context and sampler."""
    return TextStream(ctx, sampler, prompt, params).completion()


# ---- the one-call API over a Model -------------------------------------------------------

def _prompt_tokens(model: "Model", prompt: str | Sequence[int], params: GenerationParams) -> list[int]:
    if isinstance(prompt, str):
        return Tokenizer.encode(model, prompt, add_special=params.add_special, parse_special=params.parse_special)
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be str or a sequence of token ids, not bytes")
    return [int(t) for t in prompt]


def stream(model: "Model", prompt: str | Sequence[int], **opts: Any) -> TextStream:
    """Stream generated text pieces for ``prompt`` (text, or token ids).

    Options: sampling (:class:`SamplingParams`: temp, top_k, top_p, seed, grammar, ...),
    generation (:class:`GenerationParams`: max_tokens=256, stop, ...) and context
    (:class:`ContextParams`: n_ctx=4096, type_k, flash_attn, ...). Unknown
    options raise TypeError. The stream is lazy; see :class:`TextStream`.
    """
    gen_opts, sampling_opts, ctx_opts = split_options(
        opts, GenerationParams, SamplingParams, ContextParams, where="unknown")
    gparams = GenerationParams(**gen_opts)
    sparams = SamplingParams(**sampling_opts)
    cparams = ContextParams(**ctx_opts)
    tokens = _prompt_tokens(model, prompt, gparams)
    sampler = Sampler(model, sparams)
    try:
        ctx = model._checkout_context(cparams)
    except BaseException:
        sampler.close()
        raise

    def release() -> None:
        sampler.close()
        model._return_context(ctx)

    return TextStream(ctx, sampler, tokens, gparams, on_close=release)


def generate(model: "Model", prompt: str | Sequence[int], **opts: Any) -> Completion:
    """Generate a completion for ``prompt``; same options as :func:`stream`.

    Returns a :class:`Completion` (``str(completion)`` is the text) with the
    finish reason (``"stop"``, ``"length"`` or ``"eog"``) and timings.
    """
    return stream(model, prompt, **opts).completion()
