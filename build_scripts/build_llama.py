"""Build llama.cpp's shared libraries and the llama_ctypes adapter, with a cache.

Run by ``setup.py`` during ``pip install`` and runnable by hand::

    python build_scripts/build_llama.py [--backend cpu] [--tools] [--force]

Environment:
    LLAMA_BACKEND        auto (default: Metal on macOS, CUDA when nvcc and an NVIDIA GPU
                         are present, else CPU) | cpu | cuda | metal | vulkan
    LLAMA_CMAKE_ARGS     extra CMake arguments, split like a shell would
    LLAMA_CPP_DIR        build this llama.cpp tree instead of the pinned one
    LLAMA_CTYPES_CACHE_DIR  cache root (default: the user cache dir, "llama_ctypes")
    LLAMA_CTYPES_AMX     1 to keep ggml's AMX kernels in a native CPU build
    LLAMA_CTYPES_PORTABLE 1 for a CPU build that runs on any x86-64-v3 machine (wheels)
    LLAMA_CTYPES_TOOLS   1 to also build llama-bench and llama-server (benchmarks)

The built libraries are cached under ``<cache>/native/<key>/lib`` where key
hashes the llama.cpp source id, the backend, the CMake flags and the adapter
sources, so a second install with the same inputs does not compile anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llama_source  # noqa: E402  (a sibling module, not a package)

BACKENDS = ("auto", "cpu", "cuda", "metal", "vulkan")
_LIB_SUFFIXES = (".so", ".dylib", ".dll")
_AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


class BuildError(RuntimeError):
    """The native build cannot proceed; the message says what is missing."""


def log(msg: str) -> None:
    print(f"[llama_ctypes build] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    env = os.environ.get("LLAMA_CTYPES_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("llama_ctypes"))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "llama_ctypes"


def resolve_backend(requested: str) -> str:
    requested = (requested or "auto").lower()
    if requested not in BACKENDS:
        raise BuildError(f"LLAMA_BACKEND={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested
    if sys.platform == "darwin":
        return "metal"
    if _has_nvcc() and _has_nvidia_gpu():
        return "cuda"
    return "cpu"


def _has_nvcc() -> bool:
    return bool(shutil.which("nvcc")) or os.path.exists("/usr/local/cuda/bin/nvcc")


def _has_nvidia_gpu() -> bool:
    # A toolkit alone is not enough: CI machines carry nvcc without a GPU (or cuBLAS),
    # and a CUDA build there fails or runs on nothing.
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/gpus"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            return out.returncode == 0 and "GPU" in out.stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
    return False


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def backend_cmake_args(backend: str) -> list[str]:
    portable = os.environ.get("LLAMA_CTYPES_PORTABLE") == "1"
    args: list[str] = []
    if portable:
        args.append("-DGGML_NATIVE=OFF")
        if _is_x86():
            # x86-64-v3: what every machine from the last decade runs; no AVX-512, no AMX.
            args += ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
    else:
        args.append("-DGGML_NATIVE=ON")
        if _is_x86() and sys.platform != "win32" and os.environ.get("LLAMA_CTYPES_AMX") != "1":
            # ggml's AMX kernels crash on Q4_K models (llama.cpp #20824); -mno-amx-*
            # wins over -march=native whatever the order, so native keeps AVX-512.
            args += [f"-DCMAKE_C_FLAGS={_AMX_OFF}", f"-DCMAKE_CXX_FLAGS={_AMX_OFF}"]
    if backend == "cuda":
        args.append("-DGGML_CUDA=ON")
    elif backend == "metal":
        args += ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    return args


def _adapter_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in sorted([HERE / "CMakeLists.txt", *sorted((HERE / "adapter").glob("*"))]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(source_id: str, backend: str, cmake_args: list[str], with_adapter: bool = True) -> str:
    """Key of a build: source, backend, flags, platform (and the adapter sources).

    The CMake build folder is keyed without the adapter, so editing the adapter
    recompiles only the adapter; the cached output is keyed with it.
    """
    fields = {
        "source": source_id,
        "backend": backend,
        "cmake_args": cmake_args,
        "platform": [sys.platform, platform.machine()],
    }
    if with_adapter:
        fields["adapter"] = _adapter_fingerprint()
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return f"{source_id}-{backend}-{digest}"


def check_toolchain(backend: str) -> None:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("CMake >= 3.21 (pip install cmake, or your system package)")
    cxx = os.environ.get("CXX")
    if not (cxx and shutil.which(cxx)) and not any(shutil.which(c) for c in ("c++", "g++", "clang++", "cl")):
        missing.append("a C++17 compiler (gcc/g++, clang or MSVC)")
    if backend == "cuda" and not _has_nvcc():
        missing.append("the CUDA toolkit (nvcc) for LLAMA_BACKEND=cuda")
    if missing:
        raise BuildError("cannot build llama.cpp; missing: " + "; ".join(missing))


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    log("$ " + " ".join(shlex.quote(c) for c in cmd))
    proc = subprocess.run(cmd, cwd=cwd)
    if proc.returncode != 0:
        raise BuildError(f"command failed with exit {proc.returncode}: {' '.join(cmd[:3])} ...")


def _shared_libs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and p.suffix in _LIB_SUFFIXES)


def _is_package_lib(path: Path) -> bool:
    """The libraries the Python package loads: ggml (and its backends), llama, llama-common, the adapter."""
    stem = path.stem[3:] if path.stem.startswith("lib") else path.stem
    return stem.startswith("ggml") or stem in ("llama", "llama-common", "llama_ctypes_adapter")


def build(
    backend: str | None = None,
    extra_cmake_args: list[str] | None = None,
    llama_cpp_dir: str | None = None,
    tools: bool | None = None,
    force: bool = False,
) -> Path:
    """Build (or reuse) the native libraries; return the cache folder holding lib/ (and bin/)."""
    backend = resolve_backend(backend or os.environ.get("LLAMA_BACKEND", "auto"))
    if extra_cmake_args is None:
        extra_cmake_args = shlex.split(os.environ.get("LLAMA_CMAKE_ARGS", ""))
    if tools is None:
        tools = os.environ.get("LLAMA_CTYPES_TOOLS") == "1"
    root = cache_root()
    tree, source_id = llama_source.ensure_source(ROOT / "vendor" / "llama.cpp", root / "src", llama_cpp_dir)
    cmake_args = backend_cmake_args(backend) + extra_cmake_args
    key = cache_key(source_id, backend, cmake_args)
    out = root / "native" / key
    lib_dir, bin_dir = out / "lib", out / "bin"
    info_path = out / "build_info.json"

    have_libs = info_path.exists() and any(lib_dir.glob("*llama_ctypes_adapter*"))
    have_tools = (bin_dir / "llama-bench").exists() or (bin_dir / "llama-bench.exe").exists()
    if have_libs and (have_tools or not tools) and not force:
        log(f"reusing cached build {out}")
        return out

    check_toolchain(backend)
    build_dir = root / "build" / cache_key(source_id, backend, cmake_args, with_adapter=False)
    build_dir.mkdir(parents=True, exist_ok=True)
    configure = [
        "cmake", "-S", str(HERE), "-B", str(build_dir),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DLLAMA_CPP_DIR={tree}",
        f"-DLLAMA_CTYPES_TOOLS={'ON' if tools else 'OFF'}",
    ]
    if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    t0 = time.monotonic()
    _run(configure + cmake_args)
    targets = ["llama_ctypes_adapter"] + (["llama-bench", "llama-server"] if tools else [])
    jobs = str(os.cpu_count() or 2)
    _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", jobs, "--target", *targets])
    elapsed = time.monotonic() - t0

    built = build_dir / "bin"
    if sys.platform == "win32" and (built / "Release").is_dir():
        built = built / "Release"
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "lib").mkdir(parents=True)
    if tools:
        (staging / "bin").mkdir()
    for lib in _shared_libs(built):
        if _is_package_lib(lib):
            shutil.copy2(lib, staging / "lib" / lib.name)
        elif tools:  # libraries only the tools use
            shutil.copy2(lib, staging / "bin" / lib.name)
    if tools:
        for exe in ("llama-bench", "llama-server"):
            for cand in (built / exe, built / f"{exe}.exe"):
                if cand.exists():
                    shutil.copy2(cand, staging / "bin" / cand.name)
    info = {
        "llama_cpp_source": source_id,
        "llama_cpp_dir": str(tree),
        "backend": backend,
        "cmake_args": cmake_args,
        "cache_key": key,
        "build_seconds": round(elapsed, 1),
        "platform": [sys.platform, platform.machine()],
    }
    (staging / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    log(f"built {backend} libraries in {elapsed:.0f} s -> {out}")
    return out


def install_into(cached: Path, package_lib_dir: Path) -> list[Path]:
    """Copy the cached libraries (and build_info.json) into the package's lib/ folder."""
    package_lib_dir.mkdir(parents=True, exist_ok=True)
    for old in package_lib_dir.iterdir():
        if old.is_file() and (old.suffix in _LIB_SUFFIXES or old.name == "build_info.json"):
            old.unlink()
    copied = []
    for lib in _shared_libs(cached / "lib"):
        shutil.copy2(lib, package_lib_dir / lib.name)
        copied.append(package_lib_dir / lib.name)
    shutil.copy2(cached / "build_info.json", package_lib_dir / "build_info.json")
    copied.append(package_lib_dir / "build_info.json")
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None, help="auto|cpu|cuda|metal|vulkan (default: $LLAMA_BACKEND or auto)")
    parser.add_argument("--llama-cpp-dir", default=None, help="use this llama.cpp tree instead of the pinned source")
    parser.add_argument("--tools", action="store_true", default=None, help="also build llama-bench and llama-server")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has this build")
    parser.add_argument("--no-install", action="store_true", help="do not copy the libraries into llama_ctypes/lib")
    args = parser.parse_args(argv)
    try:
        out = build(args.backend, None, args.llama_cpp_dir, args.tools, args.force)
    except (BuildError, llama_source.SourceError) as exc:
        log(f"error: {exc}")
        return 1
    if not args.no_install:
        install_into(out, ROOT / "llama_ctypes" / "lib")
        log(f"installed into {ROOT / 'llama_ctypes' / 'lib'}")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
