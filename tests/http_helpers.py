"""Helpers for the HTTP server tests: a real ``llama-ctypes serve`` process on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m llama_ctypes serve ARGS --port <free>`` until :meth:`stop`; its log goes to ``log_path``.

    ``metrics``: pass ``--metrics`` (most tests read /metrics; the CLI's default is off, as llama-server).
    """

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, metrics: bool = True):
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, **(env or {})}
        env.pop("LLAMA_CTYPES_API_KEY", None)
        cmd = [sys.executable, "-m", "llama_ctypes", "--log-level", "INFO", "serve", *args,
               "--host", host, "--port", str(self.port)]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        if metrics:
            cmd.append("--metrics")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0, path: str = "/health") -> None:
        """Wait for /health (at ``path``) to answer 200 (every model loaded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}{path}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready within {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60, **kw)


def metric_samples(text: str, name: str) -> dict[tuple, float]:
    """The samples of metric ``name`` in Prometheus text: {sorted label items: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value (returned) or ``timeout`` seconds pass (the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def metrics_text(server: ServeProcess) -> str:
    """The server's /metrics page (Prometheus text)."""
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def busy(server: ServeProcess, model: str) -> tuple[float, float]:
    """(slots in use, requests waiting) of one model, from /metrics."""
    text = metrics_text(server)
    label = (("model", model),)
    return (metric_samples(text, "llama_ctypes_slots_in_use")[label],
            metric_samples(text, "llama_ctypes_queue_depth")[label])


def api_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """The OpenAI-shaped error of ``r``, checked to have ``status`` (and ``param``)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
