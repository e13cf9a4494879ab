"""Router mode under races: ``/models/load``, ``/models/unload``, ``GET /models?reload=1``, idle sleep and
requests on the same models at once (issue 42, part 4).

Whatever the interleaving, a model ends ``loaded`` or ``unloaded`` (never ``failed`` for an unload that
stopped its load), the next request loads it (autoload), no request gets a 500, and the process holds no
model, context or server thread beyond those of the models loaded. The server runs in a subprocess behind a
small probe (``PROBE``): on SIGUSR1 it writes what is alive in it (models and contexts not closed, threads by
name), read with :func:`probe`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from http_helpers import free_port, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the probe is a POSIX signal")

#: The server, with a SIGUSR1 handler that writes what is alive in the process to $PROBE_OUT.
PROBE = r'''
import gc, json, os, signal, sys, threading
from collections import Counter

def dump(signum, frame):
    from llama_ctypes.core.context import Context
    from llama_ctypes.core.model import Model
    objs = gc.get_objects()
    state = {"models": sum(1 for o in objs if isinstance(o, Model) and not o.closed),
             "contexts": sum(1 for o in objs if isinstance(o, Context) and not o.closed),
             "threads": dict(Counter(t.name.split("_")[0] if t.name.startswith("llama_ctypes-load") else t.name
                                     for t in threading.enumerate()))}
    out = os.environ["PROBE_OUT"]
    with open(out + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(out + ".tmp", out)

signal.signal(signal.SIGUSR1, dump)
from llama_ctypes.interfaces.cli import main
sys.exit(main(sys.argv[1:]))
'''


class ProbedServer:
    """``llama-ctypes serve ARGS`` in a subprocess with the probe; its log in ``folder/serve.log``."""

    def __init__(self, args: list[str], folder: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "serve.log"
        self.probe_out = folder / "probe.json"
        script = folder / "probe_serve.py"
        script.write_text(PROBE)
        env = {**os.environ, "PROBE_OUT": str(self.probe_out)}
        env.pop("LLAMA_CTYPES_API_KEY", None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(script), "--log-level", "INFO", "serve", *args,
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.log()}"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.log())

    def probe(self) -> dict:
        """What is alive in the server now (models and contexts not closed, threads by name)."""
        self.probe_out.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        assert wait_for(self.probe_out.exists, 10), "the probe did not answer"
        return json.loads(self.probe_out.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def models_dir(tmp_path, tiny_model_path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("ga", "gb"):
        shutil.copy(tiny_model_path, folder / f"{name}.gguf")
    return folder


def statuses(url: str, reload: bool = False) -> dict[str, dict]:
    r = httpx.get(f"{url}/models" + ("?reload=1" if reload else ""), timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m["status"] for m in r.json()["data"]}


def complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/completion", timeout=60,
                      json={"model": model, "prompt": "Hi", "n_predict": 2, "temperature": 0, **extra})


def test_an_unload_during_a_load_leaves_the_model_unloaded_and_the_next_request_loads_it(tmp_path, models_dir):
    """The reproduction: ``/models/load`` at once followed by ``/models/unload`` left ``ga`` failed ("unloaded
    while it loaded") and every later request 503 ``model_failed``, autoload or not."""
    server = ProbedServer(["--models-dir", str(models_dir), "-c", "512", "--parallel", "1"], tmp_path)
    try:
        server.wait_ready()
        url = server.base_url
        for _ in range(3):
            assert httpx.post(f"{url}/models/load", json={"model": "ga"}).json() == {"success": True}
            unload = httpx.post(f"{url}/models/unload", json={"model": "ga"})
            assert unload.json() == {"success": True}, unload.text
            assert statuses(url)["ga"] == {"value": "unloaded", "args": [str(models_dir / "ga.gguf")]}
            r = complete(url, "ga")
            assert r.status_code == 200, r.text
            assert statuses(url)["ga"]["value"] == "loaded"
            assert httpx.post(f"{url}/models/unload", json={"model": "ga"}).status_code == 200
        assert "stopped: model 'ga' was unloaded while it loaded" in server.log()  # (the load did run into it)
        assert server.probe()["models"] == 0  # (every load that an unload stopped freed what it made)
    finally:
        server.stop()
    assert "Traceback" not in server.log()


RACE_ROUNDS = 3
CHAOS_S = 1.5


def write_preset(path: Path, models_dir: Path, top_k: int) -> None:
    """The two models as llama-server presets; ``ga``'s options change with ``top_k`` (a reload unloads it)."""
    path.write_text(f"[ga]\nmodel = {models_dir / 'ga.gguf'}\ntop-k = {top_k}\n\n[gb]\nmodel = {models_dir / 'gb.gguf'}\n")


def test_load_unload_reload_sleep_and_requests_race(tmp_path, models_dir):
    """Streaming and plain requests on two models while another client loads, unloads (at once after a
    load, too), changes a model's preset and reloads the list (which unloads it) and the server falls
    asleep between rounds (``--sleep-idle-seconds``):
    no request gets a 500, and at the end each model is usable, none is failed, and the process holds what
    it held before the race (live models, contexts, server threads) and nothing once both are unloaded."""
    preset = tmp_path / "models.ini"
    write_preset(preset, models_dir, 40)
    server = ProbedServer(["--models-preset", str(preset), "-c", "512", "--parallel", "2",
                           "--sleep-idle-seconds", "1"], tmp_path)
    seen: Counter = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    running = threading.Event()  # set while a round's chaos runs
    over = threading.Event()

    def note(kind: str, status: int, body: str = "") -> None:
        with lock:
            seen[(kind, status)] += 1
            if status >= 500 and status != 503:
                problems.append(f"{kind}: {status} {body[:300]}")

    def streamer(models: tuple[str, ...]) -> None:
        rng = random.Random(hash(models))
        with httpx.Client(timeout=60) as client:
            while not over.is_set():
                if not running.wait(0.1):
                    continue
                model = rng.choice(models)
                body = {"model": model, "prompt": "Once upon a time", "n_predict": 16, "stream": True}
                try:
                    with client.stream("POST", f"{server.base_url}/completion", json=body) as r:
                        if r.status_code != 200:
                            note("stream", r.status_code, r.read().decode(errors="replace"))
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: ") and '"error"' in line:
                                error = json.loads(line[6:])["error"]  # (a 500 is a "server_error")
                                note("stream-error", 500 if error.get("type") == "server_error" else 503, line)
                        note("stream", 200)
                except httpx.TransportError as exc:
                    problems.append(f"stream: {exc!r}")

    def chatter() -> None:
        rng = random.Random(7)
        with httpx.Client(timeout=60) as client:
            while not over.is_set():
                if not running.wait(0.1):
                    continue
                r = client.post(f"{server.base_url}/v1/chat/completions",
                                json={"model": rng.choice(("ga", "gb")), "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hello"}]})
                note("chat", r.status_code, r.text)

    def admin() -> None:
        rng = random.Random(11)
        with httpx.Client(timeout=60) as client:
            while not over.is_set():
                if not running.wait(0.1):
                    continue
                model = rng.choice(("ga", "gb"))
                action = rng.choice(("load", "unload", "load+unload", "load+unload", "reload", "list"))
                if action == "reload":
                    write_preset(preset, models_dir, rng.choice((20, 40)))
                    r = client.get(f"{server.base_url}/models?reload=1")
                    note("reload", r.status_code, r.text)
                    continue
                if action == "list":
                    r = client.get(f"{server.base_url}/models")
                    note("list", r.status_code, r.text)
                    continue
                for step in action.split("+"):
                    r = client.post(f"{server.base_url}/models/{step}", json={"model": model})
                    note(step, r.status_code, r.text)
                    if r.status_code not in (200, 400):
                        problems.append(f"{step} {model}: {r.status_code} {r.text[:300]}")
                time.sleep(rng.uniform(0, 0.15))

    threads = [threading.Thread(target=streamer, args=(m,), daemon=True) for m in (("ga",), ("gb",), ("ga", "gb"))]
    threads += [threading.Thread(target=chatter, daemon=True), threading.Thread(target=admin, daemon=True)]
    try:
        server.wait_ready()
        url = server.base_url
        for model in ("ga", "gb"):
            assert complete(url, model).status_code == 200
        before = server.probe()
        assert before["models"] == 2 and before["threads"].get("llama_ctypes-server") == 2, before
        for t in threads:
            t.start()
        for round_ in range(RACE_ROUNDS):
            running.set()
            time.sleep(CHAOS_S)
            running.clear()
            # quiet: the server falls asleep (every model freed) before the next round wakes it
            assert wait_for(lambda: server.log().count("entering sleeping state") > round_, 15), \
                f"round {round_}: the server never fell asleep: {statuses(url)}"
        over.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a client thread hung"
        assert not problems, problems
        assert seen[("stream", 200)] and seen[("chat", 200)] and seen[("load", 200)] and seen[("unload", 200)], seen
        # every model usable again: none failed, the next request loads it
        assert wait_for(lambda: all(s["value"] in ("loaded", "unloaded") for s in statuses(url).values()), 30), \
            statuses(url)
        for model in ("ga", "gb"):
            r = complete(url, model)
            assert r.status_code == 200, r.text
        assert {m: s["value"] for m, s in statuses(url).items()} == {"ga": "loaded", "gb": "loaded"}
        after = server.probe()
        assert (after["models"], after["contexts"]) == (before["models"], before["contexts"]), (before, after)
        assert after["threads"].get("llama_ctypes-server") == 2, after
        assert after["threads"].get("llama_ctypes-load", 0) <= 2, after  # (the manager's two workers)
        for model in ("ga", "gb"):
            assert httpx.post(f"{url}/models/unload", json={"model": model}).status_code == 200
        empty = server.probe()
        assert (empty["models"], empty["contexts"], empty["threads"].get("llama_ctypes-server", 0)) == (0, 0, 0), \
            empty
    finally:
        over.set()
        running.set()
        server.stop()
    log = server.log()
    assert "Traceback" not in log, log[-4000:]
