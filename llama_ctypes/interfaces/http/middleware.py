"""The ASGI layer around every endpoint: request counting, the API key, refusal while closing.

Pure ASGI (not Starlette's BaseHTTPMiddleware), so streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .common import AppContext
from .errors import Unauthorized, Unavailable, shape_of

#: Paths that answer without the API key (as llama-server leaves its health check open).
OPEN_PATHS = frozenset({"/health", "/v1/health"})


class ServiceMiddleware:
    """Counts every request by endpoint and status, checks the API key, refuses work while closing."""

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
        status = 500  # (unless a response starts)

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if ctx.api_key is not None and path not in OPEN_PATHS and not _authorized(scope, ctx.api_key):
                await Unauthorized("invalid or missing API key (send 'Authorization: Bearer <key>')").response(
                    shape_of(path))(scope, receive, counting_send)
            elif ctx.closing and path not in OPEN_PATHS:
                await Unavailable("the server is shutting down").response(shape_of(path))(
                    scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            ctx.metrics.request_done(self.endpoint_of(path), status)


def _authorized(scope: Scope, key: str) -> bool:
    given = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                given = token.strip()
        elif name == b"x-api-key":
            given = value.decode("latin-1").strip()
    return given is not None and hmac.compare_digest(given.encode(), key.encode())
