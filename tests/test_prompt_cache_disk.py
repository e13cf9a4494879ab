"""The prompt cache's disk tier (engines/server/prompt_cache_disk.py): states outlive the server that made
them, a state is restored only where the same model file and settings made it, a damaged file is never
handed to llama.cpp, and the directory stays within its budget."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
from http_helpers import metric_samples
from margins import assert_greedy_equivalent

import llama_ctypes as lc
from llama_ctypes.engines.server.prompt_cache import PromptCache
from llama_ctypes.engines.server.prompt_cache_disk import SUFFIX, DiskPromptCache
from llama_ctypes.errors import ArgumentTypeError, InvalidArgumentError
from llama_ctypes.interfaces.http.metrics import Metrics

SYSTEM = "You are a careful assistant who answers questions about geography and history in detail. " * 3


def _state(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _file(directory: Path, tokens: list[int]) -> Path:
    """Where a state of ``tokens`` is written (the name is a hash of the token ids)."""
    name = hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:32]
    return directory / (name + SUFFIX)


def _written(disk: DiskPromptCache) -> DiskPromptCache:
    disk.flush()
    return disk


def test_a_state_outlives_its_cache_object(tmp_path):
    disk = DiskPromptCache(tmp_path, 2**30, "k")
    tokens = list(range(1, 40))
    state = _state(5000)
    assert disk.put(tokens, state, floor=7)
    assert not _written(disk).put(tokens, state)  # (already on disk)
    disk.close()
    assert not disk.put([5] * 20, state)  # (closed)
    again = DiskPromptCache(tmp_path, 2**30, "k")
    assert len(again) == 1
    found, n = again.find(tokens[:30] + [999, 1000])
    assert n == 30 and found is not None
    entry = again.load(found)
    assert entry is not None and entry.tokens == tuple(tokens) and entry.floor == 7
    assert bytes(entry.state) == state.tobytes() and again.hits == 1
    assert DiskPromptCache(tmp_path, 2**30, "other key").find(tokens) == (None, 0)  # (another namespace)
    assert not again.put([1, 2, -77, 3] * 5, state)  # media placeholders: never on disk


def test_damaged_files_never_reach_llama_cpp(tmp_path):
    disk = DiskPromptCache(tmp_path, 2**30, "k")
    prompts = [[i + 1] * 20 for i in range(3)]
    for i, tokens in enumerate(prompts):
        disk.put(tokens, _state(3000, i))
    _written(disk).close()
    flipped, cut, foreign = (_file(tmp_path / "k", t) for t in prompts)
    raw = bytearray(flipped.read_bytes())
    raw[-10] ^= 0xFF  # a bit of the state: its checksum fails when it is read
    flipped.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:-1])  # a short file: not even indexed
    foreign.write_bytes(b"not a state" * 100)
    left, going_on = tmp_path / "k" / "left.1.tmp", tmp_path / "k" / "going-on.2.tmp"
    left.write_bytes(b"half a write")
    going_on.write_bytes(b"a write in another process")
    os.utime(left, (time.time() - 3600, time.time() - 3600))
    disk = DiskPromptCache(tmp_path, 2**30, "k")
    assert len(disk) == 1 and not cut.exists() and not foreign.exists()
    assert not left.exists() and going_on.exists()
    found, _ = disk.find(prompts[0])
    assert found is not None and disk.load(found) is None
    assert not flipped.exists() and len(disk) == 0 and disk.failed == 1


def test_the_directory_stays_within_its_budget_least_recently_used_first(tmp_path):
    disk = DiskPromptCache(tmp_path, 3 * 110_000, "k")
    prompts = [[i + 1] * 20 for i in range(4)]
    for i, tokens in enumerate(prompts[:3]):
        _written(disk).put(tokens, _state(100_000, i))
        time.sleep(0.01)  # (distinct modification times: the order a later process sees)
    found, _ = disk.find(prompts[0])
    assert disk.load(found) is not None  # the oldest file, used again: the second goes first
    _written(disk).put(prompts[3], _state(100_000, 3))
    _written(disk)
    on_disk = [p for p in prompts if _file(tmp_path / "k", p).exists()]
    assert on_disk == [prompts[0], prompts[2], prompts[3]] and len(disk) == 3
    assert sum(f.stat().st_size for f in (tmp_path / "k").iterdir()) <= 3 * 110_000
    disk.close()
    smaller = DiskPromptCache(tmp_path, 2 * 110_000, "k")  # (a later run with less room drops the oldest)
    assert len(smaller) == 2 and not _file(tmp_path / "k", prompts[2]).exists()
    tiny = DiskPromptCache(tmp_path, 50_000, "k")  # (each file alone is larger: none is kept)
    assert len(tiny) == 0 and not list((tmp_path / "k").iterdir())
    assert tiny.put([9] * 20, _state(100_000)) and _written(tiny).skipped == 1 and len(tiny) == 0
    assert not list((tmp_path / "k").iterdir())


def test_the_ram_tier_reads_the_disk_tier_only_where_it_is_longer(tmp_path):
    disk = DiskPromptCache(tmp_path, 2**30, "k")
    ram = PromptCache(2**30, disk=disk, disk_tag="base")
    long, short = list(range(1, 60)), list(range(1, 30))
    ram.put(long, _state(2000, 1), tag="base")
    ram.put([7] * 20, _state(2000, 2), tag="lora")  # (another tag: RAM only)
    _written(disk)
    assert len(disk) == 1
    fresh = PromptCache(2**30, disk=DiskPromptCache(tmp_path, 2**30, "k"), disk_tag="base")
    assert len(fresh) == 0 and not fresh.empty
    entry, n = fresh.lookup(long + [99], tag="base")
    assert n == len(long) and bytes(entry.state) == _state(2000, 1).tobytes() and len(fresh) == 1
    assert fresh.lookup(long + [99], tag="lora") == (None, 0)
    fresh.put(short, _state(10, 3), tag="base")
    fresh.disk.flush()
    assert fresh.lookup(short + [5], tag="base")[1] == len(short)  # (RAM, as long as the disk's: no read)
    assert fresh.disk.hits == 1
    no_ram = PromptCache(0, disk=DiskPromptCache(tmp_path, 2**30, "k"), disk_tag="base")
    entry, n = no_ram.lookup(long, tag="base")  # (a RAM tier of 0 bytes: the disk still serves)
    assert entry is not None and n == len(long) and len(no_ram) == 0


def test_options_are_checked(tiny_model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="prompt_cache_disk_mb"):
        lc.Server(model=tiny_model, prompt_cache_dir=tmp_path, prompt_cache_disk_mb=0)
    with pytest.raises(ArgumentTypeError, match="prompt_cache_dir"):
        lc.Server(model=tiny_model, prompt_cache_dir=3)
    blocker = tmp_path / "a file"
    blocker.write_text("x")
    with pytest.raises(InvalidArgumentError, match="prompt cache directory"):
        lc.Server(model=tiny_model, prompt_cache_dir=blocker)


def _greedy(srv, prompt, **opts):
    return srv.generate(prompt, max_tokens=12, temp=0, ignore_eos=True, logprobs=2, **opts)


def test_a_new_server_starts_from_the_last_ones_states(tiny_model, tmp_path):
    """A server's prefixes, written at close, serve the next server on the same model and settings: the same
    greedy tokens as a cold run; other settings (another K cache type) make another namespace."""
    prompt, follow = SYSTEM + "Question one?", SYSTEM + "Question one? And then?"
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, cache_prompt=False) as cold_srv:
        cold = _greedy(cold_srv, follow)
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, prompt_cache_dir=tmp_path) as srv:
        first = _greedy(srv, prompt)
    assert first.timings.cached_tokens == 0 and len(list(tmp_path.rglob("*" + SUFFIX))) >= 1
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, prompt_cache_dir=tmp_path) as srv:
        warm = _greedy(srv, follow)
        stats = srv.stats()
        text = Metrics(lambda: {"tiny": srv.stats()}).render().decode()
    assert warm.timings.cached_tokens >= first.prompt_tokens - 1 and stats["cache_restored"] == 1
    # /metrics shows both tiers as Server.stats() does
    entries = metric_samples(text, "llama_ctypes_prompt_cache_entries")
    size = metric_samples(text, "llama_ctypes_prompt_cache_bytes")
    disk = (("model", "tiny"), ("tier", "disk"))
    assert entries[disk] == stats["disk_cache_entries"] >= 1 and size[disk] == stats["disk_cache_bytes"] > 0
    assert size[(("model", "tiny"), ("tier", "ram"))] == stats["ram_cache_bytes"]
    assert metric_samples(text, "llama_ctypes_prompt_cache_restored_total")[(("model", "tiny"),)] == 1
    assert metric_samples(text, "llama_ctypes_prompt_cache_disk_hits_total")[(("model", "tiny"),)] == \
        stats["disk_cache_hits"] >= 1
    assert_greedy_equivalent(warm, cold, what="restored from disk")
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, prompt_cache_dir=tmp_path, type_k="f32") as srv:
        other = _greedy(srv, follow)
    assert other.timings.cached_tokens == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_a_damaged_state_file_is_recomputed(tiny_model, tmp_path):
    prompt = SYSTEM + "Question two?"
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_dir=tmp_path) as srv:
        cold = _greedy(srv, prompt)
    files = list(tmp_path.rglob("*" + SUFFIX))
    assert files
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2 + 5] ^= 0x55
        f.write_bytes(bytes(raw))
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=1024, prompt_cache_dir=tmp_path) as srv:
        again = _greedy(srv, prompt)
        assert srv.stats()["cache_restored"] == 0
    assert again.timings.cached_tokens == 0
    assert_greedy_equivalent(again, cold, what="recomputed after a damaged file")


@pytest.mark.gemma
def test_a_sliding_window_model_restarts_warm(gemma, tmp_path):
    """Gemma 3 (sliding-window cache): the prompt's checkpoint, written when it was taken, serves the next
    server's turn that extends the prompt; the same greedy tokens as a cold run."""
    prompt = SYSTEM * 3 + "Which river runs through Paris?"
    follow = prompt + " Answer in one word, then name its source."
    with lc.Server(model=gemma, n_parallel=1, n_ctx=2048, cache_prompt=False) as cold_srv:
        cold = _greedy(cold_srv, follow)
    with lc.Server(model=gemma, n_parallel=1, n_ctx=2048, prompt_cache_dir=tmp_path) as srv:
        _greedy(srv, prompt)
    with lc.Server(model=gemma, n_parallel=1, n_ctx=2048, prompt_cache_dir=tmp_path) as srv:
        warm = _greedy(srv, follow)
    assert warm.timings.cached_tokens > len(gemma.tokenize(prompt)) // 2
    assert_greedy_equivalent(warm, cold, what="Gemma restored from disk")


