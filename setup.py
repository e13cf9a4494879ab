"""Build hook: compile (or reuse) llama.cpp's shared libraries before packaging.

All metadata lives in pyproject.toml. This file only wires the native build
(build_scripts/build_llama.py) into ``build_py`` and marks the wheel as
platform-specific (it carries shared libraries, but no CPython extension, so
one wheel serves every Python 3 version of a platform).
"""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "build_scripts"))

import build_llama  # noqa: E402
from wheel_tags import BinaryDistribution, PlatformWheel  # noqa: E402

# A folder holding lib/ and build_info.json (a build_llama.py output): package those
# libraries instead of building. build_scripts/build_wheel.py sets it.
PREBUILT_ENV = "LLAMA_CTYPES_PREBUILT"


class BuildPyWithNative(build_py):
    def run(self):
        prebuilt = os.environ.get(PREBUILT_ENV)
        if prebuilt:
            cached = Path(prebuilt)
        elif os.environ.get("LLAMA_CTYPES_TARGET_ARCH") and build_llama.host_machine() != os.environ[
                "LLAMA_CTYPES_TARGET_ARCH"].strip().lower():
            sys.exit("llama_ctypes: LLAMA_CTYPES_TARGET_ARCH is for build_scripts/build_wheel.py --arch, which tags "
                     "the wheel for its target; pip install builds for this machine")
        else:
            try:
                cached = build_llama.build()
            except (build_llama.BuildError, build_llama.llama_source.SourceError) as exc:
                sys.exit(f"llama_ctypes: native build failed: {exc}")
            # Into the source tree too: editable installs and tests run from a checkout use it.
            build_llama.install_into(cached, ROOT / "llama_ctypes" / "lib")
        super().run()
        if not self.editable_mode:
            # Exactly this build's libraries in the wheel, whatever else the tree holds.
            try:
                build_llama.install_into(cached, Path(self.build_lib) / "llama_ctypes" / "lib")
            except build_llama.BuildError as exc:
                sys.exit(f"llama_ctypes: {exc}")


setup(
    cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": PlatformWheel},
    distclass=BinaryDistribution,
)
