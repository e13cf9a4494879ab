"""Memory-budget arithmetic of the model manager: pools, footprints, budget specs, the fit check.

Memory is accounted in *pools*, all in bytes:

* ``"ram"`` — host memory: the CPU device and every device without a GPU index
  (integrated GPUs that llama.cpp does not offload to, BLAS/accelerator devices);
* ``("gpu", i)`` — GPU ``i``, where ``i`` is ``lc.Device.gpu_index``: the index space of
  ``tensor_split`` and ``main_gpu``, not ggml's device index (``lc.Device.index``);
* ``"total"`` — one combined pool over all of the above (an int ``memory_budget``).

A model's :class:`Footprint` says how many bytes it needs in each pool. A
:class:`MemoryBudget` is what the user passed (``None``, an int, ``"auto"`` or a dict);
:meth:`MemoryBudget.resolve` turns it into a :class:`ResolvedBudget` of capacities
against the device table, and :meth:`ResolvedBudget.check` raises
:class:`~llama_ctypes.errors.InsufficientMemoryError` for the first pool a model does
not fit in. Resolve once, before loading: ``"auto"`` reads each GPU's *free* memory,
so resolving again after loads would count the resident models twice.

No native calls: devices are any objects with ``index``, ``type`` and ``gpu_index``
(plus ``memory_free``, ``memory_total`` and ``name`` where ``"auto"`` and
:meth:`ResolvedBudget.describe` use them), so everything is tested with synthetic tables.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal, Protocol, Tuple, Union

from ...core.memory import detect_system_memory
from ...errors import ArgumentTypeError, InsufficientMemoryError, InvalidArgumentError

logger = logging.getLogger(__name__)

#: What one budget limit covers: "total", "ram" or ("gpu", gpu_index). (A device row's own pool, which may
#: also be an RPC worker's, is core.memory.Pool.)
BudgetPool = Union[Literal["total", "ram"], Tuple[Literal["gpu"], int]]
"""A memory pool: ``"total"``, ``"ram"`` or ``("gpu", gpu_index)``."""

Limit = Union[int, Literal["auto"], None]
"""One pool's limit in a spec: bytes, ``"auto"``, or ``None`` (unlimited)."""

AUTO_RAM_FRACTION = 0.8
"""Share of system memory that ``"auto"`` grants the RAM pool (the rest is left to the OS and the application)."""

_SPEC_KEYS = ("total", "ram", "vram")
_GiB = 2**30


class DeviceLike(Protocol):
    """What the budget reads from a device; ``lc.Device`` has all of it."""

    index: int  # position in ggml's device list
    type: str  # "cpu" | "gpu" | "igpu" | "accel" | "meta"
    gpu_index: int | None  # index among offload GPUs (tensor_split/main_gpu); None for others


# ---------------------------------------------------------------------------------------------
# validation helpers


def _gib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / _GiB:.2f} GiB"


_INT_MESSAGES = {
    "bytes": ("{name}={value!r}: expected an int number of bytes, got {type}",
              "{name}={value!r}: expected a number of bytes >= 0"),
    "gpu": ("{name}: GPU index {value!r} is not an int (got {type})", "{name}: GPU index {value!r} is negative"),
}


def _non_negative(value: Any, name: str, kind: str) -> int:
    """An int >= 0 (numpy ints too; bool and float are refused); ``kind`` picks the messages."""
    not_int, negative = _INT_MESSAGES[kind]
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ArgumentTypeError(not_int.format(name=name, value=value, type=type(value).__name__))
    value = operator.index(value)
    if value < 0:
        raise InvalidArgumentError(negative.format(name=name, value=value))
    return value


def _check_bytes(value: Any, name: str) -> int:
    return _non_negative(value, name, "bytes")


def _check_gpu_index(value: Any, name: str) -> int:
    return _non_negative(value, name, "gpu")


