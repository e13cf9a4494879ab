"""Build hook of a llama_ctypes backend plugin (generated project, see build_wheel.py).

The wheel carries a shared library but no CPython extension (wheel_tags.py,
copied here from build_scripts/, makes it ``py3-none-<platform>``).
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wheel_tags import BinaryDistribution, PlatformWheel  # noqa: E402

setup(cmdclass={"bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
