"""MCP servers as ``/tools``: llama-server's ``--mcp-servers-json`` / ``--mcp-servers-config`` client.

Each configured server is a child process speaking newline-delimited JSON-RPC 2.0 on stdio (MCP's
stdio transport). At start every server is spawned, initialized and asked for ``tools/list``, then
shut down again (llama-server's warm-up); a tool call spawns it lazily, re-spawns it once it has
died, and waits out a 5 s cool-down after a failed spawn. Its tools appear as ``<server>_<tool>``
with ``type: "mcp"``; a call answers ``{"plain_text_response": text}`` or ``{"error": message}``
(HTTP 200, as llama-server: a slow, crashed or missing server is a tool failure, not a server one).

Own stdlib client, not the official ``mcp`` SDK: the SDK's stdio client is an async context manager
that must be entered and left by one task (our sessions are opened by whichever request respawns
them and closed at shutdown), inherits only a few environment variables (llama-server passes the
whole environment), writes the child's stderr to ours, gives a dying server a 2 s + 2 s grace
(llama-server kills at once), has no bound on a line's length, validates every message with pydantic
(a tool without ``inputSchema`` breaks the listing) and pulls in cryptography, pyjwt, jsonschema,
opentelemetry, httpx and sse-starlette for what is ~400 lines here.

Everything here runs on the event loop that called :meth:`McpManager.start`; :meth:`McpTool.invoke`
bridges to it from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .base import StopFn, StreamFn, Tool
from .mcp_config import McpServerConfig, parse_mcp_config, read_mcp_config_file

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "2024-11-05"  # what llama-server announces
CLIENT_INFO = {"name": "llama.cpp", "version": "1.0"}
WARMUP_TIMEOUT_S = 10.0  # cap on one server's initialize + tools/list at start
COOLDOWN_S = 5.0  # after a failed spawn, calls answer "unavailable" for this long
MAX_LINE = 8 * 1024 * 1024  # a longer NDJSON line is dropped, so a child cannot grow our buffer unbounded
STDERR_TAIL = 4096  # bytes of the child's stderr kept for diagnostics
STDERR_LOG_INTERVAL_S = 1.0  # with debug logging on, at most one stderr record per server this often
STDERR_LOG_MAX = 1024  # bytes of stderr one debug record shows
PUMP_YIELD_LINES = 256  # a line pump lets the event loop run other tasks after this many lines
EXIT_GRACE_S = 0.2  # after the child's exit, for its last lines to be read
KILL_GRACE_S = 0.5  # between SIGTERM and SIGKILL of the server's process group
MAX_LIST_PAGES = 100
# Keys the /tools route adds from headers: they are the route's, not the remote tool's arguments.
ROUTE_KEYS = ("runtime", "resp_type")


@dataclass(frozen=True)
class McpToolDef:
    """A tool one server advertised: bare ``name`` (no ``<server>_`` prefix), schema or ``None``."""

    server: str
    name: str
    description: str
    input_schema: Any


def _rpc_error(message: str) -> dict[str, Any]:
    return {"error": {"code": -32603, "message": message}}


# "transport closed" before the request reached the child: the call can safely go to a fresh spawn
_UNSENT: dict[str, Any] = {**_rpc_error("transport closed"), "unsent": True}


def _error_message(reply: Mapping[str, Any]) -> str:
    err = reply.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return err if isinstance(err, str) else "unknown error"


def _to_response(result: Any) -> dict[str, Any]:
    """llama-server's /tools shape for an MCP ``tools/call`` result: the text parts joined by newlines,
    as ``plain_text_response``, or as ``error`` when the result says ``isError``."""
    texts = []
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [p["text"] if isinstance(p.get("text"), str) else "" for p in result["content"]
                 if isinstance(p, dict) and p.get("type") == "text"]
    text = "\n".join(texts)
    if isinstance(result, dict) and result.get("isError") is True:
        return {"error": text or "MCP tool returned an error"}
    return {"plain_text_response": text}


async def _pump_lines(stream: asyncio.StreamReader, on_line: Callable[[bytes], None], max_line: int) -> None:
    """Feed each non-empty line of ``stream`` to ``on_line`` until EOF, dropping lines over ``max_line``;
    every :data:`PUMP_YIELD_LINES` lines it yields, so a flood of messages cannot hog the event loop."""
    buf = bytearray()
    skipping = False  # inside an over-long line: discard up to its newline
    lines = 0
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            return
        scan = len(buf)  # only the new bytes can hold a newline
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", scan)) >= 0:
            line, start, scan = bytes(buf[start:nl]).strip(), nl + 1, nl + 1
            if skipping:
                skipping = False
            elif line:
                on_line(line)
                lines += 1
                if lines % PUMP_YIELD_LINES == 0:
                    await asyncio.sleep(0)
        del buf[:start]
        if len(buf) > max_line:
            if not skipping:
                log.warning("MCP: dropping a line over %d bytes from a child pipe", max_line)
            buf.clear()
            skipping = True


class _StdioSession:
    """One spawned server: JSON-RPC requests over its stdin, replies matched by id from its stdout.

    Requests may overlap (each waits for its own id); ids restart at 1 per spawn. Every request
    answers a reply dict or an ``{"error": {...}}`` one ("request timed out", "transport closed",
    "cancelled"), as llama-server's ``send_rpc``.
    """

    def __init__(self, config: McpServerConfig):
        self.config = config
        self.last_error = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 1
        self._eof = False
        self._closed = False
        self._initialized = False
        self._init_lock = asyncio.Lock()
        self._drain_lock = asyncio.Lock()
        self._stderr_tail = bytearray()

    async def start(self) -> bool:
        """Spawn the child (in its own process group on POSIX); False, with ``last_error``, if it can't."""
        cfg = self.config
        env = {**os.environ, **cfg.env} if cfg.env else None
        extra: dict[str, Any] = {"start_new_session": True} if os.name == "posix" else {}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                cfg.command, *cfg.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, cwd=cfg.cwd or None, **extra)
        except (OSError, ValueError) as e:  # no such command or cwd, not executable, NUL in an argument
            self.last_error = f"failed to spawn '{cfg.command}': {e}"
            return False
        if self._closed:  # close() ran while we spawned
            await _kill_tree(self._proc)
            self.last_error = "closed"
            return False
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._tasks = [asyncio.create_task(self._read_stdout(self._proc.stdout)),
                       asyncio.create_task(self._read_stderr(self._proc.stderr))]
        return True

    @property
    def alive(self) -> bool:
        """Spawned, stdout open and the child not exited (a grandchild can hold stdout open)."""
        proc = self._proc
        return (proc is not None and not self._closed and not self._eof and proc.returncode is None
                and proc.stdin is not None and not proc.stdin.is_closing())

    def diagnostics(self) -> str:
        """The last error and the tail of the child's stderr, for the log."""
        tail = bytes(self._stderr_tail[-STDERR_TAIL:]).decode("utf-8", "replace").strip()
        return "; ".join(s for s in (self.last_error, f"last stderr: {tail}" if tail else "") if s)

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        # Chunks, not lines, and no copy of the tail per chunk: a child spamming stderr costs a buffer append
        # per 64 KiB. Logged only when debugging, at most once per STDERR_LOG_INTERVAL_S, the rest counted.
        loop = asyncio.get_running_loop()
        tail = self._stderr_tail
        next_log, unlogged = 0.0, 0
        try:
            while chunk := await stream.read(1 << 16):
                tail += chunk[-STDERR_TAIL:]
                if len(tail) > 2 * STDERR_TAIL:  # trimmed now and then, so the cost stays per chunk
                    del tail[:-STDERR_TAIL]
                if not log.isEnabledFor(logging.DEBUG):
                    continue
                if loop.time() < next_log:
                    unlogged += len(chunk)
                    continue
                next_log = loop.time() + STDERR_LOG_INTERVAL_S
                text = chunk[-STDERR_LOG_MAX:].decode("utf-8", "replace").strip()
                skipped = unlogged + max(0, len(chunk) - STDERR_LOG_MAX)
                log.debug("MCP '%s' stderr%s: %s", self.config.name,
                          f" ({skipped} earlier bytes not logged)" if skipped else "", text)
                unlogged = 0
        except (OSError, ValueError) as e:
            log.debug("MCP '%s': stderr read failed: %s", self.config.name, e)

    async def _read_stdout(self, stream: asyncio.StreamReader) -> None:
        try:
            await _pump_lines(stream, self._on_message, MAX_LINE)
        except (OSError, ValueError) as e:
            log.debug("MCP '%s': stdout read failed: %s", self.config.name, e)
        finally:
            self._eof = True
            self._fail_pending("transport closed")

    def _on_message(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            log.debug("MCP '%s': skipping a non-JSON line (%d bytes)", self.config.name, len(line))
            return
        if not isinstance(msg, dict):
            return
        if "method" in msg:
            if "id" in msg:  # a request from the server: ping is the only one we serve
                self._answer(msg)
            return  # a notification (progress, log, list_changed): nothing waits for it
        rid = msg.get("id")
        # bool is an int to Python: {"id": true} must not answer request 1
        fut = None if not isinstance(rid, (int, float)) or isinstance(rid, bool) else self._pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        # else: a late reply to a request that timed out, or garbage; skipped as llama-server

    def _answer(self, request: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": request["id"]}
        if request.get("method") == "ping":
            reply["result"] = {}
        else:
            reply["error"] = {"code": -32601, "message": f"Method not found: {request.get('method')}"}
        self._write(reply)

    def _write(self, msg: dict[str, Any]) -> bool:
        stdin = self._proc.stdin if self._proc else None
        if stdin is None or self._closed or stdin.is_closing():
            return False
        try:
            stdin.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        except (OSError, RuntimeError):
            return False
        # the pipe transport swallows EPIPE and closes itself: the child had exited, nothing was sent
        return not stdin.is_closing()

    def _fail_pending(self, message: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_result(_rpc_error(message))

    async def request(self, method: str, params: dict[str, Any] | None = None,
                      stop_at: float | None = None) -> dict[str, Any]:
        """Send one request and wait for its reply: ``timeout_ms`` from now, or until ``stop_at``
        (event-loop time, the warm-up's cap), whichever comes first; either ends as "request timed out"
        (llama-server's warm-up says "cancelled" there, which reads as if someone had stopped it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout
        deadline = min(deadline, stop_at) if stop_at is not None else deadline
        if not self.alive or self._proc is None or self._proc.stdin is None:
            return _UNSENT
        rid, self._next_id = self._next_id, self._next_id + 1
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = fut
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        try:
            if not self._write(msg):
                return _UNSENT
            await asyncio.wait_for(self._drain(), max(0.0, deadline - loop.time()))
            return await self._reply(fut, deadline)
        except asyncio.TimeoutError:
            return _rpc_error("request timed out")
        except (OSError, RuntimeError):  # broken pipe: the child is gone
            return _rpc_error("transport closed")
        finally:
            self._pending.pop(rid, None)

    async def _reply(self, fut: asyncio.Future[dict[str, Any]], deadline: float) -> dict[str, Any]:
        # Not just wait_for(fut): a child that exits while a grandchild holds its stdout never sends
        # EOF, so its exit is polled too (its last lines get EXIT_GRACE_S to arrive).
        loop = asyncio.get_running_loop()
        exited_at = None
        while not fut.done():
            now = loop.time()
            if now >= deadline:
                raise asyncio.TimeoutError
            if self._proc is not None and self._proc.returncode is not None:
                exited_at = now if exited_at is None else exited_at
                if now - exited_at >= EXIT_GRACE_S:
                    return _rpc_error("transport closed")
            await asyncio.wait({fut}, timeout=min(deadline - now, 0.1))
        return fut.result()

    async def _drain(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        async with self._drain_lock:  # StreamWriter.drain() is not safe to await from two tasks on 3.10
            await self._proc.stdin.drain()

    async def _ensure_init(self, stop_at: float | None) -> bool:
        async with self._init_lock:
            if self._initialized:
                return True
            reply = await self.request("initialize", {
                "protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO}, stop_at)
            if "result" not in reply:
                self.last_error = "initialize failed: " + _error_message(reply)
                return False
            self._write({"jsonrpc": "2.0", "method": "notifications/initialized"})
            self._initialized = True
            return True

    async def list_tools(self, stop_at: float | None = None) -> list[McpToolDef]:
        """Initialize if needed and list every tool (following ``nextCursor``); ``[]`` on failure."""
        if not await self._ensure_init(stop_at):
            return []
        tools: list[McpToolDef] = []
        cursor = None
        for _ in range(MAX_LIST_PAGES):
            reply = await self.request("tools/list", {"cursor": cursor} if cursor else None, stop_at)
            result = reply.get("result")
            if not isinstance(result, dict):
                self.last_error = "tools/list failed: " + _error_message(reply)
                return tools
            for t in result.get("tools") or []:
                if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
                    log.warning("MCP '%s': skipping a tool without a name: %.200r", self.config.name, t)
                    continue
                desc = t.get("description")
                tools.append(McpToolDef(self.config.name, t["name"], desc if isinstance(desc, str) else "",
                                        t.get("inputSchema")))
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str) or not cursor:
                break
        return tools

    async def call_tool(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
        """``tools/call``, in llama-server's /tools shape (see :func:`_to_response`); ``None`` when the
        child had exited before the request reached it (it answered the previous one, then died)."""
        if not await self._ensure_init(None):
            return {"error": self.last_error}
        reply = await self.request("tools/call", {"name": tool, "arguments": arguments})
        if reply.get("unsent"):
            return None
        if "error" in reply:
            return {"error": _error_message(reply)}
        if "result" in reply:
            return _to_response(reply["result"])
        return {"error": "invalid response from MCP server"}

    async def close(self) -> None:
        """Kill the child's process group (children and grandchildren) and reap it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail_pending("cancelled")
        proc = self._proc
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            await _kill_tree(proc)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if proc is not None:
            # A grandchild that left our process group can still hold stdout open; the transport
            # would then stay open (and warn at exit). asyncio has no public close for it.
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()


async def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the process group, SIGKILL it after :data:`KILL_GRACE_S` (grandchildren may outlive
    the leader); on Windows only the child itself is killed. Waits until the child is reaped (≤ 2 s).

    The group id is the leader's pid (start_new_session), which is free for reuse once the leader is
    reaped and its group empty. So the group is signalled while ``returncode`` is None (not reaped yet:
    the id is ours), or after that only while no process holds that pid: the kernel does not reuse a pid
    that is still some group's id, so a group found then is the leader's leftover children (unless the pid
    was reused by a new group leader that exited since, leaving its group). Remaining windows: asyncio's
    threaded child watcher reaps before it sets ``returncode``, and the pid may be taken between the check
    and the signal; each needs the pids to wrap around within microseconds."""
    loop = asyncio.get_running_loop()

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.name != "posix":
                if proc.returncode is None:
                    proc.kill()
                return
            if proc.returncode is not None:
                try:
                    os.getpgid(proc.pid)
                except ProcessLookupError:
                    pass  # no process has the pid: a group with that id is our leftovers
                else:
                    return  # the pid was reused: that group is someone else's
            os.killpg(proc.pid, sig)

    async def reaped(within: float) -> bool:
        # returncode, not proc.wait(): on 3.11+ wait() also waits for the pipes, which a grandchild can hold
        end = loop.time() + within
        while proc.returncode is None and loop.time() < end:
            await asyncio.sleep(0.01)
        return proc.returncode is not None

    signal_group(signal.SIGTERM)
    await reaped(KILL_GRACE_S)
    signal_group(getattr(signal, "SIGKILL", signal.SIGTERM))
    if not await reaped(2.0):
        log.warning("MCP server pid %d survived SIGKILL", proc.pid)


def _never() -> bool:
    return False


class McpTool(Tool):
    """One remote tool as a ``/tools`` entry named ``<server>_<tool>``; calls go to :class:`McpManager`."""

    kind = "mcp"

    def __init__(self, manager: McpManager, spec: McpToolDef):
        self.manager = manager
        self.server = spec.server
        self.tool = spec.name
        self.description = spec.description
        self.input_schema = spec.input_schema if isinstance(spec.input_schema, dict) else {}
        self.name = self.display_name = f"{spec.server}_{spec.name}"

    def definition(self) -> dict[str, Any]:
        """``{"type": "function", "function": {name, description, parameters}}``; no schema = ``{}``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.input_schema}}

    def _arguments(self, params: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if k not in ROUTE_KEYS}

    async def ainvoke(self, params: dict[str, Any], stream: StreamFn | None = None,
                      should_stop: StopFn = _never) -> dict[str, Any]:
        """Call the remote tool with ``params`` (less the route's ``runtime``/``resp_type``)."""
        coro = self.manager.call_tool(self.server, self.tool, self._arguments(params))
        loop = self.manager.loop
        if loop is None or loop is asyncio.get_running_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = _never) -> dict[str, Any]:
        """Blocking call from a thread other than the manager's event loop."""
        loop = self.manager.loop
        if loop is None or not loop.is_running():
            raise RuntimeError("MCP manager is not running")
        coro = self.manager.call_tool(self.server, self.tool, self._arguments(params))
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


