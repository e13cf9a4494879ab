"""One command on a machine with an NVIDIA GPU: build, test, and compare with llama.cpp's own tools.

    python bench/gpu_check.py                 # build with CUDA, run the GPU tests and the speed table
    python bench/gpu_check.py --no-build      # use what is installed (a wheel + its llama-ctypes-cuda12/13
                                              # plugin); llama-bench/llama-server found beside the loaded
                                              # libraries or given with --llama-bench/--llama-server
    python bench/gpu_check.py --cpu           # the same steps on the CPU backend (checks this script on a
                                              # machine without a GPU; the figures are then CPU figures)

Steps, each in a child process (so that the libraries it builds are the ones later steps load), each
timed:

1. the GPU: ``nvidia-smi``'s name, memory and driver. No NVIDIA GPU (and no ``--cpu``): exit 2, saying so.
2. the build: ``build_scripts/build_llama.py --backend cuda --tools`` — our libraries with CUDA, and
   llama-bench and llama-server from the same sources and flags (cached: a second run reuses them), then a
   check that ggml lists the GPU. Needs the CUDA toolkit (``nvcc``); without it, ``--no-build``.
3. the GPU tests: ``tests/test_gpu.py`` with ``LLAMA_CTYPES_TEST_GPU=require`` (weights and KV cache on
   the device, greedy tokens equal to the CPU's up to near ties, in-graph sampling, a Server's slots,
   embeddings).
4. speed against llama.cpp's tools, all layers offloaded on both sides (Gemma 3 270M):
   ``bench/single_generate.py`` (prefill pp512 and decode tg128 against llama-bench) and
   ``bench/server_overhead.py`` at each ``--slots`` count, greedy, sampled (temperature 1, top-k 40) and
   sampled in the graph (``-bs``), against llama-server.

Printed at the end: one table (ours, llama.cpp's, ours / theirs) and each step's time. The exit status is
0 when every step ran and the tests passed. Meant to finish in under 10 minutes on one recent GPU with
the build cached, about 10 more for the first CUDA build on 16 cores (``--slots`` and ``--max-tokens``
trim it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


class StepFailed(RuntimeError):
    pass


class Run:
    """The steps' log: what ran, how long it took, and whether it failed."""

    def __init__(self, deadline_s: float, cwd: Path) -> None:
        self.cwd = cwd
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s
        self.steps: list[tuple[str, float, str]] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def call(self, name: str, cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
             capture: bool = False) -> str:
        budget = min(timeout or self.left(), self.left())
        if budget <= 5:
            self.steps.append((name, 0.0, "skipped: out of time"))
            raise StepFailed(f"{name}: no time left (--deadline)")
        print(f"\n== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=self.cwd, env=dict(os.environ, **(env or {})), timeout=budget, text=True,
                                  stdout=subprocess.PIPE if capture else None, stderr=None)
        except subprocess.TimeoutExpired:
            self.steps.append((name, time.monotonic() - t0, f"timed out after {budget:.0f} s"))
            raise StepFailed(f"{name}: timed out after {budget:.0f} s") from None
        took = time.monotonic() - t0
        if proc.returncode != 0:
            self.steps.append((name, took, f"failed (exit {proc.returncode})"))
            raise StepFailed(f"{name}: exit {proc.returncode}")
        self.steps.append((name, took, "ok"))
        return proc.stdout if capture else ""


