"""LoRA adapters: low-rank weight deltas loaded over a Model and applied per context by llama.cpp.

An adapter is loaded once per model (``model.load_lora(path)``) and applied to any number of
contexts with a scale each (``lease.set_loras({adapter: 1.0})``); llama.cpp adds ``scale * B·A``
to the targeted weights inside its graph, so no weight is touched here.

Lifetime: an adapter keeps its model alive, and every context that applies it keeps the adapter
alive. ``close()`` refuses (BusyError) while a context applies it; closing the model (or a server's
unload) frees its adapters once their last context lets go. llama.cpp frees adapters with their model: ours are
always freed first, by us.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ArgumentTypeError, BusyError, ClosedError, InvalidArgumentError, ModelLoadError
from .backend import clear_native_error, native_error
from .gguf_file import check_gguf_file
from .handle import NativeHandle

if TYPE_CHECKING:
    from .model import Model

logger = logging.getLogger(__name__)

#: Largest LoRA scale magnitude accepted: beyond it llama.cpp's float32 arithmetic only overflows.
MAX_LORA_SCALE = 1e4


class AdapterGuard:
    """A model's lock around llama.cpp's set of adapters (``Model.adapter_lock``): loading and freeing an
    adapter change the set; a context reserving its graph reads it. Not reentrant; a free asked for on
    the thread that holds it (a finalizer run by a log callback during a reserve) waits until the
    holder lets go, so the set never changes under an iteration."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._deferred: list[Any] = []

    def __enter__(self) -> "AdapterGuard":
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc: Any) -> None:
        pending, self._deferred = self._deferred, []
        self._owner = None
        self._lock.release()
        for fn in pending:
            self.run(fn)

    def run(self, fn: Any) -> None:
        """``fn()`` under the lock, or once this thread's hold ends if it holds the lock now."""
        if self._owner == threading.get_ident():
            self._deferred.append(fn)
            return
        with self:
            fn()


