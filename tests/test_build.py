"""The build scripts: backend choice, flags, cache keys, source pin checks, error messages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_scripts"))

import build_llama  # noqa: E402
import llama_source  # noqa: E402


def test_backend_resolution(monkeypatch):
    assert build_llama.resolve_backend("cpu") == "cpu"
    assert build_llama.resolve_backend("CUDA") == "cuda"
    with pytest.raises(build_llama.BuildError, match="not one of"):
        build_llama.resolve_backend("opencl")
    monkeypatch.setattr(build_llama, "_has_nvcc", lambda: True)
    monkeypatch.setattr(build_llama, "_has_nvidia_gpu", lambda: False)
    # a CUDA toolkit without a GPU (as on CI machines) builds for the CPU
    expected = "metal" if sys.platform == "darwin" else "cpu"
    assert build_llama.resolve_backend("auto") == expected
    monkeypatch.setattr(build_llama, "_has_nvidia_gpu", lambda: True)
    assert build_llama.resolve_backend("auto") == ("metal" if sys.platform == "darwin" else "cuda")


def test_cpu_flags_leave_amx_out_unless_asked(monkeypatch):
    monkeypatch.delenv("LLAMA_CTYPES_PORTABLE", raising=False)
    monkeypatch.delenv("LLAMA_CTYPES_AMX", raising=False)
    monkeypatch.setattr(build_llama, "_is_x86", lambda: True)
    monkeypatch.setattr(build_llama.sys, "platform", "linux")
    args = build_llama.backend_cmake_args("cpu")
    assert "-DGGML_NATIVE=ON" in args
    assert any("-mno-amx-int8" in a for a in args)
    monkeypatch.setenv("LLAMA_CTYPES_AMX", "1")
    assert not any("amx" in a for a in build_llama.backend_cmake_args("cpu"))
    monkeypatch.setenv("LLAMA_CTYPES_PORTABLE", "1")
    portable = build_llama.backend_cmake_args("cpu")
    assert "-DGGML_NATIVE=OFF" in portable
    assert "-DGGML_BACKEND_DL=ON" in portable and "-DGGML_CPU_ALL_VARIANTS=ON" in portable
    assert "-DLLAMA_CTYPES_AMX=ON" in portable  # the AMX variant shipped: another cache key
    monkeypatch.delenv("LLAMA_CTYPES_AMX")
    assert "-DLLAMA_CTYPES_AMX=ON" not in build_llama.backend_cmake_args("cpu")


def test_portable_build_ships_every_cpu_variant_and_no_plugin_modules(tmp_path, monkeypatch):
    cached = tmp_path / "cached"
    (cached / "lib").mkdir(parents=True)
    names = ["libggml-base.so", "libggml.so", "libggml-cpu-x64.so", "libggml-cpu-zen4.so",
             "libggml-cpu-sapphirerapids.so", "libggml-rpc.so", "libllama.so", "libllama_ctypes_adapter.so"]
    for name in names:
        (cached / "lib" / name).write_bytes(b"\x7fELF")
    assert build_llama.cpu_variants(cached / "lib") == ["sapphirerapids", "x64", "zen4"]

    # A run-time-dispatched build keeps its plugin modules out of the package...
    (cached / "build_info.json").write_text('{"backend_dl": true, "backend": "cpu"}')
    installed = {p.name for p in build_llama.install_into(cached, tmp_path / "pkg")}
    assert "libggml-rpc.so" not in installed and "libggml-cpu-x64.so" in installed
    # ...but the backend it was built for (LLAMA_BACKEND=cuda LLAMA_CTYPES_PORTABLE=1 pip install .)...
    (cached / "lib" / "libggml-cuda.so").write_bytes(b"\x7fELF")
    (cached / "build_info.json").write_text('{"cmake_args": ["-DGGML_BACKEND_DL=ON"], "backend": "cuda"}')
    installed = {p.name for p in build_llama.install_into(cached, tmp_path / "pkg")}
    assert "libggml-cuda.so" in installed and "libggml-rpc.so" not in installed
    # ...and a single build links its backends and needs every library.
    (cached / "build_info.json").write_text('{"backend_dl": false, "backend": "cpu"}')
    installed = {p.name for p in build_llama.install_into(cached, tmp_path / "pkg")}
    assert "libggml-rpc.so" in installed


def test_install_into_carries_the_llama_cpp_licence_and_needs_build_info(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "LICENSE").write_text("MIT License (llama.cpp)")
    cached = tmp_path / "cached"
    (cached / "lib").mkdir(parents=True)
    (cached / "lib" / "libllama.so").write_bytes(b"\x7fELF")
    with pytest.raises(build_llama.BuildError, match="build_info.json"):
        build_llama.install_into(cached, tmp_path / "pkg")
    (cached / "build_info.json").write_text(json.dumps({"llama_cpp_dir": str(tree), "backend": "cpu"}))
    build_llama.install_into(cached, tmp_path / "pkg")
    assert (tmp_path / "pkg" / build_llama.LICENSE_NAME).read_text() == "MIT License (llama.cpp)"


def test_variant_names_keep_their_dots(tmp_path):
    """ARM variants are named like armv8.2_1: the name runs to the library suffix."""
    from llama_ctypes.native import backends

    names = ["armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.6_1", "armv9.2_1"]
    for name in names:
        (tmp_path / f"libggml-cpu-{name}.so").write_bytes(b"\x7fELF")
    (tmp_path / "libggml-base.so").write_bytes(b"\x7fELF")
    assert sorted(backends.cpu_variant_files(tmp_path)) == names
    assert build_llama.cpu_variants(tmp_path) == names
    (tmp_path / "libggml-cpu.so").write_bytes(b"\x7fELF")  # a module build without variants
    assert backends.cpu_variant_files(tmp_path)["default"] == tmp_path / "libggml-cpu.so"


def test_every_build_has_the_rpc_backend(monkeypatch):
    # rpc_servers= and `llama-ctypes rpc-server` work from a plain source install; the
    # run-time-dispatched build makes it a module for the llama-ctypes-rpc plugin.
    monkeypatch.delenv("LLAMA_CTYPES_PORTABLE", raising=False)
    assert "-DGGML_RPC=ON" in build_llama.backend_cmake_args("cpu")
    monkeypatch.setenv("LLAMA_CTYPES_PORTABLE", "1")
    if sys.platform != "darwin":
        assert "-DGGML_RPC=ON" in build_llama.backend_cmake_args("cpu")
    # Linked into libggml, it must be one unversioned file the installer copies (no symlinks).
    cmake = (ROOT / "build_scripts" / "CMakeLists.txt").read_text()
    assert re.search(r"foreach\(lib [^)]*\bggml-rpc\b[^)]*\)", cmake)


def test_backend_flags():
    assert "-DGGML_CUDA=ON" in build_llama.backend_cmake_args("cuda")
    assert "-DGGML_VULKAN=ON" in build_llama.backend_cmake_args("vulkan")
    assert "-DGGML_METAL=ON" in build_llama.backend_cmake_args("metal")


def test_cross_build_targets_aarch64_with_a_compiler_that_takes_every_variant(monkeypatch):
    monkeypatch.setattr(build_llama, "host_machine", lambda: "x86_64")
    monkeypatch.delenv("LLAMA_CTYPES_TARGET_ARCH", raising=False)
    host_key = build_llama.cache_key("src", "cpu", ["-DA=1"], with_adapter=False)
    monkeypatch.setenv("LLAMA_CTYPES_TARGET_ARCH", "arm64")  # Apple's and Windows' name for it
    assert build_llama.target_machine() == "aarch64" and build_llama.is_cross()
    monkeypatch.setenv("LLAMA_CTYPES_TARGET_ARCH", "riscv64")
    with pytest.raises(build_llama.BuildError, match="aarch64 only"):
        build_llama.target_machine()
    monkeypatch.setenv("LLAMA_CTYPES_TARGET_ARCH", "aarch64")
    monkeypatch.delenv("LLAMA_CTYPES_PORTABLE", raising=False)
    with pytest.raises(build_llama.BuildError, match="portable CPU build"):
        build_llama.backend_cmake_args("cpu")  # -march=native of another machine means nothing
    monkeypatch.setenv("LLAMA_CTYPES_PORTABLE", "1")
    with pytest.raises(build_llama.BuildError, match="portable CPU build"):
        build_llama.backend_cmake_args("cuda")
    monkeypatch.setattr(build_llama.sys, "platform", "linux")
    # Which compiler: the cross gcc if it compiles the armv9.2 (SME) variants, else clang 16+.
    for gcc_takes_sme in (True, False):
        def fake_compiles(cmd, takes=gcc_takes_sme):
            return takes or "clang" in cmd[0]
        monkeypatch.setattr(build_llama, "_compiles", fake_compiles)
        monkeypatch.setattr(build_llama.shutil, "which", lambda name: f"/usr/bin/{name}")
        args = build_llama.backend_cmake_args("cpu")
        assert "-DCMAKE_SYSTEM_PROCESSOR=aarch64" in args and "-DGGML_CPU_ALL_VARIANTS=ON" in args
        assert not any("amx" in a for a in args)
        compiler = next(a for a in args if a.startswith("-DCMAKE_CXX_COMPILER="))
        if gcc_takes_sme:
            assert compiler.endswith("aarch64-linux-gnu-g++") and "-DGGML_OPENMP=OFF" not in args
        else:
            assert "clang++-" in compiler and "-DCMAKE_CXX_COMPILER_TARGET=aarch64-linux-gnu" in args
            assert "-DGGML_OPENMP=OFF" in args  # no libomp to link for the target
    assert build_llama.cache_key("src", "cpu", ["-DA=1"], with_adapter=False) != host_key
    monkeypatch.setattr(build_llama, "_compiles", lambda cmd: False)
    with pytest.raises(build_llama.BuildError, match="clang 16 or later"):
        build_llama.backend_cmake_args("cpu")


def test_cross_built_wheel_is_tagged_for_its_target(monkeypatch):
    import build_wheel

    monkeypatch.setattr(build_llama, "host_machine", lambda: "x86_64")
    monkeypatch.delenv("LLAMA_CTYPES_TARGET_ARCH", raising=False)
    assert build_wheel._cross_env() == {}
    monkeypatch.setenv("LLAMA_CTYPES_TARGET_ARCH", "aarch64")
    assert build_wheel._cross_env() == {"_PYTHON_HOST_PLATFORM": "linux-aarch64"}
    assert build_wheel.main(["--arch", "aarch64", "--no-base", "--plugin", "cuda13"]) == 1  # refused, not built


def test_cache_key_depends_on_every_input():
    base = build_llama.cache_key("src-1", "cpu", ["-DA=1"])
    assert base == build_llama.cache_key("src-1", "cpu", ["-DA=1"])
    assert base != build_llama.cache_key("src-2", "cpu", ["-DA=1"])
    assert base != build_llama.cache_key("src-1", "cuda", ["-DA=1"])
    assert base != build_llama.cache_key("src-1", "cpu", ["-DA=2"])
    # the CMake build folder does not change when only the adapter does
    assert build_llama.cache_key("src-1", "cpu", [], with_adapter=False) != build_llama.cache_key("src-1", "cpu", [])


_PATCH = """--- a/src/a.c
+++ b/src/a.c
@@ -2,3 +2,3 @@
 int a(void) {
-    return 1;
+    return 2;
 }
