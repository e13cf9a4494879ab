"""In-graph sampling on a ContextLease: llama.cpp's backend sampling, one sampler chain per sequence.

A chain attached to a sequence (``llama_set_sampler``) runs inside ``llama_decode``'s graph for that
sequence's output rows; ``llama_sampler_sample`` then returns the token the graph drew (and accepts it
into the chain) instead of reading the logits. The context keeps a raw pointer to each attached chain,
so the lease owns the invariant "a chain is attached only while the lease is held and its binding has
not released it": a :class:`~llama_ctypes.core.sampler.SamplerBinding` attaches and detaches its own
(a clone of the sampler's chain: llama.cpp marks an attached chain as set up for the graph for good),
and :meth:`ContextLease.release` detaches whatever is left before another holder can decode. One chain
per sequence: a second one is refused while the first is attached. The rows such a sequence outputs
have no logits row (llama.cpp keeps the graph's sampled candidates there instead): reading them
raises. Part of :class:`~llama_ctypes.core.context.ContextLease` (a mixin: same object, same rules).

Attaching or detaching makes llama.cpp rebuild its graph reservation at the next decode (a
scheduler reserve), so a runner attaches once per request, not per token; that decode holds the
model's adapter lock, as after an adapter change (``AdapterOps.guarded``).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import BusyError, InvalidArgumentError

logger = logging.getLogger(__name__)

__all__ = ["InGraphSampling"]


class InGraphSampling:
    """The in-graph sampling operations of a ContextLease."""

    ctx: Any
    _lib: Any
    _ptr: Any
    _held: bool
    _in_graph: dict[int, int]  # sequence -> address of the chain attached to it
    _graph_used: bool  # a chain was attached since the lease began: rows may hold sampled data

    def attach_sampler(self, seq: int, chain: int) -> bool:
        """Run the native chain at address ``chain`` inside the graph for sequence ``seq`` (True; again
        for the chain attached there already). False when llama.cpp cannot (a split mode or backend
        without it): the sequence then samples as usual. BusyError when another chain is attached
        there, and InvalidArgumentError for a chain attached elsewhere (llama.cpp sets a chain up for
        one graph use only). The caller keeps the chain alive until :meth:`detach_sampler` or the
        lease's release, and never samples through it outside this sequence's rows."""
        self._check()  # type: ignore[attr-defined]
        seq = self._check_seq(seq)  # type: ignore[attr-defined]
        if not chain:
            raise InvalidArgumentError("attach_sampler needs a live sampler chain")
        current = self._in_graph.get(seq)
        if current == chain:
            return True
        if current is not None:
            raise BusyError(f"sequence {seq} already samples in the graph with another chain")
        if chain in self._in_graph.values():
            raise InvalidArgumentError("this chain is attached to another sequence")
        self.ctx._reserve_pending = True
        self._graph_used = True
        self._in_graph[seq] = chain  # (before the call: an interrupt after it must still detach)
        try:
            ok = bool(self._lib.llama_set_sampler(self._ptr, seq, chain))
        except BaseException:
            self.detach_sampler(seq, chain)
            raise
        if not ok:
            del self._in_graph[seq]  # (llama.cpp keeps none there then)
        return ok

    def detach_sampler(self, seq: int, chain: int) -> None:
        """Stop sampling sequence ``seq`` in the graph, if ``chain`` is still the one attached there (a
        later binding's chain stays). Nothing to do once the lease was released: the release detached it."""
        if self._held and self._in_graph.get(seq) == chain:
            del self._in_graph[seq]
            self.ctx._reserve_pending = True
            self._lib.llama_set_sampler(self._ptr, seq, None)

    def _sampled_in_graph(self, row: int) -> bool:
        """Whether output ``row`` of the last decode was sampled (wholly or partly) inside the graph."""
        if not self._graph_used:
            return False
        lib, ptr = self._lib, self._ptr
        if lib.llama_get_sampled_token_ith(ptr, row) != -1:
            return True
        # (a chain the backend took only in part leaves filtered candidates and no token; the counts
        # are stale once no chain is attached, so they are read only while one is)
        return bool(self._in_graph) and (bool(lib.llama_get_sampled_logits_count_ith(ptr, row))
                                         or bool(lib.llama_get_sampled_probs_count_ith(ptr, row)))

    def _refuse_in_graph_row(self, row: int) -> None:
        if self._sampled_in_graph(row):
            raise InvalidArgumentError(f"batch row {row} was sampled inside the graph (its sequence had an "
                                       "in-graph sampler): it has no logits row")

    @property
    def in_graph_sequences(self) -> frozenset[int]:
        """The sequences whose tokens the graph samples now."""
        return frozenset(self._in_graph)

    def _detach_all_samplers(self) -> None:
        while self._in_graph:
            seq, _ = self._in_graph.popitem()
            self.ctx._reserve_pending = True
            try:
                self._lib.llama_set_sampler(self._ptr, seq, None)
            except Exception:  # (a release must finish: the next holder would decode with a stale chain)
                logger.exception("detaching the in-graph sampler of sequence %d failed", seq)
