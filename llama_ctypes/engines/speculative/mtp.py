"""MTP: speculative decoding with the target model's own multi-token-prediction ("nextn") head.

Models such as Qwen 3.5/3.6 ship an extra decoder block (the MTP head) trained to predict the
token after next from two inputs: the embedding of a token and the target's last hidden state
(after the final norm) at the position before it. llama.cpp runs it in a second context over the
same model (``LLAMA_CONTEXT_TYPE_MTP``), whose KV cache holds that block's attention over every
position the target holds. :class:`MTPDraft` keeps that context in step with the target, as
llama.cpp's ``common_speculative_impl_draft_mtp`` does:

* after every target decode (prompt chunks and verification runs), the MTP context decodes the
  same tokens at the same positions, token ``p`` paired with the target's hidden row of position
  ``p - 1`` (:meth:`MTPDraft.target_decoded`, through the session's ``ContextLease.after_decode``);
* a draft decodes the pending token at ``pos0`` with the target's row of ``pos0 - 1``, takes the
  head's top token, and feeds each drafted token back with the head's own hidden row;
* the drafts are then cut off again: the verification run re-decodes them with the target's rows,
  and what the target rejects is cut from the MTP cache as from the target's.

The rows of the last ``n_draft + 1`` positions the target decoded are kept (a few KiB to a few
hundred KiB): the next batch's first token needs the row of the position before it, which the
target's next decode overwrites. Verification is the session's (``MatchVerifier``): the output
is the target's, for every sampler.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ...core.backend import init as native_lib
from ...core.context import Context
from ...core.handle import Hold
from ...core.model import Model, load_model
from ...core.params import ContextParams, ModelParams, split_options
from ...errors import ArgumentTypeError, InvalidArgumentError
from .drafters import ContextDrafter, greedy_draft
from .session import MAX_DRAFT, SpeculativeSession

if TYPE_CHECKING:
    from ...core.context import ContextLease

__all__ = ["MTP", "MTPDraft", "check_mtp_model", "MTP_ARCHITECTURES"]

#: Architectures whose single MTP head this drafter drives (llama.cpp's "neither shared memory nor
#: chained heads" mode, the one tested here). Others (Gemma 4 assistants sharing the target's KV,
#: Step 3.5's chained heads, DeepSeek/GLM/MiMo heads) are refused rather than run untested.
MTP_ARCHITECTURES = ("qwen35", "qwen35moe")

# llama.cpp's MTP drafter keeps the top 10 candidates and judges p_min on their softmax.
_TOP_K = 10


def n_layer_nextn(model: Model) -> int:
    """The model's MTP ("nextn") layers, from its GGUF metadata (0: none)."""
    hold = model.hold()
    try:
        return int(native_lib().llama_model_n_layer_nextn(model.native()))
    finally:
        hold.release()


def check_mtp_model(model: Model) -> None:
    """Raise InvalidArgumentError unless ``model`` can draft for itself with its MTP head here."""
    name = model.path.name
    n_nextn = n_layer_nextn(model)
    if n_nextn == 0:
        raise InvalidArgumentError(
            f"{name} has no multi-token-prediction (MTP/nextn) layers; MTP needs a GGUF converted with them "
            "(e.g. ggml-org/Qwen3.6-27B-MTP-GGUF). Use NgramDraft or DraftModel with this model")
    arch = model.architecture
    if arch not in MTP_ARCHITECTURES:
        raise InvalidArgumentError(f"{name} ({arch}): MTP drafting supports the single MTP head of "
                                   f"{', '.join(MTP_ARCHITECTURES)} models")
    if n_nextn != 1:
        raise InvalidArgumentError(f"{name} has {n_nextn} chained MTP heads; only a single head is supported")
    if not model.params.load_mtp:
        raise InvalidArgumentError(f"{name} was loaded without its MTP layers: load it with "
                                   "lc.load_model(path, load_mtp=True), or give lc.MTP the path")


