"""The model manager: several resident models routed by id under one memory budget.

:mod:`.manager` holds :class:`ModelManager` (loading in a worker, routing by id or
``"default"``, server and direct modes, deterministic unloading); :mod:`.budget` the
pure arithmetic of the memory budget: the pools (RAM and each GPU), a model's
:class:`Footprint` per pool, parsing the user's ``memory_budget=`` spec, and the
check that names the pool a model does not fit in.
"""

from .budget import AUTO_RAM_FRACTION, BudgetPool, Footprint, MemoryBudget, ResolvedBudget, detect_system_memory
from .manager import LoadCancelledError, ModelInfo, ModelManager, ModelNotReadyError

__all__ = ["AUTO_RAM_FRACTION", "BudgetPool", "Footprint", "MemoryBudget", "ResolvedBudget", "detect_system_memory",
           "LoadCancelledError", "ModelInfo", "ModelManager", "ModelNotReadyError"]


def __getattr__(name: str):
    if name == "Pool":  # the name before BudgetPool (core.memory.Pool is a device row's pool)
        import warnings

        warnings.warn("llama_ctypes.engines.manager.Pool is now BudgetPool", DeprecationWarning, stacklevel=2)
        return BudgetPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
