"""The ASGI layer around every endpoint: request counting, the API keys, CORS, refusal while closing,
waking sleeping models (``--sleep-idle-seconds``).

Pure ASGI (not Starlette's BaseHTTPMiddleware), so streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .common import AppContext
from .errors import APIError, NotFound, Unauthorized, Unavailable, shape_of
from .sleep import wakes

#: Paths that answer without the API key (as llama-server leaves its health check open).
OPEN_PATHS = frozenset({"/health", "/v1/health"})

#: What a CORS preflight is told (llama-server's answer, but the headers: see _preflight).
_PREFLIGHT = [(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"), (b"access-control-max-age", b"86400")]


def _preflight(scope: Scope) -> list[tuple[bytes, bytes]]:
    # The headers the browser asks for, named back: a "*" (llama-server's answer) never covers
    # Authorization, so a page on another origin could not send its API key.
    asked = _header(scope, b"access-control-request-headers")
    return [*_PREFLIGHT, (b"access-control-allow-headers", asked.encode("latin-1") if asked else b"*")]


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class ServiceMiddleware:
    """Counts every request by endpoint and status, answers CORS preflights, checks the API keys, refuses
    work while closing. With an API prefix (llama-server's ``--api-prefix``), only paths under it are
    served, and routing sees them without it."""

    def __init__(self, app: ASGIApp, context: AppContext, endpoint_of: Callable[[str], str]):
        self.app = app
        self.context = context
        self.endpoint_of = endpoint_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.context
        path = scope["path"]
        outside = False
        if ctx.api_prefix:
            # ASGI's convention: the path keeps the prefix, root_path names it (routing takes it off)
            outside = path != ctx.api_prefix and not path.startswith(ctx.api_prefix + "/")
            path = path[len(ctx.api_prefix):] or "/"
            scope = {**scope, "root_path": scope.get("root_path", "") + ctx.api_prefix}
        status = 500  # (unless a response starts)
        cors = ctx.cors.headers(_header(scope, b"origin"))

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if cors:
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        try:
            if outside:
                await NotFound("not found (this server answers under its --api-prefix)", code="not_found").response()(
                    scope, receive, counting_send)
            elif scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None:
                # a browser's preflight: answered before the API key is asked for, as llama-server does
                await counting_send({"type": "http.response.start", "status": 200,
                                     "headers": [*_preflight(scope), (b"content-length", b"0")] if cors else
                                     [(b"content-length", b"0")]})
                await send({"type": "http.response.body", "body": b""})
            elif ctx.api_keys and path not in OPEN_PATHS and not _public_page(ctx, scope, path) \
                    and not _authorized(scope, ctx.api_keys):
                await Unauthorized("invalid or missing API key (send 'Authorization: Bearer <key>')").response(
                    shape_of(path))(scope, receive, counting_send)
            elif ctx.closing and path not in OPEN_PATHS:
                await Unavailable("the server is shutting down").response(shape_of(path))(
                    scope, receive, counting_send)
            elif ctx.sleep is not None and wakes(scope["method"], path) \
                    and self.endpoint_of(path) not in ("other", "webui"):  # (API paths only: no 404 wakes it)
                try:
                    await ctx.sleep.enter()  # (wakes the models first when they sleep)
                except APIError as error:
                    await error.response(shape_of(path))(scope, receive, counting_send)
                    return
                try:
                    await self.app(scope, receive, counting_send)
                finally:
                    ctx.sleep.leave()
            else:
                await self.app(scope, receive, counting_send)
        finally:
            ctx.metrics.request_done(self.endpoint_of(path), status)


def _public_page(ctx: AppContext, scope: Scope, path: str) -> bool:
    """A file of the web page: open, as llama-server's UI (the page asks for the key, then sends it)."""
    return ctx.webui is not None and scope["method"] in ("GET", "HEAD") and ctx.webui.serves(path)


def _authorized(scope: Scope, keys: tuple[str, ...]) -> bool:
    given = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                given = token.strip()
        elif name == b"x-api-key":
            given = value.decode("latin-1").strip()
    if given is None:
        return False
    # (every key is compared, so the time taken says nothing of which one nearly matched)
    return sum(hmac.compare_digest(given.encode(), key.encode()) for key in keys) > 0
