"""On a GPU: the model and its KV cache offloaded, and the same answers as the CPU.

These run where ggml lists a GPU device (a CUDA/Vulkan/Metal build, or a wheel with its GPU plugin);
elsewhere they are skipped, since the CPU path is what the rest of the suite tests.
``bench/gpu_check.py`` runs them with ``LLAMA_CTYPES_TEST_GPU=require`` (no GPU is then a failure, not
a skip), or with ``LLAMA_CTYPES_TEST_GPU=cpu`` (its ``--cpu`` mode: the same steps with the CPU as the
device, to check the script itself on a machine without a GPU).

Invariants, each against a CPU run of the same model (``n_gpu_layers=0``): greedy tokens equal up to a
near tie (GPU kernels round differently: a wider margin than across CPU variants), in-graph sampling on
the device picks the CPU's greedy tokens, a Server's concurrent slots each give their solo answer and a
cancelled request frees its slot, embeddings point the same way.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from margins import assert_greedy_equivalent
from server_helpers import wait_idle

import llama_ctypes as lc

pytestmark = [pytest.mark.gpu, pytest.mark.gemma]

MODE = os.environ.get("LLAMA_CTYPES_TEST_GPU", "")
#: GPU matmuls (cuBLAS, tensor cores, flash attention on the device) against the CPU's kernels: a few
#: tenths of a nat on a Q4_K 270M model's near ties.
GPU_MARGIN = 0.3
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are"]


def _gpus() -> list[lc.Device]:
    return [d for d in lc.devices() if d.gpu_index is not None]


@pytest.fixture(scope="module")
def device_layers() -> int:
    """n_gpu_layers for "the device": all layers on a GPU; 0 under LLAMA_CTYPES_TEST_GPU=cpu."""
    if MODE == "cpu":
        return 0
    if not _gpus():
        if MODE == "require":
            pytest.fail(f"LLAMA_CTYPES_TEST_GPU=require, but ggml lists no GPU: {[d.name for d in lc.devices()]} "
                        f"(backends: {[b.name for b in lc.loaded_backends()]})")
        pytest.skip("no GPU device (bench/gpu_check.py runs these on a GPU machine)")
    return -1


@pytest.fixture(scope="module")
def on_device(gemma_path, device_layers):
    with lc.load_model(gemma_path, n_gpu_layers=device_layers) as model:
        yield model


@pytest.fixture(scope="module")
def on_cpu(gemma_path):
    with lc.load_model(gemma_path, n_gpu_layers=0) as model:
        yield model


def test_the_weights_and_the_cache_are_on_the_device(on_device, device_layers):
    ctx = lc.Context.create(on_device, n_ctx=2048)
    try:
        usage = ctx.memory()
    finally:
        ctx.close()
    if device_layers == 0:
        assert all(d.gpu_index is None for d in usage.devices), str(usage)
        return
    on_gpu = [d for d in usage.devices if d.gpu_index is not None]
    assert on_gpu, str(usage)
    # (the token embeddings stay in host memory, as llama.cpp keeps them: Gemma's are ~70% of its weights;
    # the output matrix, tied to them, is copied to the GPU with the layers)
    assert sum(d.model for d in on_gpu) > 0.3 * usage.model, str(usage)
    assert sum(d.context for d in on_gpu) == usage.context > 0, str(usage)


def test_greedy_on_the_device_is_the_cpus(on_device, on_cpu):
    for prompt in PROMPTS:
        ref = lc.generate(on_cpu, prompt, temp=0, max_tokens=32, ignore_eos=True, logprobs=5)
        out = lc.generate(on_device, prompt, temp=0, max_tokens=32, ignore_eos=True)
        assert_greedy_equivalent(out, ref, margin=GPU_MARGIN, what=prompt)


def test_in_graph_sampling_on_the_device_picks_the_cpus_greedy_tokens(on_device, on_cpu):
    refs = [lc.generate(on_cpu, p, temp=0, max_tokens=32, ignore_eos=True, logprobs=5) for p in PROMPTS[:2]]
    with lc.Server(model=on_device, n_parallel=2, n_ctx=512, backend_sampling=True) as server:
        outs = [server.generate(p, temp=0, max_tokens=32, ignore_eos=True) for p in PROMPTS[:2]]
        # a seeded draw in the graph is reproducible
        opts = dict(temp=0.9, top_k=40, seed=11, max_tokens=16, ignore_eos=True)
        assert server.generate(PROMPTS[0], **opts).tokens == server.generate(PROMPTS[0], **opts).tokens
        stats = server.stats()
    assert stats["in_graph_requests"] == 4 and stats["in_graph_fallbacks"] == {}, stats  # (in the graph, really)
    for prompt, out, ref in zip(PROMPTS, outs, refs):
        assert_greedy_equivalent(out, ref, margin=GPU_MARGIN, what=prompt)


def test_a_server_on_the_device_serves_its_slots_as_solo_runs(on_device):
    opts = dict(temp=0, max_tokens=24, ignore_eos=True, cache_prompt=False)
    with lc.Server(model=on_device, n_parallel=4, n_ctx=1024) as server:
        refs = [server.stream(p, logprobs=5, **opts).completion() for p in PROMPTS]
        long = server.stream("Tell me a long story", temp=0.8, max_tokens=100_000, ignore_eos=True)
        next(iter(long))
        long.cancel()
        with pytest.raises(lc.CancelledError):
            long.completion()
        wait_idle(server)
        before = server.stats()
        assert before["active_slots"] == 0  # (the cancelled request gave its slot back)
        streams = [server.stream(p, **opts) for p in PROMPTS]
        outs = [s.completion() for s in streams]
        after = server.stats()
    for prompt, out, ref in zip(PROMPTS, outs, refs):
        assert_greedy_equivalent(out, ref, margin=GPU_MARGIN, what=prompt)
    ticks = after["ticks"] - before["ticks"]
    steps = after["avg_busy_slots"] * after["ticks"] - before["avg_busy_slots"] * before["ticks"]
    assert ticks > 0 and steps / ticks > 2, (steps, ticks)  # (the four ran together, on four slots)


def test_embeddings_on_the_device_point_as_the_cpus(on_device, on_cpu):
    texts = ["A cat sat on the mat.", "GPUs multiply matrices.", "Paris is in France."]
    dev = np.asarray(lc.embed(on_device, texts))
    cpu = np.asarray(lc.embed(on_cpu, texts))
    assert dev.shape == cpu.shape and np.isfinite(dev).all()
    cos = (dev * cpu).sum(1) / (np.linalg.norm(dev, axis=1) * np.linalg.norm(cpu, axis=1))
    assert (cos > 0.99).all(), cos