def _check_limit(value: Any, name: str) -> Limit:
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        raise InvalidArgumentError(f"{name}={value!r}: expected an int number of bytes, 'auto' or None")
    return _check_bytes(value, name)


def _check_pool(pool: Any, name: str) -> BudgetPool:
    """A footprint pool: "ram" or ("gpu", i). ("total" is not a place memory lives.)"""
    if isinstance(pool, str):
        if pool == "ram":
            return "ram"
        raise InvalidArgumentError(f"{name}: {pool!r} is not a memory pool; expected 'ram' or ('gpu', i)")
    if isinstance(pool, tuple) and len(pool) == 2 and pool[0] == "gpu":
        return ("gpu", _check_gpu_index(pool[1], name))
    raise ArgumentTypeError(f"{name}: {pool!r} is not a memory pool; expected 'ram' or ('gpu', i)")


def _pool_key(pool: BudgetPool) -> tuple[int, int]:
    # The one order used everywhere (iteration, check, reports): total, ram, then GPUs ascending.
    if pool == "total":
        return (0, 0)
    if pool == "ram":
        return (1, 0)
    return (2, pool[1])


def _pool_label(pool: BudgetPool) -> str:
    return {"total": "total", "ram": "RAM"}.get(pool) if isinstance(pool, str) else f"GPU {pool[1]}"


def _device_table(devices: Iterable[DeviceLike]) -> tuple[dict[int, DeviceLike], list[DeviceLike]]:
    """Validate a device table: (devices by ggml index, GPUs ordered by gpu_index)."""
    if isinstance(devices, (str, bytes, Mapping)) or not isinstance(devices, Iterable):
        raise ArgumentTypeError(f"devices={devices!r}: expected a list of lc.Device-like objects")
    by_index: dict[int, DeviceLike] = {}
    by_gpu: dict[int, DeviceLike] = {}
    for k, dev in enumerate(devices):
        for attr in ("index", "type", "gpu_index"):
            if not hasattr(dev, attr):
                raise ArgumentTypeError(f"devices[{k}]={dev!r} has no {attr!r}; expected lc.Device-like objects")
        if isinstance(dev.index, bool) or not isinstance(dev.index, int):
            raise ArgumentTypeError(f"devices[{k}].index={dev.index!r}: expected an int")
        if dev.index in by_index:
            raise InvalidArgumentError(f"devices[{k}]: device index {dev.index} appears twice")
        by_index[dev.index] = dev
        if dev.gpu_index is not None:
            g = _check_gpu_index(dev.gpu_index, f"devices[{k}].gpu_index")
            if g in by_gpu:
                raise InvalidArgumentError(f"devices[{k}]: gpu_index {g} appears twice")
            by_gpu[g] = dev
    # llama.cpp numbers offload GPUs 0..n-1; a gap means the table is not one of lc.devices().
    if sorted(by_gpu) != list(range(len(by_gpu))):
        raise InvalidArgumentError(f"devices: gpu_index values {sorted(by_gpu)} are not 0..{len(by_gpu) - 1}")
    return by_index, [by_gpu[g] for g in range(len(by_gpu))]


# ---------------------------------------------------------------------------------------------
# footprints


