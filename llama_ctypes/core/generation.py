"""Single-sequence generation, in three layers (after mlx-lm's generate.py):

``token_loop`` yields token ids → ``TextStream`` turns them into UTF-8-safe text
pieces and applies stop strings (core/text.py, shared with the speculative and
server paths) → ``generate`` collects a :class:`Completion`.
The one-call ``generate``/``stream`` over a Model live in one_call.py; prompts are
checked in prompt.py. Nothing here imports the context at run time, so
``Context.generate/stream`` can build on this module.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping, Sequence

from ..errors import ArgumentTypeError, CancelledError, InvalidArgumentError
from .budget import ReasoningBudget
from .control_vector import ControlVector
from .handle import Closeable
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, post_sampling_logprob, token_logprob
from .lora import activation_start, check_lora_spec, resolve_loras
from .prompt import check_prompt
from .text import RunControl, TextAssembler, assemble
from .vocab import encode_text

if TYPE_CHECKING:
    from .context import Context, ContextLease
    from .sampler import Sampler

__all__ = ["GenerationParams", "Timings", "Completion", "TextStream", "LazyStream", "GenerationResults",
           "generate_with", "token_loop", "read_prompt", "FinishReason"]

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
    are nearly tied. Off by default here (``Context.generate``: the same input gives the same
    output); the one-call API (``lc.generate``, ``lc.stream``, chat on a Model) turns it on."""
    logprobs: int | None = None
    """Log-probabilities of the generated tokens (``Completion.logprobs``): None = off, 0 = the
    chosen token's only, 1..20 = also that many most likely alternatives. From the model's raw
    distribution (before temperature, penalties and grammar); see ``core/logprobs.py``."""
    post_sampling: bool = False
    """With ``logprobs``: report the probabilities after the sampler chain (truncation by top-k,
    top-p, min-p, ... and temperature; the candidates the token was drawn from; greedy: the chosen
    token at 1) instead of the model's raw distribution (llama-server's ``post_sampling_probs``). The
    tokens drawn are the same, but with a grammar and a temperature above 0: the grammar then masks
    the candidates before the chain (llama.cpp's exact path) instead of checking the chain's choice."""
    lora: Any = None
    """LoRA adapters for this generation: ``{adapter or name: scale}`` (names of ``model.loras``), one
    adapter or name (scale 1.0), or a list of them; ``{}``: none. None: the context keeps the adapters
    it applies (the one-call API and the Server then apply none). An activated LoRA applies from its
    invocation tokens on."""
    control_vector: Any = None
    """A :class:`~llama_ctypes.ControlVector` for this generation (``lc.load_control_vector``). None: the
    context keeps the one it applies (the one-call API then applies none; a Server applies its own)."""
    reasoning_budget: ReasoningBudget | None = None
    """At most that many tokens inside a thinking model's reasoning block, then its end is forced
    (:class:`~llama_ctypes.core.budget.ReasoningBudget`; chat builds it from ``reasoning_budget=N``)."""

    def __post_init__(self) -> None:
        for name in ("ignore_eos", "add_special", "parse_special", "special", "cache_prompt", "post_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentTypeError(f"{name}={getattr(self, name)!r}: expected True or False")
        if (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < -1
                or self.max_tokens == 0):
            raise InvalidArgumentError(f"max_tokens={self.max_tokens!r}: expected a positive integer or -1")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidArgumentError(f"stop={self.stop!r}: expected non-empty strings")
        for s in stop:
            encode_text(s)  # a lone surrogate can never appear in generated (UTF-8) text
        object.__setattr__(self, "stop", stop)
        if self.reasoning_budget is not None and not isinstance(self.reasoning_budget, ReasoningBudget):
            raise ArgumentTypeError(f"reasoning_budget={self.reasoning_budget!r}: expected a ReasoningBudget or None "
                                    "(chat takes a number of tokens)")
        if self.control_vector is not None and not isinstance(self.control_vector, ControlVector):
            raise ArgumentTypeError(f"control_vector={self.control_vector!r}: expected a ControlVector "
                                    "(lc.load_control_vector) or None")
        if self.lora is not None:
            check_lora_spec(self.lora)
            spec = self.lora
            # (kept as pairs: the parameters stay hashable and immutable)
            pairs = tuple(spec.items()) if isinstance(spec, Mapping) else \
                tuple((x, 1.0) for x in spec) if isinstance(spec, (list, tuple)) else ((spec, 1.0),)
            object.__setattr__(self, "lora", pairs)
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
                raise ArgumentTypeError(f"logprobs={self.logprobs!r}: expected None or an integer "
                                        f"0..{MAX_TOP_LOGPROBS}")
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidArgumentError(f"logprobs={self.logprobs!r}: expected None or an integer "
                                           f"0..{MAX_TOP_LOGPROBS} (alternatives per token)")
        elif self.post_sampling:
            raise InvalidArgumentError("post_sampling=True needs logprobs= (how many alternatives to report)")


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
    draft_tokens: int = 0  # speculative decoding: tokens drafted (0 without speculation)
    draft_accepted: int = 0  # of those, tokens the target kept

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
    ``prompt_tokens`` and ``timings`` describe the run. ``logprobs`` (when
    requested with ``logprobs=``, else None) holds one :class:`TokenLogprob`
    per entry of ``tokens``, in order.
    """

    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    timings: Timings
    logprobs: list[TokenLogprob] | None

    def __new__(cls, text: str, tokens: list[int], finish_reason: FinishReason, prompt_tokens: int,
                timings: Timings, logprobs: list[TokenLogprob] | None = None) -> "Completion":
        self = super().__new__(cls, text)
        self.tokens = tokens
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.timings = timings
        self.logprobs = logprobs
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Completion({str.__repr__(self)}, finish_reason={self.finish_reason!r}, tokens={len(self.tokens)})"


class _Run:
    """State of one generation: what the token loop reports to the layers above."""

    def __init__(self, logprobs: bool = False) -> None:
        self.finish_reason: FinishReason | None = None
        self.timings = Timings()
        self.tokens: list[int] = []
        #: One entry per token of ``tokens`` when logprobs were requested.
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None


def read_prompt(lease: ContextLease, prompt: list[int], params: GenerationParams) -> int:
    """Apply the generation's adapters and bring sequence 0 to ``prompt`` (logits of its last token
    ready); returns the tokens reused from the cache. An activated LoRA reads the prompt up to its
    invocation tokens without the adapter (that part stays reusable by plain requests) and the rest
    with it; absent invocation tokens leave the adapter off, as llama-server does."""
    reuse = params.cache_prompt
    if params.control_vector is not None:
        lease.set_control_vector(params.control_vector)
    if params.lora is None:
        return lease.prefill(prompt, reuse=reuse)
    wanted = resolve_loras(lease.ctx.model, dict(params.lora))
    start = activation_start(wanted, prompt)
    if start and getattr(prompt, "spans", None):
        raise InvalidArgumentError("an activated LoRA cannot start inside a prompt with images or audio yet")
    if not start:  # (None: plain adapters; 0: activated from the first token)
        lease.apply_loras(wanted)
        return lease.prefill(prompt, reuse=reuse)
    lease.apply_loras(())
    if start >= len(prompt):
        return lease.prefill(prompt, reuse=reuse)
    cached = lease.prefill(prompt[:start], reuse=reuse)
    lease.apply_loras(wanted)
    lease.extend(prompt[start:])
    return cached


def token_loop(lease: ContextLease, sample: Callable[[int], int], prompt: list[int], params: GenerationParams,
               run: _Run, cancelled: Callable[[], bool] = lambda: False,
               post: dict[int, Any] | None = None,
               accept_forced: Callable[[int, int], None] | None = None) -> Iterator[int]:
    """Yield generated token ids; the caller holds the context (``lease``) and the sampler.

    Each token is yielded before the next decode starts, so a consumer that
    stops iterating costs no extra decode. ``cancelled()`` is checked between
    tokens (an abort stops a decode in flight). With ``params.logprobs`` set,
    each token's :class:`TokenLogprob` goes to ``run.logprobs`` before it is yielded
    (with ``params.post_sampling``, from ``post``: the sampler binding's record of each row).
    With ``params.reasoning_budget``, a token the budget forces is not sampled: ``accept_forced(row,
    token)`` gives it to the sampler (required then).
    """
    t0 = time.perf_counter()
    timings = run.timings
    timings.prompt_tokens = len(prompt)
    timings.cached_tokens = read_prompt(lease, prompt, params)
    timings.prompt_ms = (time.perf_counter() - t0) * 1e3
    vocab = lease.ctx.vocab
    eog_get, is_eog = vocab.eog_cache().get, vocab.is_eog
    append = lease.append_fn()
    tokens, ctx_tokens = run.tokens, lease.tokens
    max_tokens, n_ctx, ignore_eos = params.max_tokens, lease.ctx.n_ctx_seq, params.ignore_eos
    logprob = None
    if params.logprobs is not None:
        logprob = _logprob_fn(lease, params, post)
        if run.logprobs is None:
            run.logprobs = []
    entries = run.logprobs
    budget = None
    if params.reasoning_budget is not None:
        if accept_forced is None:
            raise InvalidArgumentError("a reasoning budget needs a runner that can give forced tokens to its sampler")
        budget = params.reasoning_budget.start(lease.ctx.vocab)
    clock = time.perf_counter
    decode_s = sample_s = 0.0
    t_first = None
    try:
        while True:
            ts = clock()
            forced = budget.forced() if budget is not None else None
            if forced is None:
                tok = sample(-1)
                if budget is not None:
                    budget.seen(tok)
            else:
                tok = forced
                accept_forced(-1, tok)  # type: ignore[misc]
            te = clock()
            sample_s += te - ts
            if t_first is None:
                t_first = te
                timings.ttft_ms = (te - t0) * 1e3
                sample_s = 0.0  # count generation from the first token on
            if not ignore_eos:
                eog = eog_get(tok)
                if eog is None:
                    eog = is_eog(tok)
                if eog:
                    run.finish_reason = "eog"
                    return
            tokens.append(tok)
            if logprob is not None:  # (one test per token when off: the loop keeps its speed)
                entries.append(logprob(tok))  # type: ignore[union-attr]
            timings.generated_tokens = len(tokens)
            yield tok
            if len(tokens) == max_tokens or len(ctx_tokens) >= n_ctx:
                run.finish_reason = "length"
                return
            if cancelled():
                return
            ts = clock()
            append(tok)
            decode_s += clock() - ts
    finally:
        if t_first is not None:
            timings.generation_ms = (clock() - t_first) * 1e3
            timings.decode_ms = decode_s * 1e3
            timings.sample_ms = sample_s * 1e3


def in_graph_blocker(params: GenerationParams) -> str | None:
    """What of these parameters keeps sampling out of the decode graph (it reads the logits), or None."""
    return "logprobs" if params.logprobs is not None else None


def post_candidates(params: GenerationParams) -> int:
    """Candidates a sampler binding keeps per row for these parameters (0: none)."""
    return max(params.logprobs or 0, 1) if params.post_sampling else 0


def _logprob_fn(lease: ContextLease, params: GenerationParams,
                post: dict[int, Any] | None = None) -> Callable[[int], TokenLogprob]:
    """``token -> TokenLogprob`` over the last decode's output row (the row the token was sampled
    from, still unchanged: sampling copies the logits), or from what the sampler chain left of it
    (``params.post_sampling``); pieces rendered as the stream renders them."""
    logits_of, k, special = lease.logits_view_fn(), params.logprobs or 0, params.special
    token_bytes = lease.ctx.vocab.token_bytes

    def piece(token: int) -> bytes:
        return token_bytes(token, special)

    if params.post_sampling:
        if post is None:
            raise InvalidArgumentError("post_sampling=True is not available on this path")

        def post_entry(token: int) -> TokenLogprob:
            return post_sampling_logprob(post.pop(-1), k, piece)

        return post_entry

    def entry(token: int) -> TokenLogprob:
        return token_logprob(logits_of(-1), token, k, piece)

    return entry


class LazyStream(Closeable):
    """Iteration, cancellation and lifetime shared by every stream (text, server, chat).

    A subclass sets ``_gen``, a generator built by a function that does not refer
    back to the stream: then dropping the stream (e.g. breaking out of a ``for``
    over ``lc.stream(...)``) frees it at once by reference counting, which
    closes the generator and stops the work, with no wait for the cycle
    collector. ``cancel()`` may be called from any thread; ``close()`` from the
    iterating thread or any other.
    """

    _gen: Iterator[Any]
    #: Serialises next() and close() when a subclass sets it: a close() from another thread then
    #: cancels the work, waits for the step in flight to end, and closes the generator — the
    #: iterating thread never sees "generator already executing".
    _iter_lock: threading.Lock | None = None

    def __iter__(self):
        return self

    def __next__(self):
        lock = self._iter_lock
        if lock is None:
            return next(self._gen)
        with lock:
            return next(self._gen)

    def cancel(self) -> None:  # pragma: no cover - defined by subclasses
        """Stop the work from any thread; the iterating thread then gets CancelledError."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop generating and release what the stream holds (idempotent, any thread)."""
        lock = self._iter_lock
        if lock is not None:
            if not lock.acquire(blocking=False):  # a step runs in another thread: stop it first
                self.cancel()
                lock.acquire()
            try:
                self._gen.close()
            finally:
                lock.release()
        else:
            try:
                self._gen.close()
            except ValueError:  # "generator already executing": it runs in another thread
                self.cancel()
        self._after_close()

    def _after_close(self) -> None:
        """Release what an unstarted generator's ``finally`` would have released."""


