"""A local stand-in for the Hugging Face Hub endpoints the client uses, on 127.0.0.1.

Implements model search, the repository tree (with LFS sha256), and
``resolve`` with redirects to a file server that honours Range requests; it
can cut a response short, corrupt a body, and demand a token, and it records
every request.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

TOKEN = "hf_test_secret_token_123"


@dataclass
class Repo:
    files: dict[str, bytes]
    private: bool = False
    downloads: int = 0


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, dict]] = field(default_factory=list)
    truncate: dict[str, int] = field(default_factory=dict)  # file path -> bytes to send before hanging up (once)
    corrupt: set = field(default_factory=set)  # file paths served with one byte flipped
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _record(self):
            with state.lock:
                state.requests.append((self.command, self.path, dict(self.headers)))

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)

        def _json(self, data):
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

        def _authorized(self, repo: Repo) -> bool:
            return not repo.private or self.headers.get("Authorization") == f"Bearer {TOKEN}"

        def do_HEAD(self):
            self._record()
            self._route()

        def do_GET(self):
            self._record()
            self._route()

        def _route(self):
            url = urlparse(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) == 2:
                q = parse_qs(url.query).get("search", [""])[0].lower()
                limit = int(parse_qs(url.query).get("limit", ["20"])[0])
                hits = [{"id": rid, "downloads": r.downloads, "likes": 1, "tags": ["gguf"],
                         "lastModified": "2026-11-01T00:00:00.000Z"}
                        for rid, r in state.repos.items() if q in rid.lower() and not r.private]
                return self._json(sorted(hits, key=lambda h: -h["downloads"])[:limit])
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                rid = f"{parts[2]}/{parts[3]}"
                repo = state.repos.get(rid)
                if repo is None or parts[5] != "main":
                    return self._send(404)
                if not self._authorized(repo):
                    return self._send(401)
                entries = []
                for path, data in repo.files.items():
                    entry = {"type": "file", "path": path, "size": len(data)}
                    if path.endswith(".gguf"):
                        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}
                    entries.append(entry)
                return self._json(entries)
            if len(parts) >= 5 and parts[2] == "resolve":
                rid, rev, path = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                repo = state.repos.get(rid)
                if repo is None or rev != "main" or path not in repo.files:
                    return self._send(404)
                if not self._authorized(repo):
                    return self._send(401)
                data = repo.files[path]
                headers = {"Location": f"/cdn/{rid}/{path}", "X-Linked-Size": str(len(data)),
                           "X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "ETag": '"gitsha1"'}
                return self._send(302, b"", headers)
            if parts[0] == "cdn":
                rid, path = f"{parts[1]}/{parts[2]}", "/".join(parts[3:])
                data = state.repos[rid].files[path]
                if path in state.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start = 0
                rng = self.headers.get("Range")
                if rng:
                    start = int(rng.split("=")[1].split("-")[0])
                body = data[start:]
                code = 206 if rng else 200
                cut = state.truncate.pop(path, None)
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if cut is not None:
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)
                return
            self._send(404)

    return Handler


class FakeHub:
    def __init__(self):
        self.state = HubState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def requests_to(self, fragment: str) -> list:
        return [r for r in self.state.requests if fragment in r[1]]