class MTPDraft(ContextDrafter):
    """Drafting with the target model's own MTP head (a second context over the same weights).

    ``p_min`` (0..1, default 0): end a draft before a token the head gives less than this
    probability (among its top 10, as llama.cpp). Drafts are the head's greedy picks; the session
    verifies them by matching, so sampled output keeps the target's distribution. The model must
    be an MTP model (see :data:`MTP_ARCHITECTURES`) loaded with ``load_mtp=True``. The MTP context
    (same ``n_ctx`` as the target, one logits row) is created when a session attaches the drafter.
    """

    observes_target = True

    def __init__(self, *, p_min: float = 0.0) -> None:
        self._closed = True  # until built
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
            raise InvalidArgumentError(f"p_min={p_min!r}: expected a number in [0, 1]")
        self.p_min = float(p_min)
        self._ctx: Context | None = None
        self._target_hold: Hold | None = None
        self._lease: "ContextLease | None" = None
        self._zeros = np.zeros(0, dtype=np.float32)
        # The target's hidden rows of its last decoded positions: _rows[j] is position _rows_pos + j.
        self._rows: np.ndarray | None = None
        self._rows_pos = 0
        self._keep_rows = 1
        self._last_batch = (-1, 0)  # (pos, n) of the last target decode mirrored
        self._last_draft = (-1, 0)  # (pos0, n) of the last draft
        self._closed = False

    def __repr__(self) -> str:
        return f"MTPDraft(p_min={self.p_min}{', closed' if self._closed else ''})"

    def attach(self, model: Model, n_draft: int, ctx_opts: dict[str, Any], target: Context | None = None) -> None:
        self._check_unbound()
        if target is None or target.model is not model:
            raise InvalidArgumentError("MTPDraft drafts from its session's target context "
                                       "(a SpeculativeSession attaches it)")
        # The MTP cache mirrors the target's positions (llama.cpp gives it the target's n_ctx); it is
        # a plain attention cache (no rollback snapshots) and a draft step reads one logits row.
        self._make_context(model, dict(ctx_opts, n_outputs_max=1), target)
        self._keep_rows = n_draft + 1

    def attach_server(self, model: Model, n_seq: int, ctx_opts: dict[str, Any], target: Context) -> Context:
        """Bind to a batching server's ``target`` context: an MTP context with one sequence per slot
        (``n_seq``), owned by the drafter like a session's; the server drives it."""
        self._check_unbound()
        return self._make_context(model, dict(ctx_opts, n_seq_max=n_seq, n_outputs_max=n_seq), target)

    def _make_context(self, model: Model, opts: dict[str, Any], target: Context) -> Context:
        check_mtp_model(model)
        if target.params.pooling not in ("none", "unspecified"):
            # llama.cpp writes the hidden rows an MTP head reads only without pooling.
            raise InvalidArgumentError(f"pooling={target.params.pooling!r}: MTP drafting needs a context "
                                       "without pooling (the head reads the per-token hidden rows)")
        opts.update(n_ctx=target.n_ctx, n_rs_seq=0, pooling="none")
        opts.pop("swa_full", None)
        hold = target.hold()  # the MTP context is made beside the target: keep the target until it goes
        try:
            ctx = Context(model, ContextParams(**opts), mtp_of=target)
            try:
                with target.lease() as tl:
                    tl.set_embeddings_nextn(True, False)  # a row per decoded token: every prompt chunk too
                with ctx.lease() as dl:
                    dl.set_embeddings_nextn(True, True)  # a row per output: the draft step's own
            except BaseException:
                ctx.close()
                raise
        except BaseException:
            hold.release()
            raise
        self._ctx, self._target_hold = ctx, hold
        self._zeros = np.zeros(model.n_embd_out, dtype=np.float32)
        return ctx

    def start(self) -> None:
        super().start()
        self._logits_of = self._lease.logits_view_fn()
        self._is_eog = self._ctx.vocab.is_eog

    def follows(self, target_tokens: Sequence[int]) -> bool:
        """Whether the MTP cache holds exactly what the target holds (it can fall behind when an
        aborted or failed MTP decode cleared it; only a cold start brings it back)."""
        lease = self._lease
        return lease is None or lease.tokens == list(target_tokens)

    def reset(self) -> None:
        """Forget the sequence: the MTP cache and the kept rows (a cold start, as the target's)."""
        lease = self._lease
        if lease is not None:
            lease.clear()
        self._rows = None
        self._last_batch = self._last_draft = (-1, 0)

    def _state_before(self, pos: int) -> np.ndarray:
        """The target's hidden row of position ``pos - 1`` (zeros when there is none to pair with)."""
        rows = self._rows
        if pos > 0 and rows is not None:
            j = pos - 1 - self._rows_pos
            if 0 <= j < len(rows):
                return rows[j]
        # Position 0 has no predecessor; otherwise a prefix reused from an earlier call (cache_prompt)
        # whose row was not kept: one position gets a neutral state (weaker drafts, same output).
        return self._zeros

    def target_decoded(self, target: "ContextLease", tokens: Sequence[int], pos: int) -> None:
        lease = self._lease
        if lease is None:
            return
        n = len(tokens)
        rows = target.nextn_rows(n)
        held = len(lease.tokens)
        if pos < held:
            # The target dropped these positions (rejected drafts, a new prompt): so does the MTP cache.
            if not lease.truncate(pos):
                lease.clear()
            held = len(lease.tokens)
        if pos == held:
            first = self._state_before(pos)
            base, step = rows.ctypes.data, rows.strides[0]
            states = [first.ctypes.data] + [base + i * step for i in range(n - 1)]
            lease.decode_with_states(tokens, states, output_last=False)
        # (pos > held: the MTP cache lacks earlier positions; the session mirrors every target decode,
        # so this does not happen through it. The cache then stays behind and draft() proposes nothing.)
        keep = min(n, self._keep_rows)
        self._rows = rows[n - keep:].copy()  # the next decode overwrites the target's buffer
        self._rows_pos = pos + n - keep
        self._last_batch = (pos, n)

    def draft(self, context_tokens: Sequence[int], k: int) -> list[int]:
        lease = self._lease
        if lease is None:
            raise InvalidArgumentError("MTPDraft.draft outside start()/finish()")
        pos0 = len(context_tokens) - 1  # where the pending token goes
        self._last_draft = (pos0, 0)
        k = min(k, lease.ctx.n_ctx_seq - pos0)  # the draft decodes positions pos0 .. pos0 + k - 1
        if k <= 0 or len(lease.tokens) < pos0:
            return []
        if len(lease.tokens) > pos0:
            lease.truncate(pos0)
        logits_of, is_eog, p_min = self._logits_of, self._is_eog, self.p_min
        state = self._state_before(pos0)
        out: list[int] = []

        def advance(tok: int) -> None:
            row = lease.nextn_row(-1)  # the head's own row (copied into the next batch before it runs)
            lease.decode_with_states([tok], [row.ctypes.data], output_last=True)

        try:
            lease.decode_with_states([int(context_tokens[-1])], [state.ctypes.data], output_last=True)
            out = greedy_draft(k, lambda: logits_of(-1), advance, is_eog, p_min, head_top_prob)
        finally:
            # The verification run re-decodes [pending] + drafts here with the target's own rows.
            if len(lease.tokens) > pos0:
                lease.truncate(pos0)
        self._last_draft = (pos0, len(out))
        return out

    def accept(self, n_accepted: int) -> None:
        lease = self._lease
        pos0, n = self._last_draft
        # Only right after the verification of this draft was mirrored (a rollback that recomputed the
        # target re-mirrored exactly the kept tokens, and a step without draft changes nothing).
        if lease is None or self._last_batch != (pos0, n + 1):
            return
        keep = pos0 + 1 + min(n_accepted, n)
        if len(lease.tokens) > keep and not lease.truncate(keep):
            lease.clear()

    def _release_owned(self) -> None:
        if self._target_hold is not None:  # let the target context go
            self._target_hold.release()


