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
* :class:`MTPSlots` — the model's own MTP head (:class:`MTPDraft`): an MTP context with one
  sequence per slot that mirrors every tick's batch (``observe``: each token with the target's
  hidden row of the position before it) and follows the pool's KV operations (``KVMirror``);
  drafting runs all slots' heads together, one batch per draft step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ...core.batch import Batch
from ...core.context import Context, ContextLease
from ...core.model import Model
from ...core.prompt import common_prefix
from ...errors import ArgumentTypeError, InvalidArgumentError
from ..speculative.drafters import Drafter, DraftModel
from ..speculative.mtp import MTPDraft, head_top_prob

if TYPE_CHECKING:
    from .scheduler import DraftAsk, TickPlan

__all__ = ["SlotDrafter", "PerSlotDrafts", "DraftModelSlots", "MTPSlots", "slot_drafter"]

logger = logging.getLogger(__name__)


class SlotDrafter(Protocol):
    def propose(self, asks: Sequence["DraftAsk"]) -> None:
        """Set ``ask.draft`` (at most ``ask.k`` tokens, possibly none) for every ask."""

    def abort(self) -> None:
        """Stop a draft in flight, from any thread (the scheduler thread then goes on without it)."""

    def close(self) -> None:
        """Free what the drafter holds (after the scheduler thread has ended)."""


def slot_drafter(drafter: Drafter, model: Model, n_seq: int, n_draft: int, ctx_opts: dict[str, Any],
                 target: Context) -> SlotDrafter:
    """The server-side form of ``drafter`` for ``n_seq`` slots (checks it against ``model`` and the
    server's ``target`` context)."""
    if isinstance(drafter, DraftModel):
        return DraftModelSlots(drafter, model, n_seq, n_draft, ctx_opts)
    if isinstance(drafter, MTPDraft):
        return MTPSlots(drafter, model, n_seq, ctx_opts, target)
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


