"""The server's tools, as ``/tools`` serves them: the built-in ones ``--tools`` enables, then those of
the MCP servers (``--mcp-servers-json``/``--mcp-servers-config``), named ``<server>_<tool>``.

llama-server's ``server_tools``: an MCP tool whose name is already taken is skipped (with a warning);
``--tools-runtime`` names where every call runs unless a request's ``x-tool-runtime`` header says
otherwise. The box owns the MCP servers and the runtime's container: ``close()`` stops both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from .base import Tool, ToolNotFound
from .builtin import build_tools
from .mcp import McpManager, McpServerConfig
from .process import kill_running
from .runtime import ToolsRuntime, make_tools_runtime

logger = logging.getLogger(__name__)


class ToolBox:
    """The tools one app serves. Build it before the app (bad names or specs raise ``ValueError``),
    ``await start()`` in the app's lifespan (MCP servers are spawned and their tools listed), and
    ``await close()`` at shutdown. Listing and finding are safe from any task once started."""

    def __init__(self, enabled: Sequence[str] = (), *, runtime: str | None = None,
                 mcp_servers: Sequence[McpServerConfig] = ()):
        self.builtin: list[Tool] = build_tools(enabled) if enabled else []
        self.runtime: ToolsRuntime | None = make_tools_runtime(runtime) if runtime else None
        self.mcp = McpManager(list(mcp_servers)) if mcp_servers else None
        self.tools: list[Tool] = list(self.builtin)
        self.closed = False
        self.stopping = False  # (set from a signal handler: running calls end now)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing_task: asyncio.Future | None = None

    @property
    def features(self) -> list[str]:
        """What this box turns on, for the start-up warning (llama-server's names)."""
        names = ["server tools (experimental)"] if self.builtin else []
        names += ["tools runtime (experimental)"] if self.runtime is not None else []
        return names + (["MCP servers (experimental)"] if self.mcp is not None else [])

    async def start(self) -> None:
        """Spawn the MCP servers and add their tools (a server that fails adds none)."""
        self.loop = asyncio.get_running_loop()
        if self.mcp is None:
            return
        await self.mcp.start()
        seen = {tool.name for tool in self.tools}
        added = []
        for tool in self.mcp.tools():
            if tool.name in seen:
                logger.warning("MCP tool %r collides with an existing tool, skipping", tool.name)
                continue
            seen.add(tool.name)
            added.append(tool)
        self.tools = self.tools + added
        if added:
            logger.info("added %d MCP tools", len(added))

    def listing(self) -> list[dict[str, Any]]:
        """``GET /tools``: every tool's description."""
        return [tool.to_json() for tool in self.tools]

    def find(self, name: str, *, stream: bool = False) -> Tool:
        """The tool called ``name``; raises :class:`ToolNotFound` if there is none or it cannot stream."""
        for tool in self.tools:
            if tool.name == name:
                if stream and not tool.support_stream:
                    raise ToolNotFound(f'tool "{name}" does not support stream = true')
                return tool
        raise ToolNotFound(f'unknown tool "{name}"')

    def call_params(self, params: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
        """A call's parameters as the tool sees them: ``cwd``, ``runtime`` and ``resp_type`` come only
        from the ``x-tool-cwd``, ``x-tool-runtime`` and ``x-resp-type`` headers (the model writes the
        parameters; the client chooses where they run), the runtime else from ``--tools-runtime``."""
        out = {k: v for k, v in params.items() if k not in ("cwd", "runtime", "resp_type")}
        if headers.get("x-tool-cwd"):
            out["cwd"] = headers["x-tool-cwd"]
        if headers.get("x-tool-runtime"):
            out["runtime"] = headers["x-tool-runtime"]
        elif self.runtime is not None:
            out["runtime"] = self.runtime.spec
        if headers.get("x-resp-type"):
            out["resp_type"] = headers["x-resp-type"]
        return out

    def should_stop(self) -> bool:
        """True once the server is stopping: a running tool ends (its command is killed)."""
        return self.stopping or self.closed

    def stop_soon(self) -> None:
        """The server is going down (its signal handler calls this): end running calls and stop the MCP
        servers now, rather than let a slow call hold the shutdown. Safe from any thread."""
        self.stopping = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            def begin() -> None:
                self.closing_task = asyncio.ensure_future(self.close())
            loop.call_soon_threadsafe(begin)

    async def close(self) -> None:
        """Stop the MCP servers and remove the runtime's own container (idempotent)."""
        if self.closed:
            if self.closing_task is not None and self.closing_task is not asyncio.current_task():
                await asyncio.shield(self.closing_task)  # (the shutdown waits for the one that began)
            return
        self.closed = True
        try:
            killed = kill_running()  # (commands still running: the calls that started them end now)
            if killed:
                logger.info("stopped %d running tool command(s)", killed)
            if self.mcp is not None:
                await self.mcp.close()
        finally:
            if self.runtime is not None:
                await anyio.to_thread.run_sync(self.runtime.close)
