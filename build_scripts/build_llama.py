"""Build llama.cpp's shared libraries and the llama_ctypes adapter, with a cache.

Run by ``setup.py`` during ``pip install`` and runnable by hand::

    python build_scripts/build_llama.py [--backend cpu] [--tools] [--force]

Environment:
    LLAMA_BACKEND        auto (default: Metal on macOS, CUDA when nvcc and an NVIDIA GPU
                         are present, else CPU) | cpu | cuda | metal | vulkan
    LLAMA_CMAKE_ARGS     extra CMake arguments, split like a shell would
    LLAMA_CPP_DIR        build this llama.cpp tree instead of the pinned one
    LLAMA_CTYPES_CACHE_DIR  cache root (default: the user cache dir, "llama_ctypes")
    LLAMA_CTYPES_AMX     1 to keep ggml's AMX kernels (a native build; the sapphirerapids
                         variant of a portable one)
    LLAMA_CTYPES_PORTABLE 1 for a build that runs on any machine of the platform (wheels):
                         backends as loadable modules, one CPU library per instruction-set
                         level (x86-64 baseline up to AVX-512), the best picked at run time
    LLAMA_CTYPES_TOOLS   1 to also build llama-bench, llama-server and llama-mtmd-cli (benchmarks, references)
    LLAMA_CTYPES_TARGET_ARCH  aarch64 to cross-build Linux aarch64 libraries on an x86-64 Linux machine
                         (build_wheel.py --arch aarch64; see cross_toolchain())

The built libraries are cached under ``<cache>/native/<key>/lib`` where key
hashes the llama.cpp source id, the backend, the CMake flags and the adapter
sources, so a second install with the same inputs does not compile anything.

The CMake build folder (``<cache>/build/<key>``) outlives whatever ran it: a pip
build environment that is deleted afterwards, a second checkout, an sdist
unpacked to a new temporary folder. So CMake is only ever pointed at paths that
stay put: the pinned llama.cpp tree is copied once to ``<cache>/src/<source id>``,
this folder's CMakeLists.txt and adapter/ are mirrored to
``<cache>/project/<key>``, and a cache configured by a CMake, Ninja or source
folder that is gone or different is configured afresh, keeping the compiled
objects. Another CMake or Ninja version recompiles everything, so the build keeps
to the cmake and ninja that configured the folder while they exist, else prefers
installed ones to those of pip's temporary build environment. A lock file
serializes builds of one key across processes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llama_source  # noqa: E402  (a sibling module, not a package)

BACKENDS = ("auto", "cpu", "cuda", "metal", "vulkan")
_LIB_SUFFIXES = (".so", ".dylib", ".dll")
LICENSE_NAME = "LICENSE.llama.cpp.txt"
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


def cuda_release() -> str | None:
    """nvcc's release ("13.0"), or None without a CUDA toolkit."""
    # CMake takes CUDACXX first, then nvcc on PATH
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


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


def host_machine() -> str:
    """This machine's architecture, normalized: "x86_64", "aarch64", ..."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def target_machine() -> str:
    """The architecture the libraries are built for: ``LLAMA_CTYPES_TARGET_ARCH``, else this machine's."""
    target = os.environ.get("LLAMA_CTYPES_TARGET_ARCH", "").strip().lower()
    if not target:
        return host_machine()
    target = {"amd64": "x86_64", "arm64": "aarch64"}.get(target, target)
    if target not in CROSS_TARGETS and target != host_machine():
        raise BuildError(f"LLAMA_CTYPES_TARGET_ARCH={target!r}: cross builds go to {', '.join(CROSS_TARGETS)} only")
    return target


def is_cross() -> bool:
    return target_machine() != host_machine()