class _TextGeneration:
    """What a TextStream's generator works on. It holds no reference to the stream object."""

    def __init__(self, ctx: "Context", sampler: Sampler, prompt: list[int], params: GenerationParams,
                 on_close: Callable[[], None] | None):
        self.ctx = ctx
        self.sampler = sampler
        self.prompt = prompt
        self.params = params
        # (logprobs: the list exists from the start, so TextStream.logprobs is [] before the first token)
        self.run = _Run(logprobs=params.logprobs is not None)
        self.pieces: list[str] = []
        self.control = control = RunControl(ctx.abort)
        # The stream keeps the context and the sampler alive from its creation to its end: a
        # ``with Sampler.create(...) as s: st = ctx.stream(s, ids)`` read later must not free them.
        control.defer(ctx.hold().release)
        try:
            control.defer(sampler.hold().release)
        except BaseException:
            control.release()
            raise
        if on_close is not None:
            control.defer(on_close)

    @property
    def cancelled(self) -> bool:
        return self.control.cancelled

    def tokens_iter(self) -> Iterator[int]:
        """Generated token ids, with the context and the sampler claimed from the first to the end;
        everything the stream holds is released when it ends."""
        try:
            lease = self.ctx.lease(held=True)
            try:
                binding = self.sampler.bind(lease, held=True, candidates=post_candidates(self.params), seq=0,
                                            blocker=in_graph_blocker(self.params))
            except BaseException:
                lease.release()
                raise
            control = self.control
            try:
                with control.running(self.run):
                    yield from token_loop(lease, binding.sample, self.prompt, self.params, self.run,
                                          lambda: control.cancelled, binding.post, binding.accept_forced)
            finally:
                binding.release()
                lease.release()
        finally:
            self.control.release()

    def pieces_iter(self) -> Iterator[str]:
        """The non-empty text pieces (their tokens' resources released before the last one)."""
        text = TextAssembler.for_vocab(self.ctx.vocab, self.params.special, self.params.stop)
        return assemble(self.tokens_iter(), text, self.run, self.pieces)