def test_serve_flags(tiny_model_path, tmp_path):
    from llama_ctypes.interfaces.cli import build_parser
    from llama_ctypes.interfaces.http.serve import model_specs

    parse = build_parser().parse_args
    _, (spec,) = model_specs(parse(["serve", str(tiny_model_path), "--cache-disk", str(tmp_path),
                                    "--cache-disk-mib", "512"]))
    assert spec["prompt_cache_dir"] == str(tmp_path) and spec["prompt_cache_disk_mb"] == 512
    _, (spec,) = model_specs(parse(["serve", str(tiny_model_path)]))
    assert "prompt_cache_dir" not in spec
    with pytest.raises(ArgumentTypeError, match="--cache-disk"):
        model_specs(parse(["serve", str(tiny_model_path), "--cache-disk-mib", "512"]))


def test_the_size_bound_holds_under_a_soak(tmp_path):
    """600 states of 5-60 KB under one 1 MB budget, some prompts again, a reopen every 200: the files on disk
    never take more than the budget, and the index holds exactly the files there."""
    rng = np.random.default_rng(3)
    budget = 2**20
    disk = DiskPromptCache(tmp_path, budget, "k")
    for i in range(600):
        tokens = [int(t) for t in rng.integers(0, 50, int(rng.integers(16, 80)))]
        disk.put(tokens, _state(int(rng.integers(5_000, 60_000)), i))
        if i % 50 == 49:
            _written(disk)
            files = list((tmp_path / "k").glob("*" + SUFFIX))
            assert sum(f.stat().st_size for f in files) <= budget and len(files) == len(disk)
        if i % 200 == 199:
            disk.close()
            disk = DiskPromptCache(tmp_path, budget, "k")
    assert len(disk) > 10  # (the last reopen found them)