class Footprint(Mapping):
    """Bytes a model needs in each pool, e.g. ``{"ram": 1 << 30, ("gpu", 0): 6 << 30}``; immutable.

    Built from a mapping or (pool, bytes) pairs (pairs naming a pool twice add up),
    from :meth:`of` or from llama.cpp's per-device figures with :meth:`from_devices`.
    Pools are ``"ram"`` and ``("gpu", i)``; zero entries are dropped, so two footprints
    are equal when they need the same bytes in the same places. Iteration is in pool
    order (RAM, then GPUs ascending). ``a + b`` adds per pool (``sum()`` works);
    ``a - b`` subtracts and refuses to go below zero.
    """

    __slots__ = ("_bytes",)

    def __init__(self, per_pool: Mapping[BudgetPool, int] | Iterable[tuple[BudgetPool, int]] = (), /):
        if isinstance(per_pool, Mapping):
            items: Iterable = per_pool.items()
        elif isinstance(per_pool, Iterable) and not isinstance(per_pool, (str, bytes)):
            items = per_pool
        else:
            raise ArgumentTypeError(f"Footprint({per_pool!r}): expected a mapping or (pool, bytes) pairs")
        acc: dict[BudgetPool, int] = {}
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ArgumentTypeError(f"Footprint: {item!r} is not a (pool, bytes) pair")
            pool = _check_pool(item[0], "footprint")
            acc[pool] = acc.get(pool, 0) + _check_bytes(item[1], f"footprint[{pool!r}]")
        object.__setattr__(self, "_bytes", {p: acc[p] for p in sorted(acc, key=_pool_key) if acc[p]})

    @classmethod
    def of(cls, ram: int = 0, gpus: Mapping[int, int] | Iterable[int] = ()) -> Footprint:
        """``ram`` bytes of host memory plus ``gpus``: a list (position = GPU index) or {gpu_index: bytes}."""
        pairs = gpus.items() if isinstance(gpus, Mapping) else enumerate(gpus)
        return cls([("ram", ram), *((("gpu", g), n) for g, n in pairs)])

    @classmethod
    def from_devices(cls, per_device: Mapping[int, int], devices: Iterable[DeviceLike]) -> Footprint:
        """Map bytes per ggml device index (``lc.Device.index``) onto pools.

        A device with a ``gpu_index`` counts in ``("gpu", gpu_index)``; the CPU and
        other devices (BLAS, accelerators, integrated GPUs outside the offload list)
        count in ``"ram"``. Several devices may add into one pool. A discrete GPU
        outside llama.cpp's offload list (no ``gpu_index``) holding bytes is refused:
        its memory belongs to no pool, and charging it to RAM would hide it.
        """
        if not isinstance(per_device, Mapping):
            raise ArgumentTypeError(f"per_device={per_device!r}: expected a mapping {{device index: bytes}}")
        by_index, _ = _device_table(devices)
        pairs = []
        for index, n in per_device.items():
            dev = by_index.get(index) if isinstance(index, int) and not isinstance(index, bool) else None
            if dev is None:
                raise InvalidArgumentError(f"per_device[{index!r}]: no device with that index "
                                           f"(indices: {sorted(by_index)})")
            n = _check_bytes(n, f"per_device[{index}]")
            if dev.gpu_index is not None:
                pairs.append((("gpu", dev.gpu_index), n))
            elif dev.type == "gpu" and n:
                raise InvalidArgumentError(f"per_device[{index}]: device {index} ({getattr(dev, 'name', '?')}) is a "
                                           "GPU outside llama.cpp's offload list (no gpu_index); its memory has no pool")
            else:
                pairs.append(("ram", n))
        return cls(pairs)

    # Mapping protocol
    def __getitem__(self, pool: BudgetPool) -> int:
        return self._bytes[pool]

    def __iter__(self) -> Iterator[BudgetPool]:
        return iter(self._bytes)

    def __len__(self) -> int:
        return len(self._bytes)

    def __hash__(self) -> int:
        return hash(frozenset(self._bytes.items()))

    def __setattr__(self, name, value):
        raise AttributeError("Footprint is immutable")

    def __reduce__(self):
        return (Footprint, (list(self._bytes.items()),))

    # arithmetic
    def __add__(self, other: Mapping[BudgetPool, int]) -> Footprint:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Footprint([*self._bytes.items(), *other.items()])

    def __radd__(self, other):
        if other == 0:  # sum() starts from 0
            return self
        return self.__add__(other)

    def __sub__(self, other: Mapping[BudgetPool, int]) -> Footprint:
        if not isinstance(other, Mapping):
            return NotImplemented
        other = _as_footprint(other, "subtrahend")
        out = dict(self._bytes)
        for pool, n in other.items():
            left = out.get(pool, 0) - n
            if left < 0:
                # Accounting went wrong somewhere (releasing more than was charged): say so rather than clamp.
                raise InvalidArgumentError(f"footprint subtraction: {_pool_label(pool)} would be {left} bytes")
            out[pool] = left
        return Footprint(out)

    # figures
    def total(self) -> int:
        """All bytes, every pool together."""
        return sum(self._bytes.values())

    @property
    def ram(self) -> int:
        """Bytes in host memory."""
        return self._bytes.get("ram", 0)

    def gpu(self, index: int) -> int:
        """Bytes on GPU ``index`` (0 if none)."""
        return self._bytes.get(("gpu", index), 0)

    def gpus(self) -> dict[int, int]:
        """{gpu_index: bytes} for the GPUs this footprint uses."""
        return {p[1]: n for p, n in self._bytes.items() if p != "ram"}

    def describe(self) -> str:
        """E.g. ``"RAM 1.00 GiB, GPU 0 6.00 GiB (total 7.00 GiB)"``."""
        parts = [f"{_pool_label(p)} {_gib(n)}" for p, n in self._bytes.items()] or ["nothing"]
        return f"{', '.join(parts)} (total {_gib(self.total())})"

    def __repr__(self) -> str:
        return f"Footprint({self._bytes!r})"