"""


def test_patches_change_copies_of_the_pinned_tree_and_the_cache_key():
    tree = ROOT / "vendor" / "llama.cpp"
    if not (tree / ".llama_ctypes_source").exists():
        pytest.skip("no extracted pinned tree")
    rel = "ggml/src/ggml-rpc/ggml-rpc.cpp"
    vocab = "src/llama-vocab.cpp"
    files, applied = llama_source.patched_files(tree, pinned=True)
    assert applied == [p.stem for p in llama_source.patches()] == ["ggml-rpc-connection-errors", "llama-grammar-trigger-window",
                                                                  "llama-grammar-work-bound", "llama-vocab-linear-partition"]
    assert sorted(files) == [rel, "src/llama-grammar.cpp", vocab]
    # two patches of one file apply in turn: the second to the first's result
    grammar = files["src/llama-grammar.cpp"]
    assert b"LLAMA_CTYPES_TRIGGER_WINDOW" in grammar and b"llama_ctypes_check_work" in grammar
    assert b"ggml_backend_rpc_connection_failed" in files[rel]
    assert b"ggml_backend_rpc_connection_failed" not in (tree / rel).read_bytes()  # the tree stays as released
    assert b"std::distance(buffer.begin(), it)" in (tree / vocab).read_bytes()
    assert b"std::distance(buffer.begin(), it)" not in files[vocab] and b"prev = it++;" in files[vocab]
    assert any(p.parent.name == "patches" for p in llama_source.patches())


def test_a_patch_applies_exactly_or_not_at_all(tmp_path, monkeypatch, capsys):
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "change.patch").write_text(_PATCH)
    monkeypatch.setattr(llama_source, "PATCH_DIR", patches)
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    # two lines more above the hunk than the patch says: it still applies, where it matches
    (tree / "src" / "a.c").write_text("// x\n// y\n// one\nint a(void) {\n    return 1;\n}\n")
    files, applied = llama_source.patched_files(tree, pinned=True)
    assert applied == ["change"]
    assert files == {"src/a.c": b"// x\n// y\n// one\nint a(void) {\n    return 2;\n}\n"}
    # a tree it does not match: refused for the pin, left out (with a warning) for a user's tree
    (tree / "src" / "a.c").write_text("int a(void) {\n    return 3;\n}\n")
    with pytest.raises(llama_source.PatchError, match="change.patch does not apply"):
        llama_source.patched_files(tree, pinned=True)
    assert llama_source.patched_files(tree, pinned=False) == ({}, [])
    assert "change.patch does not apply" in capsys.readouterr().err
    # the patches are part of the cached output's key
    before = build_llama._adapter_fingerprint()
    (patches / "change.patch").write_text(_PATCH.replace("return 2;", "return 4;"))
    assert build_llama._adapter_fingerprint() != before


def test_missing_toolchain_is_named(monkeypatch):
    monkeypatch.setattr(build_llama.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(build_llama.BuildError) as err:
        build_llama.check_toolchain("cpu")
    assert "CMake" in str(err.value) and "C++17 compiler" in str(err.value)


def test_second_build_reuses_the_cache():
    # The install already built these libraries; asking again must not compile.
    t0 = time.monotonic()
    out = build_llama.build()
    assert time.monotonic() - t0 < 30
    assert (out / "build_info.json").exists()
    assert any((out / "lib").glob("*llama_ctypes_adapter*"))


def test_archive_with_wrong_hash_is_refused(tmp_path):
    fake = tmp_path / llama_source.PIN_ARCHIVE
    fake.write_bytes(b"not the pinned archive")
    with pytest.raises(llama_source.SourceError, match="sha256"):
        llama_source._extract(fake, tmp_path / "llama.cpp")
    assert not (tmp_path / "llama.cpp").exists()


def test_custom_tree_is_used_as_is(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "llama.h").write_text("/* */")
    tree, source_id = llama_source.ensure_source(tmp_path / "unused", tmp_path / "dl", str(tmp_path))
    assert tree == tmp_path.resolve() and source_id.startswith("custom-")
    with pytest.raises(llama_source.SourceError, match="not a llama.cpp tree"):
        llama_source.ensure_source(tmp_path / "unused", tmp_path / "dl", str(tmp_path / "nope"))


def test_vendor_tree_is_not_tracked():
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "vendor/"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    assert tracked.stdout.strip() == ""


def test_pinned_tree_is_copied_once_to_a_fixed_place(tmp_path):
    # Two checkouts (or two unpacked sdists) extract their own vendor/llama.cpp; the
    # build compiles one copy in the cache, so paths and mtimes do not change between them.
    trees = []
    for name in ("checkout-a", "checkout-b"):
        tree = tmp_path / name / "vendor" / "llama.cpp"
        (tree / "include").mkdir(parents=True)
        (tree / "include" / "llama.h").write_text(f"/* {name} */")
        (tree / llama_source._MARKER).write_text(f"{llama_source.PIN_ID} {llama_source.PIN_SHA256}\n")
        trees.append(tree)
    dest = tmp_path / "cache" / "src" / llama_source.PIN_ID
    assert llama_source.stable_copy(trees[0], dest) == dest
    stamp = (dest / "include" / "llama.h").stat().st_mtime_ns
    shutil.rmtree(tmp_path / "checkout-a")
    assert llama_source.stable_copy(trees[1], dest) == dest
    assert (dest / "include" / "llama.h").stat().st_mtime_ns == stamp


# ---- rebuilding a cache that something else configured ---------------------------------
# These run the real build script (a copy of build_scripts/, as an unpacked sdist or pip's
# temporary folder holds it) against a tiny stand-in llama.cpp tree, so configure and build
# take seconds; the CMake and make-program failure modes are the real ones.

_FAKE_CMAKE = """cmake_minimum_required(VERSION 3.21)
project(fake_llama C)
add_library(ggml ggml.c)
target_include_directories(ggml PUBLIC include)
add_library(llama llama.c)
target_include_directories(llama PUBLIC include)
target_link_libraries(llama PUBLIC ggml)
add_library(llama-common common.c)
target_link_libraries(llama-common PUBLIC llama)
if (LLAMA_BUILD_MTMD OR LLAMA_BUILD_TOOLS)
    add_library(mtmd mtmd.c)
    target_link_libraries(mtmd PUBLIC llama)
