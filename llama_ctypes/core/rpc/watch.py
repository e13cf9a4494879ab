"""Connection state of RPC workers (the patched ggml-rpc): which connections failed, and who depends on them."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

from ...errors import RPCConnectionError
from ...native import ggml_rpc_h as R
from .procs import proc, rpc_reg

if TYPE_CHECKING:
    from ...native import NativeLibrary

__all__ = ["ConnectionAPI", "connection_api", "lost", "ConnectionWatch"]


class ConnectionAPI:
    """The patch's connection-state functions (``native/ggml_rpc_h.py``)."""

    _REASON = 512

    def __init__(self, lib: NativeLibrary):
        self.connection_id = proc(lib, "ggml_backend_rpc_connection_id")
        self.failure_count = proc(lib, "ggml_backend_rpc_failure_count")
        self._failed = proc(lib, "ggml_backend_rpc_connection_failed")
        self._last_failure = proc(lib, "ggml_backend_rpc_last_failure")
        self._reset = proc(lib, "ggml_backend_rpc_reset_connection")
        # (newer than the others: libraries built with an older version of the patch lack it)
        reg = rpc_reg(lib)
        self._exercise = (proc(lib, "ggml_backend_rpc_check_connection")
                          if lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_check_connection") else None)

    def failed(self, conn_id: int) -> str | None:
        """The reason connection ``conn_id`` failed, or None while it has not."""
        buf = ctypes.create_string_buffer(self._REASON)
        if not self._failed(conn_id, buf, self._REASON):
            return None
        return buf.value.decode("utf-8", "replace")

    def last_failure(self, endpoint: str) -> tuple[int, str]:
        """(id, reason) of the last connection to ``endpoint`` that failed; (0, "") if none has."""
        buf = ctypes.create_string_buffer(self._REASON)
        conn_id = int(self._last_failure(endpoint.encode(), buf, self._REASON))
        return conn_id, buf.value.decode("utf-8", "replace")

    def current_failed(self, endpoint: str) -> bool:
        """Whether the connection ggml would use for ``endpoint`` now is a failed one."""
        conn_id = int(self.connection_id(endpoint.encode()))
        return conn_id != 0 and self.failed(conn_id) is not None

    def reset(self, endpoint: str) -> bool:
        return bool(self._reset(endpoint.encode()))

    def exercise(self, endpoint: str) -> bool:
        """Send a cheap command over ``endpoint``'s open connection, if any (connects nothing).

        Returns whether that connection is a failed one now; a connection whose worker went
        away while it sat idle (nothing noticed yet) fails here. The command waits behind
        whatever the connection is doing.
        """
        if self._exercise is None:
            return self.current_failed(endpoint)
        return bool(self._exercise(endpoint.encode()))


_apis: dict[int, ConnectionAPI | None] = {}


def connection_api(lib: NativeLibrary | None) -> ConnectionAPI | None:
    """The connection-state functions of these libraries; None when they lack the patch (or RPC)."""
    if lib is None:
        return None
    key = id(lib)
    if key not in _apis:
        reg = lib.ggml_backend_reg_by_name(R.RPC_REG_NAME)
        has = bool(reg) and bool(lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_failure_count"))
        _apis[key] = ConnectionAPI(lib) if has else None
    return _apis[key]


def lost(endpoint: str, reason: str, when: str = "") -> RPCConnectionError:
    return RPCConnectionError(
        f"RPC worker {endpoint} was lost{' ' + when if when else ''}: {reason}. A model (and its "
        "contexts) that used it cannot be used any more: close it and load it again (once the worker "
        "is back); other models are not affected", endpoint=endpoint)


class ConnectionWatch:
    """The connections to RPC workers a model or a context depends on, and whether one failed.

    Made just before the native call that connects (a model load, a context creation):
    a connection to one of ``endpoints`` that fails from then on counts. ``attach()``,
    after that call, records the connections the model or context now uses and returns
    the error of one that failed meanwhile. ``failure()`` (cheap: one native call while
    no connection of the process fails) returns the error of a failed one, or that of
    ``parent`` (the model of a context), and keeps returning it. Without the patch (or
    without endpoints) it watches nothing.
    """

    __slots__ = ("endpoints", "_api", "_parent", "_baseline", "_conns", "_seen", "_error")

    def __init__(self, lib: NativeLibrary | None, endpoints: Sequence[str],
                 parent: ConnectionWatch | None = None):
        self.endpoints = tuple(endpoints)
        self._api = connection_api(lib) if self.endpoints else None
        self._parent = parent
        self._baseline = {e: self._api.last_failure(e)[0] for e in self.endpoints} if self._api else {}
        self._conns: tuple[tuple[str, int], ...] = ()
        self._seen = -1
        self._error: RPCConnectionError | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything to watch (RPC endpoints, and a patched build)."""
        return self._api is not None or (self._parent is not None and self._parent.active)

    def child(self, lib: NativeLibrary | None) -> ConnectionWatch:
        """A watch for a context of the model this watch follows (same endpoints; this one as parent)."""
        return ConnectionWatch(lib, self.endpoints, parent=self)

    def attach(self) -> RPCConnectionError | None:
        """Record the connections in use now; the error of one that failed since this watch was made."""
        api = self._api
        if api is None:
            return self.failure()
        for e in self.endpoints:
            conn_id, reason = api.last_failure(e)
            if conn_id != self._baseline[e]:
                self._error = lost(e, reason)
                return self._error
        self._conns = tuple((e, c) for e in self.endpoints if (c := int(api.connection_id(e.encode()))))
        return self.failure()

    def failure(self) -> RPCConnectionError | None:
        """The error of a failed connection this watch (or its parent) depends on, else None."""
        if self._error is not None:
            return self._error
        parent = self._parent
        if parent is not None and (error := parent.failure()) is not None:
            self._error = error
            return error
        api = self._api
        if api is None or not self._conns:
            return None
        count = int(api.failure_count())
        if count == self._seen:
            return None
        for endpoint, conn_id in self._conns:
            reason = api.failed(conn_id)
            if reason is not None:
                self._error = lost(endpoint, reason)
                return self._error
        self._seen = count
        return None

    def check(self) -> None:
        """Raise the error of :meth:`failure`, if any."""
        error = self.failure()
        if error is not None:
            raise error