def head_top_prob(row: np.ndarray) -> float:
    """Probability of the top token among the top ``_TOP_K`` (llama.cpp's MTP candidates)."""
    top = np.partition(row, -_TOP_K)[-_TOP_K:].astype(np.float64) if row.size > _TOP_K else row.astype(np.float64)
    return 1.0 / float(np.exp(top - top.max()).sum())


class MTP(SpeculativeSession):
    """Speculative decoding with the model's own multi-token-prediction head (no second model).

    ``model``: a :class:`Model` loaded with ``load_mtp=True`` (not owned), or a GGUF path (loaded
    here with ``load_mtp=True`` and ``model_params``, closed with the session). ``n_draft`` (1..32,
    default 3, llama.cpp's default): tokens drafted per step. ``p_min``: see :class:`MTPDraft`.
    Context options (``n_ctx=4096``, ``n_threads``, ...) apply to the target context and to the MTP
    context. Otherwise a :class:`SpeculativeSession`: ``generate``, ``stream``, ``stream_events``,
    ``stats()``, ``close()``, ``with``.
    """

    def __init__(self, model: Model | str | os.PathLike, n_draft: int = 3, *, p_min: float = 0.0,
                 model_params: dict[str, Any] | None = None, **ctx_opts: Any) -> None:
        self._closed = True  # until fully built
        self._owned_model: Model | None = None
        if isinstance(n_draft, bool) or not isinstance(n_draft, int) or not 1 <= n_draft <= MAX_DRAFT:
            raise InvalidArgumentError(f"n_draft={n_draft!r}: expected an integer in [1, {MAX_DRAFT}]")
        drafter = MTPDraft(p_min=p_min)
        (copts,) = split_options(ctx_opts, ContextParams, where="MTP: unknown")
        ContextParams(**copts)  # validated before a model is loaded
        owned = None
        if isinstance(model, (str, os.PathLike)):
            (mp,) = split_options(model_params or {}, ModelParams, where="MTP model_params: unknown")
            if mp.get("load_mtp") is False:
                raise InvalidArgumentError("MTP drafts with the model's MTP layers: "
                                           "model_params load_mtp=False contradicts it")
            model = owned = load_model(model, **{**mp, "load_mtp": True})
        elif isinstance(model, Model):
            if model_params:
                raise InvalidArgumentError("model_params only apply when the model is given as a path")
        else:
            raise ArgumentTypeError(f"MTP takes a Model or a GGUF path, not {type(model).__name__}")
        try:
            check_mtp_model(model)  # before the session allocates its target context
            super().__init__(model, drafter, n_draft, **copts)
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        self._owned_model = owned

    def close(self) -> None:
        """Free both contexts, and the model when the session loaded it (after a running stream ends)."""
        was_open = not self._closed
        super().close()
        owned, self._owned_model = self._owned_model, None
        if was_open and owned is not None:
            owned.close()
