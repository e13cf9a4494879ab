"""``/cors-proxy``: llama-server's ``--ui-mcp-proxy``, a pass-through a browser page uses to reach MCP
servers that send no CORS headers.

``GET|POST /cors-proxy?url=<http(s) URL>`` sends the request on and streams the answer back: status,
body as it comes (bytes untouched), headers but those that describe the hop. Only headers the page names
explicitly go on, as ``x-llama-server-proxy-header-<name>: value``: the page's own ``Authorization``,
``Cookie`` and API key are for this server and never leave it, and neither do credentials or proxies of
this process's environment (``~/.netrc``, ``HTTP_PROXY``). Redirects are followed, as llama-server; a
target that cannot be reached is a 500 whose body says ``proxy error: ...``. Like llama-server's, this
lets anyone holding the API key reach any host this server can: enable it only where that is acceptable.

The answer comes back under this server's origin, so it must never act as one of this server's pages (a
link to ``/cors-proxy?url=<attacker's page>`` would otherwise run the attacker's script here, where it may
call ``/tools``). Every answer is confined (:data:`CONFINE`: a sandbox with nothing allowed, a download,
no MIME sniffing, not embeddable by other sites), the target's headers that act on the origin that
serves them (cookies, site data, refreshes, HSTS, its own CORS or security policies, ...) are dropped,
and a browser's navigation or subresource request, which its ``Sec-Fetch-*`` headers show, is refused
before the target is reached. A URL with credentials (``user@host``) is refused: httpx would send them
as ``Authorization: Basic``.

It runs on the event loop (an async client): a stalled target holds no worker thread, and a client that
leaves closes the connection to the target at once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .errors import APIError, BadRequest, InternalError
from .streaming import until_disconnect

logger = logging.getLogger(__name__)

#: the prefix of the headers a page wants sent to the target (stripped on the way)
HEADER_PREFIX = "x-llama-server-proxy-header-"
#: seconds to connect, and between two reads or writes (llama-server: 600)
TIMEOUT_S = 600.0
#: set on every request the proxy sends: one that comes back to a proxy (directly or by a redirect) is
#: refused, or a target redirecting to the proxy would make it call itself without end
LOOP_HEADER = "x-llama-ctypes-proxied"


class ProxyLoop(APIError):
    status, type, code = 508, "invalid_request_error", "loop_detected"


class NotAFetch(APIError):
    status, type, code = 403, "invalid_request_error", "navigation_not_allowed"


#: set on every answer, whatever the target sent: a browser that opens it (a link, a frame) neither runs
#: its scripts nor renders it as a page of this origin, and no other site can embed it
CONFINE = [(b"content-security-policy", b"sandbox; default-src 'none'; frame-ancestors 'none'"),
           (b"content-disposition", b"attachment"),
           (b"x-content-type-options", b"nosniff"),
           (b"cross-origin-resource-policy", b"same-origin")]

#: the target's answer headers that would act on this server's origin (or stand in for :data:`CONFINE`)
_ORIGIN_HEADERS = {
    "set-cookie", "set-cookie2", "clear-site-data", "refresh", "link", "location", "content-location",
    "strict-transport-security", "alt-svc", "public-key-pins", "public-key-pins-report-only", "expect-ct", "nel",
    "report-to", "reporting-endpoints", "x-frame-options", "x-xss-protection", "x-content-type-options",
    "content-disposition", "origin-agent-cluster", "permissions-policy", "feature-policy", "document-policy",
    "service-worker-allowed", "timing-allow-origin", "accept-ch", "accept-ch-lifetime", "critical-ch",
    "supports-loading-mode", "speculation-rules", "set-login", "no-vary-search", "referrer-policy",
    "x-dns-prefetch-control", "x-permitted-cross-domain-policies", "x-download-options", "x-ua-compatible",
    "sourcemap", "x-sourcemap", "observe-browsing-topics", "activate-storage-access"}
_ORIGIN_PREFIXES = ("access-control-", "content-security-policy", "cross-origin-", "sec-")
#: a challenge that makes a browser ask its user for a password, in a dialog shown for this server
#: (MCP's ``Bearer`` challenges pass)
_PROMPTING = re.compile(r"(?:^|,)\s*(?:basic|digest|ntlm|negotiate|kerberos)\b", re.IGNORECASE)
#: ``Sec-Fetch-Dest`` values of requests that cannot run or render what they get (fetch() is "empty")
_INERT_DESTS = {"empty", "image", "audio", "video", "track", "font"}


#: request headers never sent on (the client sets them for the new hop)
_HOP_REQUEST = {"host", "content-length", "transfer-encoding", "accept-encoding", "connection", "keep-alive",
                "te", "upgrade", "proxy-connection", "proxy-authorization"}
#: answer headers not passed back: this server frames the body and sets its own CORS headers
_HOP_RESPONSE = {"server", "transfer-encoding", "content-length", "keep-alive", "connection", "date", "te",
                 "trailer", "upgrade", "proxy-authenticate", "proxy-connection"}


def target_url(request: Request) -> str:
    """The ``url`` parameter, checked as llama-server does (an ``InternalError``, 500, otherwise)."""
    url = request.query_params.get("url", "")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise InternalError(f"invalid target URL: {exc}") from None
    if parts.scheme not in ("http", "https") and parts.scheme:  # (first: file:///x has no host either)
        raise InternalError(f"unsupported URL scheme in target URL: {parts.scheme}")
    if not parts.hostname:
        raise InternalError("invalid target URL: missing host")
    if "@" in parts.netloc:  # (llama-server refuses a password only; httpx sends a user name as Basic auth)
        raise BadRequest("authentication in target URL is not supported", param="url")
    return url


def refuse_navigation(request: Request) -> None:
    """Refuse a request a browser sends to open or embed the answer (a link, a frame, a script tag, a form):
    what its ``Sec-Fetch-*`` headers (which no page can set) say. Pages call the proxy with fetch()."""
    mode = request.headers.get("sec-fetch-mode", "")
    dest = request.headers.get("sec-fetch-dest", "empty")
    if mode in ("navigate", "nested-navigate") or dest not in _INERT_DESTS:
        raise NotAFetch(f"/cors-proxy answers requests of pages (fetch), not a browser's {dest or mode} request: "
                        "its answer would act as a page of this server")


def forwarded_headers(request: Request) -> list[tuple[bytes, bytes]]:
    """The headers the page named with :data:`HEADER_PREFIX`, under their own names (bytes as sent)."""
    out = []
    prefix = HEADER_PREFIX.encode()
    for key, value in request.headers.raw:
        if key.lower().startswith(prefix):
            name = key[len(prefix):]
            if name and name.lower().decode("latin-1") not in _HOP_REQUEST:
                out.append((name, value))
    out.append((b"accept-encoding", b"identity"))  # (the body goes back as it came: no decoding here)
    out.append((LOOP_HEADER.encode(), b"1"))
    return out


def _answer_headers(upstream: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The target's answer headers that may pass, then :data:`CONFINE`."""
    named = {n.strip().lower() for v in upstream.headers.get_list("connection") for n in v.split(",")}
    out = []
    for key, value in upstream.headers.raw:
        name = key.decode("latin-1").lower()
        if name in _HOP_RESPONSE or name in named or name in _ORIGIN_HEADERS or name.startswith(_ORIGIN_PREFIXES):
            continue
        if name == "www-authenticate" and _PROMPTING.search(value.decode("latin-1")):
            continue
        out.append((key.lower(), value))
    return out + CONFINE