class GenerationResults:
    """The results a single-sequence stream shows: ``self._g`` holds ``run`` (finish reason, timings,
    tokens, logprobs), ``pieces``, ``prompt`` and ``cancelled`` (plain and speculative generation)."""

    _g: Any

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._g.run.finish_reason

    @property
    def timings(self) -> Timings:
        return self._g.run.timings

    @property
    def tokens(self) -> list[int]:
        return self._g.run.tokens

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._g.pieces)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One entry per token of ``tokens`` so far (None unless requested with ``logprobs=``)."""
        return self._g.run.logprobs

    @property
    def prompt_tokens(self) -> int:
        return len(self._g.prompt)

    @property
    def cancelled(self) -> bool:
        return self._g.cancelled

    def completion(self) -> Completion:
        """Run to the end (if not done) and return the :class:`Completion`."""
        lock = getattr(self, "_iter_lock", None)
        if lock is None:
            for _ in self:
                pass
        else:
            with lock:  # (once, not per token: a close() from another thread cancels, then waits for this)
                for _ in self._gen:  # type: ignore[attr-defined]
                    pass
        g = self._g
        if g.run.finish_reason is None:
            # closed (from another thread, between two steps) before its end: not a finished run
            raise CancelledError("the stream was closed before the end of the generation")
        entries = g.run.logprobs
        return Completion("".join(g.pieces), list(g.run.tokens), g.run.finish_reason, len(g.prompt),
                          g.run.timings, None if entries is None else list(entries))


class TextStream(GenerationResults, LazyStream):
    """A lazy stream of generated text pieces (``for piece in stream: ...``).

    Decoding starts at the first ``next()``, which claims the context and the
    sampler (``BusyError`` if another generation holds either). Breaking out of
    the loop, ``close()`` or dropping the stream stops decoding at once and
    releases both. ``cancel()``, from any thread, also interrupts a decode in
    flight (a long prompt); the iterating thread then gets ``CancelledError``.
    After the end, ``finish_reason``, ``timings``, ``tokens``, ``text`` and
    ``logprobs`` describe the run.
    """

    def __init__(self, ctx: "Context", sampler: Sampler, prompt: list[int], params: GenerationParams,
                 on_close: Callable[[], None] | None = None):
        self._g = g = _TextGeneration(ctx, sampler, prompt, params, on_close)
        self._gen = g.pieces_iter()
        self._iter_lock = threading.Lock()
        try:
            check_prompt(ctx, prompt)  # fail at the call, not at the first next()
        except BaseException:
            self.close()
            raise

    def cancel(self) -> None:
        """Stop the generation from any thread, interrupting a decode in flight."""
        self._g.control.cancel()

    def _after_close(self) -> None:
        self._g.control.release()


def generate_with(ctx: "Context", sampler: Sampler, prompt: list[int], params: GenerationParams) -> Completion:
    """Generate to completion with an existing context and sampler."""
    return TextStream(ctx, sampler, prompt, params).completion()
