"""Run llama.cpp's own ``llama-server`` from the same build, for parity tests.

``LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py`` builds it into the
build cache next to the libraries this package loads (``<cache>/native/<key>/bin``,
with ``<key>`` from the loaded ``build_info.json``); ``LLAMA_CTYPES_LLAMA_SERVER``
names another executable.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import requests

import llama_ctypes as lc

ROOT = Path(__file__).resolve().parent.parent

#: Why a tool is missing (the suite builds the tools before the first test that needs them: conftest.py).
NOT_BUILT = ("llama-server is not built for this build of the libraries; the suite builds it before the tests "
             "marked `needs_tools` (see the build's log above), or build it with "
             "`LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py` (or set LLAMA_CTYPES_LLAMA_SERVER)")

#: Where the suite's own build of the tools writes its log.
BUILD_LOG = Path(tempfile.gettempdir()) / "llama_ctypes-tools-build.log"


def find_llama_server() -> Path | None:
    """The llama-server built with the loaded libraries, or None."""
    env = os.environ.get("LLAMA_CTYPES_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else None
    return find_tool("llama-server")


def find_tool(name: str) -> Path | None:
    """A tool of the tools build (``llama-server``, ``llama-mtmd-cli``, ...) beside the loaded libraries, or None."""
    key = lc.init().build_info.get("cache_key")
    if not key:
        return None
    sys.path.insert(0, str(ROOT / "build_scripts"))
    try:
        import build_llama
    finally:
        sys.path.pop(0)
    bin_dir = build_llama.cache_root() / "native" / key / "bin"
    for exe in (name, f"{name}.exe"):
        if (bin_dir / exe).is_file():
            return bin_dir / exe
    return None


def tools_build_blocker() -> str | None:
    """Why the tools cannot be built for the loaded libraries here, or None."""
    info = lc.init().build_info
    if not info.get("cache_key"):
        return "the loaded libraries were not built by build_scripts/build_llama.py (no cache key)"
    if info.get("backend_dl"):
        return ("the loaded libraries are the run-time-dispatched build (--cpu-variant, a wheel): llama.cpp's "
                "tools are compared with the native build; run these tests without --cpu-variant")
    return None


def build_tools() -> str | None:
    """Build llama-server, llama-mtmd-cli and llama-bench beside the loaded libraries (into the build
    cache, keyed as the libraries are), unless they are there; None when done, else why not.

    Incremental after the libraries' own build (a few minutes on 2 cores: the server's sources), and
    waits for a concurrent build of the same key. Its output goes to :data:`BUILD_LOG`.
    """
    if find_tool("llama-server") and find_tool("llama-mtmd-cli"):
        return None
    blocker = tools_build_blocker()
    if blocker:
        return blocker
    info = lc.init().build_info
    env = dict(os.environ, LLAMA_CTYPES_TOOLS="1")
    env.pop("LLAMA_CTYPES_PORTABLE", None)
    cmd = [sys.executable, str(ROOT / "build_scripts" / "build_llama.py"), "--no-install", "--tools",
           "--backend", info.get("backend") or "cpu"]
    with open(BUILD_LOG, "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
    if rc != 0:
        tail = BUILD_LOG.read_text(errors="replace")[-2000:]
        return f"the tools build failed (exit {rc}; log {BUILD_LOG}):\n{tail}"
    if not (find_tool("llama-server") and find_tool("llama-mtmd-cli")):
        return (f"the tools were built, but not for the loaded libraries' key {info.get('cache_key')} (were the "
                f"libraries built with other LLAMA_CMAKE_ARGS or LLAMA_BACKEND? log {BUILD_LOG})")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1 (start with :meth:`start`, then :meth:`wait`)."""

    def __init__(self, exe: Path, model: Path, args: Sequence[str] = ()):
        self.exe, self.model, self.args = exe, model, list(args)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()
        self._session = requests.Session()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LlamaServer":
        self.port = free_port()
        cmd = [str(self.exe), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
               "--no-webui", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait(self, timeout: float = 60.0) -> "LlamaServer":
        """Wait until /health answers 200; raises with the server's log if it exits or times out."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self._session.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"llama-server did not become healthy in {timeout:g} s:\n{self.log()[-3000:]}")

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> requests.Response:
        return self._session.post(f"{self.url}{path}", json=body, timeout=timeout)

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", errors="replace")

    def stop(self, kill: bool = False) -> None:
        """Terminate the server (``kill``: at once, skipping its graceful shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._session.close()

    def close(self, kill: bool = False) -> None:
        self.stop(kill)
        self._log.close()

    def __enter__(self) -> "LlamaServer":
        if self.proc is None:
            self.start()
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.close()
