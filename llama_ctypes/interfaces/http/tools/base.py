"""What every server-side tool is: llama-server's ``server_tool`` (``/tools``), in Python.

A tool's ``invoke`` runs in a worker thread (it may block on files and subprocesses); an MCP tool
overrides ``ainvoke`` and runs on the event loop. Results are JSON objects: a tool that failed the way a
tool can fail (no such file, an edit that is not unique) returns ``{"error": message}`` (HTTP 200, as
llama-server); bad parameters raise :class:`ToolParamError` (400); a failure of the server side
(an unknown runtime, a runtime that cannot start) raises :class:`ToolCallError` (500).
"""

from __future__ import annotations

import abc
import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import anyio

StreamFn = Callable[[str], None]
"""Pushes one chunk of a streamed tool's output (empty chunks are dropped)."""
StopFn = Callable[[], bool]
"""True once the client has gone: a long tool stops (and kills what it started)."""


class ToolParamError(ValueError):
    """The request's parameters are malformed (HTTP 400, ``invalid_request_error``)."""


class ToolCallError(RuntimeError):
    """The call could not be carried out by the server (HTTP 500, ``server_error``)."""


class ToolNotFound(LookupError):
    """No such tool, or it cannot stream (HTTP 404, llama-server's ``std::invalid_argument``)."""


def _never() -> bool:
    return False


#: worker threads tool calls may hold at once, per event loop: a tool may wait for a minute, and the
#: app's shared thread pool is what inference needs (tokenizing, templating)
TOOL_THREADS = 16
_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = \
    weakref.WeakKeyDictionary()


def tool_limiter() -> anyio.CapacityLimiter:
    """The running event loop's pool of :data:`TOOL_THREADS` threads for tool calls."""
    loop = asyncio.get_running_loop()
    limiter = _LIMITERS.get(loop)
    if limiter is None:
        limiter = _LIMITERS[loop] = anyio.CapacityLimiter(TOOL_THREADS)
    return limiter


class Tool(abc.ABC):
    """One callable tool. Attributes mirror llama-server's ``server_tool``."""

    name: str = ""
    display_name: str = ""
    permission_write: bool = False
    support_stream: bool = False
    uses_cwd: bool = False
    kind: str = "server"  # llama-server's type(): "server" or "mcp"

    @abc.abstractmethod
    def definition(self) -> dict[str, Any]:
        """The OpenAI function-tool definition: ``{"type": "function", "function": {...}}``."""

    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = _never) -> dict[str, Any]:
        """Run the tool (blocking). ``params`` may carry ``cwd``, ``runtime`` and ``resp_type``, set by
        the route from the ``x-tool-cwd``, ``x-tool-runtime`` and ``x-resp-type`` headers."""
        raise NotImplementedError

    async def ainvoke(self, params: dict[str, Any], stream: StreamFn | None = None,
                      should_stop: StopFn = _never) -> dict[str, Any]:
        """Run the tool from the event loop (default: ``invoke`` in a worker thread)."""
        return await anyio.to_thread.run_sync(lambda: self.invoke(params, stream, should_stop),
                                              limiter=tool_limiter())

    def to_json(self) -> dict[str, Any]:
        """The tool as ``GET /tools`` lists it."""
        return {"display_name": self.display_name, "tool": self.name, "type": self.kind,
                "permissions": {"write": self.permission_write}, "uses_cwd": self.uses_cwd,
                "definition": self.definition()}
