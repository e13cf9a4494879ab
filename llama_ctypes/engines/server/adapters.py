"""The LoRA adapters a Server serves: names, ids, default scales, unloading, and requests in flight.

One object owns that bookkeeping (:class:`ServedAdapters`, one lock); the Server asks it to resolve
a request's ``lora=`` and tells it when the request is queued; an unload waits until no request
resolved with the adapter is still on its way to the queue (the scheduler covers those queued or
running). Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from ...core.lora import LoraAdapter, LoraSet, check_lora_spec, resolve_loras
from ...core.model import Model
from ...errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ServedAdapters"]


class ServedAdapters:
    """The adapters requests may name over one model, by name and by a stable id (see the module docs)."""

    def __init__(self, model: Model):
        self.model = model
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._ids: dict[str, int] = {}  # never reused: an id a client read stays valid or unknown
        self._next_id = 0
        self._scales: dict[str, float] = {}  # what requests that name no adapter get
        self._unloading: dict[str, LoraAdapter] = {}  # out of service, waiting for their requests
        self._owned: set[LoraAdapter] = set()  # loaded by the server: closed with it
        self._resolving: dict[LoraAdapter, int] = {}  # requests resolved with an adapter, not yet queued

    def add(self, adapter: LoraAdapter, owned: bool, scale: float) -> int:
        """Serve ``adapter`` under its name; returns its id."""
        if not isinstance(adapter, LoraAdapter):
            raise ArgumentTypeError(f"{adapter!r}: expected a LoraAdapter (from model.load_lora)")
        if adapter.model is not self.model:
            raise InvalidArgumentError(f"the LoRA adapter {adapter.name!r} was loaded over another model")
        check_lora_spec({adapter: scale})
        with self._lock:
            if adapter.name in self._by_name or adapter.name in self._unloading:
                raise InvalidArgumentError(f"a LoRA adapter named {adapter.name!r} is already loaded")
            lora_id = self._next_id
            self._next_id += 1
            self._by_name[adapter.name] = adapter
            self._ids[adapter.name] = lora_id
            self._scales[adapter.name] = float(scale)
            if owned:
                self._owned.add(adapter)
        return lora_id

    def by_name(self) -> dict[str, LoraAdapter]:
        with self._lock:
            return dict(self._by_name)

    def scales(self) -> dict[str, float]:
        with self._lock:
            return dict(self._scales)

    def table(self) -> list[tuple[int, LoraAdapter, float]]:
        """(id, adapter, default scale) of each adapter served, by id."""
        with self._lock:
            return sorted(((self._ids[n], a, self._scales.get(n, 0.0)) for n, a in self._by_name.items()),
                          key=lambda row: row[0])

    def set_scales(self, scales: Mapping[Any, float]) -> None:
        """The default scales, as llama-server's ``POST /lora-adapters``: those not listed get 0."""
        with self._lock:
            resolved = resolve_loras(self.model, self._with_ids(dict(scales)), list(self._by_name.values()))
            self._scales = {name: 0.0 for name in self._by_name}
            for adapter, scale in resolved:
                self._scales[adapter.name] = scale

    def resolve(self, lora: Any) -> LoraSet:
        """The set a request's ``lora`` names (the default scales when None), counted as on its way to
        the queue until :meth:`unresolve`."""
        with self._lock:
            spec = dict(lora) if lora is not None else {name: s for name, s in self._scales.items() if s}
            if not spec:
                return ()
            for key in spec:
                if isinstance(key, str) and key in self._unloading or \
                        isinstance(key, LoraAdapter) and key in self._unloading.values():
                    name = key if isinstance(key, str) else key.name
                    raise InvalidArgumentError(f"lora: the adapter {name!r} is being unloaded")
            loras = resolve_loras(self.model, self._with_ids(spec), list(self._by_name.values()))
            for adapter, _ in loras:
                self._resolving[adapter] = self._resolving.get(adapter, 0) + 1
        return loras

    def unresolve(self, sets: Sequence[LoraSet]) -> None:
        """The requests of these sets are queued now (or were refused)."""
        with self._lock:
            for loras in sets:
                for adapter, _ in loras:
                    left = self._resolving.get(adapter, 0) - 1
                    if left > 0:
                        self._resolving[adapter] = left
                    else:
                        self._resolving.pop(adapter, None)

    def begin_unload(self, name: str) -> LoraAdapter:
        """Take ``name`` out of service (new requests naming it are refused); returns the adapter."""
        with self._lock:
            adapter = self._by_name.pop(name, None) or self._unloading.get(name)
            if adapter is None:
                raise InvalidArgumentError(f"no LoRA adapter named {name!r} is loaded "
                                           f"({', '.join(sorted(self._by_name)) or 'none'})")
            self._unloading[name] = adapter
            self._scales.pop(name, None)
            self._ids.pop(name, None)
            return adapter

    def resolving(self, adapter: LoraAdapter) -> int:
        """Requests resolved with ``adapter`` and not queued yet."""
        with self._lock:
            return self._resolving.get(adapter, 0)

    def end_unload(self, name: str, adapter: LoraAdapter) -> bool:
        """The unload of ``name`` is done; returns whether the server loaded the adapter (and closes it)."""
        with self._lock:
            self._unloading.pop(name, None)
            owned = adapter in self._owned
            self._owned.discard(adapter)
            return owned

    def clear(self) -> set[LoraAdapter]:
        """Serve nothing more; returns the adapters the server loaded (to close)."""
        with self._lock:
            owned, self._owned = self._owned, set()
            self._by_name.clear()
            return owned

    def _with_ids(self, spec: dict[Any, Any]) -> dict[Any, Any]:
        """``spec`` with adapter ids replaced by the adapters (the caller holds the lock)."""
        if not any(isinstance(k, int) and not isinstance(k, bool) for k in spec):
            return spec
        by_id = {self._ids[name]: a for name, a in self._by_name.items()}
        out: dict[Any, Any] = {}
        for key, scale in spec.items():
            if isinstance(key, int) and not isinstance(key, bool):
                if key not in by_id:
                    raise InvalidArgumentError(f"lora: no adapter with id {key} "
                                               f"(ids: {', '.join(map(str, sorted(by_id))) or 'none is loaded'})")
                key = by_id[key]
            out[key] = scale
        return out
