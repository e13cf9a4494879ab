"""What every endpoint shares: the app's context, body reading, the endpoint wrapper (OpenAI's shapes:
:mod:`llama_ctypes.features.openai`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import pydantic_core
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..._version import __version__
from .cors import CorsPolicy
from .errors import BadRequest, BodyTooLarge, Unavailable, from_exception, shape_of
from .json_cost import check_json_cost
from .limits import RequestLimits
from .metrics import Metrics
from .routing import Router
from .streaming import ClientGone
from .webui import WebUI

logger = logging.getLogger(__name__)

#: Default request body limit (bytes).
MAX_BODY_BYTES = 8 * 2**20
#: Beyond the limit, the rest of a body is read and dropped up to this many bytes, so the client
#: (still sending) gets the 413 instead of a reset connection; a larger body has the connection cut.
_DRAIN_BYTES = 64 * 2**20

SYSTEM_FINGERPRINT = f"llama_ctypes-{__version__}"

@dataclass
class AppContext:
    """The state an app's endpoints share (``request.app.state.llama``)."""

    router: Router
    metrics: Metrics
    api_keys: tuple[str, ...] = ()  # any of them is accepted; none: no key is asked for
    cors: CorsPolicy = field(default_factory=lambda: CorsPolicy("*"))
    api_prefix: str = ""  # every path is served under it (--api-prefix)
    max_body_bytes: int = MAX_BODY_BYTES
    limits: RequestLimits = field(default_factory=RequestLimits)
    close_manager: bool = False
    slots_endpoint: bool = True  # /slots answers (llama-server's --slots / --no-slots)
    metrics_endpoint: bool = True  # /metrics answers (llama-server's --metrics)
    verbose: bool = False  # responses carry ``__verbose`` unless a request says otherwise (--verbose)
    reasoning_format: str = "auto"  # "none": reasoning stays in the content (--reasoning-format)
    enable_thinking: bool | None = True  # for chat requests that do not set it (--reasoning off: False)
    reasoning_budget: int = -1  # thinking tokens before the block's end is forced, for requests that set none
    reasoning_budget_message: str = ""  # forced before that end (--reasoning-budget-message)
    spm_infill: bool = False  # /infill puts the suffix before the prefix (--spm-infill)
    router_mode: bool = False  # several models (or none) rather than one: /props describes the router
    slot_save_path: Path | None = None  # where /slots/{id}?action=save|restore files live (--slot-save-path)
    webui: WebUI | None = None  # the page at / (None: --no-webui)
    fetch_media: Callable[[str], bytes] | None = None  # http(s) media URLs (None: refused; --media-urls)
    tools: Any = None  # the ToolBox of /tools (tools/box.py), None: 403 (--tools, --mcp-servers-*)
    cors_proxy: bool = False  # /cors-proxy answers (--ui-mcp-proxy), else 403
    sleep: Any = None  # an IdleSleep with --sleep-idle-seconds (sleep.py), else None
    #: the chat completions being answered, by response id (weak: each goes with its response)
    running_chats: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    sleep_props: dict[str, Any] | None = None  # /props as the server fell asleep
    closing: bool = False
    started: int = field(default_factory=lambda: int(time.time()))


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes (before any parsing)."""
    declared = request.headers.get("content-length")
    # (isascii: '²'.isdigit() is true, and int('²') raises)
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        await _drain(request, int(declared))
        raise BodyTooLarge(f"the request body is {int(declared)} bytes, over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, size)
            raise BodyTooLarge(f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def json_body(raw: bytes) -> Any:
    """A request body's JSON, read as strictly as llama-server's parser and the schema-checked endpoints
    (:func:`~.schemas.parse`): a lone surrogate (``"\\ud800"``, which no UTF-8 text holds: it would
    fail later, when encoded for a file name, a tokenizer or the answer), ``NaN``, ``Infinity`` or a
    nesting too deep is a 400 ``invalid_json``, never a 500. Python's ``json.loads`` lets all of these in.
    A body that would cost too much to parse is a 413 (:func:`~.json_cost.check_json_cost`)."""
    check_json_cost(raw)
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None


async def _drain(request: Request, seen: int) -> None:
    if seen > _DRAIN_BYTES:
        return
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > _DRAIN_BYTES:
                return
    except Exception:  # (a disconnect, or a stream already consumed)
        return


Handler = Callable[[Request, AppContext], Awaitable[Response]]


def _route_path(request: Request) -> str:
    """The path as the routes see it (without an ``--api-prefix``)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def endpoint(fn: Handler) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint whose errors come out in its API's shape (OpenAI's, or Anthropic's under
    ``/v1/messages``), and a 499 when its client left."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        shape = shape_of(_route_path(request))
        try:
            return await fn(request, request.app.state.llama)
        except (ClientGone, ClientDisconnect):  # (ClientDisconnect: it left while sending its body)
            return Response(status_code=499)  # nobody reads it; the metrics count it
        except asyncio.CancelledError:
            # The server cancels what is still running when its graceful shutdown times out; the
            # requests behind this one were cancelled on the way out. Answer instead of dying with
            # a traceback: the client can retry elsewhere.
            return Unavailable("the server is shutting down").response(shape)
        except Exception as exc:  # noqa: BLE001 - every error becomes a response
            return from_exception(exc).response(shape)

    return wrapper