class MTPSlots:
    """The target model's MTP head drafting for every slot (see :class:`MTPDraft` for one sequence).

    The MTP context holds one sequence per slot, kept equal to the slot's KV: after every tick
    (:meth:`observe`) it decodes what each slot's sequence kept, token ``p`` paired with the
    target's hidden row of position ``p - 1`` (the first of a step with the row kept from the
    slot's previous step); the pool's KV operations reach it through ``ContextKV(mirror=)``
    (``kv_forget``, ``kv_truncate``, ``kv_copy``, ``kv_restore``, ``kv_complete``). Where a
    row is unknown (a prefix reused from an earlier request, copied from another slot) one position
    pairs with zeros: weaker drafts, the same output. A prefix the mirror lacks (after a failed
    mirror decode, or restored from the RAM cache) is not reused (``kv_complete``): the slot
    recomputes it, and the mirror with it.
    """

    needs_observe = True

    def __init__(self, drafter: MTPDraft, model: Model, n_seq: int, ctx_opts: dict[str, Any],
                 target: Context) -> None:
        self._drafter = drafter
        ctx = drafter.attach_server(model, n_seq, ctx_opts, target)  # (closed with the drafter)
        try:
            self._lease: ContextLease = ctx.lease()
        except BaseException:
            drafter.close()
            raise
        self._ctx = ctx
        self._width = model.n_embd_out
        self._zeros = np.zeros(self._width, dtype=np.float32)
        self._held = [0] * n_seq  # positions each MTP sequence holds (-1: incomplete, no drafts)
        self._rows: list[np.ndarray | None] = [None] * n_seq  # target row of each sequence's last position
        self._logits_of = self._lease.logits_view_fn()
        self._is_eog = ctx.vocab.is_eog
        self._p_min = drafter.p_min

    # ---- the pool's KV operations, mirrored -----------------------------------------------------
    def kv_forget(self, seq: int) -> None:
        self._lease.seq_rm(seq, -1, -1)
        self._held[seq], self._rows[seq] = 0, None

    def kv_truncate(self, seq: int, keep: int) -> None:
        if self._held[seq] > keep:
            if not self._lease.seq_rm(seq, keep, -1):
                self.kv_forget(seq)
                self._held[seq] = -1
                return
            self._held[seq], self._rows[seq] = keep, None

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        self._lease.seq_rm(dst, -1, -1)
        held = self._held[src]
        if held < 0:
            self._held[dst], self._rows[dst] = -1, None
            return
        self._lease.seq_cp(src, dst, 0, n)
        self._held[dst] = min(held, n)
        self._rows[dst] = self._rows[src] if held == n else None

    def kv_complete(self, seq: int, n: int) -> bool:
        """Whether the MTP sequence holds the first ``n`` positions: a prefix it lacks (a failed
        mirror decode, a RAM-cache restore) is recomputed rather than reused, so drafting resumes."""
        return self._held[seq] >= n

    def kv_restore(self, seq: int) -> None:
        self._lease.seq_rm(seq, -1, -1)
        self._held[seq], self._rows[seq] = -1, None  # the restored positions have no MTP entries

    # ---- the tick ---------------------------------------------------------------------------------
    def observe(self, plan: "TickPlan", outputs, target: ContextLease, n_tokens: int) -> None:
        """Mirror what each step of the decoded ``plan`` left in its slot's sequence (``outputs``: the
        sampled tokens in plan order; a speculative step keeps its agreeing drafts only)."""
        rows = target.nextn_rows(n_tokens)
        base, stride = rows.ctypes.data, rows.strides[0]
        seq_ids, positions, tokens, states = [], [], [], []
        last: list[tuple[int, int]] = []
        k = 0
        for step in plan.steps:
            n_out = len(step.sample)
            kept = step.tokens
            if step.n_draft:
                m = 0
                while m < step.n_draft and outputs[k + m] == step.tokens[1 + m]:
                    m += 1
                kept = step.tokens[:1 + m]
            k += n_out
            seq, start = step.slot.seq_id, step.slot.n_past
            held = self._held[seq]
            if held < 0:
                continue
            if held > start:  # (the pool cuts the slot first; a mirror ahead of it is cut here)
                self.kv_truncate(seq, start)
                held = self._held[seq]
            if held != start:
                self.kv_forget(seq)
                self._held[seq] = -1
                continue
            first = self._rows[seq]
            for i, tok in enumerate(kept):
                seq_ids.append(seq)
                positions.append(start + i)
                tokens.append(tok)
                if i == 0:
                    states.append((first if first is not None else self._zeros).ctypes.data)
                else:
                    states.append(base + (step.row + i - 1) * stride)
            last.append((seq, step.row + len(kept) - 1))
            self._held[seq] = start + len(kept)
        if tokens:
            rc = self._decode(seq_ids, positions, tokens, states, [])
            if rc != 0:
                logger.debug("MTP mirror decode failed (%d): every MTP sequence starts over", rc)
                self._reset_all()
                return
        for seq, row in last:
            self._rows[seq] = rows[row].copy()  # the target's next decode overwrites its buffer

    def _decode(self, seq_ids, positions, tokens, states, outputs) -> int:
        n_batch = self._ctx.n_batch
        for i in range(0, len(tokens), n_batch):
            j = i + n_batch
            out = [o - i for o in outputs if i <= o < j]
            rc = self._lease.decode_states(seq_ids[i:j], positions[i:j], tokens[i:j], states[i:j], out)
            if rc != 0:
                return rc
        return 0

    def reset(self) -> None:
        """Forget every MTP sequence (after a failure): no drafts until each slot starts over."""
        self._reset_all()

    def _reset_all(self) -> None:
        self._lease.clear()
        self._held = [-1] * len(self._held)  # until each slot's sequence is forgotten and rebuilt
        self._rows = [None] * len(self._rows)

    def propose(self, asks: Sequence["DraftAsk"]) -> None:
        live = []
        for ask in asks:
            pos0 = len(ask.context) - 1  # where the pending token goes
            k = min(ask.k, self._ctx.n_ctx_seq - pos0)
            if k > 0 and self._held[ask.seq_id] == pos0:
                live.append([ask, k, pos0, self._rows[ask.seq_id], int(ask.context[-1])])
        if not live:
            return
        try:
            step = 0
            while live:
                states = [(st if st is not None else self._zeros).ctypes.data for _, _, _, st, _ in live]
                rc = self._decode([a.seq_id for a, *_ in live], [p + step for _, _, p, _, _ in live],
                                  [t for *_, t in live], states, list(range(len(live))))
                if rc != 0:
                    logger.debug("MTP draft decode failed (%d)", rc)
                    return
                nxt = []
                for j, entry in enumerate(live):
                    ask, k = entry[0], entry[1]
                    row = self._logits_of(j)
                    tok = int(row.argmax())
                    if self._p_min > 0.0 and head_top_prob(row) < self._p_min:
                        continue
                    ask.draft.append(tok)
                    if len(ask.draft) < k and not self._is_eog(tok):
                        entry[3] = self._lease.nextn_row(j).copy()  # the head's own row feeds its next step
                        entry[4] = tok
                        nxt.append(entry)
                live = nxt
                step += 1
        finally:
            # The drafts leave the MTP cache: the tick's verification is mirrored with the target's rows.
            for ask in asks:
                if self._held[ask.seq_id] >= 0:
                    self._lease.seq_rm(ask.seq_id, self._held[ask.seq_id], -1)

    def abort(self) -> None:
        self._ctx.abort()

    def close(self) -> None:
        self._lease.release()
        self._drafter.close()  # the MTP context, and the hold on the target

