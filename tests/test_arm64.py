"""The aarch64 wheel, cross-built here and run under qemu-user in an arm64 Debian root (tests/arm64_root.py).

Opt-in (``LLAMA_CTYPES_TEST_ARM64=1``): it needs root and Debian's qemu-user-static, debootstrap and
aarch64 cross compilers, and takes ~30-60 minutes on a 2-core machine the first time (the cross build
compiles eight ARM CPU variants, debootstrap configures a root under emulation, pip installs numpy
there), ~15-25 minutes after. Each emulated CPU must pick the best ggml variant it can run, every
variant must run without an illegal instruction, and greedy tokens must match the x86-64 build's up to
a near tie (other kernels round differently).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

import arm64_root
from margins import assert_same_greedy

ROOT = Path(__file__).resolve().parent.parent
OPT_IN_ENV = "LLAMA_CTYPES_TEST_ARM64"
#: A folder of aarch64 wheels to use instead of cross-building them.
WHEELS_ENV = "LLAMA_CTYPES_ARM64_WHEELS"

pytestmark = [
    pytest.mark.skipif(os.environ.get(OPT_IN_ENV) != "1",
                       reason=f"opt-in: {OPT_IN_ENV}=1 (root, qemu-user-static, debootstrap; 30+ min)"),
    pytest.mark.timeout(7200),
]

PROMPT = "The capital of France is"
ALL_VARIANTS = ("armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1", "armv8.6_2", "armv9.2_1", "armv9.2_2")


@pytest.fixture(scope="module")
def arm64(tmp_path_factory, tiny_model_path, gemma_path) -> dict:
    why = arm64_root.blocker()
    if why:
        pytest.fail(f"{OPT_IN_ENV}=1 but the arm64 root cannot run here: {why}")
    work = tmp_path_factory.mktemp("arm64-work")
    source = os.environ.get(WHEELS_ENV)
    wheels = arm64_root.find_wheels(Path(source)) if source else arm64_root.build_wheels(work / "build")
    (work / "wheels").mkdir()
    for wheel in wheels.values():
        shutil.copy2(wheel, work / "wheels" / wheel.name)
    shutil.copy2(tiny_model_path, work / "tiny.gguf")
    binds = {work: arm64_root.GUEST_WORK, Path(gemma_path).parent: "/models/gemma"}
    python = arm64_root.make_venv("/opt/llama-ctypes-test", [work / "wheels" / w.name for w in wheels.values()],
                                  binds=binds)
    return {"work": work, "wheels": wheels, "binds": binds, "python": python,
            "models": {"tiny": f"{arm64_root.GUEST_WORK}/tiny.gguf",
                       "gemma": f"/models/gemma/{Path(gemma_path).name}"}}


@pytest.fixture(scope="module")
def x86_reference(tiny_model, gemma) -> dict:
    import llama_ctypes as lc

    ref = {}
    for name, model, n in (("tiny", tiny_model, 16), ("gemma", gemma, 6)):
        out = lc.generate(model, PROMPT, max_tokens=n, temp=0.0, logprobs=2)
        ref[name] = {"tokens": list(out.tokens), "top": [[(t.token, t.logprob) for t in e.top] for e in out.logprobs]}
    return ref


def test_wheel_is_manylinux_aarch64_and_installs_without_a_compiler(arm64):
    for wheel in arm64["wheels"].values():
        assert re.search(r"-py3-none-manylinux_\d+_\d+_aarch64\.whl$", wheel.name), wheel.name
    assert arm64_root.compilers_in_root() == []  # pip took the wheel as it is: nothing was compiled
    proc = arm64_root.run(["uname", "-m"], check=True)
    assert proc.stdout.strip() == "aarch64"


@pytest.mark.parametrize("cpu", list(arm64_root.EXPECTED_VARIANT))
def test_each_emulated_cpu_picks_its_best_variant_and_generates(arm64, x86_reference, cpu):
    cli = arm64["python"].rsplit("/", 1)[0] + "/llama-ctypes"
    version = arm64_root.run([cli, "version"], cpu=cpu, check=True).stdout
    match = re.search(r"CPU variant (\S+?)\)", version)
    assert match, version
    assert match.group(1) == arm64_root.EXPECTED_VARIANT[cpu], version
    # ...which is the best that ggml's own scores allow on this CPU, and the ones above it score 0
    scores = json.loads(arm64_root.run([arm64["python"], "-c", _SCORES], cpu=cpu, check=True).stdout)
    assert set(scores) == set(ALL_VARIANTS)
    assert max(scores, key=lambda v: scores[v]) == match.group(1), scores
    res = arm64_root.generate(arm64["python"], {"tiny": arm64["models"]["tiny"]}, cpu=cpu, binds=arm64["binds"])
    assert res["variant"] == match.group(1)
    ref = x86_reference["tiny"]
    assert_same_greedy(res["tiny"]["tokens"], ref["tokens"], ref["top"], what=f"aarch64 {cpu} vs x86-64")


_SCORES = """
import json
from pathlib import Path
import llama_ctypes
from llama_ctypes.native.backends import cpu_variant_files, variant_score
files = cpu_variant_files(Path(llama_ctypes.__file__).parent / "lib")
print(json.dumps({name: variant_score(path) for name, path in files.items()}))
"""


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_variant_runs_on_a_cpu_that_has_its_features(arm64, x86_reference, variant):
    # qemu's "max" CPU implements every feature the eight variants are compiled for (SVE2, I8MM, SME):
    # each variant's kernels run without an illegal instruction and give x86-64's greedy tokens.
    res = arm64_root.generate(arm64["python"], {"tiny": arm64["models"]["tiny"]}, cpu="max",
                              env={"LLAMA_CTYPES_CPU_VARIANT": variant}, binds=arm64["binds"])
    assert res["variant"] == variant
    ref = x86_reference["tiny"]
    assert_same_greedy(res["tiny"]["tokens"], ref["tokens"], ref["top"], what=f"aarch64 {variant} vs x86-64")


def test_gemma_generates_its_first_tokens(arm64, x86_reference):
    res = arm64_root.generate(arm64["python"], {"gemma": arm64["models"]["gemma"]}, cpu="neoverse-n1",
                              max_tokens=6, binds=arm64["binds"])
    assert res["variant"] == "armv8.2_2" and res["gemma"]["text"].strip()
    ref = x86_reference["gemma"]
    n = assert_same_greedy(res["gemma"]["tokens"], ref["tokens"], ref["top"], what="Gemma aarch64 vs x86-64")
    assert n >= 2, "'The capital of France is' starts with clear margins"


def test_the_wheel_tests_pass_in_the_arm64_root(arm64):
    """tests/test_wheel.py in the root, on the cross-built wheels, on an emulated Neoverse N1 (Graviton 2)."""
    checkout = arm64["work"] / "checkout"
    (checkout / "vendor" / "llama.cpp" / "models").mkdir(parents=True)
    shutil.copytree(ROOT / "tests", checkout / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "build_scripts", checkout / "build_scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    for vocab in (ROOT / "vendor" / "llama.cpp" / "models").glob("ggml-vocab-*.gguf"):
        shutil.copy2(vocab, checkout / "vendor" / "llama.cpp" / "models" / vocab.name)
    guest = f"{arm64_root.GUEST_WORK}/checkout"
    runner = arm64_root.make_venv("/opt/llama-ctypes-runner",
                                  [arm64["work"] / "wheels" / w.name for w in arm64["wheels"].values()],
                                  arm64_root.RUNNER_REQUIREMENTS, binds=arm64["binds"])
    proc = arm64_root.run(
        [runner, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "3600", "tests/test_wheel.py"],
        cpu="neoverse-n1", cwd=guest, binds=arm64["binds"], timeout=5400,
        env={"LLAMA_CTYPES_TEST_WHEELS": f"{arm64_root.GUEST_WORK}/wheels",
             "LLAMA_CPP_DIR": f"{guest}/vendor/llama.cpp"},
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 10 and "failed" not in summary and "error" not in summary, summary
