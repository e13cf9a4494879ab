"""Memory per device: llama.cpp's no-alloc dry run against what a real load holds."""

from __future__ import annotations

import pytest

import llama_ctypes as lc

# n_seq_max: the server's parallel slots; type_k/v: a quantized cache (Gemma only: the
# tiny model's 16-wide heads do not divide into q8_0 blocks).
SHAPES = [("tiny", dict(n_ctx=2048)), ("tiny", dict(n_ctx=8192, n_seq_max=4)),
          ("gemma", dict(n_ctx=2048)), ("gemma", dict(n_ctx=8192, n_seq_max=4)),
          ("gemma", dict(n_ctx=4096, type_k="q8_0", type_v="q8_0"))]


def _actual(path, **opts) -> lc.MemoryUsage:
    with lc.load_model(path) as model:
        with lc.Context.create(model, **opts) as ctx:
            return ctx.memory()


@pytest.mark.parametrize("which,shape", SHAPES,
                         ids=[f"{w}-" + ",".join(f"{k}={v}" for k, v in s.items()) for w, s in SHAPES])
def test_estimate_is_within_ten_percent_of_a_real_load(which, shape, request):
    path = request.getfixturevalue("tiny_model_path" if which == "tiny" else "gemma_path")
    est = lc.estimate_memory(path, **shape)
    act = _actual(path, **shape)
    assert act.total > 0 and abs(est.total - act.total) <= 0.10 * act.total, (str(est), str(act))
    # per part too (a real load also counts the mapped file under weights that the CPU
    # backend repacks, which the dry run does not map)
    assert abs(est.model - act.model) <= 0.10 * act.model
    assert est.context == act.context and est.compute == act.compute
    # on a CPU-only machine every byte is system RAM
    if not any(d.gpu_index is not None for d in lc.devices()):
        assert set(est.by_pool()) == {"ram"} and sum(est.by_pool().values()) == est.total


def test_estimate_follows_the_context_options(gemma_path):
    small = lc.estimate_memory(gemma_path, n_ctx=2048)
    large = lc.estimate_memory(gemma_path, n_ctx=16384)
    quant = lc.estimate_memory(gemma_path, n_ctx=16384, type_k="q8_0", type_v="q8_0")
    assert small.model == large.model == quant.model
    assert large.context > small.context > 0
    assert quant.context < large.context


def test_estimate_loads_nothing(gemma_path):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    est = lc.estimate_memory(gemma_path, n_ctx=32768, n_seq_max=8)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB on Linux
    assert grown < est.total / 4, f"the dry run grew the process by {grown} bytes"


def test_estimate_bad_input(tmp_path, tiny_model_path):
    with pytest.raises(FileNotFoundError):
        lc.estimate_memory(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOTGGUF" * 10)
    with pytest.raises(lc.ModelLoadError):
        lc.estimate_memory(junk)
    with pytest.raises(TypeError):
        lc.estimate_memory(tiny_model_path, n_ctx_typo=5)
    with pytest.raises(ValueError):
        lc.estimate_memory(tiny_model_path, type_k="q9_9")


def test_context_memory_needs_an_open_idle_context(tiny_model):
    ctx = lc.Context.create(tiny_model, n_ctx=512)
    with ctx.lease():
        with pytest.raises(lc.BusyError):
            ctx.memory()
    assert ctx.memory().total > 0
    ctx.close()
    with pytest.raises(lc.ClosedError):
        ctx.memory()