#: A Footprint, or any mapping of pools to bytes (converted on use).
FootprintLike = Union[Footprint, Mapping[BudgetPool, int]]


def _as_footprint(value: Any, name: str) -> Footprint:
    if isinstance(value, Footprint):
        return value
    if isinstance(value, Mapping):
        return Footprint(value)
    raise ArgumentTypeError(f"{name}={value!r}: expected a Footprint or a mapping {{pool: bytes}}")


# ---------------------------------------------------------------------------------------------
# budget specs


@dataclass(frozen=True, eq=True)
class MemoryBudget:
    """A memory budget as the user gives it; :meth:`resolve` turns it into byte capacities.

    ``MemoryBudget.parse(spec)`` accepts what ``memory_budget=`` takes:

    * ``None`` — no limit;
    * an int — one combined pool (``total``) of that many bytes over RAM and every GPU;
    * ``"auto"`` — RAM: ``auto_ram_fraction`` (default 0.8) of system memory;
      each GPU: its free memory when resolved;
    * a dict with keys ``"ram"`` (bytes | ``"auto"`` | None), ``"vram"`` and,
      optionally, ``"total"`` (bytes | None, checked before the per-pool limits).
      ``"vram"`` is ``"auto"``, None, a list ``[b0, b1, ...]`` (position = GPU index)
      or a dict ``{gpu_index: limit}``, each limit bytes | ``"auto"`` | None.
      **GPUs a list or dict does not name are unlimited.**

    Fields (bytes): ``total``; ``ram``; ``vram`` — ``"auto"``, None, or a read-only
    {gpu_index: limit} mapping (a list is stored as that mapping); ``auto_ram_fraction``.
    Validation is strict: bool is not a number, floats are not bytes, negative
    values, unknown keys and non-int GPU indices raise ``InvalidArgumentError`` /
    ``ArgumentTypeError`` naming the key.
    """

    total: int | None = None
    ram: Limit = None
    vram: Any = None  # "auto" | None | Mapping[int, Limit] (input: also a list)
    auto_ram_fraction: float = AUTO_RAM_FRACTION

    def __post_init__(self) -> None:
        if self.total is not None:
            object.__setattr__(self, "total", _check_bytes(self.total, "memory_budget['total']"))
        object.__setattr__(self, "ram", _check_limit(self.ram, "memory_budget['ram']"))
        object.__setattr__(self, "vram", self._normalise_vram(self.vram))
        f = self.auto_ram_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise ArgumentTypeError(f"auto_ram_fraction={f!r}: expected a number in (0, 1]")
        if not 0 < f <= 1:
            raise InvalidArgumentError(f"auto_ram_fraction={f!r}: expected a number in (0, 1]")

    @staticmethod
    def _normalise_vram(vram: Any) -> Any:
        if vram is None or isinstance(vram, str):
            return _check_limit(vram, "memory_budget['vram']")
        if isinstance(vram, Mapping):
            pairs = [(_check_gpu_index(g, f"memory_budget['vram'][{g!r}]"), limit) for g, limit in vram.items()]
        elif isinstance(vram, (list, tuple)):
            pairs = list(enumerate(vram))
        else:
            # An int would be ambiguous (each GPU, or all of them together?): ask for a list or dict.
            raise ArgumentTypeError(f"memory_budget['vram']={vram!r}: expected 'auto', None, a list of per-GPU "
                                    "limits or a dict {gpu_index: limit}")
        return MappingProxyType({g: _check_limit(limit, f"memory_budget['vram'][{g}]") for g, limit in sorted(pairs)})

    @classmethod
    def parse(cls, spec: Any) -> MemoryBudget:
        """A budget from a ``memory_budget=`` value (a MemoryBudget is returned as is)."""
        if isinstance(spec, MemoryBudget):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, str):
            if spec == "auto":
                return cls(ram="auto", vram="auto")
            raise InvalidArgumentError(f"memory_budget={spec!r}: expected None, bytes (int), 'auto' or a dict")
        if isinstance(spec, Mapping):
            unknown = [k for k in spec if k not in _SPEC_KEYS]
            if unknown:
                raise ArgumentTypeError(f"memory_budget: unknown key(s) {', '.join(map(repr, unknown))}; "
                                        "expected 'ram', 'vram' and optionally 'total'")
            return cls(total=spec.get("total"), ram=spec.get("ram"), vram=spec.get("vram"))
        if isinstance(spec, bool) or not hasattr(type(spec), "__index__"):
            raise ArgumentTypeError(f"memory_budget={spec!r}: expected None, bytes (int), 'auto' or a dict, "
                                    f"got {type(spec).__name__}")
        return cls(total=_check_bytes(spec, "memory_budget"))

    @property
    def unlimited(self) -> bool:
        """True when no pool has a limit (resolving cannot add one)."""
        vram_free = self.vram is None or (not isinstance(self.vram, str) and
                                          all(v is None for v in self.vram.values()))
        return self.total is None and self.ram is None and vram_free

    def to_spec(self) -> Any:
        """The budget in ``memory_budget=`` form (None, int, "auto" or a dict), for reports."""
        if self.unlimited:
            return None
        if self.ram is None and self.vram is None and self.auto_ram_fraction == AUTO_RAM_FRACTION:
            return self.total
        if self.total is None and self.ram == "auto" and self.vram == "auto":
            return "auto"
        spec: dict[str, Any] = {"ram": self.ram,
                                "vram": dict(self.vram) if isinstance(self.vram, Mapping) else self.vram}
        if self.total is not None:
            spec["total"] = self.total
        return spec

    def resolve(self, devices: Iterable[DeviceLike], system_memory: int | None = None) -> ResolvedBudget:
        """Capacities in bytes per pool for this device table (``lc.devices()``); None means unlimited.

        ``system_memory`` (bytes) is what ``ram="auto"`` takes its share of; read with
        :func:`detect_system_memory` when not given, and where the platform cannot say,
        the RAM pool is unlimited (with a warning). A GPU on ``"auto"`` gets its
        ``memory_free`` now; one whose backend reports no memory at all (free and total
        0) is unlimited, with a warning, rather than a budget of 0. A ``vram`` entry
        for a GPU that does not exist raises ``InvalidArgumentError``.
        """
        _, gpus = _device_table(devices)
        if system_memory is not None:
            system_memory = _check_bytes(system_memory, "system_memory")

        ram = self.ram
        if ram != "auto":
            system_memory = None  # only kept when it made a figure, so reports don't show an unused one
        else:
            if system_memory is None:
                system_memory = detect_system_memory()
            if system_memory is None:
                logger.warning("memory_budget: system memory is unknown on this platform; the RAM pool is unlimited")
                ram = None
            else:
                # Fraction(str(f)) is the decimal the user wrote (0.8 == 4/5), so the result is exact.
                ram = int(system_memory * Fraction(str(self.auto_ram_fraction)))

        if self.vram is None:
            limits: Mapping[int, Limit] = {}
        elif isinstance(self.vram, str):
            limits = {g: "auto" for g in range(len(gpus))}
        else:
            limits = self.vram
            beyond = [g for g in limits if g >= len(gpus)]
            if beyond:
                have = f"GPUs 0..{len(gpus) - 1}" if gpus else "no GPU"
                raise InvalidArgumentError(f"memory_budget['vram'][{beyond[0]}]: there is no GPU {beyond[0]} "
                                           f"(this machine has {have})")
        capacities: list[int | None] = []
        for g, dev in enumerate(gpus):
            limit = limits.get(g)
            if limit == "auto":
                free = _check_bytes(getattr(dev, "memory_free", None), f"GPU {g} memory_free")
                total = getattr(dev, "memory_total", None)
                if free == 0 and not total:
                    logger.warning("memory_budget: GPU %d (%s) reports no memory; its pool is unlimited",
                                   g, getattr(dev, "name", "?"))
                    limit = None
                else:
                    limit = free
            capacities.append(limit)
        return ResolvedBudget(total=self.total, ram=ram, gpus=tuple(capacities), spec=self,
                              system_memory=system_memory,
                              gpu_names=tuple(str(getattr(dev, "name", "")) for dev in gpus))

    def __hash__(self) -> int:
        vram = tuple(self.vram.items()) if isinstance(self.vram, Mapping) else self.vram
        return hash((self.total, self.ram, vram, self.auto_ram_fraction))

    def __repr__(self) -> str:
        fraction = "" if self.auto_ram_fraction == AUTO_RAM_FRACTION else f", auto_ram_fraction={self.auto_ram_fraction}"
        return f"MemoryBudget.parse({self.to_spec()!r}){fraction}"


