"""llama-cpp-python, built from the pinned sdist our llama.cpp comes from, in a cached venv for benchmarks.

    python bench/llama_cpp_python_env.py        # build it (about 10 CPU-minutes, once) and print its python

The venv lives under the build cache (``<cache>/bench/llama-cpp-python-<version>``), outside the checkout,
and is reused while its marker names the same archive and flags. Its llama.cpp is built as ours is on
this machine (``-DGGML_NATIVE=ON``, no AMX): the comparison is between the bindings, not the kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_scripts"))

import build_llama  # noqa: E402
import llama_source  # noqa: E402

CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def venv_dir() -> Path:
    return build_llama.cache_root() / "bench" / llama_source.PIN_ID


def python() -> Path:
    return venv_dir() / "bin" / "python"


def ensure(quiet: bool = False) -> Path:
    """The venv's python, building llama-cpp-python into it first if needed."""
    where = venv_dir()
    marker = where / "llama_ctypes-bench.json"
    want = {"archive": llama_source.PIN_SHA256, "cmake_args": CMAKE_ARGS, "cflags": CFLAGS}
    if marker.exists() and python().exists():
        try:
            if json.loads(marker.read_text()) == want:
                return python()
        except ValueError:
            pass
    shutil.rmtree(where, ignore_errors=True)
    archive = llama_source.download_archive(build_llama.cache_root() / "src")
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CFLAGS=CFLAGS, CXXFLAGS=CFLAGS,
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    print(f"building llama-cpp-python {llama_source.PIN_VERSION} into {where} (about 10 CPU-minutes, once)",
          file=sys.stderr)
    subprocess.run([str(python()), "-m", "pip", "install", "--disable-pip-version-check",
                    *(["-q"] if quiet else []), str(archive)], env=env, check=True)
    marker.write_text(json.dumps(want))
    return python()


if __name__ == "__main__":
    print(ensure())