def test_a_server_soak_keeps_the_directory_within_its_budget(tiny_model, tmp_path):
    """Conversations through a server whose disk tier holds far fewer of them than pass: within the budget
    after every round and after close; a conversation evicted from RAM and slots comes back from disk with
    the same greedy tokens as a cold run."""
    budget_mb = 1.0
    prompts = [SYSTEM + f"Conversation {i}: tell me about place number {i}." for i in range(24)]
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, cache_prompt=False) as cold_srv:
        cold = _greedy(cold_srv, prompts[0] + " More?")
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, prompt_cache_ram_mb=0.5,
                   prompt_cache_dir=tmp_path, prompt_cache_disk_mb=budget_mb) as srv:
        for p in prompts:
            _greedy(srv, p)
        srv._engine.pool.ram.disk.flush()
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*" + SUFFIX))
        assert 0 < on_disk <= budget_mb * 2**20
    assert sum(f.stat().st_size for f in tmp_path.rglob("*" + SUFFIX)) <= budget_mb * 2**20
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=1024, prompt_cache_dir=tmp_path,
                   prompt_cache_disk_mb=budget_mb) as srv:
        late = [_greedy(srv, p + " More?") for p in prompts[::-1]]
        restored = srv.stats()["disk_cache_hits"]
    assert restored > 0
    assert_greedy_equivalent(late[-1], cold, what="conversation 0 after the soak")


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk (the rename or a write raising): what was written of the state goes, the cache goes on."""
    import llama_ctypes.engines.server.prompt_cache_disk as tier

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier.os, "replace", full)
    disk = DiskPromptCache(tmp_path, 2**30, "k")
    assert disk.put([4] * 20, _state(10_000))
    _written(disk)
    assert disk.failed == 1 and len(disk) == 0 and not list((tmp_path / "k").iterdir())
    monkeypatch.undo()
    assert _written(disk).put([5] * 20, _state(10_000)) and len(_written(disk)) == 1
