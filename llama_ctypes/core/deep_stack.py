"""Threads with a large stack, for native calls that recurse once per level of what they read.

llama.cpp's JSON parsers (chat code, output parsers) and its JSON Schema converter recurse
once per nesting level, or per optional property of an object: a deep enough input overflows
the caller's stack (8 MiB on Linux, 512 KiB on a macOS thread, 128 KiB on musl) and the process
dies, which nothing in Python can catch. Such calls go through :data:`DEEP_STACK`, a few daemon
threads with a 256 MiB stack (only what is touched is committed), and inputs deeper than that
stack allows for are refused before the call (``max_openers``).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from typing import Any, Callable

__all__ = ["DEEP_STACK", "DeepStackThreads", "STACK_BYTES"]

STACK_BYTES = 256 * 2**20
#: Stack bytes per nesting level allowed for (llama.cpp's PEG parser takes about 2 KiB).
STACK_PER_LEVEL = 4096
#: Where no thread with a large stack can be started: the limit for the caller's own thread.
_FALLBACK_MAX_OPENERS = 64


class DeepStackThreads:
    """A few daemon threads with a large stack that run native calls which recurse deeply."""

    def __init__(self, size: int = 2, name: str = "deep-stack"):
        self._size = size
        self._name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._pid: int | None = None
        self._max_openers = _FALLBACK_MAX_OPENERS

    def _started(self) -> queue.SimpleQueue | None:
        if self._pid == os.getpid():
            return self._queue
        with self._lock:
            if self._pid != os.getpid():  # (first use, or a forked child: the threads are not here)
                self._queue, self._max_openers = self._start()
                self._pid = os.getpid()
            return self._queue

    def _start(self) -> tuple[queue.SimpleQueue | None, int]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        try:
            old = threading.stack_size(STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform without settable thread stacks
            return None, _FALLBACK_MAX_OPENERS
        started = 0
        try:
            for i in range(self._size):
                threading.Thread(target=_serve, args=(q,), name=f"llama_ctypes-{self._name}-{i}",
                                 daemon=True).start()
                started += 1
        except RuntimeError:  # (the large stack could not be mapped)
            pass
        finally:
            threading.stack_size(old)
        if not started:
            return None, _FALLBACK_MAX_OPENERS
        return q, STACK_BYTES // STACK_PER_LEVEL

    @property
    def max_openers(self) -> int:
        """Most nesting levels a call may recurse through (llama.cpp's JSON parsers: opening brackets)."""
        self._started()
        return self._max_openers

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on one of the threads (on the caller's, where none could start)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        q = self._started()
        if q is None:
            _run(future, fn, args)
        else:
            q.put((future, fn, args))
        return future

    def run(self, fn: Callable[..., Any], *args: Any, cleanup: Callable[[Any], None] | None = None) -> Any:
        """``fn(*args)`` on one of the threads, waited for to the end: an interrupt (Ctrl-C) that comes
        meanwhile is raised once the call returned (a native call keeps running whatever Python does;
        returning early would let its caller free what it still uses), after ``cleanup(result)``."""
        future = self.submit(fn, *args)
        interrupt: BaseException | None = None
        while True:
            try:
                result = future.result()
                break
            except BaseException as e:  # noqa: BLE001 - fn's own error, or an interrupt of the wait
                if future.done():
                    if interrupt is not None:
                        raise interrupt from e
                    raise
                interrupt = interrupt or e
        if interrupt is not None:
            if cleanup is not None:
                cleanup(result)
            raise interrupt
        return result


def _run(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
        future.set_exception(e)


def _serve(q: queue.SimpleQueue) -> None:
    while True:
        future, fn, args = q.get()
        _run(future, fn, args)
        del future, fn, args


DEEP_STACK = DeepStackThreads()
