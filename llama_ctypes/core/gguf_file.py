"""Checks on a model path before llama.cpp sees it (a leaf: loading and memory estimates both use it)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError, ModelNotFoundError

__all__ = ["check_gguf_file"]

_GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: str | os.PathLike) -> Path:
    """path as a Path, after checking it names a GGUF file (clear errors before llama.cpp sees it)."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelNotFoundError(f"model path is a directory: {path}")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    return path
