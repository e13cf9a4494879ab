"""``/tools`` and ``/cors-proxy``: the helpers llama-server gives its web UI for agents (built-in tools,
MCP servers, and a CORS pass-through), each off unless enabled, answering 403 then as llama-server."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..common import AppContext, endpoint, json_body, read_body
from ..cors_proxy import proxy, refuse_loop
from ..errors import APIError, BadRequest, InternalError
from ..json_answer import json_response
from ..origin import check_origin
from ..streaming import EventStream, until_disconnect
from ..tools.base import ToolCallError, ToolNotFound, ToolParamError, tool_limiter

logger = logging.getLogger(__name__)


class FeatureDisabled(APIError):
    status, type, code = 403, "feature_disabled", None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type}}


class ToolMissing(APIError):
    status, type, code = 404, "invalid_request_error", None


class MethodRefused(APIError):
    status, type, code = 405, "invalid_request_error", None


def _disabled() -> FeatureDisabled:
    return FeatureDisabled("this feature is disabled")


#: the headers that steer a call, decoded as the UTF-8 clients send (Starlette reads headers as latin-1)
_STEERING = ("x-tool-cwd", "x-tool-runtime", "x-resp-type")


def _steering(request: Request) -> dict[str, str]:
    out = {}
    for name in _STEERING:
        value = request.headers.get(name)
        if value:
            out[name] = value.encode("latin-1").decode("utf-8", "surrogateescape")
    return out


@endpoint
async def tools(request: Request, app: AppContext) -> Response:
    """``GET /tools``: the tools and their definitions; ``POST /tools`` ``{"tool", "params", "stream"}``:
    call one (``x-tool-cwd``, ``x-tool-runtime`` and ``x-resp-type`` headers say where and how)."""
    box = app.tools
    if box is None:
        raise _disabled()
    # (a page's request that /cors-proxy sent on, e.g. after a target's redirect here, is refused there too)
    check_origin(request, app, wildcard=False)  # (a command or a request to any host: named pages only)
    if request.method == "GET":
        return JSONResponse(box.listing())
    data = json_body(await read_body(request, app.max_body_bytes))
    if not isinstance(data, dict) or not isinstance(data.get("tool"), str):
        raise BadRequest("expected a JSON object with a 'tool' name", param="tool")
    params = data.get("params", {})
    if not isinstance(params, dict):
        raise BadRequest("'params' must be an object", param="params")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    try:
        tool = box.find(data["tool"], stream=stream)
    except ToolNotFound as exc:
        raise ToolMissing(str(exc)) from None
    try:  # (a thread: the --tools-runtime spec may start its container again, which takes seconds)
        params = await anyio.to_thread.run_sync(box.call_params, params, _steering(request),
                                                limiter=tool_limiter())
    except ToolCallError as exc:
        raise InternalError(str(exc)) from None
    if not stream:  # (a client that leaves stops the call: its command is killed)
        gone = threading.Event()
        stop = lambda: gone.is_set() or box.should_stop()  # noqa: E731
        return await json_response(await until_disconnect(request.receive, _call(tool, params, stop=stop), gone.set))
    return _streamed(tool, params, box.should_stop)


async def _call(tool: Any, params: dict[str, Any], push: Any = None, stop: Any = None) -> dict[str, Any]:
    kwargs = {} if stop is None else {"should_stop": stop}
    try:
        return await tool.ainvoke(params, push, **kwargs)
    except ToolParamError as exc:
        raise BadRequest(str(exc)) from None
    except ToolCallError as exc:
        logger.error("tool %s: %s", tool.name, exc)
        raise InternalError(str(exc)) from None


def _streamed(tool: Any, params: dict[str, Any], stopping: Any) -> Response:
    """llama-server's stream: ``data: {"chunk": ...}`` as the tool writes, then ``{"done": true}`` (with
    ``"error"`` when it failed). The client leaving stops the tool."""
    gone = threading.Event()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()  # (unbounded: the tools cap their own output)

    def push(chunk: str) -> None:  # (from the tool's thread)
        if chunk and not gone.is_set():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except RuntimeError:  # (the loop is closed: the server is stopping)
                gone.set()

    async def run() -> None:
        done: dict[str, Any] = {"done": True}
        try:
            await tool.ainvoke(params, push, should_stop=lambda: gone.is_set() or stopping())
            if stopping():
                done["error"] = "cancelled: the server is stopping"
        except Exception as exc:  # noqa: BLE001 - the stream's last event carries it
            logger.warning("tool %s failed: %s", tool.name, exc)
            done["error"] = str(exc) or type(exc).__name__
        queue.put_nowait(done)

    async def events():
        task = asyncio.ensure_future(run())
        _RUNNING.add(task)  # (a task nobody holds may be collected before it ends)
        task.add_done_callback(_RUNNING.discard)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, dict):
                    yield item
                    return
                yield {"chunk": item}
        finally:
            gone.set()  # (the client left, or the tool is done: either way it stops)

    return EventStream(events(), gone.set, shape="native")


#: streamed tool calls still running (their task ends when the tool sees the client gone)
_RUNNING: set[asyncio.Future] = set()


@endpoint
async def cors_proxy(request: Request, app: AppContext) -> Response:
    """``GET|POST /cors-proxy?url=...`` (``--ui-mcp-proxy``; cors_proxy.py)."""
    if not app.cors_proxy:
        raise _disabled()
    if request.method not in ("GET", "POST"):  # (Starlette adds HEAD to a GET route)
        raise MethodRefused(f"{request.method} is not proxied: GET and POST are")
    refuse_loop(request)  # (508: a target's redirect back here; the origin check would refuse it too)
    check_origin(request, app, wildcard=False)  # (a command or a request to any host: named pages only)
    return await proxy(request, await read_body(request, app.max_body_bytes))