endif()
if (LLAMA_BUILD_TOOLS)
    foreach(tool llama-bench llama-server llama-mtmd-cli)
        add_executable(${tool} tool.c)
        target_link_libraries(${tool} PRIVATE llama)
    endforeach()
endif()
"""

_needs_cmake = pytest.mark.skipif(
    shutil.which("cmake") is None or not (shutil.which("ninja") or shutil.which("make")),
    reason="needs cmake and ninja or make on PATH",
)


@pytest.fixture
def fake_tree(tmp_path):
    tree = tmp_path / "llama.cpp"
    (tree / "include").mkdir(parents=True)
    (tree / "include" / "llama.h").write_text(
        "#ifdef __cplusplus\nextern \"C\" {\n#endif\nint fake_llama(void);\n"
        "#ifdef __cplusplus\n}\n#endif\n"
    )
    (tree / "ggml.c").write_text("int fake_ggml(void) { return 1; }\n")
    (tree / "llama.c").write_text("int fake_ggml(void);\nint fake_llama(void) { return fake_ggml(); }\n")
    (tree / "common.c").write_text("int fake_common(void) { return 2; }\n")
    (tree / "mtmd.c").write_text("int fake_mtmd(void) { return 3; }\n")
    (tree / "tool.c").write_text('#include "llama.h"\nint main(void) { return fake_llama() - 1; }\n')
    (tree / "CMakeLists.txt").write_text(_FAKE_CMAKE)
    return tree


def _copy_scripts(dest: Path) -> Path:
    """build_scripts/ as another checkout or pip's temporary copy holds it, with a stub adapter."""
    scripts = dest / "build_scripts"
    shutil.copytree(ROOT / "build_scripts", scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "adapter" / "llama_ctypes_adapter.cpp").write_text(
        '#include "llama.h"\nextern "C" int llama_ctypes_stub(void) { return fake_llama(); }\n'
    )
    return scripts


