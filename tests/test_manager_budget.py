"""The model manager's memory-budget arithmetic, without a model or native call.

Device tables are synthetic: an 8-GPU box whose ggml device indices differ from the
GPU indices (the CPU is ggml device 0, GPU g is ggml device g + 1, a BLAS device is 9),
so every test also checks that pools are keyed by ``gpu_index``.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.engines.manager import budget
from llama_ctypes.engines.manager.budget import Footprint, MemoryBudget, ResolvedBudget
from llama_ctypes.errors import (
    AlreadyLoadedError,
    ArgumentTypeError,
    InsufficientMemoryError,
    InvalidArgumentError,
    LlamaError,
)

GiB = 2**30
MiB = 2**20
SYS = 128 * GiB
AUTO_RAM = 109_951_162_777  # floor(128 GiB * 4/5)
# Free memory per GPU: GPU 2 is full, GPUs 3 and 6 nearly so.
FREE = [79 * GiB, 10 * GiB, 0, 2 * GiB, 40 * GiB, 23 * GiB + 512 * MiB, 1 * GiB, 80 * GiB]


@dataclass(frozen=True)
class Dev:
    index: int
    type: str
    gpu_index: int | None
    memory_free: int = 0
    memory_total: int = 0
    name: str = ""


def eight_gpus() -> list[Dev]:
    cpu = Dev(0, "cpu", None, 100 * GiB, SYS, "CPU")
    gpus = [Dev(g + 1, "gpu", g, FREE[g], 80 * GiB, f"CUDA{g}") for g in range(8)]
    return [cpu, *gpus, Dev(9, "accel", None, 0, 0, "BLAS")]


def resolve(spec, **kw) -> ResolvedBudget:
    return MemoryBudget.parse(spec).resolve(eight_gpus(), system_memory=kw.pop("system_memory", SYS), **kw)


def gpu(g):
    return ("gpu", g)


# --- resolution -------------------------------------------------------------------------------


def test_auto_takes_a_share_of_system_memory_and_each_gpus_free_memory():
    rb = resolve("auto")
    assert rb.total is None
    assert rb.ram == AUTO_RAM
    assert rb.gpus == tuple(FREE)
    assert rb.system_memory == SYS
    assert rb.gpu_names[3] == "CUDA3" and rb.n_gpus == 8
    assert rb.capacities() == {"total": None, "ram": AUTO_RAM, **{gpu(g): FREE[g] for g in range(8)}}
    # The fraction is applied exactly: 0.9 of 128 GiB = 123695058124.8 bytes, floored.
    rb90 = MemoryBudget(ram="auto", vram="auto", auto_ram_fraction=0.9).resolve(eight_gpus(), system_memory=SYS)
    assert rb90.ram == 123_695_058_124


def test_vram_list_and_dict_leave_unnamed_gpus_unlimited():
    rb = resolve({"ram": 16 * GiB, "vram": [1 * GiB, "auto", None]})
    assert rb.ram == 16 * GiB
    assert rb.gpus == (1 * GiB, 10 * GiB) + (None,) * 6
    rb = resolve({"vram": {5: 0, 2: "auto", 7: np.int64(3 * GiB)}})
    assert rb.ram is None
    assert rb.gpus == (None, None, 0, None, None, 0, None, 3 * GiB)
    assert type(rb.gpus[7]) is int
    # Unnamed GPU 4 takes anything; GPU 5's budget of 0 refuses a single byte.
    rb.check(Footprint.of(ram=500 * GiB, gpus={4: 1000 * GiB}))
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(Footprint.of(gpus={5: 1}))
    assert (e.value.device, e.value.required, e.value.available) == (gpu(5), 1, 0)


def test_int_budget_is_one_combined_pool():
    rb = resolve(20 * GiB)
    assert (rb.total, rb.ram, rb.gpus) == (20 * GiB, None, (None,) * 8)
    rb = resolve({"total": 30 * GiB, "vram": "auto"})
    assert (rb.total, rb.ram, rb.gpus) == (30 * GiB, None, tuple(FREE))


def test_none_and_empty_dict_are_unlimited():
    for spec in (None, {}, {"ram": None, "vram": None}, {"vram": [None, None]}):
        rb = resolve(spec)
        assert rb.unlimited and MemoryBudget.parse(spec).unlimited
        rb.check(Footprint.of(ram=10**15, gpus=[10**15] * 8), used=Footprint.of(ram=10**15))
    assert not MemoryBudget.parse({"vram": {3: 0}}).unlimited


def test_auto_ram_without_system_memory_is_unlimited_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(budget, "detect_system_memory", lambda: None)
    with caplog.at_level(logging.WARNING, logger=budget.__name__):
        rb = MemoryBudget.parse("auto").resolve(eight_gpus())
    assert rb.ram is None and rb.system_memory is None and rb.gpus == tuple(FREE)
    assert "system memory is unknown" in caplog.text


def test_system_memory_is_read_only_when_ram_is_auto(monkeypatch):
    def fail():
        raise AssertionError("read system memory needlessly")

    monkeypatch.setattr(budget, "detect_system_memory", fail)
    assert MemoryBudget.parse({"ram": 1, "vram": "auto"}).resolve(eight_gpus()).ram == 1
    monkeypatch.setattr(budget, "detect_system_memory", lambda: 10_000_000_000)
    rb = MemoryBudget.parse("auto").resolve(eight_gpus())
    assert (rb.ram, rb.system_memory) == (8_000_000_000, 10_000_000_000)


def test_detect_system_memory(monkeypatch):
    found = budget.detect_system_memory()
    if hasattr(os, "sysconf"):
        assert isinstance(found, int) and 0 < found <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert budget.detect_system_memory() is None
    monkeypatch.setattr(os, "sysconf", lambda name: -1)  # indeterminate
    assert budget.detect_system_memory() is None


def test_auto_gpu_that_reports_no_memory_is_unlimited_but_a_full_one_is_zero(caplog):
    table = [Dev(0, "cpu", None), Dev(1, "gpu", 0, 0, 0, "RPC0"), Dev(2, "gpu", 1, 0, 24 * GiB, "CUDA0")]
    with caplog.at_level(logging.WARNING, logger=budget.__name__):
        rb = MemoryBudget.parse({"vram": "auto"}).resolve(table)
    assert rb.gpus == (None, 0)
    assert "GPU 0 (RPC0) reports no memory" in caplog.text


# --- footprints -------------------------------------------------------------------------------


def test_from_devices_maps_ggml_indices_to_pools():
    per_device = {0: 1 * GiB, 9: 256 * MiB, 1: 4 * GiB, 4: 3 * GiB, 6: 0}
    fp = Footprint.from_devices(per_device, eight_gpus())
    # CPU + BLAS add up in RAM; ggml device 1 is GPU 0 and ggml device 4 is GPU 3; zeros vanish.
    assert dict(fp) == {"ram": 1 * GiB + 256 * MiB, gpu(0): 4 * GiB, gpu(3): 3 * GiB}
    assert list(fp) == ["ram", gpu(0), gpu(3)]
    assert (fp.ram, fp.gpu(0), fp.gpu(3), fp.gpu(5)) == (1 * GiB + 256 * MiB, 4 * GiB, 3 * GiB, 0)
    assert fp.total() == 8 * GiB + 256 * MiB
    # An integrated GPU outside the offload list shares host memory: it counts in RAM.
    table = [Dev(0, "cpu", None), Dev(1, "igpu", None), Dev(2, "gpu", 0)]
    assert dict(Footprint.from_devices({1: 5, 0: 7, 2: 9}, table)) == {"ram": 12, gpu(0): 9}


def test_from_devices_refuses_what_it_cannot_place():
    with pytest.raises(InvalidArgumentError, match=r"per_device\[42\]"):
        Footprint.from_devices({42: 1}, eight_gpus())
    # A discrete GPU llama.cpp does not offload to (a duplicate of another backend's GPU) has no pool.
    table = [Dev(0, "cpu", None), Dev(1, "gpu", 0), Dev(2, "gpu", None, name="Vulkan0")]
    with pytest.raises(InvalidArgumentError, match=r"per_device\[2\].*Vulkan0"):
        Footprint.from_devices({2: 1}, table)
    assert Footprint.from_devices({2: 0}, table) == Footprint()
    with pytest.raises(InvalidArgumentError, match=r"per_device\[1\]=-1"):
        Footprint.from_devices({1: -1}, eight_gpus())
    with pytest.raises(ArgumentTypeError, match="per_device"):
        Footprint.from_devices([1, 2], eight_gpus())


def test_footprint_arithmetic():
    a = Footprint.of(ram=1 * GiB, gpus=[4 * GiB, 0, 2 * GiB])
    b = Footprint({gpu(2): 1 * GiB, gpu(7): 5 * GiB})
    c = Footprint([("ram", 3), ("ram", 4)])  # pairs naming a pool twice add up
    assert dict(c) == {"ram": 7}
    s = a + b
    assert dict(s) == {"ram": 1 * GiB, gpu(0): 4 * GiB, gpu(2): 3 * GiB, gpu(7): 5 * GiB}
    assert s.total() == a.total() + b.total() == 13 * GiB
    assert sum([a, b, c]) == s + c
    assert a + {"ram": 1} == Footprint.of(ram=1 * GiB + 1, gpus={0: 4 * GiB, 2: 2 * GiB})
    assert s - b == a and (a - a) == Footprint() and len(a - a) == 0
    with pytest.raises(InvalidArgumentError, match="GPU 7 would be"):
        a - b
    assert s.gpus() == {0: 4 * GiB, 2: 3 * GiB, 7: 5 * GiB}
    assert a == {"ram": GiB, gpu(0): 4 * GiB, gpu(2): 2 * GiB} and hash(a) == hash(Footprint(dict(a)))
    assert a.describe() == "RAM 1.00 GiB, GPU 0 4.00 GiB, GPU 2 2.00 GiB (total 7.00 GiB)"
    assert Footprint().describe() == "nothing (total 0.00 GiB)"
    assert repr(c) == "Footprint({'ram': 7})"
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(AttributeError):
        a._bytes = {}


@pytest.mark.parametrize("value, exc, fragment", [
    ({"vram": 1}, InvalidArgumentError, "'vram' is not a memory pool"),
    ({"total": 1}, InvalidArgumentError, "'total' is not a memory pool"),
    ({("gpu", "0"): 1}, ArgumentTypeError, "GPU index '0'"),
    ({("gpu", -1): 1}, InvalidArgumentError, "GPU index -1"),
    ({("cuda", 0): 1}, ArgumentTypeError, "('cuda', 0)"),
    ({"ram": -1}, InvalidArgumentError, "footprint['ram']=-1"),
    ({"ram": 1.0}, ArgumentTypeError, "footprint['ram']=1.0"),
    ({"ram": True}, ArgumentTypeError, "footprint['ram']=True"),
    (5, ArgumentTypeError, "Footprint(5)"),
    ([("ram",)], ArgumentTypeError, "('ram',)"),
])
def test_bad_footprints(value, exc, fragment):
    with pytest.raises(exc) as e:
        Footprint(value)
    assert type(e.value) is exc and fragment in str(e.value)


# --- the check --------------------------------------------------------------------------------


def test_tensor_split_that_leaves_out_full_gpus_fits():
    rb = resolve("auto")
    # tensor_split=[1, 0, 0, 0, 1, 0, 0, 1]: layers on GPUs 0, 4 and 7 only; GPU 2 (0 free) untouched,
    # GPU 3 already over-committed by another model (used 5 GiB of a 2 GiB budget).
    model = Footprint.of(ram=2 * GiB, gpus={0: 30 * GiB, 4: 30 * GiB, 7: 30 * GiB})
    used = Footprint.of(ram=10 * GiB, gpus={3: 5 * GiB, 6: 1 * GiB})
    rb.check(model, used, model_id="split")
    assert rb.fits(model, used)
    # The same split touching GPU 2 by one byte (a compute buffer on main_gpu=2) does not fit.
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(model + {gpu(2): 1}, used, model_id="split")
    assert (e.value.device, e.value.required, e.value.available, e.value.model_id) == (gpu(2), 1, 0, "split")
    assert not rb.fits(model + {gpu(2): 1}, used)


def test_partial_offload_accumulates_ram_and_gpu_use():
    rb = resolve({"ram": 16 * GiB, "vram": "auto"})
    a = Footprint.of(ram=6 * GiB, gpus=[30 * GiB, 8 * GiB])  # some layers on GPUs 0-1, the rest in RAM
    rb.check(a)
    assert rb.remaining(a) == {"total": None, "ram": 10 * GiB, gpu(0): 49 * GiB, gpu(1): 2 * GiB,
                               **{gpu(g): FREE[g] for g in range(2, 8)}}
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(Footprint.of(ram=6 * GiB, gpus={1: 3 * GiB}), used=a, model_id="b")
    assert (e.value.device, e.value.required, e.value.available) == (gpu(1), 3 * GiB, 2 * GiB)
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(Footprint.of(ram=11 * GiB), used=a, model_id="c")
    assert (e.value.device, e.value.required, e.value.available) == ("ram", 11 * GiB, 10 * GiB)
    assert str(e.value) == ("model 'c' needs 11.00 GiB (11811160064 bytes) in RAM but only 10.00 GiB "
                            "(10737418240 bytes) of the RAM budget is left")
    # Exactly what is left fits.
    rb.check(Footprint.of(ram=10 * GiB, gpus={1: 2 * GiB}), used=a)


def test_combined_pool_versus_per_device_pools():
    spread = Footprint.of(gpus={0: 8 * GiB, 1: 8 * GiB, 4: 8 * GiB})  # fits each GPU, 24 GiB in all
    lumped = Footprint.of(gpus={3: 12 * GiB})  # 12 GiB in all, but GPU 3 has 2 GiB free
    combined, per_device = resolve(20 * GiB), resolve("auto")

    per_device.check(spread)
    with pytest.raises(InsufficientMemoryError) as e:
        combined.check(spread, model_id="spread")
    assert (e.value.device, e.value.required, e.value.available) == ("total", 24 * GiB, 20 * GiB)
    assert "in total" in str(e.value) and "the combined budget" in str(e.value)

    combined.check(lumped)
    with pytest.raises(InsufficientMemoryError) as e:
        per_device.check(lumped)
    assert (e.value.device, e.value.required, e.value.available) == (gpu(3), 12 * GiB, 2 * GiB)

    # The combined pool counts what is used anywhere, RAM included.
    with pytest.raises(InsufficientMemoryError) as e:
        combined.check(Footprint.of(gpus={0: 6 * GiB}), used=Footprint.of(ram=15 * GiB))
    assert (e.value.device, e.value.available) == ("total", 5 * GiB)
    assert combined.remaining(Footprint.of(ram=15 * GiB))["total"] == 5 * GiB

    # Both at once: the total is checked first, then each device.
    both = resolve({"total": 30 * GiB, "vram": "auto"})
    with pytest.raises(InsufficientMemoryError) as e:
        both.check(Footprint.of(gpus={3: 31 * GiB}))
    assert e.value.device == "total"
    with pytest.raises(InsufficientMemoryError) as e:
        both.check(lumped)
    assert e.value.device == gpu(3)


def test_check_order_is_deterministic():
    rb = resolve({"ram": 1 * GiB, "vram": "auto"})
    # Inserted GPU 6 first: the report still follows pool order (RAM, then the lowest GPU).
    over = Footprint({gpu(6): 2 * GiB, gpu(3): 3 * GiB, "ram": 2 * GiB})
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(over)
    assert e.value.device == "ram"
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(over - {"ram": 2 * GiB})
    assert (e.value.device, e.value.required, e.value.available) == (gpu(3), 3 * GiB, 2 * GiB)
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(over - {"ram": 2 * GiB, gpu(3): 3 * GiB})
    assert (e.value.device, e.value.available) == (gpu(6), 1 * GiB)


def test_available_is_floored_at_zero():
    rb = resolve("auto")
    used = Footprint.of(ram=200 * GiB, gpus={3: 5 * GiB})  # more than the budgets (e.g. free memory fell)
    assert rb.remaining(used)["ram"] == 0 and rb.remaining(used)[gpu(3)] == 0
    with pytest.raises(InsufficientMemoryError) as e:
        rb.check(Footprint.of(gpus={3: 1}), used)
    assert (e.value.device, e.value.required, e.value.available) == (gpu(3), 1, 0)


def test_footprints_naming_unknown_gpus_are_refused():
    rb = resolve("auto")
    with pytest.raises(InvalidArgumentError, match="GPU 8 is not in this budget"):
        rb.check(Footprint.of(gpus={8: 1}))
    with pytest.raises(InvalidArgumentError, match="used: GPU 9"):
        rb.check(Footprint(), used={gpu(9): 1})
    with pytest.raises(ArgumentTypeError, match="required"):
        rb.check([1, 2])
    rb.check({"ram": 1, gpu(0): 1})  # plain mappings are accepted


# --- errors -----------------------------------------------------------------------------------


def test_insufficient_memory_error():
    e = InsufficientMemoryError(device=("gpu", 3), required=10_000_000_000, available=2 * GiB, model_id="big")
    assert str(e) == ("model 'big' needs 9.31 GiB (10000000000 bytes) on GPU 3 but only 2.00 GiB "
                      "(2147483648 bytes) of GPU 3's budget is left")
    assert isinstance(e, MemoryError) and isinstance(e, LlamaError)
    assert lc.InsufficientMemoryError is InsufficientMemoryError and "InsufficientMemoryError" in lc.__all__
    copy = pickle.loads(pickle.dumps(e))
    assert (copy.device, copy.required, copy.available, copy.model_id, str(copy)) == \
        (("gpu", 3), 10_000_000_000, 2 * GiB, "big", str(e))
    anon = InsufficientMemoryError(device="total", required=3 * GiB, available=0)
    assert str(anon).startswith("the model needs 3.00 GiB (3221225472 bytes) in total but only 0.00 GiB")
    assert anon.model_id is None


def test_already_loaded_error():
    e = AlreadyLoadedError(model_id="chat")
    assert isinstance(e, ValueError) and isinstance(e, LlamaError) and e.model_id == "chat"
    assert "'chat'" in str(e) and "already" in str(e)
    assert lc.AlreadyLoadedError is AlreadyLoadedError and "AlreadyLoadedError" in lc.__all__
    assert pickle.loads(pickle.dumps(e)).model_id == "chat"


# --- bad specs --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, exc, fragment", [
    (True, ArgumentTypeError, "memory_budget=True"),
    (-1, InvalidArgumentError, "memory_budget=-1"),
    (1.5e9, ArgumentTypeError, "memory_budget=1500000000.0"),
    ("8GiB", InvalidArgumentError, "memory_budget='8GiB'"),
    ([1, 2], ArgumentTypeError, "memory_budget=[1, 2]"),
    ({"rma": 1}, ArgumentTypeError, "unknown key(s) 'rma'"),
    ({0: 1}, ArgumentTypeError, "unknown key(s) 0"),
    ({"total": -1}, InvalidArgumentError, "memory_budget['total']=-1"),
    ({"total": "auto"}, ArgumentTypeError, "memory_budget['total']='auto'"),
    ({"ram": -5}, InvalidArgumentError, "memory_budget['ram']=-5"),
    ({"ram": False}, ArgumentTypeError, "memory_budget['ram']=False"),
    ({"ram": 2.0}, ArgumentTypeError, "memory_budget['ram']=2.0"),
    ({"ram": "half"}, InvalidArgumentError, "memory_budget['ram']='half'"),
    ({"vram": 8 * GiB}, ArgumentTypeError, "memory_budget['vram']=8589934592"),
    ({"vram": "free"}, InvalidArgumentError, "memory_budget['vram']='free'"),
    ({"vram": [1, -1]}, InvalidArgumentError, "memory_budget['vram'][1]=-1"),
    ({"vram": [1, True]}, ArgumentTypeError, "memory_budget['vram'][1]=True"),
    ({"vram": {0: 1.5}}, ArgumentTypeError, "memory_budget['vram'][0]=1.5"),
    ({"vram": {"0": 1}}, ArgumentTypeError, "memory_budget['vram']['0']"),
    ({"vram": {True: 1}}, ArgumentTypeError, "memory_budget['vram'][True]"),
    ({"vram": {-1: 1}}, InvalidArgumentError, "memory_budget['vram'][-1]"),
])
def test_bad_specs(spec, exc, fragment):
    with pytest.raises(exc) as e:
        MemoryBudget.parse(spec)
    assert type(e.value) is exc and fragment in str(e.value)


@pytest.mark.parametrize("fraction, exc", [(0, InvalidArgumentError), (1.5, InvalidArgumentError),
                                           (True, ArgumentTypeError), ("0.8", ArgumentTypeError)])
def test_bad_auto_ram_fraction(fraction, exc):
    with pytest.raises(exc, match="auto_ram_fraction"):
        MemoryBudget(ram="auto", auto_ram_fraction=fraction)


def test_resolve_time_errors():
    with pytest.raises(InvalidArgumentError, match=r"memory_budget\['vram'\]\[8\]: there is no GPU 8.*GPUs 0\.\.7"):
        resolve({"vram": [1] * 9})
    resolve({"vram": [1] * 8})
    with pytest.raises(InvalidArgumentError, match=r"memory_budget\['vram'\]\[11\]"):
        resolve({"vram": {2: 1, 11: 1}})
    with pytest.raises(InvalidArgumentError, match="no GPU"):
        MemoryBudget.parse({"vram": {0: 1}}).resolve([Dev(0, "cpu", None)], system_memory=SYS)
    # "auto" on a machine without GPUs is simply no GPU pools.
    assert MemoryBudget.parse("auto").resolve([Dev(0, "cpu", None)], system_memory=SYS).gpus == ()
    with pytest.raises(ArgumentTypeError, match="system_memory=True"):
        resolve("auto", system_memory=True)
    with pytest.raises(InvalidArgumentError, match="system_memory=-1"):
        resolve("auto", system_memory=-1)


@pytest.mark.parametrize("table, exc, fragment", [
    ([Dev(0, "gpu", 0), Dev(1, "gpu", 0)], InvalidArgumentError, "gpu_index 0 appears twice"),
    ([Dev(0, "gpu", 0), Dev(1, "gpu", 2)], InvalidArgumentError, "[0, 2] are not 0..1"),
    ([Dev(0, "cpu", None), Dev(0, "gpu", 0)], InvalidArgumentError, "device index 0 appears twice"),
    ([Dev(0, "gpu", "0")], ArgumentTypeError, "devices[0].gpu_index"),
    ([object()], ArgumentTypeError, "has no 'index'"),
    ({0: Dev(0, "cpu", None)}, ArgumentTypeError, "devices="),
])
def test_bad_device_tables(table, exc, fragment):
    with pytest.raises(exc) as e:
        MemoryBudget.parse("auto").resolve(table, system_memory=SYS)
    assert type(e.value) is exc and fragment in str(e.value)


# --- reports ----------------------------------------------------------------------------------


def test_spec_round_trip_and_identity():
    for spec in (None, 20 * GiB, "auto", {"ram": 1, "vram": {0: 2, 3: "auto"}},
                 {"ram": "auto", "vram": None, "total": 5}):
        b = MemoryBudget.parse(spec)
        assert b.to_spec() == spec
        assert MemoryBudget.parse(b.to_spec()) == b and hash(MemoryBudget.parse(spec)) == hash(b)
        assert MemoryBudget.parse(b) is b
    # A list is stored as {gpu_index: limit}.
    assert MemoryBudget.parse({"vram": [1, None, "auto"]}).to_spec() == {"ram": None, "vram": {0: 1, 1: None, 2: "auto"}}
    assert repr(MemoryBudget.parse("auto")) == "MemoryBudget.parse('auto')"


def test_describe_and_as_dict():
    rb = resolve({"ram": 16 * GiB, "vram": "auto"})
    used = Footprint.of(ram=6 * GiB, gpus={3: 1 * GiB + 512 * MiB})
    text = rb.describe(used)
    lines = text.splitlines()
    assert lines[0] == "memory budget {'ram': 17179869184, 'vram': 'auto'}"
    assert len(lines) == 2 + 1 + 1 + 8  # header, column names, total, RAM, 8 GPUs
    total_row = next(line for line in lines if line.strip().startswith("total"))
    assert total_row.split()[1:] == ["unlimited", "7.50", "GiB", "unlimited"]
    gpu3 = next(line for line in lines if "GPU 3 (CUDA3)" in line)
    assert gpu3.split()[-6:] == ["2.00", "GiB", "1.50", "GiB", "0.50", "GiB"]
    ram = next(line for line in lines if line.strip().startswith("RAM"))
    assert ram.split()[1:] == ["16.00", "GiB", "6.00", "GiB", "10.00", "GiB"]
    assert "used" not in rb.describe() and "system memory 128.00 GiB" in resolve("auto").describe()
    assert rb.as_dict() == {"spec": {"ram": 16 * GiB, "vram": "auto"}, "total": None, "ram": 16 * GiB,
                            "vram": dict(enumerate(FREE)), "system_memory": None}
