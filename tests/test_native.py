"""The native layer: symbols, struct layouts, library search, devices, logs, raw decode."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from ctypes import c_float, c_int32
from pathlib import Path

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes import native
from llama_ctypes.native import adapter_h, ggml_h, layout, llama_h, loader, mtmd_h

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lib():
    return lc.init()


def test_every_prototype_resolves(lib):
    assert lib.missing == []
    for module in (llama_h, ggml_h, adapter_h):
        for name, argtypes, restype in module.PROTOTYPES:
            fn = getattr(lib, name)
            assert fn.argtypes == argtypes, name
            assert fn.restype is restype, name


def test_mtmd_prototypes_resolve_on_first_use(lib):
    from llama_ctypes.core.backend import init_mtmd

    assert init_mtmd() is lib and lib.missing == []
    for name, argtypes, restype in mtmd_h.PROTOTYPES:
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes and fn.restype is restype, name
    assert lib.mtmd_default_marker() == b"<__media__>"
    params = lib.mtmd_context_params_default()  # a struct returned by value: read through the mirror
    assert params.n_threads == 4 and params.batch_max_tokens == 1024 and params.image_min_tokens == -1
    assert params.media_marker == b"<__media__>" and params.use_gpu and params.warmup


def test_struct_layouts_match_native(lib):
    native_table = layout.native_layouts(lib)
    mirrored = {**llama_h.STRUCTS, **ggml_h.STRUCTS, **adapter_h.STRUCTS, **mtmd_h.STRUCTS}
    # Every struct the adapter reports is mirrored, and every mirror is checked.
    assert set(native_table) == set(mirrored)
    layout.check_layouts(native_table, mirrored)  # raises on any difference
    assert native_table["llama_context_params"][""][1] == ctypes.sizeof(llama_h.llama_context_params)


def _without_field(struct: type, dropped: str) -> type:
    fields = [f for f in struct._fields_ if f[0] != dropped]
    return type(struct.__name__, (ctypes.Structure,), {"_fields_": fields})


def test_wrong_layout_is_refused_with_clear_error(lib):
    broken = _without_field(llama_h.llama_context_params, "n_rs_seq")
    with pytest.raises(lc.LayoutMismatchError) as err:
        layout.check_layouts(layout.native_layouts(lib), {"llama_context_params": broken})
    message = str(err.value)
    assert "llama_context_params.n_rs_seq" in message
    assert "absent" in message or "not mirrored" in message
    # the fields after it are reported as moved
    assert "llama_context_params.ctx_type: Python offset 32 size 4, native offset 36 size 4" in message


def test_wrong_layout_refused_at_load(lib, monkeypatch):
    broken = _without_field(llama_h.llama_batch, "embd")
    monkeypatch.setitem(llama_h.STRUCTS, "llama_batch", broken)
    with pytest.raises(lc.LayoutMismatchError, match=r"llama_batch\.embd"):
        loader.NativeLibrary(lib.directory)


def test_missing_libraries_name_the_search_path(tmp_path, monkeypatch):
    monkeypatch.setenv(native.LIB_DIR_ENV, str(tmp_path))
    with pytest.raises(lc.NativeLibraryError) as err:
        loader._load_first()
    assert str(tmp_path) in str(err.value)
    assert native.LIB_DIR_ENV in str(err.value)


def test_lib_dir_env_var_is_honoured(lib, monkeypatch):
    monkeypatch.setenv(native.LIB_DIR_ENV, str(lib.directory))
    assert loader.search_dirs() == [lib.directory]
    assert loader._load_first().lcx_abi_version() == adapter_h.ABI_VERSION


def test_init_is_idempotent():
    assert lc.init() is lc.init()


def test_devices_lists_cpu_with_plausible_memory():
    devs = lc.devices()
    cpus = [d for d in devs if d.type == "cpu"]
    assert cpus, devs
    cpu = cpus[0]
    assert cpu.memory_total > 256 * 2**20
    assert 0 < cpu.memory_free <= cpu.memory_total
    assert cpu.gpu_index is None
    gpu_indices = [d.gpu_index for d in devs if d.gpu_index is not None]
    assert gpu_indices == list(range(len(gpu_indices)))


def test_version_and_system_info():
    info = lc.version_info()
    assert info.package == lc.__version__
    assert info.llama_cpp
    assert info.backend in ("cpu", "cuda", "metal", "vulkan")
    assert "CPU" in lc.system_info()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks ELF run paths")
def test_bundled_libraries_use_relative_run_paths(lib):
    for so in Path(lib.directory).glob("*.so"):
        data = so.read_bytes()
        assert b"$ORIGIN" in data, so
        assert str(ROOT / "build").encode() not in data, so


def test_default_cpu_build_leaves_amx_out(lib):
    args = " ".join(lib.build_info.get("cmake_args", []))
    if lib.build_info.get("backend") == "cpu" and "GGML_NATIVE=ON" in args:
        assert "-mno-amx-int8" in args


def test_log_routing_reaches_python_logging(caplog, tiny_model_path):
    with caplog.at_level(logging.DEBUG, logger="llama_ctypes.llama_cpp"):
        model = lc.load_model(tiny_model_path)
        model.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "llama_ctypes.llama_cpp"]
    assert any("llama_model_loader" in m or "print_info" in m for m in messages), messages[:5]
    assert all("\n" not in m for m in messages)


@pytest.mark.gemma
def test_a_plain_stream_writes_nothing_to_stderr(gemma_path):
    """llama.cpp's log goes to the llama_ctypes.llama_cpp logger only: a plain lc.stream on Gemma (a
    sliding-window model, whose cache logs a warning when full-size: llama-cpp-python prints
    "llama_kv_cache_iswa: using full-size SWA cache" with verbose=False) leaves stderr empty, swa_full too."""
    code = ("import llama_ctypes as lc, sys\n"
            "m = lc.load_model(sys.argv[1])\n"
            "print(''.join(lc.stream(m, 'Hi', max_tokens=2)), ''.join(lc.stream(m, 'Hi', max_tokens=2, swa_full=True)))")
    proc = subprocess.run([sys.executable, "-c", code, str(gemma_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""


def _raw_decode(lib, path: Path) -> np.ndarray:
    """Load, tokenize and decode one batch using only the native layer."""
    mparams = lib.llama_model_default_params()
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    assert model
    try:
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = 256
        ctx = lib.llama_init_from_model(model, cparams)
        assert ctx
        try:
            vocab = lib.llama_model_get_vocab(model)
            text = b"The quick brown fox"
            toks = (c_int32 * 64)()
            n = lib.llama_tokenize(vocab, text, len(text), toks, 64, True, False)
            assert n > 2
            batch = lib.llama_batch_init(n, 0, 1)
            try:
                for i in range(n):
                    batch.token[i] = toks[i]
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = i == n - 1
                batch.n_tokens = n
                assert lib.llama_decode(ctx, batch) == 0
                n_vocab = lib.llama_vocab_n_tokens(vocab)
                logits = lib.llama_get_logits_ith(ctx, -1)
                return np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(c_float)), shape=(n_vocab,)).copy()
            finally:
                lib.llama_batch_free(batch)
        finally:
            lib.llama_free(ctx)
    finally:
        lib.llama_model_free(model)


def test_tiny_model_decodes_one_batch_natively(lib, tiny_model_path):
    logits = _raw_decode(lib, tiny_model_path)
    assert np.isfinite(logits).all()
    assert logits.std() > 0


@pytest.mark.gemma
def test_gemma_q4k_decodes_one_batch_natively(lib, gemma_path):
    # Gemma 270M is Q4_K_M: this is the model that crashes builds with AMX kernels.
    logits = _raw_decode(lib, gemma_path)
    assert np.isfinite(logits).all()
    assert logits.std() > 0
