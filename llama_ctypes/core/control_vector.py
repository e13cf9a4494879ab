"""Control vectors: per-layer directions added to a model's hidden state (llama.cpp's ``cvec``).

A control-vector GGUF (llama.cpp's ``cvector-generator`` writes them) holds one F32 tensor
``direction.<layer>`` of ``n_embd`` floats per layer (layer 0 never has one). Several files, each
with a strength, are summed, as llama.cpp's ``common_control_vector_load`` does; llama.cpp then
adds the result to the output of the chosen layers (``llama_set_adapter_cvec``). The files are read
with the ``gguf`` package (llama.cpp's own reader, from the package index: ``pip install
llama-ctypes[control-vectors]``, included in the ``server`` extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError, ModelLoadError
from .gguf_file import check_gguf_file

__all__ = ["ControlVector", "load_control_vector"]


@dataclass(frozen=True, eq=False)
class ControlVector:
    """Directions for layers 1.. (row ``i`` is layer ``i + 1``), ``n_embd`` floats each, applied to
    layers ``layer_start``..``layer_end`` (inclusive; 1-based as llama.cpp's ``--control-vector-layer-range``;
    None: from layer 1 to the model's last). Apply it with ``lease.set_control_vector`` or
    ``control_vector=`` on a call; compared by identity (the KV cache remembers which one computed what)."""

    data: np.ndarray
    layer_start: int | None = None
    layer_end: int | None = None
    sources: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        data = np.array(self.data, dtype=np.float32, order="C")  # (a copy of its own, read-only below)
        if data.ndim != 2 or data.shape[1] == 0:
            raise InvalidArgumentError(f"a control vector is (layers, n_embd) floats, got shape {self.data.shape}")
        if not np.isfinite(data).all():
            raise InvalidArgumentError("a control vector holds NaN or infinite values")
        data.setflags(write=False)  # (compared by identity: changing it in place would go unnoticed)
        object.__setattr__(self, "data", data)
        for name in ("layer_start", "layer_end"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"{name}={value!r}: expected a layer number >= 1 or None")
        if self.layer_start is not None and self.layer_end is not None and self.layer_start > self.layer_end:
            raise InvalidArgumentError(f"layer range {self.layer_start}..{self.layer_end} is empty")

    @property
    def n_embd(self) -> int:
        return int(self.data.shape[1])

    def layers(self, n_layer: int) -> tuple[int, int]:
        """The inclusive layer range for a model of ``n_layer`` layers (llama.cpp's defaults: 1..n_layer)."""
        return (self.layer_start or 1, self.layer_end or n_layer)

    def __repr__(self) -> str:
        return (f"<ControlVector {len(self.data)} layers x {self.n_embd} "
                f"layers {self.layer_start or 1}..{self.layer_end or 'last'}>")


def _read_one(path: Path, strength: float) -> np.ndarray:
    try:
        from gguf import GGMLQuantizationType, GGUFReader
    except ImportError:
        raise ImportError("reading control-vector files needs the gguf package: "
                          "pip install 'llama-ctypes[control-vectors]'") from None
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # (the reader raises ValueError and friends on a malformed file)
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    rows: dict[int, np.ndarray] = {}
    n_embd = None
    for tensor in reader.tensors:
        prefix, _, index = tensor.name.partition(".")
        if prefix != "direction" or not index.isdigit() or int(index) == 0:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} is not a control vector direction "
                                 "('direction.<layer>', layer >= 1)")
        if tensor.tensor_type != GGMLQuantizationType.F32 or len([d for d in tensor.shape if d != 1]) > 1:
            raise ModelLoadError(f"{path}: direction tensor {tensor.name!r} is not a 1-D F32 tensor")
        values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        if n_embd is None:
            n_embd = values.size
        elif values.size != n_embd:
            raise ModelLoadError(f"{path}: direction tensors of {n_embd} and {values.size} floats")
        layer = int(index)
        rows[layer] = rows.get(layer, 0) + values * strength  # (several directions of one layer add up)
    if not rows:
        raise ModelLoadError(f"{path}: no direction tensors")
    out = np.zeros((max(rows), n_embd), dtype=np.float32)  # (no row for layer 0)
    for layer, values in rows.items():
        out[layer - 1] += values
    return out


def load_control_vector(files: Any, layer_range: tuple[int, int] | None = None) -> ControlVector:
    """Read control-vector GGUF files and sum them: ``files`` is a path, a ``(path, strength)`` pair,
    or a list of them (strength 1.0 by default). ``layer_range``: the inclusive layers to apply to
    (1-based; default all). Raises ModelLoadError for a file that is not a control vector, and when
    the files disagree on ``n_embd``."""
    if isinstance(files, (str, os.PathLike)) or (isinstance(files, tuple) and len(files) == 2
                                                   and isinstance(files[1], (int, float))):
        files = [files]
    if not isinstance(files, Sequence) or not files:
        raise ArgumentTypeError("files: expected a path, a (path, strength) pair or a list of them")
    total: np.ndarray | None = None
    names = []
    for item in files:
        path, strength = (item, 1.0) if isinstance(item, (str, os.PathLike)) else item
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not np.isfinite(strength):
            raise InvalidArgumentError(f"{path}: the strength must be a finite number, got {strength!r}")
        checked = check_gguf_file(path)
        rows = _read_one(checked, float(strength))
        if total is None:
            total = rows
        else:
            if rows.shape[1] != total.shape[1]:
                raise ModelLoadError(f"{path}: directions of {rows.shape[1]} floats, the other files "
                                     f"{total.shape[1]}")
            if len(rows) > len(total):
                total = np.vstack([total, np.zeros((len(rows) - len(total), total.shape[1]), np.float32)])
            total[:len(rows)] += rows
        names.append(str(checked))
    start, end = layer_range if layer_range is not None else (None, None)
    return ControlVector(total, start, end, tuple(names))  # type: ignore[arg-type]