def _env(tmp_path: Path, tree: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "CMAKE_"))}
    env.update(LLAMA_CTYPES_CACHE_DIR=str(tmp_path / "cache"), LLAMA_CPP_DIR=str(tree), LLAMA_BACKEND="cpu")
    # Its own temporary folder, so that the tools the tests put under tmp_path count as
    # installed ones (the build prefers those to tools in the temporary folder).
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(TMPDIR=str(tmp_path / "tmp"), TEMP=str(tmp_path / "tmp"), TMP=str(tmp_path / "tmp"))
    env.update(extra)
    return env


def _build(scripts: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(scripts / "build_llama.py"), "--no-install"],
        env=env, capture_output=True, text=True, timeout=240,
    )


def _built_ok(proc: subprocess.CompletedProcess, tools: bool) -> Path:
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = Path(proc.stdout.strip().splitlines()[-1])
    assert any((out / "lib").glob("*llama_ctypes_adapter*"))
    assert any((out / "lib").glob("*mtmd*"))  # images and audio ship with every build
    if tools:
        assert any((out / "bin").glob("llama-bench*")) and any((out / "bin").glob("llama-mtmd-cli*"))
    return out


def _objects(cache: Path) -> dict[str, int]:
    """mtime of each compiled object of the build folders: unchanged means not recompiled."""
    objs = [p for p in (cache / "build").rglob("*") if p.suffix in (".o", ".obj") and p.is_file()]
    assert objs
    return {str(p): p.stat().st_mtime_ns for p in objs}