class McpManager:
    """Owns every configured MCP server: warm-up, the tool registry, lazy (re)spawn and teardown.

    ``warmup_timeout_s`` caps one server's warm-up (default 10 s); ``cooldown_s`` is how long calls
    answer "unavailable" after a failed spawn (default 5 s). Duplicate server names are skipped.
    """

    def __init__(self, configs: list[McpServerConfig], *, warmup_timeout_s: float = WARMUP_TIMEOUT_S,
                 cooldown_s: float = COOLDOWN_S):
        self.configs: dict[str, McpServerConfig] = {}
        for cfg in configs:
            if cfg.name in self.configs:
                log.warning("MCP config: duplicate server name '%s', skipping", cfg.name)
                continue
            self.configs[cfg.name] = cfg
        self.warmup_timeout_s = warmup_timeout_s
        self.cooldown_s = cooldown_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._defs: list[McpToolDef] = []
        self._sessions: dict[str, _StdioSession] = {}
        self._warming: set[_StdioSession] = set()  # warm-up sessions, so close() during start() kills them
        self._dead_until: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._started = False
        self._closed = False

    @property
    def empty(self) -> bool:
        """True when no server is configured (llama-server then adds no MCP tools)."""
        return not self.configs

    async def start(self) -> None:
        """Warm every server up concurrently: spawn, initialize, ``tools/list``, shut down. A server
        that fails is logged and has no tools; nothing is raised. Runs once."""
        if self._started or self._closed:
            return
        self._started = True
        self.loop = asyncio.get_running_loop()
        found = await asyncio.gather(*(self._warm_up(cfg) for cfg in self.configs.values()),
                                     return_exceptions=True)
        for cfg, defs in zip(self.configs.values(), found):
            if isinstance(defs, BaseException):  # a bug here must not stop the HTTP server from starting
                log.error("MCP warmup: '%s' failed", cfg.name, exc_info=defs)
            else:
                self._defs += defs

    async def _warm_up(self, cfg: McpServerConfig) -> list[McpToolDef]:
        session = _StdioSession(cfg)
        self._warming.add(session)
        try:
            if not await session.start():
                log.warning("MCP warmup: failed to spawn '%s': %s", cfg.name, session.diagnostics())
                return []
            assert self.loop is not None
            tools = await session.list_tools(self.loop.time() + self.warmup_timeout_s)
        finally:
            self._warming.discard(session)
            await session.close()
        if session.last_error:
            log.warning("MCP warmup: '%s': %s", cfg.name, session.diagnostics())
        log.info("MCP warmup: '%s' discovered %d tools", cfg.name, len(tools))
        return tools

    def tools(self) -> list[Tool]:
        """One :class:`McpTool` per discovered tool, in config order; a repeated name is skipped."""
        seen: set[str] = set()
        out: list[Tool] = []
        for spec in self._defs:
            tool = McpTool(self, spec)
            if tool.name in seen:
                log.warning("MCP tool '%s' from server '%s' collides with another, skipping", tool.name, spec.server)
                continue
            seen.add(tool.name)
            out.append(tool)
        return out

    async def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Call ``tool`` on ``server`` (spawned if needed): ``{"plain_text_response": text}`` or
        ``{"error": message}``; never raises for a server's failure."""
        for _ in range(2):  # llama-server's race: the child exited after its last answer, unnoticed yet
            session = await self._get_or_create(server)
            if session is None:
                return {"error": f"MCP server unavailable: {server}"}
            result = await session.call_tool(tool, arguments)
            if result is not None:
                return result
            log.info("MCP '%s' had exited before the call reached it; respawning", server)
        return {"error": "transport closed"}

    async def _get_or_create(self, name: str) -> _StdioSession | None:
        cfg = self.configs.get(name)
        if cfg is None or self._closed:
            return None
        stale: _StdioSession | None = None
        try:
            async with self._locks.setdefault(name, asyncio.Lock()):  # one spawn per server at a time
                loop = asyncio.get_running_loop()
                if self._closed or loop.time() < self._dead_until.get(name, -math.inf):
                    return None
                session = self._sessions.get(name)
                if session is not None and session.alive:
                    return session
                if session is not None:
                    log.warning("MCP '%s' is no longer alive: %s", name, session.diagnostics() or "exited")
                    stale = self._sessions.pop(name)
                fresh = _StdioSession(cfg)
                if not await fresh.start():
                    log.warning("MCP '%s': failed to start: %s", name, fresh.diagnostics())
                    self._dead_until[name] = loop.time() + self.cooldown_s
                    return None
                if self._closed:  # close() ran while we spawned
                    await fresh.close()
                    return None
                self._sessions[name] = fresh
                return fresh
        finally:
            if stale is not None:
                await stale.close()

    async def close(self) -> None:
        """Fail calls in flight ("cancelled"), kill every server with its descendants; later calls
        answer "MCP server unavailable". Idempotent."""
        self._closed = True
        sessions, self._sessions = [*self._sessions.values(), *self._warming], {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)


__all__ = ["McpManager", "McpServerConfig", "McpTool", "McpToolDef", "parse_mcp_config",
           "read_mcp_config_file"]
