"""The adapter operations of a ContextLease: LoRA adapters and control vectors.

llama.cpp applies adapters per context (``llama_set_adapters_lora``, ``llama_set_adapter_cvec``);
the next decode re-sizes the context's graph over every adapter of the model, so that call runs
under the model's adapter lock (:meth:`AdapterOps.guarded`). Each change is told to the context's
:class:`~llama_ctypes.core.kv_record.KVRecord`, so a prefix computed under other adapters is not
reused. Part of :class:`~llama_ctypes.core.context.ContextLease` (a mixin: same object, same rules).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..native import llama_h as L
from .backend import native_error
from .control_vector import ControlVector
from .lora import LoraAdapter, LoraSet, resolve_loras

__all__ = ["AdapterOps"]


class AdapterOps:
    """ContextLease's adapter methods (see the module docs); the lease supplies ``ctx``, ``_lib``,
    ``_ptr`` and ``_check``."""

    def guarded(self, run: Callable[[], int]) -> int:
        """``run()`` (a native decode, encode or process call), holding the model's adapter lock when
        the adapters changed since the last one: that call sizes its graph over every adapter of the
        model, which another thread must not load or free meanwhile."""
        ctx = self.ctx
        if not ctx._reserve_pending:
            return run()
        with ctx.model.adapter_lock:
            rc = run()
        ctx._reserve_pending = False
        return rc

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def set_loras(self, loras: Mapping[Any, float] | None) -> None:
        """Apply LoRA adapters to every later decode of this context: ``{adapter or name: scale}``
        (names of ``model.loras``); None or ``{}``: none. The KV already computed stays as it was:
        a prefix computed under other adapters is not reused by :meth:`prefill`."""
        self._check()
        self.apply_loras(resolve_loras(self.ctx.model, loras))

    def set_control_vector(self, cvec: ControlVector | None) -> None:
        """Apply a control vector (:func:`~llama_ctypes.load_control_vector`) to every later decode of
        this context; None: none. Raises InvalidArgumentError when its ``n_embd`` is not the model's
        (nothing changes then). As with adapters, a prefix computed without it is not reused with it."""
        self._check()
        ctx = self.ctx
        if cvec is ctx._cvec:
            return
        if cvec is None:
            rc = self._lib.llama_set_adapter_cvec(self._ptr, None, 0, 0, 0, 0)
        else:
            if not isinstance(cvec, ControlVector):
                raise ArgumentTypeError(f"{cvec!r}: expected a ControlVector (lc.load_control_vector) or None")
            model = ctx.model
            if cvec.n_embd != ctx.n_embd:
                raise InvalidArgumentError(f"a control vector of {cvec.n_embd} floats per layer; "
                                           f"{model.path.name} has n_embd={ctx.n_embd}")
            start, end = cvec.layers(ctx.n_layer)
            # Every layer's row, zeros where the vector has none: llama.cpp overwrites only the rows it
            # is given, so a shorter vector would keep a previous one's later layers.
            data = np.zeros((max(ctx.n_layer - 1, 1), cvec.n_embd), dtype=np.float32)
            k = min(len(data), len(cvec.data))
            data[:k] = cvec.data[:k]
            rc = self._lib.llama_set_adapter_cvec(self._ptr, data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                  data.size, cvec.n_embd, start, end)
        if rc != 0:
            raise InvalidArgumentError(f"llama.cpp refused the control vector: {native_error('rc ' + str(rc))}")
        ctx._cvec = cvec  # (llama.cpp copied the data into its own tensors)
        ctx._reserve_pending = True
        ctx._record.set_adapters(ctx._adapter_key())

    def apply_loras(self, wanted: LoraSet) -> None:
        """:meth:`set_loras` with a set already resolved (``core.lora.lora_set``)."""
        self._check()
        ctx = self.ctx
        if wanted == ctx._loras:
            return
        taken: list[LoraAdapter] = []
        try:
            for adapter, _ in wanted:
                adapter.applied_by_context()
                taken.append(adapter)
            n = len(wanted)
            ptrs = (L.llama_adapter_lora_p * max(n, 1))(*[a.native() for a, _ in wanted])
            scales = (ctypes.c_float * max(n, 1))(*[s for _, s in wanted])
            self._lib.llama_set_adapters_lora(self._ptr, ptrs if n else None, n, scales if n else None)
        except BaseException:
            for adapter in taken:
                adapter.released_by_context()
            raise
        old, ctx._loras = ctx._loras, wanted
        ctx._reserve_pending = True
        ctx._record.set_adapters(ctx._adapter_key())
        if old:
            # (a released adapter may be freed now: no decode still in flight on the device may read it)
            self._lib.llama_synchronize(self._ptr)
        for adapter, _ in old:
            adapter.released_by_context()

