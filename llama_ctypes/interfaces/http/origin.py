"""Which browser pages may make the server act: endpoints that run commands or change what it serves.

CORS only hides an answer from a page of another origin; a "simple" cross-site POST (``text/plain``, no
preflight) still runs, and a link, an image or a ``no-cors`` fetch sends no ``Origin`` at all. For
generation that costs compute; for ``/tools`` and ``/cors-proxy`` it would run commands or reach hosts,
and for the administrative endpoints (``/models/load``, ``/models/unload``, slot actions, adapter changes)
it would let any web page the user visits unload the model or overwrite slots. Those refuse such pages
outright (llama-server does not).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.requests import Request

from .common import AppContext
from .cors_proxy import LOOP_HEADER
from .errors import APIError


class OriginRefused(APIError):
    status, type, code = 403, "invalid_request_error", "origin_not_allowed"


def own_host(host: str) -> bool:
    """Whether a ``Host`` header names an IP address or ``localhost`` (with or without a port): names that no
    other site's page can make a browser send (DNS rebinding needs the attacker's own host name)."""
    name = urlsplit("//" + host).hostname or ""
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_origin(request: Request, app: AppContext, *, wildcard: bool = True, what: str = "the tools and the proxy") \
        -> None:
    """Refuse a browser page of another origin than ``--cors-origins`` lets in (or the server's own).

    ``wildcard=False``: ``--cors-origins *`` (the default) does not count; only origins named there (or
    ``localhost``) and the server's own page. The server's own page is let in when it was reached by an IP
    address or ``localhost``: a page reached by another host name sends that name as both ``Origin`` and
    ``Host``, which is also what a page of an attacker's domain sends once the domain resolves to this
    server (DNS rebinding). Such names go in ``--cors-origins``.

    A browser's ``Sec-Fetch-Site`` (which no page can set) says whether another site's page sent a request
    that carries no ``Origin``: such a request is refused. A request without ``Origin`` by a host name that
    ``--cors-origins`` does not name is refused too, unless the server asks for an API key: a page's
    same-origin GET carries no ``Origin``, and to a plain-http origin a browser sends no ``Sec-Fetch-*``
    either, so after DNS rebinding it looks like any client (which reaches these endpoints by an IP
    address, ``localhost``, a name in ``--cors-origins``, or with the key).

    Nor is a request that ``/cors-proxy`` sent on (its mark, ``LOOP_HEADER``): a target's redirect to this server
    would otherwise reach these endpoints without the page's ``Origin`` (httpx keeps a 307's method and body)."""
    if LOOP_HEADER in request.headers:
        raise OriginRefused("a request that came through /cors-proxy (a redirect of its target) is not allowed here")
    origin = request.headers.get("origin")
    if origin is None:
        site = request.headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site"):
            raise OriginRefused("a request from a page of another site (a link, an image, a no-cors fetch) "
                                "is not allowed here")
        host = request.headers.get("host", "")
        if not app.api_keys and not own_host(host) \
                and not (app.cors.names(f"http://{host}") or app.cors.names(f"https://{host}")):
            # A page's same-origin GET carries no Origin, and to a plain-http origin a browser sends no Sec-Fetch-*
            # either: after DNS rebinding, the attacker's host name is the page's origin and the Host it sends. A
            # client that gives the API key is no such page.
            raise OriginRefused(f"a request to this server by the name {host!r} is not allowed here without an API "
                                f"key: add http://{host} to --cors-origins to let it use {what}, or use --api-key")
        return
    if app.cors.allows(origin) if wildcard else app.cors.names(origin):
        return
    host = request.headers.get("host", "")
    if own_host(host) and origin in (f"http://{host}", f"https://{host}"):
        return
    raise OriginRefused(f"requests from pages of {origin} are not allowed here: add the origin to "
                        f"--cors-origins to let its pages use {what}")
