"""Lifetime of native handles: close once, never use a freed pointer.

Every object that owns a llama.cpp pointer (Model, Context, Sampler) derives
from ``NativeHandle``. Its rules:

* ``close()`` is idempotent; after it, every public use raises ``ClosedError``.
* The pointer is freed only when nothing is using it: a close requested while
  another thread is inside a call, or while dependents (a Context of a Model)
  are alive, is deferred until the last user lets go.
* Garbage collection calls ``close()`` as a backstop.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from ..errors import BusyError, ClosedError


class Closeable:
    """``with`` support and closing on garbage collection, for anything with an idempotent ``close()``."""

    def close(self) -> None:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finalizer
            pass


class NativeHandle(Closeable):
    """Owns one native pointer; subclasses implement ``_free()``."""

    _kind = "handle"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._freed = False
        self._users = 0  # shared users: in-flight calls and dependent handles
        self._exclusive = False

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called (the pointer may still await its last user)."""
        return self._closed

    def close(self) -> None:
        """Release the native resources (now, or when the last user finishes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free_now = self._users == 0 and not self._exclusive
        if free_now:
            self._do_free()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_freed", True):
                self.close()
        except Exception:
            pass

    def _mark_dead(self) -> None:
        """For a constructor that failed: nothing to free, and every use raises ClosedError."""
        self._closed = True
        self._freed = True

    # ---- use tracking ------------------------------------------------------------
    @property
    def freed(self) -> bool:
        """True once the native memory was actually freed (``close()`` may be waiting for users)."""
        return self._freed

    def _acquire(self, held: bool = False) -> None:
        """Register a shared user (a dependent handle, or a call that may overlap others).

        ``held``: the caller is (or works for) a holder of this handle, so a close requested
        meanwhile does not refuse it; only a freed handle does.
        """
        with self._lock:
            if self._freed or (self._closed and not held):
                raise ClosedError(f"{self._kind} is closed")
            self._users += 1

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            free_now = self._closed and self._users == 0 and not self._exclusive
        if free_now:
            self._do_free()

    @contextmanager
    def _shared(self, held: bool = False) -> Iterator[None]:
        self._acquire(held)
        try:
            yield
        finally:
            self._release()

    def hold(self) -> "Hold":
        """Keep the native object alive until the returned :class:`Hold` is released.

        ``close()`` while held is deferred until the last hold goes; a holder may
        still claim the handle (``held=True``). Raises ClosedError when already closed.
        """
        return Hold(self)

    def _begin_exclusive(self, held: bool = False) -> None:
        """Claim sole use (a decode, a generation); another concurrent claim raises BusyError.

        ``held``: the caller holds the handle (see :meth:`hold`), so a close requested meanwhile
        does not stop it.
        """
        with self._lock:
            if self._closed and not (held and not self._freed):
                raise ClosedError(f"{self._kind} is closed")
            if self._exclusive:
                raise BusyError(
                    f"this {self._kind} is in use by another call (a running generation or another thread); "
                    f"a {self._kind} serves one caller at a time: create one per thread, or use a Server"
                )
            self._exclusive = True

    def _end_exclusive(self) -> None:
        with self._lock:
            self._exclusive = False
            free_now = self._closed and self._users == 0
        if free_now:
            self._do_free()

    @contextmanager
    def _exclusively(self) -> Iterator[None]:
        self._begin_exclusive()
        try:
            yield
        finally:
            self._end_exclusive()

    def _do_free(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        self._free()

    def _free(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class Hold:
    """A registered user of a :class:`NativeHandle`; ``release()`` (idempotent) lets it go."""

    __slots__ = ("handle", "_held")

    def __init__(self, handle: NativeHandle) -> None:
        handle._acquire()
        self.handle = handle
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.handle._release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass
