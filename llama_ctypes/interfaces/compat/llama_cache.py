"""llama-cpp-python's prompt caches, taken by ``Llama.set_cache``: prompt reuse is built in here."""

from __future__ import annotations

import os

__all__ = ["LlamaCache", "LlamaRAMCache", "LlamaDiskCache"]


class LlamaCache:
    """A marker: llama_ctypes keeps each pooled context's last prompt, so calls that extend it decode only
    the new tokens whatever cache is set; the object is accepted and kept, not filled."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        self.capacity_bytes = int(capacity_bytes)


class LlamaRAMCache(LlamaCache):
    pass


class LlamaDiskCache(LlamaCache):
    def __init__(self, cache_dir: str | os.PathLike = ".cache/llama_cache", capacity_bytes: int = 2 << 30) -> None:
        super().__init__(capacity_bytes)
        self.cache_dir = os.fspath(cache_dir)
