"""SpeculativeSession: one target context and a drafter, with generate/stream/stream_events."""

from __future__ import annotations

import functools
import random
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from ...core.context import Context, ContextLease
from ...core.generation import Completion, GenerationParams, GenerationResults, LazyStream
from ...core.handle import Closeable
from ...core.model import Model
from ...core.params import ContextParams, split_options
from ...core.prompt import check_prompt, prompt_tokens
from ...core.sampler import Sampler, SamplerBinding, SamplingParams
from ...core.target import StreamTarget
from ...core.text import RunControl, TextAssembler, assemble
from ...errors import ArgumentTypeError, ClosedError, InvalidArgumentError, MediaError
from .drafters import Drafter, rollback_snapshots
from .loop import MatchVerifier, SamplingVerifier, SpecRun, Verifier, speculative_loop
from .stats import SpeculativeEvent, SpeculativeStats, StatsRecorder
from .verify import numpy_supported

__all__ = ["SpeculativeSession", "SpeculativeStream", "SpeculativeEventStream", "MAX_DRAFT"]

#: Most tokens one step may draft (one verification decode scores n_draft + 1 rows).
MAX_DRAFT = 32


class SpeculativeSession(StreamTarget, Closeable):
    """Speculative decoding of one sequence at a time: a drafter proposes, ``model`` verifies.

    ``drafter``: :class:`DraftModel` (a small model sharing the vocabulary) or
    :class:`NgramDraft` (prompt lookup). ``n_draft`` (1..32, default 4): tokens drafted
    per step. Context options (``n_ctx=4096``, ``n_threads``, ``type_k``, ... the fields of
    :class:`ContextParams`) apply to the target context, and to a draft model's context
    unless it sets its own. The session owns both contexts and the drafter:
    ``close()`` (or ``with``) frees them once a running stream ends.

    Greedy output is the target's own greedy output; sampled output follows the target's
    sampling distribution (see docs/speculative.md). Reuse one session across prompts:
    each call starts from a clean sequence (or the shared prefix, with ``cache_prompt``).
    One generation runs at a time (a second concurrent one raises ``BusyError``). A session is a
    :class:`~llama_ctypes.GenerationTarget`: ``lc.chat``, tool calls and structured output run on it.
    """

    def __init__(self, model: Model, drafter: Drafter, n_draft: int = 4, **ctx_opts: Any) -> None:
        self._closed = True  # until fully built: a failed constructor leaves nothing to close
        if not isinstance(model, Model):
            raise ArgumentTypeError(f"model must be a Model, not {type(model).__name__}")
        if not isinstance(drafter, Drafter):
            raise ArgumentTypeError(f"drafter must be a Drafter (DraftModel, NgramDraft), not {type(drafter).__name__}")
        if isinstance(n_draft, bool) or not isinstance(n_draft, int) or not 1 <= n_draft <= MAX_DRAFT:
            raise InvalidArgumentError(f"n_draft={n_draft!r}: expected an integer in [1, {MAX_DRAFT}]")
        (copts,) = split_options(ctx_opts, ContextParams, where="SpeculativeSession: unknown")
        user = ContextParams(**copts)  # validates before anything is allocated
        if user.embeddings:
            raise InvalidArgumentError("speculative decoding generates text: an embeddings context "
                                       "(embeddings=True) cannot serve as its target")
        if model.has_encoder:
            raise InvalidArgumentError(f"{model.path.name} is an encoder model; speculative decoding "
                                       "needs a decoder-only model")
        rows = n_draft + 1
        if user.n_batch < rows or user.n_ubatch < rows:
            raise InvalidArgumentError(f"n_batch={user.n_batch} and n_ubatch={user.n_ubatch} must hold a "
                                       f"verification batch of n_draft + 1 = {rows} tokens")
        topts = dict(copts)
        topts["n_outputs_max"] = max(rows, user.n_outputs_max)
        if model.is_recurrent or model.is_hybrid:
            # A recurrent state cannot drop rejected drafts unless it kept a snapshot per drafted token.
            topts.setdefault("n_rs_seq", rollback_snapshots(n_draft, topts))
        if model.n_swa > 0:
            # Cutting rejected drafts back must never lose window cells the kept prefix needs.
            topts.setdefault("swa_full", True)
        self.model = model
        self.n_draft = n_draft
        self.drafter = drafter
        self._ctx = Context.create(model, **topts)
        try:
            drafter.attach(model, n_draft, copts, target=self._ctx)
        except BaseException:
            self._ctx.close()
            raise
        self._recorder = StatsRecorder()
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"n_ctx={self._ctx.n_ctx}"
        return f"<SpeculativeSession {self.model.path.name} drafter={self.drafter!r} n_draft={self.n_draft} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def context(self) -> Context:
        """The target context."""
        return self._ctx

    def stats(self) -> SpeculativeStats:
        """Cumulative counters (an immutable snapshot; any thread, never blocks the generation)."""
        return self._recorder.snapshot

    def close(self) -> None:
        """Free the contexts and the drafter (a running stream keeps them until it ends). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ctx.close()
        self.drafter.close()

    # ---- generation ----------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], **opts: Any) -> "SpeculativeStream":
        """A lazy stream of text pieces, like ``lc.stream``.

        Options: sampling (:class:`SamplingParams`: temp, top_k, top_p, min_p, seed, grammar,
        json_schema, penalties, ...) and generation (:class:`GenerationParams`: max_tokens=256,
        stop, ignore_eos, cache_prompt, logprobs, ...).
        """
        return SpeculativeStream(self._start(prompt, opts))

    def generate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        """Generate to the end; a :class:`Completion` (a ``str`` with tokens, finish reason, timings)."""
        return self.stream(prompt, **opts).completion()

    def stream_events(self, prompt: str | Sequence[int], emit_stats_every: int | None = None,
                      **opts: Any) -> "SpeculativeEventStream":
        """A lazy stream of :class:`SpeculativeEvent` (token, stats, eog, done); options as :meth:`stream`.

        ``emit_stats_every``: a ``"stats"`` event after every that many tokens (None: none).
        """
        if emit_stats_every is not None and (isinstance(emit_stats_every, bool) or not isinstance(
                emit_stats_every, int) or emit_stats_every < 1):
            raise InvalidArgumentError(f"emit_stats_every={emit_stats_every!r}: expected None or an integer >= 1")
        return SpeculativeEventStream(self._start(prompt, opts), emit_stats_every)

    def _start(self, prompt: str | Sequence[int], opts: dict[str, Any]) -> "_Generation":
        if self._closed:
            raise ClosedError("SpeculativeSession is closed")
        if getattr(prompt, "spans", None) is not None:  # a MediaPrompt (Projector.tokenize): images, audio
            raise MediaError("a SpeculativeSession does not take images or audio (its drafter follows token ids; "
                             "its context decodes no media): use the model or a Server without speculative=")
        gen_opts, sampling_opts = split_options(opts, GenerationParams, SamplingParams,
                                                where="SpeculativeSession: unknown")
        gparams, sparams = GenerationParams(**gen_opts), SamplingParams(**sampling_opts)
        if gparams.post_sampling:
            raise InvalidArgumentError("post_sampling=True is not offered with a single-sequence speculative "
                                       "session (a Server with speculative= offers it)")
        if gparams.reasoning_budget is not None:  # (a forced token is no draw of the sampler: no draft verifies it)
            raise InvalidArgumentError("a reasoning budget cannot be combined with speculative decoding (a Server "
                                       "with speculative= runs budgeted requests without drafts)")
        ctx = self._ctx
        tokens = prompt_tokens(ctx.vocab, prompt, gparams, ctx.n_ctx_seq)
        check_prompt(ctx, tokens)
        return _Generation(self, tokens, gparams, sparams)


class _Generation:
    """What a speculative stream's generator works on; it holds no reference to the stream object.

    It keeps the target context, the drafter's resources and its sampler alive from its
    creation to its end, so closing the session meanwhile is safe.
    """

    def __init__(self, session: SpeculativeSession, prompt: list[int], gparams: GenerationParams,
                 sparams: SamplingParams) -> None:
        self.ctx = ctx = session.context
        self.drafter = drafter = session.drafter
        self.n_draft = session.n_draft
        self.recorder = session._recorder
        self.prompt, self.gparams, self.sparams = prompt, gparams, sparams
        self.run = SpecRun(logprobs=gparams.logprobs is not None)
        self.pieces: list[str] = []
        # (a function of the resources, not a bound method: the run state must not point back at this
        # object, or a dropped stream would wait for the cycle collector)
        self.control = control = RunControl(functools.partial(_abort, ctx, drafter))
        try:
            control.defer(ctx.hold().release)
            control.defer(drafter.hold().release)
            # (built now: a bad grammar fails at the call, not at the first next())
            self.sampler = Sampler(ctx.model, sparams, n_ctx=ctx.n_ctx_seq, holder=ctx)
            control.defer(self.sampler.close)
        except BaseException:
            control.release()
            raise

    @property
    def cancelled(self) -> bool:
        return self.control.cancelled

    def _verifier(self, lease: ContextLease, binding: SamplerBinding) -> Verifier:
        # The speculative-sampling rule where the drafter gives q and numpy reproduces p; else Match.
        p = self.sparams
        if p.temp > 0 and self.drafter.has_distribution and numpy_supported(p):
            seed = p.seed if p.seed is not None else random.getrandbits(32)
            return SamplingVerifier(p, np.random.default_rng(seed), lease.logits_view_fn())
        return MatchVerifier(binding.sample)

    def tokens_iter(self) -> Iterator[int]:
        """Generated token ids, with every resource claimed from the first to the end."""
        if self.sampler.closed:
            raise ClosedError("this stream was closed")
        lease = self.ctx.lease(held=True)
        binding = None
        started = False
        try:
            # (drafts are verified from the logits: backend_sampling falls back here, said in the debug log)
            binding = self.sampler.bind(lease, held=True, seq=0, blocker="speculative")
            self.drafter.start()
            started = True
            if self.drafter.observes_target:
                lease.after_decode = self.drafter.target_decoded
            if not self.gparams.cache_prompt:
                # A cold draft context, as the target's: the draft distributions of a seeded call
                # then do not depend on what earlier calls left there (batch shapes round apart).
                self.drafter.reset()
            elif not self.drafter.follows(lease.tokens):
                # The drafter lost track of the target (an MTP cache cleared by an aborted decode):
                # both start cold, so it follows the prompt's recomputation again.
                lease.clear()
                self.drafter.reset()
            control = self.control
            loop = speculative_loop(lease, self._verifier(lease, binding), self.drafter, self.prompt,
                                    self.gparams, self.n_draft, self.run, self.recorder, lambda: control.cancelled)
            with control.running(self.run):
                yield from loop
        finally:
            if started:
                self.drafter.finish()
            if binding is not None:
                binding.release()
            lease.release()

    def events_iter(self, emit_stats_every: int | None) -> Iterator[SpeculativeEvent]:
        """Token events (with the text they release), periodic stats, eog and done."""
        run, params = self.run, self.gparams
        text = TextAssembler.for_vocab(self.ctx.vocab, params.special, params.stop)
        tail = ""
        try:
            # (the tokens' resources are released before the last events)
            for n, (tok, out) in enumerate(assemble(self.tokens_iter(), text, run, self.pieces, every_token=True), 1):
                if tok is None:
                    tail = out
                    break
                yield SpeculativeEvent("token", token=tok, text=out)
                if emit_stats_every and n % emit_stats_every == 0 and not text.stopped:
                    yield SpeculativeEvent("stats", stats=self.recorder.snapshot)
        finally:
            self.control.release()
        if run.finish_reason == "eog":
            yield SpeculativeEvent("eog", token=run.eog_token)
        yield SpeculativeEvent("done", text=tail, stats=self.recorder.snapshot,
                               finish_reason=run.finish_reason or "length")

    def pieces_iter(self) -> Iterator[str]:
        for ev in self.events_iter(None):
            if ev.text:
                yield ev.text


def _abort(ctx: Context, drafter: Drafter) -> None:
    ctx.abort()
    drafter.abort()


class _StreamBase(GenerationResults, LazyStream):
    """Results and control shared by the text and event streams of a session."""

    def __init__(self, g: _Generation, gen: Iterator[Any]) -> None:
        self._g = g
        self._gen = gen
        self._iter_lock = threading.Lock()

    def stats(self) -> SpeculativeStats:
        """The session's cumulative counters (see :meth:`SpeculativeSession.stats`)."""
        return self._g.recorder.snapshot

    def cancel(self) -> None:
        """Stop from any thread, interrupting a decode in flight; the iterating thread gets CancelledError."""
        self._g.control.cancel()

    def _after_close(self) -> None:
        self._g.control.release()


class SpeculativeStream(_StreamBase):
    """Text pieces of a speculative generation; the protocol of ``lc.stream``'s TextStream.

    Decoding starts at the first ``next()``; breaking out, ``close()`` or dropping the
    stream stops it and releases the contexts; ``cancel()`` works from any thread.
    """

    def __init__(self, g: _Generation) -> None:
        super().__init__(g, g.pieces_iter())


class SpeculativeEventStream(_StreamBase):
    """:class:`SpeculativeEvent` items of a speculative generation (see ``stream_events``)."""

    def __init__(self, g: _Generation, emit_stats_every: int | None) -> None:
        super().__init__(g, g.events_iter(emit_stats_every))
