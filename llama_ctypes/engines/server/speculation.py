"""Drafting for the batching server: each tick, a proposal for every slot that speculates.

The scheduler asks (``Scheduler.draft_asks``: a sequence, its context and how many tokens
could still be emitted), a slot drafter answers in ``ask.draft``, and the drafts ride in the
tick's one batch next to the other slots' tokens. Verification is the engine's (the match
rule, exact for every sampler); rollback the scheduler's. A drafter here runs only on the
scheduler thread.

* :class:`PerSlotDrafts` — any single-sequence :class:`Drafter` without per-sequence state
  (``NgramDraft``, or your own), asked slot after slot.
* :class:`DraftModelSlots` — a :class:`DraftModel` with one draft sequence per slot: the
  sequences are brought up to date in shared batches, then drafted together, one batch per
  draft step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ...core.batch import Batch
from ...core.generation import common_prefix
from ...core.model import Model
from ...errors import ArgumentTypeError, InvalidArgumentError
from ..speculative.drafters import Drafter, DraftModel

if TYPE_CHECKING:
    from .scheduler import DraftAsk

__all__ = ["SlotDrafter", "PerSlotDrafts", "DraftModelSlots", "slot_drafter"]

logger = logging.getLogger(__name__)


class SlotDrafter(Protocol):
    def propose(self, asks: Sequence["DraftAsk"]) -> None:
        """Set ``ask.draft`` (at most ``ask.k`` tokens, possibly none) for every ask."""

    def abort(self) -> None:
        """Stop a draft in flight, from any thread (the scheduler thread then goes on without it)."""

    def close(self) -> None:
        """Free what the drafter holds (after the scheduler thread has ended)."""


def slot_drafter(drafter: Drafter, model: Model, n_seq: int, n_draft: int, ctx_opts: dict[str, Any]) -> SlotDrafter:
    """The server-side form of ``drafter`` for ``n_seq`` slots (checks it against ``model``)."""
    if isinstance(drafter, DraftModel):
        return DraftModelSlots(drafter, model, n_seq, n_draft, ctx_opts)
    if getattr(drafter, "observes_target", False):
        raise InvalidArgumentError(f"{type(drafter).__name__} drafts from the target's own decodes: a Server "
                                   "cannot serve it yet (use it with a single-sequence session)")
    if isinstance(drafter, Drafter):
        return PerSlotDrafts(drafter, model, n_draft, ctx_opts)
    raise ArgumentTypeError(f"speculative= takes a Drafter (NgramDraft, DraftModel), not {type(drafter).__name__}")


class PerSlotDrafts:
    """A single-sequence drafter asked for each slot in turn; it must not keep per-sequence state."""

    def __init__(self, drafter: Drafter, model: Model, n_draft: int, ctx_opts: dict[str, Any]) -> None:
        drafter.attach(model, n_draft, ctx_opts)
        drafter.start()
        self._drafter = drafter

    def propose(self, asks: Sequence["DraftAsk"]) -> None:
        draft = self._drafter.draft
        for ask in asks:
            ask.draft = list(draft(ask.context, ask.k))[:ask.k]

    def abort(self) -> None:
        self._drafter.abort()

    def close(self) -> None:
        self._drafter.finish()
        self._drafter.close()


class DraftModelSlots:
    """A draft model with one sequence per server slot, drafting every slot in the same batches.

    Each draft sequence keeps what it decoded for its slot; a tick's proposal reuses the common
    prefix with the slot's context and computes only the rest (a recurrent draft model, which
    cannot cut its state back, recomputes the sequence instead).
    """

    def __init__(self, drafter: DraftModel, model: Model, n_seq: int, n_draft: int,
                 ctx_opts: dict[str, Any]) -> None:
        self._drafter = drafter
        ctx = drafter.attach_server(model, n_seq, n_draft, ctx_opts)
        try:
            self._lease = ctx.lease()
        except BaseException:
            drafter.close()
            raise
        self._batch = Batch(ctx.n_batch, 1)
        self._logits_of = self._lease.logits_view_fn()
        self._is_eog = ctx.vocab.is_eog
        self._n_ctx = ctx.n_ctx_seq
        self._cut_back = not (drafter.model.is_recurrent or drafter.model.is_hybrid)
        self._held: list[list[int]] = [[] for _ in range(n_seq)]  # tokens each draft sequence holds
        self._p_min = drafter.p_min

    def propose(self, asks: Sequence["DraftAsk"]) -> None:
        lease, batch, held = self._lease, self._batch, self._held
        rows: list[tuple["DraftAsk", int, int]] = []  # rows of the batch being filled
        live: list[tuple["DraftAsk", int]] = []  # asks whose first draft token is known
        batch.clear()
        for ask in asks:
            context = ask.context
            k = min(ask.k, self._n_ctx - len(context))
            if k <= 0:  # the draft context is full for this sequence: no draft
                continue
            s = ask.seq_id
            mine = held[s]
            c = min(common_prefix(mine, context), len(context) - 1)
            if c < len(mine):
                if not (self._cut_back and lease.seq_rm(s, c, -1)):
                    lease.seq_rm(s, -1, -1)
                    c = 0
                del mine[c:]
            feed = context[c:]
            i = 0
            while i < len(feed):
                room = batch.capacity - batch.n_tokens
                if room == 0:
                    if not self._decode(rows, live):
                        return
                    rows = []
                    continue
                n = min(room, len(feed) - i)
                last = i + n == len(feed)
                row = batch.add_sequence(feed[i:i + n], c + i, s, output_last=last)
                mine.extend(feed[i:i + n])
                if last:
                    rows.append((ask, row, k))
                i += n
        if batch.n_tokens and not self._decode(rows, live):
            return
        # Draft steps: every sequence still drafting decodes its last draft token in one batch.
        while live:
            batch.clear()
            rows = []
            for ask, k in live:
                tok = ask.draft[-1]
                if len(ask.draft) < k and not self._is_eog(tok):
                    mine = held[ask.seq_id]
                    batch.add(tok, len(mine), ask.seq_id, True)
                    mine.append(tok)
                    rows.append((ask, batch.n_tokens - 1, k))
            if not rows:
                return
            live = []
            if not self._decode(rows, live):
                return

    def _decode(self, rows: list[tuple["DraftAsk", int, int]], live: list[tuple["DraftAsk", int]]) -> bool:
        """Decode the batch; append each row's greedy token to its ask (and the ask to ``live``).
        False (every draft sequence forgotten) when the decode fails."""
        rc = self._lease.decode_rc(self._batch)
        self._batch.clear()
        if rc != 0:
            logger.debug("draft decode failed (%d); the draft sequences start over", rc)
            self._lease.clear()
            for mine in self._held:
                mine.clear()
            return False
        logits_of, p_min = self._logits_of, self._p_min
        for ask, row, k in rows:
            logits = logits_of(row)
            tok = int(logits.argmax())
            if p_min > 0.0:
                z = logits.astype(np.float64) - float(logits[tok])
                if 1.0 / float(np.exp(z).sum()) < p_min:
                    continue  # not confident enough: this ask drafts no further
            ask.draft.append(tok)
            live.append((ask, k))
        return True

    def abort(self) -> None:
        self._drafter.abort()

    def close(self) -> None:
        self._lease.release()
        self._drafter.close()
