"""A child process for tests/test_no_abort.py: runs one API call per line of standard input.

A llama.cpp assert aborts the whole process, so the options the property test draws are tried
here, not in pytest's own process: the parent sees an abort as this process dying (with the
case that killed it) and carries on with a fresh worker.

Protocol: argv = model paths (name=path ...); each input line is a JSON case
``{"api": ..., "model": ..., "prompt": ..., "opts": {...}}``; each output line is
``{"ok": true}``, ``{"error": "<LlamaError subclass>", "message": ...}`` (a refusal, as the API
promises) or ``{"unexpected": "<other exception>", ...}`` (a bug: anything but an LlamaError).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

import llama_ctypes as lc

MODELS: dict[str, lc.Model] = {}
PATHS: dict[str, str] = {}


def _decode(value):
    # JSON has no NaN/inf literals the parent can rely on, nor big ints as floats: tagged values
    if isinstance(value, dict) and set(value) == {"$float"}:
        return float(value["$float"])
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def run(case: dict) -> None:
    model = MODELS[case["model"]]
    api, prompt, opts = case["api"], case.get("prompt", "Hi"), _decode(case.get("opts", {}))
    if api == "load":
        model_opts, gen_opts = opts.get("model", {}), opts.get("gen", {})
        with lc.load_model(PATHS[case["model"]], **model_opts) as loaded:
            lc.generate(loaded, prompt, **gen_opts)
    elif api == "generate":
        lc.generate(model, prompt, **opts)
    elif api == "stream":
        for _ in lc.stream(model, prompt, **opts):
            pass
    elif api == "context":
        ctx_opts, gen_opts, sampling = opts.get("ctx", {}), opts.get("gen", {}), opts.get("sampling", {})
        with lc.Context.create(model, **ctx_opts) as ctx, lc.Sampler.create(model, **sampling) as smp:
            ids = lc.Tokenizer.encode(model, prompt) if isinstance(prompt, str) else prompt
            ctx.generate(smp, ids, **gen_opts)
            ctx.generate(smp, ids, **gen_opts)  # again: the cached prefix path
    elif api == "embed":
        lc.embed(model, prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else prompt,
                 **opts)
    elif api == "server":
        server_opts, gen_opts = opts.get("server", {}), opts.get("gen", {})
        with lc.Server(model=model, **server_opts) as server:
            server.generate(prompt, **gen_opts)
            server.generate(prompt, **gen_opts)
    elif api == "speculative":
        session_opts, gen_opts = opts.get("session", {}), opts.get("gen", {})
        n_draft = session_opts.pop("n_draft", 4)
        with lc.SpeculativeSession(model, lc.NgramDraft(), n_draft=n_draft, **session_opts) as session:
            session.generate(prompt, **gen_opts)
    else:
        raise SystemExit(f"unknown api {api!r}")


def main() -> None:
    faulthandler.enable()
    # The protocol gets its own copy of stdout; whatever native code prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        PATHS[name] = path
        MODELS[name] = lc.load_model(path)
    print(json.dumps({"ready": True}), file=proto, flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        try:
            run(case)
            out = {"ok": True}
        except lc.LlamaError as e:
            out = {"error": type(e).__name__, "message": str(e)[:500]}
        except Exception as e:  # noqa: BLE001 - the parent reports it as a defect
            out = {"unexpected": type(e).__name__, "message": str(e)[:500],
                   "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(out, default=repr), file=proto, flush=True)


if __name__ == "__main__":
    main()