# Cross targets: the GNU triplet whose Debian cross compiler (gcc-<triplet>, or clang with --target)
# and sysroot (/usr/<triplet>) the build uses.
CROSS_TARGETS = {"aarch64": "aarch64-linux-gnu"}
# What the highest ARM CPU variants are compiled with (ggml's armv9.2_*): a cross gcc older than 14
# rejects it, clang 16 and later take it.
_SME_PROBE_FLAG = "-march=armv9.2-a+sme"


def _compiles(cmd: list[str]) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("#include <vector>\nint main() { std::vector<int> v(2); return (int)v.size() - 2; }\n")
        try:
            proc = subprocess.run([*cmd, str(src), "-o", str(Path(tmp) / "probe")], capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return proc.returncode == 0


def cross_toolchain(target: str) -> tuple[list[str], str]:
    """CMake arguments that cross-compile for target on this Linux machine, and a description.

    The cross gcc (``<triplet>-gcc``, Debian's gcc-<triplet>) when it can compile every CPU
    variant ggml builds for the target; else clang (16 or later) with ``--target``, on the same
    cross sysroot and libstdc++, with ggml's own thread pool (clang's OpenMP runtime, libomp,
    has no cross package to link against: ggml then uses its threadpool, as macOS builds do).
    """
    if not sys.platform.startswith("linux"):
        raise BuildError("cross builds run on Linux")
    triplet = CROSS_TARGETS[target]
    sysroot = Path("/usr") / triplet
    common = [
        "-DCMAKE_SYSTEM_NAME=Linux",
        f"-DCMAKE_SYSTEM_PROCESSOR={target}",
        f"-DCMAKE_FIND_ROOT_PATH={sysroot}",
        "-DCMAKE_FIND_ROOT_PATH_MODE_PROGRAM=NEVER",
        "-DCMAKE_FIND_ROOT_PATH_MODE_LIBRARY=ONLY",
        "-DCMAKE_FIND_ROOT_PATH_MODE_INCLUDE=ONLY",
        "-DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=ONLY",
    ]
    gcc, gxx = shutil.which(f"{triplet}-gcc"), shutil.which(f"{triplet}-g++")
    if gcc and gxx and _compiles([gxx, _SME_PROBE_FLAG]):
        return [*common, f"-DCMAKE_C_COMPILER={gcc}", f"-DCMAKE_CXX_COMPILER={gxx}"], f"{triplet}-gcc"
    for version in range(30, 15, -1):
        clang, clangxx = shutil.which(f"clang-{version}"), shutil.which(f"clang++-{version}")
        if clang and clangxx and _compiles([clangxx, f"--target={triplet}", _SME_PROBE_FLAG]):
            return [
                *common,
                f"-DCMAKE_C_COMPILER={clang}", f"-DCMAKE_CXX_COMPILER={clangxx}",
                f"-DCMAKE_C_COMPILER_TARGET={triplet}", f"-DCMAKE_CXX_COMPILER_TARGET={triplet}",
                "-DGGML_OPENMP=OFF",
            ], f"clang-{version} --target={triplet}"
    raise BuildError(
        f"cross-building for {target} needs {triplet}-g++ 14 or later, or clang 16 or later with {triplet}'s "
        f"sysroot and libstdc++ (Debian: apt install g++-{triplet} clang-16): the armv9.2 CPU variants are "
        f"compiled with {_SME_PROBE_FLAG}"
        + ("" if gxx else f"; {triplet}-g++ was not found")
    )


def _is_x86() -> bool:
    return target_machine() in ("x86_64", "i686", "x86")


def portable() -> bool:
    """A build for other machines (wheels): kernels picked at run time, nothing -march=native."""
    return os.environ.get("LLAMA_CTYPES_PORTABLE") == "1"


def _all_cpu_variants() -> bool:
    # ggml builds one CPU library per instruction-set level only where it can
    # detect features at run time (x86 everywhere, ARM on Linux).
    return _is_x86() or (sys.platform.startswith("linux") and target_machine() == "aarch64")


def backend_cmake_args(backend: str) -> list[str]:
    args: list[str] = []
    if portable():
        args.append("-DGGML_NATIVE=OFF")
        if sys.platform != "darwin":
            # Backends as loadable modules: the CPU variants (x86-64 baseline up to
            # AVX-512), chosen by score at run time, and GPU backends that plugin
            # distributions add beside the base package.
            # RPC is built for its plugin distribution (llama-ctypes-rpc), not the base wheel.
            args += ["-DGGML_BACKEND_DL=ON", "-DGGML_RPC=ON"]
            if _all_cpu_variants():
                args.append("-DGGML_CPU_ALL_VARIANTS=ON")
                if os.environ.get("LLAMA_CTYPES_AMX") == "1":
                    args.append("-DLLAMA_CTYPES_AMX=ON")  # AMX kernels kept (see CMakeLists.txt)
    else:
        # RPC (ggml's remote backend, `rpc_servers=` and `llama-ctypes rpc-server`) is small and
        # linked into libggml like the CPU backend. A flag of the key: its own build folder.
        args += ["-DGGML_NATIVE=ON", "-DGGML_RPC=ON"]
        if _is_x86() and sys.platform != "win32" and os.environ.get("LLAMA_CTYPES_AMX") != "1":
            # ggml's AMX kernels crash on Q4_K models (llama.cpp #20824); -mno-amx-*
            # wins over -march=native whatever the order, so native keeps AVX-512.
            args += [f"-DCMAKE_C_FLAGS={_AMX_OFF}", f"-DCMAKE_CXX_FLAGS={_AMX_OFF}"]
    if is_cross():
        if not portable() or backend != "cpu":
            raise BuildError("a cross build is a portable CPU build (LLAMA_CTYPES_PORTABLE=1, LLAMA_BACKEND=cpu)")
        args += cross_toolchain(target_machine())[0]
    if backend == "cuda":
        args.append("-DGGML_CUDA=ON")
    elif backend == "metal":
        args += ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    return args


def _adapter_fingerprint() -> str:
    """Hash of what this folder adds to llama.cpp: CMakeLists.txt, the adapter, the patches."""
    digest = hashlib.sha256()
    for path in sorted([HERE / "CMakeLists.txt", *sorted((HERE / "adapter").glob("*")), *llama_source.patches()]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(
    source_id: str, backend: str, cmake_args: list[str], with_adapter: bool = True, module: str | None = None
) -> str:
    """Key of a build: source, backend, flags, platform (and the adapter sources).

    The CMake build folder is keyed without the adapter, so editing the adapter
    recompiles only the adapter; the cached output is keyed with it. A build of
    one backend module (a plugin's library) is keyed by that module instead.
    """
    fields: dict = {"module": module} if module else {}
    fields |= {
        "source": source_id,
        "backend": backend,
        "cmake_args": cmake_args,
        "platform": [sys.platform, platform.machine()],
    }
    if is_cross():
        fields["platform"] = [sys.platform, target_machine()]
        fields["host"] = host_machine()
    if backend == "cuda":
        # CUDA 12 and 13 builds differ in everything (and the runtime they link);
        # CMake would also keep the first nvcc it found in a shared build folder.
        fields["nvcc"] = cuda_release()
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
    """The libraries the Python package loads: ggml (and its backends), llama, llama-common, mtmd, the adapter."""
    stem = path.stem[3:] if path.stem.startswith("lib") else path.stem
    return stem.startswith("ggml") or stem in ("llama", "llama-common", "mtmd", "llama_ctypes_adapter")


def cpu_variants(lib_dir: Path) -> list[str]:
    """Names of the CPU variant libraries in lib_dir ("haswell", ...); [] for a single-CPU build."""
    names = []
    for lib in _shared_libs(lib_dir):
        stem = lib.stem[3:] if lib.stem.startswith("lib") else lib.stem
        if stem.startswith("ggml-cpu-"):
            names.append(stem[len("ggml-cpu-"):])
    return names


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) across processes.

    Plain fcntl/msvcrt rather than the filelock package: a pip build environment
    holds only the build requirements.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        if os.name == "nt":
            import msvcrt

            fh.seek(0)
            waited = False
            while True:
                try:
                    msvcrt.locking(fh.fileno(), msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    if not waited:
                        log(f"waiting for another build (lock {path})")
                        waited = True
                    time.sleep(0.5)
            try:
                yield
            finally:
                fh.seek(0)
                msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                log(f"waiting for another build (lock {path})")
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _write_if_changed(path: Path, data: bytes) -> None:
    """Replace path's content atomically, leaving it (and its mtime) alone when equal."""
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def sync_project(dest: Path) -> Path:
    """Mirror CMakeLists.txt and adapter/ to dest, the CMake source folder of a build.

    CMake ties a build folder to its source folder for good, and this folder
    differs between checkouts and between pip's temporary copies; dest does not.
    Unchanged files keep their mtime, so nothing recompiles for a mere move.
    """
    files = {"CMakeLists.txt": HERE / "CMakeLists.txt"}
    files.update({f"adapter/{p.name}": p for p in (HERE / "adapter").iterdir() if p.is_file()})
    for rel, src in files.items():
        _write_if_changed(dest / rel, src.read_bytes())
    for old in (dest / "adapter").iterdir():
        if old.is_file() and f"adapter/{old.name}" not in files:
            old.unlink()
    return dest


def sync_patched(dest: Path, tree: Path, pinned: bool) -> list[str]:
    """Write the llama.cpp files the patches change under dest (``<project>/patched``); their names.

    CMakeLists.txt compiles these copies instead of the tree's files, so the tree stays as
    released (shared by every build of that source). Files no patch produces any more go.
    """
    files, applied = llama_source.patched_files(tree, pinned)
    for rel, data in files.items():
        _write_if_changed(dest / rel, data)
    if dest.is_dir():
        for old in sorted(dest.rglob("*"), reverse=True):
            rel = old.relative_to(dest).as_posix()
            if old.is_file() and rel not in files:
                old.unlink()
            elif old.is_dir() and not any(old.iterdir()):
                old.rmdir()
    return applied


def read_cmake_cache(path: Path) -> dict[str, str]:
    """The entries of a CMakeCache.txt (NAME:TYPE=VALUE lines); {} when there is none."""
    entries: dict[str, str] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return entries
    for line in text.splitlines():
        if not line or line.startswith(("#", "//")) or "=" not in line:
            continue
        name_type, value = line.split("=", 1)
        entries[name_type.split(":", 1)[0]] = value
    return entries


def _program_exists(program: str | None) -> bool:
    if not program:
        return False
    return os.path.isfile(program) if os.path.isabs(program) else shutil.which(program) is not None


def _is_temporary(path: str) -> bool:
    """Under the temporary folder, as pip's build environment is: gone after this build."""
    try:
        return Path(tempfile.gettempdir()).resolve() in Path(path).resolve().parents
    except OSError:
        return True


def _on_path(name: str) -> list[str]:
    """Every ``name`` executable on PATH, in PATH order (then, for ninja, the PyPI package's)."""
    found: list[str] = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        exe = shutil.which(name, path=folder) if folder else None
        if exe and os.path.abspath(exe) not in found:
            found.append(os.path.abspath(exe))
    if name == "ninja":
        try:  # the PyPI package (a build requirement) without its script on PATH
            import ninja  # type: ignore[import-not-found]

            for exe in (Path(ninja.BIN_DIR) / "ninja", Path(ninja.BIN_DIR) / "ninja.exe"):
                if exe.is_file() and str(exe) not in found:
                    found.append(str(exe))
        except (ImportError, AttributeError):
            pass
    return found


def _version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else None


def _choose_tool(name: str, cached: str | None, min_version: tuple[int, ...] | None = None) -> str | None:
    """The cmake or ninja to use for a build folder.

    Ninja recompiles everything when the ninja version (its log format) or the CMake
    version (the order of compiler flags) changes, so: the one that configured the
    folder if it is still there, else one that outlives this build (pip's build
    environment does not) so that the next build can use it again, else any.
    """
    candidates = ([cached] if _program_exists(cached) else []) + _on_path(name)
    ordered = [c for c in candidates if not _is_temporary(c)] + [c for c in candidates if _is_temporary(c)]
    for exe in ordered:
        if min_version is None or (_version(exe) or (0,)) >= min_version:
            return exe
    return None


def _same_path(a: str | None, b: Path) -> bool:
    if not a:
        return False
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def _forget_configuration(build_dir: Path) -> None:
    """Drop what CMake remembers (CMakeCache.txt, CMakeFiles/ but the targets' object folders).

    The objects and Ninja's log stay, so a build with the same commands recompiles nothing.
    """
    (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    files = build_dir / "CMakeFiles"
    if files.is_dir():
        for entry in files.iterdir():
            if entry.is_dir() and entry.name.endswith(".dir"):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def prepare_build_dir(build_dir: Path, project: Path, tree: Path) -> tuple[str, list[str]]:
    """Make build_dir configurable from here, whatever configured it before.

    Returns the cmake to run and the generator arguments for the configure command.
    A configuration made from another source folder or llama.cpp tree, by a CMake
    that is gone or of another version, or with a make program (pip's temporary
    ninja) that is gone, is forgotten and redone with the same generator; the
    objects are kept. A Ninja folder with no Ninja around any more is removed.
    """
    cache = read_cmake_cache(build_dir / "CMakeCache.txt")
    cmake = _choose_tool("cmake", cache.get("CMAKE_COMMAND"), (3, 21)) or "cmake"
    generator = cache.get("CMAKE_GENERATOR", "")
    ninja = _choose_tool("ninja", cache.get("CMAKE_MAKE_PROGRAM") if generator == "Ninja" else None)
    if cache and generator == "Ninja" and ninja is None:
        log(f"{build_dir} was built with Ninja, which is not available now; starting it afresh")
        shutil.rmtree(build_dir, ignore_errors=True)
        build_dir.mkdir(parents=True, exist_ok=True)
        cache = {}
    if cache:
        reasons = []
        if not _same_path(cache.get("CMAKE_HOME_DIRECTORY"), project):
            reasons.append(f"source folder was {cache.get('CMAKE_HOME_DIRECTORY')}")
        if not _same_path(cache.get("LLAMA_CPP_DIR"), tree):
            reasons.append(f"llama.cpp tree was {cache.get('LLAMA_CPP_DIR')}")
        cached_version = tuple(
            int(v) if v.isdigit() else -1
            for v in (cache.get(f"CMAKE_CACHE_{part}_VERSION", "") for part in ("MAJOR", "MINOR", "PATCH"))
        )
        if not _program_exists(cache.get("CMAKE_COMMAND")):
            reasons.append(f"cmake {cache.get('CMAKE_COMMAND')} is gone")
        elif cached_version != _version(cmake):
            reasons.append("configured by CMake " + ".".join(map(str, cached_version)))
        if not _program_exists(cache.get("CMAKE_MAKE_PROGRAM")):
            reasons.append(f"make program {cache.get('CMAKE_MAKE_PROGRAM')} is gone")
        if not reasons:
            return cmake, []  # CMake keeps its generator and make program
        log(f"reconfiguring {build_dir} ({'; '.join(reasons)})")
        _forget_configuration(build_dir)
        if generator and generator != "Ninja":
            args = ["-G", generator]
            for var, flag in (("CMAKE_GENERATOR_PLATFORM", "-A"), ("CMAKE_GENERATOR_TOOLSET", "-T")):
                if cache.get(var):
                    args += [flag, cache[var]]
            return cmake, args
    if ninja:
        return cmake, ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    return cmake, []


def _have_build(out: Path, tools: bool, module: str | None = None) -> bool:
    wanted = f"*ggml-{module}.*" if module else "*llama_ctypes_adapter*"
    have_libs = (out / "build_info.json").exists() and any((out / "lib").glob(wanted))
    have_tools = (out / "bin" / "llama-bench").exists() or (out / "bin" / "llama-bench.exe").exists()
    return have_libs and (have_tools or not tools)


def build(
    backend: str | None = None,
    extra_cmake_args: list[str] | None = None,
    llama_cpp_dir: str | None = None,
    tools: bool | None = None,
    force: bool = False,
    module: str | None = None,
) -> Path:
    """Build (or reuse) the native libraries; return the cache folder holding lib/ (and bin/).

    module: build only that backend module (``"cuda"`` -> libggml-cuda) and
    ggml-base, for a plugin distribution; needs a portable (GGML_BACKEND_DL) build.
    """
    if module:
        tools = False
    backend = resolve_backend(backend or os.environ.get("LLAMA_BACKEND", "auto"))
    if extra_cmake_args is None:
        extra_cmake_args = shlex.split(os.environ.get("LLAMA_CMAKE_ARGS", ""))
    if tools is None:
        tools = os.environ.get("LLAMA_CTYPES_TOOLS") == "1"
    root = cache_root()
    with _locked(root / "src" / ".lock"):
        tree, source_id = llama_source.ensure_source(ROOT / "vendor" / "llama.cpp", root / "src", llama_cpp_dir)
    cmake_args = backend_cmake_args(backend) + extra_cmake_args
    if module and "-DGGML_BACKEND_DL=ON" not in cmake_args:
        raise BuildError(f"a {module} backend module needs LLAMA_CTYPES_PORTABLE=1 (GGML_BACKEND_DL)")
    key = cache_key(source_id, backend, cmake_args, module=module)
    out = root / "native" / key

    if _have_build(out, tools, module) and not force:
        log(f"reusing cached build {out}")
        return out

    check_toolchain(backend)
    if source_id == llama_source.PIN_ID:
        # The checkout's vendor/ tree stays (the tests read its models/); CMake gets a
        # copy whose path and mtimes do not depend on which checkout or sdist runs this.
        with _locked(root / "src" / ".lock"):
            tree = llama_source.stable_copy(tree, root / "src" / source_id)
    build_key = cache_key(source_id, backend, cmake_args, with_adapter=False, module=module)
    build_dir = root / "build" / build_key
    with _locked(root / "build" / f"{build_key}.lock"):
        if _have_build(out, tools, module) and not force:
            log(f"reusing cached build {out} (built by another process meanwhile)")
            return out
        build_dir.mkdir(parents=True, exist_ok=True)
        project = sync_project(root / "project" / build_key)
        patches = sync_patched(project / "patched", tree, pinned=source_id == llama_source.PIN_ID)
        cmake, generator_args = prepare_build_dir(build_dir, project, tree)
        configure = [
            cmake, "-S", str(project), "-B", str(build_dir), *generator_args,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DLLAMA_CPP_DIR={tree}",
            f"-DLLAMA_CTYPES_TOOLS={'ON' if tools else 'OFF'}",
        ]
        t0 = time.monotonic()
        _run(configure + cmake_args)
        # Only what this configuration builds may reach the cache: a library an earlier
        # configuration of this folder made (a CPU variant since dropped) goes first;
        # the kept objects make relinking the rest cheap.
        for out_dir in (build_dir / "bin", build_dir / "bin" / "Release"):
            if out_dir.is_dir():
                for stale in _shared_libs(out_dir):
                    stale.unlink()
        if module:
            targets = [f"ggml-{module}"]
        else:
            targets = ["llama_ctypes_adapter", "mtmd"]
            if tools:
                targets += ["llama-bench", "llama-server", "llama-mtmd-cli"]
        jobs = str(os.cpu_count() or 2)
        _run([cmake, "--build", str(build_dir), "--config", "Release", "-j", jobs, "--target", *targets])
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
            for exe in ("llama-bench", "llama-server", "llama-mtmd-cli"):
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
            "platform": [sys.platform, target_machine() if is_cross() else platform.machine()],
            "backend_dl": "-DGGML_BACKEND_DL=ON" in cmake_args,
            "cpu_variants": cpu_variants(staging / "lib"),
            "module": module,
            "patches": patches,
        }
        (staging / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    log(f"built {backend} libraries in {elapsed:.0f} s -> {out}")
    return out


# Backend modules of a run-time-dispatched build that ship in plugin distributions
# (build_wheel.py --plugin ...), not in the base package.
PLUGIN_MODULES = ("ggml-rpc", "ggml-cuda", "ggml-vulkan")


def _lib_stem(lib: Path) -> str:
    name = lib.name
    for suffix in _LIB_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name[3:] if name.startswith("lib") else name


def is_plugin_module(lib: Path) -> bool:
    return _lib_stem(lib) in PLUGIN_MODULES


def _is_module_build(info: dict) -> bool:
    if "backend_dl" in info:
        return bool(info["backend_dl"])
    return "-DGGML_BACKEND_DL=ON" in info.get("cmake_args", ())


def install_into(cached: Path, package_lib_dir: Path) -> list[Path]:
    """Copy the cached libraries (and build_info.json) into the package's lib/ folder.

    A run-time-dispatched build's plugin modules stay out, but for the backend it
    was built for: they belong to the plugin distributions, and a second copy
    would register the backend twice.
    """
    try:
        info = json.loads((cached / "build_info.json").read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(f"{cached} is not a build_llama.py output (build_info.json: {exc})") from exc
    own_module = f"ggml-{info.get('backend')}"
    package_lib_dir.mkdir(parents=True, exist_ok=True)
    for old in package_lib_dir.iterdir():
        if old.is_file() and (old.suffix in _LIB_SUFFIXES or old.name in ("build_info.json", LICENSE_NAME)):
            old.unlink()
    copied = []
    for lib in _shared_libs(cached / "lib"):
        if _is_module_build(info) and is_plugin_module(lib) and _lib_stem(lib) != own_module:
            continue
        shutil.copy2(lib, package_lib_dir / lib.name)
        copied.append(package_lib_dir / lib.name)
    shutil.copy2(cached / "build_info.json", package_lib_dir / "build_info.json")
    copied.append(package_lib_dir / "build_info.json")
    # The libraries are llama.cpp's (MIT): its licence travels with them.
    licence = Path(info.get("llama_cpp_dir", "")) / "LICENSE"
    if info.get("llama_cpp_dir") and licence.is_file():
        shutil.copy2(licence, package_lib_dir / LICENSE_NAME)
        copied.append(package_lib_dir / LICENSE_NAME)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None, help="auto|cpu|cuda|metal|vulkan (default: $LLAMA_BACKEND or auto)")
    parser.add_argument("--llama-cpp-dir", default=None, help="use this llama.cpp tree instead of the pinned source")
    parser.add_argument("--tools", action="store_true", default=None,
                        help="also build llama-bench, llama-server and llama-mtmd-cli")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has this build")
    parser.add_argument("--no-install", action="store_true", help="do not copy the libraries into llama_ctypes/lib")
    parser.add_argument("--module", default=None, help="build only this backend module (e.g. cuda) for a plugin")
    args = parser.parse_args(argv)
    if args.module:
        args.no_install = True
    try:
        cross = is_cross()
    except BuildError as exc:
        log(f"error: {exc}")
        return 1
    if cross and not args.no_install:
        log(f"a cross build ({target_machine()}) is not installed into this checkout: it could not load here")
        args.no_install = True
    try:
        out = build(args.backend, None, args.llama_cpp_dir, args.tools, args.force, args.module)
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
