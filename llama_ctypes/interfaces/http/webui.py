"""The web page ``GET /`` serves: static files from the package (``webui/``) or from ``--webui-path``.

Files are read once, when the app is made, and kept with their ETag and a gzip copy: a request is
a dictionary lookup, answered 304 when the browser's copy is current. Every answer carries a
content-security policy that allows scripts from this server only, so text a model writes can
never run as a script even if the page had a bug that inserted it as HTML.
"""

from __future__ import annotations

import gzip
import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

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

    def __init__(self, folder: str | Path = PACKAGE_DIR):
        root = Path(folder).expanduser().resolve()
        if not (root / "index.html").is_file():
            raise ValueError(f"web UI folder {str(folder)!r}: no index.html in it")
        self.root = root
        self._files: dict[str, _File] = {}
        total = 0
        for path in sorted(root.rglob("*")):
            if not path.is_file() or any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            resolved = path.resolve()
            if root not in resolved.parents:  # (a link out of the folder is not served)
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
            self._files["/" + path.relative_to(root).as_posix()] = _File(body, gz, etag, media)
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
        if file.etag in _etags(request.headers.get("if-none-match", "")):
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
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().removeprefix("q=")
            try:
                return not params.strip().startswith("q=") or float(q) > 0
            except ValueError:
                return True
    return False
