"""``/cors-proxy`` against a real headless Chromium: a link to the proxy must never run the target's page
as a page of this server (where its script could call ``/tools``), nor let it set cookies here.

``serve --agent`` (every tool and the proxy), no API key; an attacker's server on another local port
serves ``/evil.html``, whose script asks ``/tools`` to run a command and write a file, sets cookies, and
calls home. Chromium follows links to ``/cors-proxy?url=<that page>``: directly (its ``Sec-Fetch-*``
headers get the request refused), and through a forwarder that strips those headers (what a browser sends
to a plain-http origin that is not this machine, such as ``http://192.168.1.5:8080``: no ``Sec-Fetch-*``),
where only the answer's own headers keep the page from running. Needs Debian's ``chromium`` and
``chromium-driver`` (a skip without them, a failure under ``LLAMA_CTYPES_REQUIRE_BROWSER=1``).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from http_helpers import ServeProcess
from test_webui import _chrome, browser_available  # noqa: F401 - the fixture: a skip, or a failure in CI

pytestmark = pytest.mark.usefixtures("browser_available")

#: how long a page is given to do harm once loaded (its script is a few fetches)
SETTLE_S = 1.5


class _Attacker(BaseHTTPRequestHandler):
    """The attacker's site: ``/evil.html`` (the page to proxy), ``/link?to=URL`` (a page with a link),
    and ``/ran`` and ``/beacon`` (what scripts call to say they ran), every request recorded."""

    def do_GET(self) -> None:
        self.server.seen.append(self.path)
        if self.path == "/evil.html":
            body = self.server.evil.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Set-Cookie", "sid=evil; Path=/")
            self.send_header("Access-Control-Allow-Origin", "*")
        elif self.path.startswith("/link?to="):
            target = self.path[len("/link?to="):]
            body = (f'<!doctype html><a id="go" href="{target}">a prize</a>'
                    "<script>fetch('/beacon')</script>").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
        else:
            body = b""
            self.send_response(204)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Forwarder(BaseHTTPRequestHandler):
    """Passes every request on to the server but its ``Sec-Fetch-*`` headers, as an old browser, or one on
    a plain-http origin that is not this machine, would send it; the answer comes back untouched."""

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items()
                   if not k.lower().startswith("sec-fetch-") and k.lower() not in
                   ("host", "connection", "content-length", "accept-encoding")}
        r = httpx.request(self.command, self.server.upstream + self.path, headers=headers, content=body,
                          timeout=30)
        self.send_response(r.status_code)
        for name, value in r.headers.multi_items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    do_GET = do_POST = _forward

    def log_message(self, *args) -> None:
        pass


def _serve(handler: type, **attrs) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in attrs.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _evil_page(attacker: str, marker: Path, written: Path) -> str:
    call = ("fetch('/tools', {method: 'POST', headers: {'Content-Type': 'application/json'}, "
            "body: JSON.stringify({tool: %r, params: %s})})")
    return ("<!doctype html><title>evil</title><script>"
            f"fetch('{attacker}/ran', {{mode: 'no-cors'}});"
            + call % ("exec_shell_command", f"{{command: 'touch {marker}'}}") + ";"
            + call % ("write_file", f"{{path: '{written}', content: 'pwned'}}") + ";"
            "document.cookie = 'js=1; path=/';"
            "</script>")


def test_a_link_to_the_proxy_never_runs_the_target_as_a_page_of_this_server(tmp_path):
    marker, written = tmp_path / "command-ran", tmp_path / "written.txt"
    attacker = _serve(_Attacker, seen=[])
    attacker_url = f"http://127.0.0.1:{attacker.server_port}"
    attacker.evil = _evil_page(attacker_url, marker, written)
    proc = ServeProcess(["--agent", "--no-webui"], tmp_path / "serve.log", metrics=False)
    forwarder = None
    driver = None
    try:
        proc.wait_ready()
        forwarder = _serve(_Forwarder, upstream=proc.base_url)
        # (the harness works: a page calling /tools from this machine does run a command, the way the
        # proxied page would if it ran here)
        r = httpx.post(f"{proc.base_url}/tools", json={"tool": "exec_shell_command",
                                                        "params": {"command": f"touch {tmp_path / 'probe'}"}})
        assert r.status_code == 200 and (tmp_path / "probe").exists()
        calls_before = proc.log().count("/tools HTTP/1.1")

        driver = _chrome(tmp_path / "profile")
        driver.set_page_load_timeout(30)
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "deny"})
        proxied = quote(f"{attacker_url}/evil.html", safe="")
        for base in (proc.base_url, f"http://127.0.0.1:{forwarder.server_port}"):
            link = f"{base}/cors-proxy?url={proxied}"
            # a link on the attacker's site, clicked ...
            attacker.seen.clear()
            driver.get(f"{attacker_url}/link?to={quote(link, safe='')}")
            _wait(lambda: "/beacon" in attacker.seen, "the attacker's own page ran no script: is JS on?")
            driver.find_element("id", "go").click()
            time.sleep(SETTLE_S)
            # ... and the same URL typed in
            driver.get(link)
            time.sleep(SETTLE_S)
            assert "/ran" not in attacker.seen, f"the proxied page's script ran ({base})"
            if base != proc.base_url:  # (directly, the proxy refuses before it fetches anything)
                assert "/evil.html" in attacker.seen, "the forwarder did not reach the page: nothing was tested"
        assert not marker.exists() and not written.exists()
        assert proc.log().count("/tools HTTP/1.1") == calls_before, "the page called /tools"
        # no cookie for this server's origin (nor any other: the proxy's answers set none)
        cookies = driver.execute_cdp_cmd("Network.getAllCookies", {})["cookies"]
        assert not cookies, cookies
    finally:
        if driver is not None:
            driver.quit()
        proc.stop()
        for server in (attacker, forwarder):
            if server is not None:
                server.shutdown()
                server.server_close()
    assert "Traceback" not in proc.log()


def _wait(predicate, message: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
