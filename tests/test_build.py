"""The build scripts: backend choice, flags, cache keys, source pin checks, error messages."""

from __future__ import annotations

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
    assert "-DGGML_NATIVE=OFF" in portable and "-DGGML_AVX2=ON" in portable


def test_backend_flags():
    assert "-DGGML_CUDA=ON" in build_llama.backend_cmake_args("cuda")
    assert "-DGGML_VULKAN=ON" in build_llama.backend_cmake_args("vulkan")
    assert "-DGGML_METAL=ON" in build_llama.backend_cmake_args("metal")


def test_cache_key_depends_on_every_input():
    base = build_llama.cache_key("src-1", "cpu", ["-DA=1"])
    assert base == build_llama.cache_key("src-1", "cpu", ["-DA=1"])
    assert base != build_llama.cache_key("src-2", "cpu", ["-DA=1"])
    assert base != build_llama.cache_key("src-1", "cuda", ["-DA=1"])
    assert base != build_llama.cache_key("src-1", "cpu", ["-DA=2"])
    # the CMake build folder does not change when only the adapter does
    assert build_llama.cache_key("src-1", "cpu", [], with_adapter=False) != build_llama.cache_key("src-1", "cpu", [])


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