def nvidia_gpus() -> list[str]:
    """``name, memory, driver`` of each NVIDIA GPU nvidia-smi lists ([] without the tool or a GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


DEVICES = """
import json, llama_ctypes as lc
info = lc.init().build_info
print(json.dumps({"devices": [[d.name, d.description, d.gpu_index is not None] for d in lc.devices()],
                  "backend": info.get("backend"), "cache_key": info.get("cache_key")}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run every step on the CPU backend (no GPU needed)")
    ap.add_argument("--no-build", action="store_true", help="use the installed libraries (a wheel and its plugin)")
    ap.add_argument("--llama-bench", type=Path, default=None, help="llama-bench to compare with (with --no-build)")
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server to compare with (with --no-build)")
    ap.add_argument("--slots", default="8,32,64", help="server slot counts (default 8,32,64)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per served request (default 64)")
    ap.add_argument("--deadline", type=float, default=1800.0, help="stop starting steps after this many seconds")
    args = ap.parse_args(argv)

    # (with --no-build the children run away from the checkout: `python -c` and `-m` put the working folder
    # first on sys.path, and the checkout's package would shadow the installed wheel)
    run = Run(args.deadline, Path(tempfile.gettempdir()) if args.no_build else ROOT)
    gpus = nvidia_gpus()
    if args.cpu:
        print(f"--cpu: every step on the CPU backend (NVIDIA GPUs here: {gpus or 'none'})")
    elif not gpus:
        print("no NVIDIA GPU: nvidia-smi is " + ("missing" if shutil.which("nvidia-smi") is None else
              "there but lists none") + ". Run on a machine with one, or with --cpu to check the script.",
              file=sys.stderr)
        return 2
    else:
        print("GPU: " + "; ".join(gpus))
    backend = "cpu" if args.cpu else "cuda"
    ngl = "0" if args.cpu else "-1"
    py = sys.executable
    failures: list[str] = []
    table: list[tuple[str, float | None, float | None]] = []
    env = {"LLAMA_CTYPES_TOOLS": "1"}
    if not args.no_build:  # (the checkout's package, with the libraries just built: not an installed copy)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if args.llama_server:
        env["LLAMA_CTYPES_LLAMA_SERVER"] = str(args.llama_server)

    try:
        if not args.no_build:
            os.environ.pop("LLAMA_CTYPES_PORTABLE", None)  # (the tools are compared with a native build)
            run.call("build", [py, str(ROOT / "build_scripts" / "build_llama.py"), "--backend", backend, "--tools"], env)
        found = json.loads(run.call("devices", [py, "-c", DEVICES], env, capture=True).strip().splitlines()[-1])
        print(f"libraries: backend {found['backend']}, cache key {found['cache_key']}; devices {found['devices']}")
        if not args.cpu and not any(is_gpu for _, _, is_gpu in found["devices"]):
            raise StepFailed("ggml lists no GPU device: the libraries have no CUDA backend (a CPU build, or the "
                             "plugin did not load: see the warnings above)")
    except StepFailed as exc:
        failures.append(str(exc))
        return report(run, table, failures)

    test_env = {**env, "LLAMA_CTYPES_TEST_GPU": "cpu" if args.cpu else "require"}
    try:
        run.call("GPU tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_gpu.py")], test_env)
    except StepFailed as exc:
        failures.append(str(exc))

    with tempfile.TemporaryDirectory() as tmp:
        single = Path(tmp) / "single.json"
        cmd = [py, str(BENCH / "single_generate.py"), "--n-gpu-layers", ngl, "--rounds", "1", "--reps", "3",
               "--json", str(single)]
        if args.llama_bench:
            cmd += ["--llama-bench", str(args.llama_bench)]
        try:
            run.call("decode/prefill vs llama-bench", cmd, env)
            figures = json.loads(single.read_text())
            table.append(("prefill tok/s (pp512)", figures["pp"]["ours"], figures["pp"]["theirs"]))
            table.append(("decode tok/s (tg128)", figures["tg"]["ours"], figures["tg"]["theirs"]))
        except (StepFailed, OSError, ValueError, KeyError) as exc:
            failures.append(str(exc))
        for label, extra in (("greedy", []), ("sampled", ["--temp", "1", "--top-k", "40"]),
                             ("sampled in graph", ["--temp", "1", "--top-k", "40", "--backend-sampling"])):
            rows_file = Path(tmp) / f"serve-{len(table)}.json"
            cmd = [py, str(BENCH / "server_overhead.py"), "--models", "gemma", "--slots", args.slots,
                   "--max-tokens", str(args.max_tokens), "--n-gpu-layers", ngl, "--json", str(rows_file), *extra]
            try:
                run.call(f"serving, {label}, vs llama-server", cmd, env)
            except StepFailed as exc:
                failures.append(str(exc))
            try:  # (the rows measured before a failure still count)
                for row in json.loads(rows_file.read_text()):
                    table.append((f"serve {row['slots']} slots, {label} (tok/s)", row["ours"], row["theirs"]))
            except (OSError, ValueError):
                pass
    return report(run, table, failures)


def report(run: Run, table: list[tuple[str, float | None, float | None]], failures: list[str]) -> int:
    print("\n" + "=" * 78)
    if table:
        print(f"{'shape':<42}{'llama_ctypes':>13}{'llama.cpp':>12}{'ratio':>9}")
        for label, ours, theirs in table:
            ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
            cell = (lambda v: f"{v:.1f}" if v is not None else "-")
            print(f"{label:<42}{cell(ours):>13}{cell(theirs):>12}{ratio:>9}")
    print(f"\n{'step':<42}{'seconds':>10}  result")
    for name, took, result in run.steps:
        print(f"{name:<42}{took:>10.1f}  {result}")
    print(f"{'total':<42}{time.monotonic() - run.start:>10.1f}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