@_needs_cmake
def test_rebuild_after_the_make_program_is_gone(tmp_path, fake_tree):
    # pip configures the build folder with the ninja of its temporary build environment,
    # then deletes it; the README's LLAMA_CTYPES_TOOLS=1 rebuild must still work.
    make = shutil.which("ninja") or shutil.which("make")
    env_bin = tmp_path / "pip-build-env" / "overlay" / "bin"
    env_bin.mkdir(parents=True)
    for name in ["ninja"] if Path(make).stem == "ninja" else ["gmake", "make"]:  # what CMake looks for
        shutil.copy2(make, env_bin / (name + Path(make).suffix))
    scripts = _copy_scripts(tmp_path / "checkout")
    _built_ok(_build(scripts, _env(tmp_path, fake_tree, PATH=f"{env_bin}{os.pathsep}{os.environ['PATH']}")), False)
    (cache_file,) = (tmp_path / "cache" / "build").glob("*/CMakeCache.txt")
    if not re.search(rf"^CMAKE_MAKE_PROGRAM:\w+={re.escape(str(env_bin))}", cache_file.read_text(), re.M):
        pytest.skip("CMake did not pick the temporary make program")
    objects = _objects(tmp_path / "cache")
    shutil.rmtree(tmp_path / "pip-build-env")

    _built_ok(_build(scripts, _env(tmp_path, fake_tree, LLAMA_CTYPES_TOOLS="1")), True)
    after = _objects(tmp_path / "cache")
    assert {k: after[k] for k in objects} == objects, "the rebuild recompiled what was already compiled"


