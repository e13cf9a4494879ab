"""``/tools`` and ``/cors-proxy`` over HTTP: llama-server's agent helpers (``--tools``, ``--mcp-servers-json``,
``--ui-mcp-proxy``), their 403s when off, the headers that steer a call, streaming, and the proxy's rules.
The tools themselves are tested in test_http_tools_builtin.py and test_http_tools_mcp.py."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

pytest.importorskip("starlette")
from http_helpers import ServeProcess  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

import llama_ctypes as lc  # noqa: E402
from llama_ctypes.interfaces.http.app import create_app  # noqa: E402
from llama_ctypes.interfaces.http.tools.box import ToolBox  # noqa: E402
from llama_ctypes.interfaces.http.tools.builtin import BUILTIN_TOOL_NAMES  # noqa: E402

FIXTURES = Path(__file__).parent / "mcp_fixtures"
DISABLED = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}


@pytest.fixture
def manager():
    with lc.ModelManager() as mm:
        yield mm


def test_tools_and_proxy_answer_403_unless_enabled(manager):
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as http:
        for method, path in (("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy?url=http://x/"),
                             ("POST", "/cors-proxy?url=http://x/")):
            r = http.request(method, path, json={"tool": "read_file", "params": {}} if method == "POST" else None)
            assert r.status_code == 403 and r.json() == DISABLED, (method, path, r.text)


def test_tools_are_listed_and_called_as_llama_server_does(manager, tmp_path):
    (tmp_path / "note.txt").write_text("hello from a file\n")
    with TestClient(create_app(manager, tools=ToolBox(["all"]), api_key="k"), base_url="http://127.0.0.1") as http:
        assert http.get("/tools").status_code == 401  # (the key guards the tools like every endpoint)
        auth = {"Authorization": "Bearer k"}
        listing = http.get("/tools", headers=auth).json()
        assert sorted(t["tool"] for t in listing) == sorted(BUILTIN_TOOL_NAMES)
        for tool in listing:
            assert set(tool) == {"display_name", "tool", "type", "permissions", "uses_cwd", "definition"}
            assert tool["type"] == "server" and tool["definition"]["function"]["name"] == tool["tool"]
        writes = {t["tool"] for t in listing if t["permissions"]["write"]}
        assert {"write_file", "edit_file", "exec_shell_command"} <= writes and "read_file" not in writes

        # the cwd comes from the header only: one the model wrote into the parameters is dropped
        r = http.post("/tools", headers={**auth, "x-tool-cwd": str(tmp_path)},
                      json={"tool": "read_file", "params": {"path": "note.txt", "cwd": "/nonexistent"}})
        assert r.status_code == 200 and "hello from a file" in r.json()["plain_text_response"]
        r = http.post("/tools", headers=auth, json={"tool": "read_file", "params": {"path": "note.txt",
                                                                                   "cwd": str(tmp_path)}})
        assert r.status_code == 200 and "error" in r.json()  # (relative to the server's own cwd: not there)

        cafe = tmp_path / "café"
        cafe.mkdir()
        (cafe / "menu.txt").write_text("croissant")
        r = http.post("/tools", headers={**auth, "x-tool-cwd": str(cafe).encode()},  # (UTF-8 bytes, as sent)
                      json={"tool": "read_file", "params": {"path": "menu.txt"}})
        assert r.status_code == 200 and r.json().get("plain_text_response") == "croissant\n", r.text
        r = http.post("/tools", headers=auth, json={"tool": "no_such_tool", "params": {}})
        assert r.status_code == 404 and 'unknown tool "no_such_tool"' in r.json()["error"]["message"]
        r = http.post("/tools", headers=auth, json={"tool": "read_file", "params": {}, "stream": True})
        assert r.status_code == 404 and "does not support stream" in r.json()["error"]["message"]
        for bad in (b"{", b"[]", b'{"tool": 3}', b'{"tool": "read_file", "params": []}',
                    b'{"tool": "read_file", "stream": "yes"}'):
            r = http.post("/tools", headers=auth, content=bad)
            assert r.status_code == 400, bad
        r = http.post("/tools", headers={**auth, "x-tool-runtime": "fake:does-not-exist"},
                      json={"tool": "exec_shell_command", "params": {"command": "echo hi"}})
        assert r.status_code == 500 and "unknown tool runtime" in r.json()["error"]["message"]

        with http.stream("POST", "/tools", headers=auth, json={
                "tool": "exec_shell_command", "params": {"command": "echo one; echo two 1>&2; exit 3"},
                "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == {"done": True} and all(set(e) == {"chunk"} for e in events[:-1])
        output = "".join(e["chunk"] for e in events[:-1])
        assert "one" in output and "two" in output and "[exit code: 3]" in output


def test_pages_of_other_origins_cannot_call_tools_or_the_proxy(manager, tmp_path, target):
    """A cross-site "simple" POST needs no preflight, so CORS headers alone would not stop a web page
    from running a command: /tools and /cors-proxy refuse origins --cors-origins does not let in."""
    marker = tmp_path / "csrf"
    call = {"tool": "exec_shell_command", "params": {"command": f"touch {marker}"}}
    app = create_app(manager, tools=ToolBox(["exec_shell_command"]), cors_proxy=True, cors_origins="localhost")
    with TestClient(app, base_url="http://192.168.7.7:8080") as http:
        for origin, host in (("https://evil.example", None), ("http://localhost.evil.example", None), ("null", None),
                             # (DNS rebinding: a page of a domain that now resolves to this server)
                             ("http://evil.example:8080", "evil.example:8080")):
            headers = {"Origin": origin, "Content-Type": "text/plain", **({"Host": host} if host else {})}
            r = http.post("/tools", content=json.dumps(call), headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", origin
            assert "--cors-origins" in r.json()["error"]["message"]
            r = http.get(f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/x", headers=headers)
            assert r.status_code == 403
        assert not marker.exists() and not target.seen
        # what /cors-proxy sends on (a target may redirect it here): no Origin, no Sec-Fetch-*, only its mark
        r = http.post("/tools", json=call, headers={"x-llama-ctypes-proxied": "1"})
        assert r.status_code == 403 and "through /cors-proxy" in r.json()["error"]["message"]
        assert not marker.exists()
        # a local page, the server's own page reached by its address, a client that is no page
        for origin in ("http://localhost:5173", "http://192.168.7.7:8080", None):
            headers = {"Origin": origin} if origin else {}
            assert http.post("/tools", json=call, headers=headers).status_code == 200, origin
            assert marker.exists()
            marker.unlink()


def test_the_proxy_hangs_up_cuts_and_loops_as_it_should(tmp_path, target):
    proc = ServeProcess(["--ui-mcp-proxy", "--no-webui"], tmp_path / "serve.log", metrics=False)
    base = f"http://127.0.0.1:{target.server_port}"
    try:
        proc.wait_ready()
        proxy = f"{proc.base_url}/cors-proxy?url="
        with httpx.Client(timeout=30) as http:
            with http.stream("GET", f"{proxy}{base}/stall") as r:
                assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
                assert next(r.iter_raw()).startswith(b"data: first")
        assert target.hung_up.wait(10), "the proxy kept its connection to the target after the client left"
        target.hung_up.clear()
        with pytest.raises(httpx.TimeoutException):  # (left before the target's headers came)
            httpx.get(f"{proxy}{base}/silent", timeout=1)
        assert target.hung_up.wait(10), "the proxy kept waiting on the target after the client left"
        with pytest.raises(httpx.RemoteProtocolError):  # (a cut answer is cut here too, not a short 200)
            httpx.get(f"{proxy}{base}/trunc", timeout=30)
        target.proxy_url = proxy + base
        r = httpx.get(f"{proxy}{base}/back", timeout=30)
        assert r.status_code == 508 and r.json()["error"]["code"] == "loop_detected"
        assert sum(1 for seen in target.seen if seen[1] == "/back") == 1
        # the proxy alone narrows CORS to this machine: no other web page may read through it
        r = httpx.get(f"{proxy}{base}/x", headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert httpx.get(f"{proc.base_url}/health").status_code == 200
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()


def test_a_targets_redirect_cannot_reach_the_administrative_endpoints(tmp_path, target, tiny_model_path):
    """(From a review) A target answering a page's proxied POST with a 307 to this server reached /models/unload
    or a slot action: the proxy's hop carries no Origin, and the administrative endpoints looked only at that.
    Its mark refuses it there too, as at /tools."""
    saves = tmp_path / "slots"
    saves.mkdir()
    proc = ServeProcess([str(tiny_model_path), "-c", "256", "--ui-mcp-proxy", "--no-webui", "--slot-save-path",
                         str(saves)], tmp_path / "serve.log", metrics=False)
    try:
        proc.wait_ready()
        target.redirect_to = f"{proc.base_url}/slots/0?action=save"
        r = httpx.post(f"{proc.base_url}/cors-proxy?url=http://127.0.0.1:{target.server_port}/307",
                       json={"filename": "x.bin"}, headers={"Origin": "http://localhost:5173"}, timeout=30)
        assert r.status_code == 403 and "through /cors-proxy" in r.text, r.text
        assert not list(saves.iterdir())
        assert httpx.post(f"{proc.base_url}/slots/0?action=save", json={"filename": "x.bin"}).status_code == 200
    finally:
        proc.stop()


def test_a_streamed_command_dies_with_its_client(tmp_path):
    pid_file = tmp_path / "pid"
    proc = ServeProcess(["--tools", "exec_shell_command", "--no-webui"], tmp_path / "serve.log", metrics=False)
    try:
        proc.wait_ready()
        command = f"echo $$ > {pid_file}; echo started; sleep 60; echo never"
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{proc.base_url}/tools", json={
                    "tool": "exec_shell_command", "params": {"command": command}, "stream": True}) as r:
                for line in r.iter_lines():
                    if "started" in line:
                        break
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), "the command outlived the client that asked for it"
        pid_file.unlink()
        with pytest.raises(httpx.TimeoutException):  # (not streamed: the same when its client leaves)
            httpx.post(f"{proc.base_url}/tools", timeout=2, json={
                "tool": "exec_shell_command", "params": {"command": command, "timeout": 60}})
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), "the command outlived the client that asked for it (not streamed)"
        assert httpx.get(f"{proc.base_url}/health").status_code == 200
    finally:
        proc.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # (it ended between two looks)
        return False
    return state != "Z"  # (a zombie has ended)


#: headers a target may send that act on the origin serving them (or would undo the proxy's confinement)
_ORIGIN_ACTING = [
    ("Set-Cookie", "sid=evil; Path=/"), ("Set-Cookie2", "old=1"), ("Clear-Site-Data", '"*"'),
    ("Refresh", "0; url=http://evil.example/"), ("Link", "<http://evil.example/x.css>; rel=stylesheet"),
    ("Location", "http://evil.example/"), ("Content-Location", "/elsewhere"),
    ("Strict-Transport-Security", "max-age=31536000"), ("Alt-Svc", 'h2=":9"'),
    ("Content-Security-Policy", "script-src *"), ("Content-Security-Policy-Report-Only", "default-src *"),
    ("X-Frame-Options", "ALLOWALL"), ("Content-Disposition", "inline"), ("X-Content-Type-Options", "none"),
    ("Access-Control-Allow-Origin", "*"), ("Access-Control-Allow-Credentials", "true"),
    ("Access-Control-Expose-Headers", "*"), ("Cross-Origin-Opener-Policy", "unsafe-none"),
    ("Cross-Origin-Resource-Policy", "cross-origin"), ("Service-Worker-Allowed", "/"),
    ("Timing-Allow-Origin", "*"), ("Permissions-Policy", "camera=*"), ("Origin-Agent-Cluster", "?0"),
    ("Accept-CH", "Sec-CH-UA-Model"), ("Report-To", '{"max_age": 1}'), ("NEL", '{"max_age": 1}'),
    ("Speculation-Rules", '"/rules.json"'), ("Sec-Anything", "1")]


class _Target(BaseHTTPRequestHandler):
    """What the proxy reaches: records each request, answers by path."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.server.seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length)))
        if self.path == "/empty":
            self.send_response(204)
            self.end_headers()
            return
        body = self.server.big if self.path == "/big" else b"ok"
        self.send_response(201 if self.command == "POST" else 200)
        self.send_header("Content-Type", "application/x-test")
        self.send_header("Access-Control-Allow-Origin", "https://elsewhere.example")
        self.send_header("X-Target", "yes")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stall(self) -> None:
        """Headers and one chunk, then nothing until the proxy hangs up (recorded in ``hung_up``)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b"data: first\n\n")
        self.wfile.flush()
        self._hold()

    def _hold(self) -> None:
        """Nothing more, until the proxy hangs up (recorded in ``hung_up``)."""
        end = time.monotonic() + 60
        while time.monotonic() < end:
            readable, _, _ = select.select([self.connection], [], [], 0.1)
            if readable and not self.connection.recv(1):
                self.server.hung_up.set()
                return

    def _page(self) -> None:
        """An attacker's page: a script, and every header that would act on the origin serving it."""
        self.server.seen.append((self.command, self.path, dict(self.headers), b""))
        status = 401 if self.path.startswith("/auth-") else 200
        body = b"<!doctype html><script>fetch('/tools')</script>"
        self.send_response(status)
        headers = [*_ORIGIN_ACTING, ("Content-Type", "text/html"), ("Mcp-Session-Id", "s-1"), ("X-Target", "yes")]
        if self.path == "/auth-basic":
            headers.append(("WWW-Authenticate", 'Basic realm="x"'))
        elif self.path == "/auth-bearer":
            headers.append(("WWW-Authenticate", 'Bearer resource_metadata="http://127.0.0.1/.well-known/x"'))
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path in ("/page", "/auth-basic", "/auth-bearer"):
            return self._page()
        if self.path == "/stall":
            return self._stall()
        if self.path == "/silent":
            return self._hold()
        if self.path == "/trunc":  # (100 bytes promised, 10 sent)
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"0123456789")
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        if self.path.startswith("/back"):  # (a redirect to the proxy that asked)
            self.server.seen.append((self.command, self.path, dict(self.headers), b""))
            self.send_response(302)
            self.send_header("Location", self.server.proxy_url + self.path)
            self.end_headers()
            return
        return self._answer()

    def do_POST(self) -> None:
        if self.path == "/307":  # (a redirect that keeps the method and the body, to wherever the test says)
            self.server.seen.append((self.command, self.path, dict(self.headers), b""))
            self.send_response(307)
            self.send_header("Location", self.server.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        return self._answer()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def target():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    server.seen, server.big, server.hung_up = [], os.urandom(3 << 20), threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_cors_proxy_passes_requests_through_with_only_the_named_headers(manager, target, tmp_path, monkeypatch):
    base = f"http://127.0.0.1:{target.server_port}"
    # the environment's credentials and proxies are this process's, never the page's to use
    (tmp_path / "netrc").write_text("machine 127.0.0.1 login svc password s3cret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")
    with TestClient(create_app(manager, cors_proxy=True, api_key="k"), base_url="http://127.0.0.1") as http:
        auth = {"Authorization": "Bearer k"}
        assert http.get(f"/cors-proxy?url={base}/x").status_code == 401
        r = http.get(f"/cors-proxy?url={base}/capture", headers={
            **auth, "Cookie": "session=secret", "X-Api-Key": "k", "Proxy-Authorization": "Basic s",
            "x-llama-server-proxy-header-accept": "application/json",
            "x-llama-server-proxy-header-authorization": "Bearer for-the-target",
            "x-llama-server-proxy-header-host": "spoofed.example"})
        assert r.status_code == 200 and r.content == b"ok"
        assert r.headers["content-type"] == "application/x-test" and r.headers["x-target"] == "yes"
        assert "access-control-allow-origin" not in r.headers  # (the target's CORS headers are not ours)
        _, path, headers, _ = target.seen[-1]
        headers = {k.lower(): v for k, v in headers.items()}
        assert path == "/capture" and headers["accept"] == "application/json"
        assert headers["authorization"] == "Bearer for-the-target"
        assert headers["host"] == f"127.0.0.1:{target.server_port}"
        assert not {"cookie", "x-api-key", "proxy-authorization"} & set(headers)
        r = http.get(f"/cors-proxy?url={base}/plain", headers=auth)
        assert r.status_code == 200 and "authorization" not in {k.lower() for k in target.seen[-1][2]}
        assert http.head(f"/cors-proxy?url={base}/plain", headers=auth).status_code == 405

        r = http.post(f"/cors-proxy?url={base}/post", headers=auth, content=b'{"jsonrpc": "2.0"}')
        assert r.status_code == 201 and target.seen[-1][3] == b'{"jsonrpc": "2.0"}'
        r = http.post(f"/cors-proxy?url={base}/empty", headers=auth, content=b"{}")
        assert r.status_code == 204 and r.content == b""
        r = http.get(f"/cors-proxy?url={base}/big", headers=auth)
        assert r.status_code == 200 and r.content == target.big  # (streamed through, byte for byte)

        for url, message in (("file:///etc/passwd", "unsupported URL scheme"), ("", "missing host")):
            r = http.get("/cors-proxy", params={"url": url}, headers=auth)
            assert r.status_code == 500 and message in r.json()["error"]["message"], url
        with socket_closed() as port:
            r = http.get(f"/cors-proxy?url=http://127.0.0.1:{port}/", headers=auth)
        assert r.status_code == 500 and r.text.startswith("proxy error")


def test_proxied_answers_never_act_as_pages_of_this_server(manager, target):
    """The answer comes back under this server's origin: it is confined (no script, no rendering, a
    download), and the target's headers that act on the origin (cookies, site data, redirects, HSTS, its
    own CORS and security policies) are dropped; what MCP needs (the type, the session id) passes."""
    base = f"http://127.0.0.1:{target.server_port}"
    with TestClient(create_app(manager, cors_proxy=True), base_url="http://127.0.0.1") as http:
        r = http.get(f"/cors-proxy?url={base}/page")
        assert r.status_code == 200 and r.content.startswith(b"<!doctype html>")
        names = {k.lower() for k in r.headers} - {"content-length", "transfer-encoding"}
        assert names == {"content-type", "mcp-session-id", "x-target", "content-security-policy",
                         "content-disposition", "x-content-type-options", "cross-origin-resource-policy"}
        assert r.headers["content-type"] == "text/html" and r.headers["mcp-session-id"] == "s-1"
        assert r.headers["content-security-policy"] == "sandbox; default-src 'none'; frame-ancestors 'none'"
        assert r.headers["content-disposition"] == "attachment"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["cross-origin-resource-policy"] == "same-origin"
        assert not http.cookies  # (the client kept no cookie for this server)
        # a challenge that makes a browser ask for a password (in a dialog of this server) is dropped,
        # MCP's Bearer challenge passes
        r = http.get(f"/cors-proxy?url={base}/auth-basic")
        assert r.status_code == 401 and "www-authenticate" not in r.headers and "set-cookie" not in r.headers
        r = http.get(f"/cors-proxy?url={base}/auth-bearer")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer resource_metadata=")
        with socket_closed() as port:  # (this server's own error answer is confined too)
            r = http.get(f"/cors-proxy?url=http://127.0.0.1:{port}/")
        assert r.status_code == 500 and r.headers["content-disposition"] == "attachment"


def test_the_proxy_refuses_what_a_browser_sends_to_open_or_embed_its_answer(manager, target, tmp_path):
    """A link, a frame, a script or image tag of another site: the Sec-Fetch-* headers a browser sets (and
    no page can) tell them from a page's fetch(), which passes; none of them reaches the target."""
    base = f"http://127.0.0.1:{target.server_port}"
    marker = tmp_path / "ran"
    app = create_app(manager, tools=ToolBox(["exec_shell_command"]), cors_proxy=True, cors_origins="localhost")
    with TestClient(app, base_url="http://127.0.0.1:8080") as http:
        refused = [  # (mode, dest, site)
            ("navigate", "document", "none"),  # typed in, or a bookmark
            ("navigate", "document", "cross-site"),  # a link on another site
            ("navigate", "iframe", "same-origin"), ("no-cors", "script", "same-origin"),
            ("no-cors", "style", "same-origin"), ("same-origin", "worker", "same-origin"),
            ("no-cors", "image", "cross-site"), ("no-cors", "empty", "same-site")]
        for mode, dest, site in refused:
            headers = {"Sec-Fetch-Mode": mode, "Sec-Fetch-Dest": dest, "Sec-Fetch-Site": site}
            r = http.get(f"/cors-proxy?url={base}/page", headers=headers)
            assert r.status_code == 403, (mode, dest, site, r.text)
            assert r.json()["error"]["code"] in ("navigation_not_allowed", "origin_not_allowed")
        assert not target.seen
        # /tools: another site's link or image carries no Origin, but its Sec-Fetch-Site gives it away
        call = json.dumps({"tool": "exec_shell_command", "params": {"command": f"touch {marker}"}})
        for site in ("cross-site", "same-site"):
            headers = {"Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document", "Sec-Fetch-Site": site}
            assert http.get("/tools", headers=headers).status_code == 403
            assert http.post("/tools", content=call, headers=headers).status_code == 403
        assert not marker.exists()
        # this server's page calling fetch(), and a client that is no browser, pass
        page = {"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty",
                "Sec-Fetch-Site": "same-origin"}
        assert http.get(f"/cors-proxy?url={base}/x", headers=page).status_code == 200
        assert http.get(f"/cors-proxy?url={base}/x").status_code == 200
        assert http.post("/tools", content=call, headers=page).status_code == 200 and marker.exists()


def test_a_dns_rebinding_page_cannot_use_the_proxy_by_get(manager, target):
    """After DNS rebinding the attacker's page is this server's origin, and its fetch() GETs carry no Origin
    (and, to a plain-http origin, no Sec-Fetch-* either: a real Chromium's request was Host and Referer only):
    a Host that names neither an IP address nor localhost is refused unless named in --cors-origins or the
    request gives the API key."""
    base = f"http://127.0.0.1:{target.server_port}"
    chromium = {"Host": "rebind.attacker.example:8080", "Referer": "http://rebind.attacker.example:8080/"}
    secure = {**chromium, "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"}
    with TestClient(create_app(manager, tools=ToolBox(["read_file"]), cors_proxy=True),
                    base_url="http://127.0.0.1:8080") as http:
        for rebound in (chromium, secure):
            r = http.get(f"/cors-proxy?url={base}/secret", headers=rebound)
            assert r.status_code == 403 and "--cors-origins" in r.json()["error"]["message"]
            assert http.get("/tools", headers=rebound).status_code == 403
        assert not target.seen
        for own in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080"):  # (names no other site can send)
            assert http.get(f"/cors-proxy?url={base}/x", headers={**secure, "Host": own}).status_code == 200
    named = create_app(manager, cors_proxy=True, cors_origins="http://rebind.attacker.example:8080")
    with TestClient(named, base_url="http://127.0.0.1:8080") as http:
        assert http.get(f"/cors-proxy?url={base}/x", headers=chromium).status_code == 200
    keyed = create_app(manager, cors_proxy=True, api_key="k")  # (behind a reverse proxy by name, with the key)
    with TestClient(keyed, base_url="http://127.0.0.1:8080") as http:
        assert http.get(f"/cors-proxy?url={base}/x", headers=chromium).status_code == 401
        r = http.get(f"/cors-proxy?url={base}/x", headers={"Host": "llm.example.com", "Authorization": "Bearer k"})
        assert r.status_code == 200


def test_the_proxy_refuses_credentials_in_the_url(manager, target):
    """``user@host`` would go out as ``Authorization: Basic``: a 400, and the target never sees it."""
    port = target.server_port
    with TestClient(create_app(manager, cors_proxy=True), base_url="http://127.0.0.1") as http:
        for url in (f"http://user@127.0.0.1:{port}/x", f"http://user:pw@127.0.0.1:{port}/x",
                    f"http://:pw@127.0.0.1:{port}/x", f"http://@127.0.0.1:{port}/x",
                    f"http://127.0.0.1:{port}@127.0.0.1:{port}/x"):
            r = http.get("/cors-proxy", params={"url": url})
            assert r.status_code == 400, (url, r.text)
            error = r.json()["error"]
            assert error["param"] == "url" and "authentication in target URL" in error["message"]
    assert not target.seen


class socket_closed:
    """A local port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


def _serve_exits(args: list[str], tmp_path: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "llama_ctypes", "serve", *args, "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr
    return r.stderr


def test_serve_refuses_bad_tool_options(tmp_path):
    assert "unknown tool" in _serve_exits(["--tools", "read_file,bogus"], tmp_path)
    assert "unknown tool runtime" in _serve_exits(["--tools", "all", "--tools-runtime", "fake:x"], tmp_path)
    err = _serve_exits(["--mcp-servers-json", "not valid json"], tmp_path)
    assert "json" in err.lower()
    assert "path.json" in _serve_exits(["--mcp-servers-config", str(tmp_path / "path.json")], tmp_path)


def test_serve_with_tools_and_mcp_lets_in_only_local_pages(tmp_path):
    servers = json.dumps({"mcpServers": {"echo": {"command": sys.executable,
                                                  "args": [str(FIXTURES / "fake_server.py")]}}})
    proc = ServeProcess(["--agent", "--mcp-servers-json", servers, "--no-webui"], tmp_path / "serve.log",
                        metrics=False)
    try:
        proc.wait_ready()
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
        for origin, allowed in (("http://localhost:8080", True), ("http://evil.example", False)):
            r = httpx.options(f"{proc.base_url}/completions", headers={"Origin": origin, **preflight})
            assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == (
                origin if allowed else None)
        names = {t["tool"] for t in httpx.get(f"{proc.base_url}/tools").json()}
        assert set(BUILTIN_TOOL_NAMES) <= names and {"echo_echo", "echo_add"} <= names
        r = httpx.post(f"{proc.base_url}/tools", json={"tool": "echo_add", "params": {"a": 3, "b": 5}}, timeout=30)
        assert r.status_code == 200 and "8" in json.dumps(r.json()) and "error" not in r.json()
        assert httpx.get(f"{proc.base_url}/cors-proxy?url={proc.base_url}/health").status_code == 200
    finally:
        proc.stop()
    assert "experimental" in proc.log() and "Traceback" not in proc.log()


def test_stopping_the_server_ends_its_running_tool_calls(tmp_path):
    """SIGTERM while an MCP call and a command run: both end at once (llama-server's
    test_mcp_slow_tool_call_slot_release asks under 3 s), and neither the MCP server nor the command
    outlives the server."""
    servers = json.dumps({"mcpServers": {"slow": {"command": sys.executable,
                                                  "args": [str(FIXTURES / "fake_server.py")]}}})
    proc = ServeProcess(["--tools", "exec_shell_command", "--mcp-servers-json", servers, "--no-webui"],
                        tmp_path / "serve.log", metrics=False)
    pid_file = tmp_path / "pid"
    try:
        proc.wait_ready()
        url = f"{proc.base_url}/tools"
        mcp_pid = int(httpx.post(url, json={"tool": "slow_pid", "params": {}}, timeout=30).json()[
            "plain_text_response"])
        calls = [{"tool": "slow_sleep", "params": {"seconds": 30}},
                 {"tool": "exec_shell_command", "params": {"command": f"echo $$ > {pid_file}; sleep 50",
                                                           "timeout": 60}}]
        answers: list = []
        threads = [threading.Thread(target=lambda c=c: answers.append(_post_or_error(url, c))) for c in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        start = time.monotonic()
        proc.proc.terminate()
        proc.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(timeout=30)
        assert elapsed < 3, f"the server took {elapsed:.1f} s to stop"
        command_pid = int(pid_file.read_text())
        for pid in (mcp_pid, command_pid):
            end = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < end:
                time.sleep(0.05)
            assert not _alive(pid), pid
        assert len(answers) == 2  # (each caller got an answer or a closed connection, none hangs)
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()


def _post_or_error(url: str, body: dict) -> object:
    try:
        return httpx.post(url, json=body, timeout=60).json()
    except (httpx.HTTPError, ValueError) as exc:
        return exc