def _check_scale(key: Any, scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale \
            or not abs(float(scale)) <= MAX_LORA_SCALE:
        name = key if isinstance(key, (str, int)) else getattr(key, "name", key)
        raise InvalidArgumentError(f"lora: the scale of {name!r} must be a number within "
                                   f"[-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}], got {scale!r}")
    return float(scale)


__all__ = ["LoraAdapter", "AdapterGuard", "MAX_LORA_SCALE", "LoraSet", "LoraSpec", "lora_set", "resolve_loras",
           "check_lora_spec", "activation_start"]


def read_string(fn, *args, initial: int = 256) -> str | None:
    """Call a llama.cpp ``(…, char * buf, size_t size) -> length`` function, growing the buffer
    (model and adapter metadata); None when it answers -1."""
    size = initial
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1


class LoraAdapter(NativeHandle):
    """A LoRA adapter (``llama_adapter_lora``) loaded over a :class:`~llama_ctypes.Model`.

    Create with :meth:`Model.load_lora`. Thread-safe to share: any number of contexts may apply
    it at once. Attributes: ``name`` (given, else the file's ``general.name``, else the file stem),
    ``path``, ``alpha`` (``adapter.lora.alpha``; 0 when the file gives none: llama.cpp then scales
    by ``scale`` alone), ``architecture``, ``metadata`` (every scalar key of the file, as text) and
    ``invocation_tokens`` (an activated LoRA's trigger sequence; empty for a plain LoRA).
    """

    _kind = "LoraAdapter"

    def __init__(self, model: "Model", path: str | os.PathLike, name: str | None = None):
        super().__init__()
        self._ptr = None
        self.model = model
        self.path = Path(path)
        self._lib = model._lib
        self._applied = 0  # contexts that apply it now (guarded by self._lock)
        if name is not None and (not isinstance(name, str) or not name.strip()):
            self._mark_dead()
            raise InvalidArgumentError(f"name={name!r}: expected a non-empty string")
        try:
            file = check_gguf_file(self.path)
        except BaseException:
            self._mark_dead()
            raise
        model._acquire()
        try:
            with model.adapter_lock:  # (llama.cpp registers the adapter in the model's set of adapters)
                clear_native_error()
                ptr = self._lib.llama_adapter_lora_init(model._ptr, os.fsencode(file))
            if not ptr:
                raise ModelLoadError(f"could not load the LoRA adapter {file} over {model.path.name}: "
                                     f"{native_error('not a LoRA adapter of this model')}")
        except BaseException:
            self._mark_dead()
            model._release()
            raise
        self._ptr = ptr
        lib = self._lib
        self.metadata: dict[str, str] = {}
        for i in range(int(lib.llama_adapter_meta_count(ptr))):
            key = read_string(lib.llama_adapter_meta_key_by_index, ptr, i)
            if key is not None:
                self.metadata[key] = read_string(lib.llama_adapter_meta_val_str_by_index, ptr, i) or ""
        self.architecture: str = self.metadata.get("general.architecture", "")
        try:
            self.alpha = float(self.metadata.get("adapter.lora.alpha", "0") or 0)
        except ValueError:
            self.alpha = 0.0
        n = int(lib.llama_adapter_get_alora_n_invocation_tokens(ptr))
        tokens = lib.llama_adapter_get_alora_invocation_tokens(ptr) if n else None
        self.invocation_tokens: tuple[int, ...] = tuple(int(tokens[i]) for i in range(n)) if n else ()
        self.name: str = name.strip() if name is not None else (self.metadata.get("general.name") or file.stem)

    @property
    def is_alora(self) -> bool:
        """An activated LoRA: it applies from its ``invocation_tokens`` on (as llama-server does)."""
        return bool(self.invocation_tokens)

    def close(self) -> None:
        """Free the adapter. Raises :class:`BusyError` while a context applies it (set its scale
        elsewhere, or end those generations first); idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._applied:
                raise BusyError(f"the LoRA adapter {self.name!r} is applied by {self._applied} context(s)")
            self._closed = True  # (checked and set together: a context cannot start applying it between)
            free_now = self._users == 0 and not self._exclusive
        if free_now:
            self._do_free()

    def close_when_unused(self) -> None:
        """Close without refusing: free the adapter once the contexts that apply it let go (the model
        is closing, or a server unloads it)."""
        super().close()

    def _free(self) -> None:
        ptr, self._ptr = self._ptr, None
        lib, model = self._lib, self.model

        def free() -> None:
            if ptr:
                lib.llama_adapter_lora_free(ptr)
            model._release()  # (after: llama.cpp's free reaches into the model's set of adapters)

        model.adapter_lock.run(free)

    # ---- use by contexts (core/context.py) ----------------------------------------------------
    def applied_by_context(self, held: bool = False) -> None:
        """A context starts applying the adapter (it stays allocated until :meth:`released_by_context`).
        Raises ClosedError once it is closed."""
        with self._lock:
            if self._freed or (self._closed and not held):
                raise ClosedError(f"the LoRA adapter {self.name!r} is closed")
            self._users += 1
            self._applied += 1

    def released_by_context(self) -> None:
        with self._lock:
            self._applied -= 1
        self._release()

    def native(self):
        if self._ptr is None or self._freed:
            raise ClosedError("LoraAdapter is closed")
        return self._ptr

    def __repr__(self) -> str:
        kind = "aLoRA" if self.is_alora else "LoRA"
        return f"<LoraAdapter {self.name!r} ({kind}, alpha={self.alpha:g}) {'closed' if self._closed else 'open'}>"


#: A set of adapters with their scales, in a canonical order: what a context applies, and what
#: the KV it computes depends on (a prefix computed under one set is not reused under another).
LoraSet = tuple[tuple[LoraAdapter, float], ...]


def lora_set(loras: Mapping[Any, float] | None, model: "Model") -> LoraSet:
    """``{adapter: scale}`` checked and put in canonical order (zero scales dropped, as llama.cpp drops
    them). Adapters must be open and belong to ``model``."""
    if not loras:
        return ()
    if not isinstance(loras, Mapping):
        raise ArgumentTypeError(f"loras={loras!r}: expected a dict {{LoraAdapter: scale}}")
    out = []
    for adapter, scale in loras.items():
        if not isinstance(adapter, LoraAdapter):
            raise ArgumentTypeError(f"{adapter!r}: expected a LoraAdapter (from model.load_lora)")
        if adapter.model is not model:
            raise InvalidArgumentError(f"the LoRA adapter {adapter.name!r} was loaded over another model")
        if adapter.closed:
            raise ClosedError(f"the LoRA adapter {adapter.name!r} is closed")
        scale = _check_scale(adapter, scale)
        if scale != 0.0:
            out.append((adapter, scale))
    out.sort(key=lambda pair: id(pair[0]))
    return tuple(out)


#: What a caller names: ``{adapter or name: scale}``, one adapter or name (scale 1), or a list of them.
LoraSpec = Any


def check_lora_spec(spec: LoraSpec) -> None:
    """Check the shape of a ``lora=`` option without a model (names are resolved later)."""
    if spec is None:
        return
    items = spec.items() if isinstance(spec, Mapping) else \
        [(x, 1.0) for x in spec] if isinstance(spec, (list, tuple)) else [(spec, 1.0)]
    for key, scale in items:
        if isinstance(key, bool) or not isinstance(key, (str, int, LoraAdapter)) or (isinstance(key, str) and not key):
            raise ArgumentTypeError(f"lora: {key!r} is neither a LoraAdapter, an adapter's name nor its id")
        _check_scale(key, scale)


def resolve_loras(model: "Model", spec: LoraSpec, available: Any = None) -> LoraSet:
    """The :data:`LoraSet` a ``lora=`` option names: ``{adapter, name or id: scale}``, one of them
    (scale 1.0), a list of them, or None (no adapter). Names and ids (positions) are those of
    ``available`` (default ``model.loras``)."""
    check_lora_spec(spec)
    if spec is None:
        return ()
    items = spec.items() if isinstance(spec, Mapping) else \
        [(x, 1.0) for x in spec] if isinstance(spec, (list, tuple)) else [(spec, 1.0)]
    resolved: dict[LoraAdapter, float] = {}
    by_name: dict[str, list[LoraAdapter]] | None = None
    for key, scale in items:
        if isinstance(key, int):
            listed = model.loras if available is None else list(available)
            if not 0 <= key < len(listed):
                raise InvalidArgumentError(f"lora: no adapter with id {key} (ids 0 to {len(listed) - 1})"
                                           if listed else f"lora: no adapter with id {key} (none is loaded)")
            key = listed[key]
        elif isinstance(key, str):
            if by_name is None:
                by_name = {}
                for adapter in (model.loras if available is None else available):
                    by_name.setdefault(adapter.name, []).append(adapter)
            found = by_name.get(key, [])
            if not found:
                known = ", ".join(sorted(by_name)) or "none is loaded"
                raise InvalidArgumentError(f"lora: no adapter named {key!r} on {model.path.name} ({known})")
            if len(found) > 1:
                raise InvalidArgumentError(f"lora: {len(found)} adapters are named {key!r}; pass the adapter")
            key = found[0]
        if key in resolved:
            raise InvalidArgumentError(f"lora: the adapter {key.name!r} is named twice")
        resolved[key] = scale
    return lora_set(resolved, model)


def activation_start(loras: LoraSet, prompt: list[int]) -> int | None:
    """Where an activated LoRA starts applying in ``prompt``: the start of the last occurrence of its
    invocation tokens (``len(prompt)`` when they are absent: the adapter stays off), as llama-server
    does. None when ``loras`` is not made of activated LoRAs only (every adapter applies throughout).
    Raises InvalidArgumentError for several activated LoRAs at once (llama-server refuses them too)."""
    if not loras or not all(adapter.is_alora for adapter, _ in loras):
        return None
    if len(loras) > 1:
        raise InvalidArgumentError("lora: several activated LoRAs (aLoRA) cannot run in one request")
    seq = list(loras[0][0].invocation_tokens)
    n = len(seq)
    for i in range(len(prompt) - n, -1, -1):
        if prompt[i:i + n] == seq:
            return i
    return len(prompt)