@_needs_cmake
def test_build_from_another_copy_of_the_build_scripts(tmp_path, fake_tree):
    # A second checkout, or an sdist unpacked to a new temporary folder, reuses the build
    # folder that the first one configured (CMake ties a build folder to its source folder).
    first, second = _copy_scripts(tmp_path / "a"), _copy_scripts(tmp_path / "b")
    _built_ok(_build(first, _env(tmp_path, fake_tree)), False)
    objects = _objects(tmp_path / "cache")
    shutil.rmtree(tmp_path / "a")  # as pip removes its temporary copy

    _built_ok(_build(second, _env(tmp_path, fake_tree, LLAMA_CTYPES_TOOLS="1")), True)
    after = _objects(tmp_path / "cache")
    assert {k: after[k] for k in objects} == objects, "the rebuild recompiled what was already compiled"


@_needs_cmake
def test_concurrent_builds_of_one_key_build_once(tmp_path, fake_tree):
    scripts = _copy_scripts(tmp_path / "checkout")
    env = _env(tmp_path, fake_tree)
    cmd = [sys.executable, str(scripts / "build_llama.py"), "--no-install"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert sum("built cpu libraries" in err for _, err in results) == 1, [err[-2000:] for _, err in results]
    assert len({out.strip().splitlines()[-1] for out, _ in results}) == 1


@pytest.mark.skipif(sys.platform == "win32", reason="shell-script stand-ins")
def test_tools_that_outlive_the_build_are_preferred(tmp_path, monkeypatch):
    # Ninja rebuilds everything when the CMake or ninja version changes, so the build sticks
    # to the cmake that configured the folder, else one outside pip's temporary environment.
    def fake(folder: Path, version: str) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        exe = folder / "cmake"
        exe.write_text(f"#!/bin/sh\necho 'cmake version {version}'\n")
        exe.chmod(0o755)
        return str(exe)

    monkeypatch.setattr(build_llama.tempfile, "tempdir", str(tmp_path / "tmp"))
    temporary = fake(tmp_path / "tmp" / "pip-build-env-x" / "overlay" / "bin", "4.4.5")
    installed = fake(tmp_path / "usr" / "bin", "3.25.1")
    configured = fake(tmp_path / "opt" / "bin", "3.28.0")
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(temporary).parent), str(Path(installed).parent)]))
    assert build_llama._choose_tool("cmake", None, (3, 21)) == installed
    assert build_llama._choose_tool("cmake", temporary, (3, 21)) == installed
    assert build_llama._choose_tool("cmake", configured, (3, 21)) == configured
    assert build_llama._choose_tool("cmake", None, (3, 26)) == temporary  # the installed one is too old
