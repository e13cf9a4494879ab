"""Drafters: cheap guesses of the target's next tokens, verified by the target in one decode.

A drafter knows nothing of who decodes the target. Per sequence it is asked
``draft(context_tokens, k)`` (``context_tokens``: the prompt and every token emitted
so far) and told ``accept(n_accepted)`` after verification; ``reset()`` forgets a
finished sequence. A session (or, later, a server slot) drives that cycle between
``start()`` and ``finish()``, which claim and release the drafter's native resources.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ...core.context import Context
from ...core.handle import Closeable, Hold
from ...core.model import Model, load_model
from ...core.params import ContextParams, ModelParams, split_options
from ...errors import ArgumentTypeError, ClosedError, InvalidArgumentError

if TYPE_CHECKING:
    from ...core.context import ContextLease
    from ...core.sampler import SamplingParams

__all__ = ["Drafter", "ContextDrafter", "NgramDraft", "DraftModel", "check_same_vocab", "ngram_lookup", "rollback_snapshots"]


class _NoHold:
    def release(self) -> None:
        pass


class Drafter(Closeable):
    """Base of every drafter: proposes up to ``k`` tokens that may follow ``context_tokens``.

    Subclasses implement :meth:`draft`; the other hooks default to doing nothing.
    One drafter serves one session (one sequence) at a time.
    """

    #: Whether :meth:`draft_sampled` gives the distributions its drafts were drawn from.
    has_distribution = False

    #: Whether the session reports every target decode to :meth:`target_decoded` (MTP drafts from
    #: the target's hidden state of each decoded token, prompt chunks included).
    observes_target = False

    def attach(self, model: Model, n_draft: int, ctx_opts: dict[str, Any], target: Context | None = None) -> None:
        """Bind to a session's target ``model`` (called once by the session; checks compatibility).

        ``ctx_opts``: the session's context options, for a drafter that makes a context;
        ``target``: the session's target context (for a drafter that reads its state).
        """

    def hold(self) -> Hold | _NoHold:
        """Keep the drafter's native resources alive until the result is released (a running stream)."""
        return _NoHold()

    def start(self) -> None:
        """Begin drafting for a new sequence (claims what :meth:`draft` needs; resets state)."""
        self.reset()

    def finish(self) -> None:
        """End the sequence begun by :meth:`start` (idempotent)."""

    def draft(self, context_tokens: Sequence[int], k: int) -> list[int]:  # pragma: no cover - abstract
        """Up to ``k`` tokens likely to follow ``context_tokens`` (fewer, or none, when unsure)."""
        raise NotImplementedError

    def draft_sampled(self, context_tokens: Sequence[int], k: int, params: "SamplingParams",
                      rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        """Drafts drawn from the drafter's distribution under ``params``, with those distributions.

        Only where ``has_distribution``; the session then verifies by speculative sampling.
        """
        raise NotImplementedError(f"{type(self).__name__} drafts deterministically")  # pragma: no cover

    def accept(self, n_accepted: int) -> None:
        """Feedback after verification: how many of the last draft's tokens the target kept."""

    def target_decoded(self, target: "ContextLease", tokens: Sequence[int], pos: int) -> None:
        """After every target decode, where ``observes_target``: ``tokens`` now sit at positions ``pos``..
        of the target (prompt chunks and verification runs); that decode's outputs are readable through
        ``target`` until its next decode."""

    def follows(self, target_tokens: Sequence[int]) -> bool:
        """Whether the drafter's state can continue from a target that holds ``target_tokens`` (a
        prefix reuse, ``cache_prompt``); False makes the session start both cold."""
        return True

    def reset(self) -> None:
        """Forget the current sequence."""

    def abort(self) -> None:
        """Stop a draft computation in flight, from any thread."""

    def close(self) -> None:
        """Release native resources (idempotent)."""


class NgramDraft(Drafter):
    """Prompt-lookup drafting: no second model.

    The longest suffix of the context (``n_max`` down to ``n_min`` tokens, defaults 4
    and 1) that also occurred earlier is looked up, and what followed its latest
    earlier occurrence is proposed. It wins when the output copies its input
    (quoting, editing code, extraction); elsewhere it proposes little and costs
    almost nothing.
    """

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        for name, value in (("n_min", n_min), ("n_max", n_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name}={value!r}: expected an integer >= 1")
        if n_min > n_max:
            raise InvalidArgumentError(f"n_min={n_min} must not exceed n_max={n_max}")
        self.n_min = n_min
        self.n_max = n_max

    def __repr__(self) -> str:
        return f"NgramDraft(n_min={self.n_min}, n_max={self.n_max})"

    def draft(self, context_tokens: Sequence[int], k: int) -> list[int]:
        return ngram_lookup(np.asarray(context_tokens, dtype=np.int64), k, self.n_min, self.n_max)


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    size = tokens.size
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # Starts i < size - n where tokens[i:i+n] equals the last n tokens.
        suffix = tokens[size - n:]
        hits = tokens[:size - n] == suffix[0]
        for j in range(1, n):
            hits &= tokens[j:size - n + j] == suffix[j]
        found = np.flatnonzero(hits)
        if found.size:
            start = int(found[-1]) + n
            return tokens[start:start + k].tolist()
    return []


def rollback_snapshots(n_draft: int, ctx_opts: dict[str, Any]) -> int:
    """Recurrent-state snapshots (``n_rs_seq``) for dropping up to ``n_draft`` tokens: llama.cpp keeps
    ``n_rs_seq + 1`` tokens of a sequence in one micro-batch, so ``n_ubatch`` bounds them (deeper
    rollbacks then recompute)."""
    return max(0, min(n_draft, ctx_opts.get("n_ubatch", ContextParams.n_ubatch) - 2))


def check_same_vocab(target: Model, draft: Model) -> None:
    """Raise InvalidArgumentError unless ``draft`` tokenizes exactly as ``target`` does
    (:meth:`Vocab.difference <llama_ctypes.Vocab.difference>`: size, BOS/EOS/EOT, end-of-generation ids,
    every token's bytes, as llama.cpp's common_speculative_are_compatible)."""
    if draft is target:
        return
    difference = target.vocab.difference(draft.vocab)
    if difference is not None:
        raise InvalidArgumentError(f"the draft model {draft.path.name} and the target {target.path.name} have "
                                   f"different vocabularies: {difference}")


class ContextDrafter(Drafter):
    """Base of drafters that own a context, made when a session (``attach``) or a server
    (``attach_server``) binds them: one user each, and ``close()`` frees the context once a running
    stream lets go of it."""

    _ctx: Context | None = None
    _lease: "ContextLease | None" = None
    _closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def context(self) -> Context | None:
        """The drafter's context (None until a session or server attaches the drafter)."""
        return self._ctx

    def _check_unbound(self) -> None:
        """Raise unless the drafter is open and serves nobody yet."""
        name = type(self).__name__
        if self._closed:
            raise ClosedError(f"{name} is closed")
        if self._ctx is not None:
            raise InvalidArgumentError(f"this {name} already serves a session or server; create one per user")

    def _attached(self) -> Context:
        if self._ctx is None:
            raise InvalidArgumentError(f"{type(self).__name__} is not attached to a session")
        return self._ctx

    def hold(self) -> Hold:
        return self._attached().hold()

    def start(self) -> None:
        # held=True: the running stream holds the context, so a session closed meanwhile
        # lets this sequence finish (the context is freed when it ends).
        self._lease = self._attached().lease(held=True)

    def finish(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def abort(self) -> None:
        ctx = self._ctx
        if ctx is not None:
            ctx.abort()

    def close(self) -> None:
        """Close the context (after a running stream ends) and what the drafter owns besides. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._ctx is not None:
            self._ctx.close()
        self._release_owned()

    def _release_owned(self) -> None:
        """Release what a subclass holds beyond its context (a model it loaded, a target it follows)."""


class DraftModel(ContextDrafter):
    """Drafting with a second, smaller model that shares the target's vocabulary.

    ``model``: a :class:`Model` (not owned: close it yourself) or a GGUF path (loaded
    here, with ``model_params``, and closed with the drafter). ``p_min`` (0..1, default 0):
    end a greedy draft before a token the draft model gives less than this probability.
    Context options (n_ctx, n_threads, ...) apply to the draft context; unset ones
    follow the session's. The draft context is created when a session attaches the drafter.
    """

    has_distribution = True

    def __init__(self, model: Model | str | os.PathLike, *, p_min: float = 0.0,
                 model_params: dict[str, Any] | None = None, **ctx_opts: Any) -> None:
        self._closed = True  # until built
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
            raise InvalidArgumentError(f"p_min={p_min!r}: expected a number in [0, 1]")
        (copts,) = split_options(ctx_opts, ContextParams, where="DraftModel: unknown")
        ContextParams(**copts)  # validated now, not at attach
        if isinstance(model, Model):
            if model_params:
                raise InvalidArgumentError("model_params only apply when the draft model is given as a path")
            self._model, self._owns_model = model, False
        elif isinstance(model, (str, os.PathLike)):
            (mp,) = split_options(model_params or {}, ModelParams, where="DraftModel model_params: unknown")
            self._model, self._owns_model = load_model(model, **mp), True
        else:
            raise ArgumentTypeError(f"DraftModel takes a Model or a GGUF path, not {type(model).__name__}")
        self.p_min = float(p_min)
        self._ctx_opts = copts
        self._ctx: Context | None = None
        self._lease: "ContextLease | None" = None
        self._closed = False

    @property
    def model(self) -> Model:
        return self._model

    def __repr__(self) -> str:
        return f"DraftModel({self._model.path.name!r}{', closed' if self._closed else ''})"

    def attach(self, model: Model, n_draft: int, ctx_opts: dict[str, Any], target: Context | None = None) -> None:
        self._check_unbound()
        check_same_vocab(model, self._model)
        opts = {**ctx_opts, **self._ctx_opts}
        # Drafting decodes one token at a time and reads one logits row.
        opts["n_outputs_max"] = max(1, opts.get("n_outputs_max") or 1)
        if self._model.is_recurrent or self._model.is_hybrid:
            # A recurrent state cannot drop the rejected drafts unless it kept a snapshot per token.
            opts.setdefault("n_rs_seq", rollback_snapshots(n_draft, opts))
        if self._model.n_swa > 0:
            opts.setdefault("swa_full", True)  # cutting rejected drafts back must not lose window cells
        self._ctx = Context.create(self._model, **opts)

    def attach_server(self, model: Model, n_seq: int, n_draft: int, ctx_opts: dict[str, Any]) -> Context:
        """Bind to a batching server's ``model``: a draft context with one sequence per slot (``n_seq``),
        owned by the drafter like a session's. ``ctx_opts``: the server's context options."""
        self._check_unbound()
        check_same_vocab(model, self._model)
        opts = {**ctx_opts, **self._ctx_opts}
        opts["n_seq_max"] = n_seq
        opts["n_outputs_max"] = n_seq  # one logits row per sequence and draft step
        if self._model.is_recurrent or self._model.is_hybrid:
            opts.setdefault("n_rs_seq", rollback_snapshots(n_draft, opts))
        if self._model.n_swa > 0:
            opts.setdefault("swa_full", True)
        self._ctx = Context.create(self._model, **opts)
        return self._ctx

    def reset(self) -> None:
        """Forget what the draft context holds: the next draft starts cold (the session calls this
        at the start of every call without ``cache_prompt``, so that a seeded call reproduces)."""
        lease = self._lease
        if lease is not None:
            lease.clear()

    def _sync(self, context_tokens: Sequence[int], k: int) -> tuple["ContextLease | None", int]:
        """The draft context brought to ``context_tokens`` (reusing the prefix it holds, and
        computing the logits of the last token), with how many tokens fit after them."""
        lease = self._lease
        if lease is None:
            raise InvalidArgumentError("DraftModel.draft outside start()/finish()")
        k = min(k, lease.ctx.n_ctx_seq - len(context_tokens))
        if k <= 0:  # a draft context smaller than the target's: stop drafting, keep generating
            return None, 0
        lease.prefill(list(context_tokens), reuse=True)
        return lease, k

    def draft(self, context_tokens: Sequence[int], k: int) -> list[int]:
        lease, k = self._sync(context_tokens, k)
        if lease is None:
            return []
        logits_of = lease.logits_view_fn()
        return greedy_draft(k, lambda: logits_of(-1), lease.append_fn(), lease.ctx.vocab.is_eog, self.p_min, _top_prob)

    def draft_sampled(self, context_tokens: Sequence[int], k: int, params: "SamplingParams",
                      rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        from .verify import sample_from, target_distribution

        lease, k = self._sync(context_tokens, k)
        if lease is None:
            return [], []
        logits_of, append = lease.logits_view_fn(), lease.append_fn()
        is_eog, out, q_rows = lease.ctx.vocab.is_eog, [], []
        for i in range(k):
            q = target_distribution(logits_of(-1), params)
            tok = sample_from(q, rng)
            out.append(tok)
            q_rows.append(q)
            if i == k - 1 or is_eog(tok):
                break
            append(tok)
        return out, q_rows

    def _release_owned(self) -> None:
        if self._owns_model:  # (a model loaded from a path)
            self._model.close()


def greedy_draft(k: int, row: Callable[[], np.ndarray], advance: Callable[[int], None], is_eog: Callable[[int], bool],
                 p_min: float, top_prob: Callable[[np.ndarray], float]) -> list[int]:
    """Up to ``k`` argmax tokens, one per step: ``row()`` is the logits row the next token comes from,
    ``advance(token)`` decodes that token so the next row follows it.

    Stops at a row whose top probability (``top_prob``) is under ``p_min`` (that token is not drafted),
    after an end of generation (nothing worth drafting follows it) and after the k-th token, which is
    not decoded.
    """
    out: list[int] = []
    for i in range(k):
        logits = row()
        tok = int(logits.argmax())
        if p_min > 0.0 and top_prob(logits) < p_min:
            break
        out.append(tok)
        if i == k - 1 or is_eog(tok):
            break
        advance(tok)
    return out


def _top_prob(row: np.ndarray) -> float:
    m = float(row.max())
    return 1.0 / float(np.exp(row.astype(np.float64) - m).sum())
