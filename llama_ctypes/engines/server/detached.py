"""Draws taken off the tick: a row whose sampler may take long runs on a worker thread, on a copy of its
logits, while the scheduler thread goes on.

A grammar's check of the candidates is the one part of sampling whose time a client chooses: an
ambiguous grammar just under the work bound of ``build_scripts/patches/llama-grammar-work-bound.patch``
costs ~2 s per token on a 262k vocabulary. Drawn on the scheduler thread, that stalls every other
client's stream by as much at each of its tokens. So a detachable row (``SamplerBinding.detachable``:
a grammar, or candidates kept) is handed to a worker at the start of the sample phase; the tick waits
for it up to :data:`DETACHED_WAIT_S` (an ordinary grammar row takes well under that: the same tick, no
added latency) and goes on without it past that. Its request then sits out the ticks until its token is
delivered (``Request.pending``; the scheduler schedules nothing for it and ends it only after the draw):
the slow request goes at the pace of its grammar, the others at theirs.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import LlamaError
from .request import Request
from .scheduler import PENDING
from .slots import Slot

__all__ = ["DETACHED_WAIT_S", "Detached", "DetachedDraws"]

#: How long a tick waits for its detached draws before it goes on without them, in seconds.
DETACHED_WAIT_S = 0.05


@dataclass(eq=False)
class Detached:
    """One row drawn on a worker: output ``k`` of its tick, batch row ``idx``, ``row`` its logits (a copy);
    ``seconds``: how long the draw itself took, once it has ended (not its wait for a worker)."""

    slot: Slot
    request: Request
    idx: int
    row: np.ndarray
    k: int
    future: concurrent.futures.Future | None = None
    seconds: float = 0.0


class DetachedDraws:
    """The worker threads and the draws still running after their tick (scheduler thread only, but for
    the workers themselves and ``wake``, which they call as each draw ends)."""

    def __init__(self, n_threads: int, wake: Callable[[], None]):
        # (several: a slow grammar's draw must not hold up an ordinary one queued behind it)
        self._n_threads = max(4, n_threads)
        self._wake = wake
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.running: list[Detached] = []  # past their tick, not delivered yet
        self.late = 0  # rows delivered after their tick (stats)

    @staticmethod
    def outlasts(seconds: float) -> bool:
        """A draw of this many seconds would have been left to finish after its tick."""
        return seconds > DETACHED_WAIT_S

    def submit(self, slot: Slot, request: Request, idx: int, row: np.ndarray, k: int) -> Detached:
        """Start drawing batch row ``idx`` of ``request`` from ``row`` (a copy: the next decode may come first)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._n_threads, thread_name_prefix="llama_ctypes-draw")
        job = Detached(slot, request, idx, row, k)
        draw = request.binding.draw

        def run() -> int:
            t0 = time.perf_counter()
            try:
                return draw(idx, row)
            finally:
                job.seconds = time.perf_counter() - t0

        job.future = self._pool.submit(run)
        return job

    def settle(self, jobs: list[Detached], outputs: list[int], row_errors: dict[int, BaseException] | None,
               started: float) -> dict[int, BaseException] | None:
        """Wait for ``jobs`` until ``DETACHED_WAIT_S`` after ``started`` (perf_counter); put the drawn tokens
        (or the sampler's LlamaError, in ``row_errors``) in ``outputs``, and :data:`PENDING` for the draws
        still running, whose requests get ``pending``. Returns ``row_errors``."""
        concurrent.futures.wait([job.future for job in jobs],  # type: ignore[misc]
                                timeout=max(0.0, started + DETACHED_WAIT_S - time.perf_counter()))
        for job in jobs:
            future = job.future
            if not future.done():
                outputs[job.k] = PENDING
                job.request.pending = future
                self.running.append(job)
                future.add_done_callback(lambda _: self._wake())
                continue
            error = future.exception()
            if error is None:
                outputs[job.k] = future.result()
            elif isinstance(error, LlamaError):  # this request's sampler refused: it fails alone
                if row_errors is None:
                    row_errors = {}
                row_errors[job.k] = error
                outputs[job.k] = -1
            else:  # a bug: as if drawn on this thread
                raise error
        return row_errors

    def collect(self) -> list[tuple[Detached, Any]]:
        """The draws that ended since their tick, each with its token or its exception, in the order they
        started; their requests' ``pending`` is cleared (the caller delivers the result)."""
        done: list[tuple[Detached, Any]] = []
        if not self.running:
            return done
        still: list[Detached] = []
        for job in self.running:
            future = job.future
            if not future.done():
                still.append(job)
                continue
            if job.request.pending is future:
                job.request.pending = None
            error = future.exception()
            done.append((job, error if error is not None else future.result()))
        self.running = still
        self.late += len(done)
        return done

    def shutdown(self) -> None:
        """Wait for every running draw (each is bounded by the grammar work bound) and stop the workers."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