def refuse_loop(request: Request) -> None:
    """A request this proxy sent (its mark) came back to it: 508, before any other check answers."""
    if LOOP_HEADER in request.headers:
        raise ProxyLoop("this request came through a proxy of this kind already: a redirect loop?")


async def proxy(request: Request, body: bytes) -> Response:
    """Send ``request`` on to its ``url`` and stream the answer back (``refuse_loop`` was called)."""
    refuse_navigation(request)
    url = target_url(request)
    logger.info("proxying %s request to %s", request.method, urlsplit(url)._replace(query="").geturl())
    client = httpx.AsyncClient(trust_env=False, follow_redirects=True, timeout=httpx.Timeout(TIMEOUT_S))
    try:
        sent = client.build_request(request.method, url, headers=forwarded_headers(request), content=body or None)
        # (a client that leaves before the target answers hangs up on the target too)
        upstream = await until_disconnect(request.receive, client.send(sent, stream=True), lambda: None)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        await _close(None, client)
        logger.error("proxy error: %s: %s", type(exc).__name__, exc)
        response = Response(f"proxy error: {type(exc).__name__}: {str(exc)[:300]}", status_code=500,
                            media_type="text/plain")
        response.raw_headers += CONFINE
        return response
    except BaseException:
        await _close(None, client)
        raise
    headers = _answer_headers(upstream)
    if upstream.status_code in (204, 304):
        await _close(upstream, client)
        response = Response(status_code=upstream.status_code)
    else:
        response = StreamingResponse(_relay(upstream, client), status_code=upstream.status_code)
    response.raw_headers = [h for h in response.raw_headers if h[0] != b"content-type"] + headers
    return response


async def _relay(upstream: httpx.Response, client: httpx.AsyncClient) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        # (raised on: the server cuts the connection, so the client sees an incomplete answer, not a short one)
        logger.warning("proxy: the target's answer broke off: %s", exc)
        raise TargetBrokeOff(str(exc)) from None
    finally:
        await _close(upstream, client)


class TargetBrokeOff(Exception):
    """The target's answer ended early: raised out of the response so that the server cuts the client's
    connection too (an ASGI app has no other way to say that a body is incomplete)."""


def _one_line(record: logging.LogRecord) -> bool:
    """uvicorn logs an app's exception with its traceback; for :class:`TargetBrokeOff` (already logged,
    and no fault of this server) one line is enough."""
    if record.exc_info and isinstance(record.exc_info[1], TargetBrokeOff):
        record.msg, record.args, record.exc_info = "proxy: the client's connection was cut with the target's", (), None
    return True


logging.getLogger("uvicorn.error").addFilter(_one_line)  # (the same function: added once however often imported)


async def _close(upstream: httpx.Response | None, client: httpx.AsyncClient) -> None:
    with anyio.CancelScope(shield=True):  # (also when the client left and this task is cancelled)
        if upstream is not None:
            await upstream.aclose()
        await client.aclose()
