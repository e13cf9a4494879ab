"""The web page ``GET /`` serves: static files from the package (``webui/``) or from ``--webui-path``.

Files are read once, when the app is made, and kept with their ETag and a gzip copy: a request is
a dictionary lookup, answered 304 when the browser's copy is current. Every answer carries a
content-security policy that allows scripts from this server only, so text a model writes can
never run as a script even if the page had a bug that inserted it as HTML.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger(__name__)

#: The page shipped in the package.
PACKAGE_DIR = Path(__file__).with_name("webui")

#: Scripts, styles and connections from this origin only; no inline script, no plugin, no framing.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

#: Files a web UI folder may hold, at most (a --webui-path pointing at a home folder must not load it all).
MAX_FILES = 2000
MAX_BYTES = 64 * 2**20

_TYPES = {".js": "text/javascript; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".html": "text/html; charset=utf-8",
          ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon",
          ".woff2": "font/woff2", ".txt": "text/plain; charset=utf-8", ".webmanifest": "application/manifest+json"}
_COMPRESSIBLE = (".js", ".mjs", ".css", ".html", ".json", ".svg", ".txt", ".webmanifest")


@dataclass(frozen=True)
class _File:
    body: bytes
    gz: bytes | None
    etag: str
    media_type: str


class WebUI:
    """The files of one web UI folder, by URL path (``/`` is ``index.html``)."""

    def __init__(self, folder: str | Path = PACKAGE_DIR, reserved: Iterable[str] = ()):
        """``reserved``: the API's paths; a file of the folder at one of them is not served (it would
        answer in the API's place, and without the API key)."""
        root = Path(folder).expanduser().resolve()
        if not (root / "index.html").is_file():
            raise ValueError(f"web UI folder {str(folder)!r}: no index.html in it")
        reserved = frozenset(reserved)
        self.root = root
        self._files: dict[str, _File] = {}
        total = 0
        for path in sorted(root.rglob("*")):
            if not path.is_file() or any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            resolved = path.resolve()
            if root not in resolved.parents:  # (a link out of the folder is not served)
                continue
            url = "/" + path.relative_to(root).as_posix()
            if url in reserved:
                logger.warning("web UI file %s is not served: the API answers at %s", path, url)
                continue
            if len(self._files) >= MAX_FILES:
                raise ValueError(f"web UI folder {str(folder)!r}: more than {MAX_FILES} files")
            body = resolved.read_bytes()
            total += len(body)
            if total > MAX_BYTES:
                raise ValueError(f"web UI folder {str(folder)!r}: more than {MAX_BYTES >> 20} MiB of files")
            suffix = path.suffix.lower()
            media = _TYPES.get(suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            gz = gzip.compress(body, 9, mtime=0) if suffix in _COMPRESSIBLE and len(body) > 512 else None
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            self._files[url] = _File(body, gz, etag, media)
        if "/index.html" not in self._files:
            raise ValueError(f"web UI folder {str(folder)!r}: its index.html is a link out of the folder")
        self._files["/"] = self._files["/index.html"]

    def serves(self, path: str) -> bool:
        """Whether ``path`` (without an API prefix) is one of the page's files (open without an API key)."""
        return path in self._files

    def response(self, request: Request, path: str) -> Response | None:
        """The file at ``path`` (None: not one of ours)."""
        file = self._files.get(path)
        if file is None:
            return None
        headers = {"ETag": file.etag, "Cache-Control": "no-cache", "Content-Security-Policy": CSP,
                   "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Vary": "Accept-Encoding"}
        tags = _etags(request.headers.get("if-none-match", ""))
        if file.etag in tags or "*" in tags:
            return Response(status_code=304, headers=headers)
        body = file.body
        if file.gz is not None and _accepts_gzip(request.headers.get("accept-encoding", "")):
            body = file.gz
            headers["Content-Encoding"] = "gzip"
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(body))
            return Response(status_code=200, headers=headers, media_type=file.media_type)
        return Response(body, headers=headers, media_type=file.media_type)


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


def _accepts_gzip(header: str) -> bool:
    """Whether ``Accept-Encoding`` admits gzip: named with q > 0, or covered by ``*`` with q > 0."""
    weights: dict[str, float] = {}
    for part in header.split(","):
        name, _, params = part.partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name.strip():
            weights[name.strip().lower()] = q
    return weights.get("gzip", weights.get("*", 0.0)) > 0
