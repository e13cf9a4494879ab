"""Wheel tags for packages that carry shared libraries but no CPython extension.

One ``py3-none-<platform>`` wheel serves every Python 3 version of a platform.
Used by the base package's setup.py and copied beside each plugin's setup.py.
"""

from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True