@dataclass(frozen=True)
class ResolvedBudget:
    """Capacities in bytes per pool (None = unlimited), fixed when the budget was resolved.

    ``gpus[i]`` is GPU ``i``'s capacity. ``spec`` is the budget it came from,
    ``system_memory`` the figure ``ram="auto"`` used (None if not needed or unknown),
    ``gpu_names`` the devices' names (``"CUDA0"``...) for reports.
    """

    total: int | None
    ram: int | None
    gpus: tuple[int | None, ...]
    spec: MemoryBudget = field(default_factory=MemoryBudget)
    system_memory: int | None = None
    gpu_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("total", "ram", "system_memory"):
            if getattr(self, name) is not None:
                _check_bytes(getattr(self, name), name)
        object.__setattr__(self, "gpus", tuple(None if c is None else _check_bytes(c, f"gpus[{i}]")
                                               for i, c in enumerate(self.gpus)))
        names = tuple(self.gpu_names)
        object.__setattr__(self, "gpu_names", names + ("",) * (len(self.gpus) - len(names)))

    @property
    def n_gpus(self) -> int:
        return len(self.gpus)

    @property
    def unlimited(self) -> bool:
        """True when no pool has a capacity: every check passes."""
        return self.total is None and self.ram is None and all(c is None for c in self.gpus)

    def pools(self) -> list[BudgetPool]:
        """Every pool, in check order: ``"total"``, ``"ram"``, then ``("gpu", 0)``...``("gpu", n-1)``."""
        return ["total", "ram", *(("gpu", g) for g in range(len(self.gpus)))]

    def capacity(self, pool: BudgetPool) -> int | None:
        """The pool's capacity in bytes, None when unlimited."""
        if pool == "total":
            return self.total
        pool = _check_pool(pool, "capacity")
        if pool == "ram":
            return self.ram
        self._check_gpu_exists(pool[1], "capacity")
        return self.gpus[pool[1]]

    def capacities(self) -> dict[BudgetPool, int | None]:
        """{pool: capacity in bytes or None}, in check order."""
        return {p: self.capacity(p) for p in self.pools()}

    def remaining(self, used: FootprintLike = Footprint()) -> dict[BudgetPool, int | None]:
        """{pool: bytes left after ``used``, floored at 0; None when unlimited}, in check order."""
        used = self._footprint(used, "used")
        return {p: None if (cap := self.capacity(p)) is None else max(0, cap - self._in(used, p))
                for p in self.pools()}

    def check(self, required: FootprintLike, used: FootprintLike = Footprint(),
              model_id: str | None = None) -> None:
        """Raise InsufficientMemoryError if ``required`` does not fit beside ``used`` (both bytes per pool).

        Pools are checked in order — total, RAM, GPU 0, 1, ... — and the first that
        does not fit is reported with ``available`` = capacity − used, floored at 0.
        A pool the model needs nothing from always fits, even one already full (a
        tensor split that leaves out a busy GPU). A footprint naming a GPU the budget
        does not know raises ``InvalidArgumentError``.
        """
        required = self._footprint(required, "required")
        used = self._footprint(used, "used")
        for pool in self.pools():
            cap = self.capacity(pool)
            need = self._in(required, pool)
            if cap is None or need == 0:
                continue
            available = max(0, cap - self._in(used, pool))
            if need > available:
                raise InsufficientMemoryError(device=pool, required=need, available=available, model_id=model_id)

    def fits(self, required: FootprintLike, used: FootprintLike = Footprint()) -> bool:
        """Whether :meth:`check` would pass."""
        try:
            self.check(required, used)
        except InsufficientMemoryError:
            return False
        return True

    def as_dict(self) -> dict[str, Any]:
        """Plain figures for reports: spec, total, ram, vram {gpu_index: bytes or None}, system_memory."""
        return {"spec": self.spec.to_spec(), "total": self.total, "ram": self.ram,
                "vram": dict(enumerate(self.gpus)), "system_memory": self.system_memory}

    def describe(self, used: FootprintLike | None = None) -> str:
        """A table of the pools: budget, and with ``used``, what is used and left (GiB)."""
        used_fp = None if used is None else self._footprint(used, "used")
        sysmem = f"; system memory {_gib(self.system_memory)}" if self.system_memory is not None else ""
        lines = [f"memory budget {self.spec.to_spec()!r}{sysmem}",
                 f"  {'pool':<16}{'budget':>14}" + (f"{'used':>14}{'left':>14}" if used_fp is not None else "")]
        left = self.remaining(used_fp) if used_fp is not None else {}
        for pool in self.pools():
            label = _pool_label(pool)
            if pool != "total" and pool != "ram" and self.gpu_names[pool[1]]:
                label += f" ({self.gpu_names[pool[1]]})"
            row = f"  {label:<16}{_gib(self.capacity(pool)):>14}"
            if used_fp is not None:
                row += f"{_gib(self._in(used_fp, pool)):>14}{_gib(left[pool]):>14}"
            lines.append(row)
        return "\n".join(lines)

    # helpers
    def _check_gpu_exists(self, g: int, name: str) -> None:
        if g >= len(self.gpus):
            raise InvalidArgumentError(f"{name}: GPU {g} is not in this budget ({len(self.gpus)} GPU(s))")

    def _footprint(self, value: Any, name: str) -> Footprint:
        fp = _as_footprint(value, name)
        for g in fp.gpus():
            self._check_gpu_exists(g, name)
        return fp

    @staticmethod
    def _in(fp: Footprint, pool: BudgetPool) -> int:
        return fp.total() if pool == "total" else fp.get(pool, 0)
