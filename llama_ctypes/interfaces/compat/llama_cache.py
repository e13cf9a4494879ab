"""llama-cpp-python's prompt caches for ``Llama.set_cache``: saved states keyed by the tokens they hold.

A completion looks up the state whose tokens share the longest prefix with its prompt, restores it if
that beats what the ``Llama``'s own context holds, and saves its state when it ends. (Without a cache
the pooled contexts keep their last prompts by themselves; a cache is for reuse across ``Llama``
objects, or across processes with :class:`LlamaDiskCache`.)
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

from ._session import LlamaState

__all__ = ["BaseLlamaCache", "LlamaCache", "LlamaRAMCache", "LlamaDiskCache"]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _state_bytes(state: LlamaState) -> int:
    return state.llama_state_size + state.input_ids.nbytes + state.scores.nbytes


class BaseLlamaCache:
    """The cache protocol: ``cache[tokens]`` (the state with the longest common prefix, KeyError when none
    shares a token), ``cache[tokens] = state``, ``tokens in cache``, ``cache_size`` (bytes)."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r}: expected a positive number of bytes")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()

    @property
    def cache_size(self) -> int:
        raise NotImplementedError

    def _keys(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def _find_longest_prefix_key(self, key: Sequence[int]) -> tuple[int, ...] | None:
        best, best_n = None, 0
        for k in self._keys():
            n = _common(k, key)
            if n > best_n:
                best, best_n = k, n
        return best

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(tuple(key)) is not None


class LlamaRAMCache(BaseLlamaCache):
    """States in memory, least recently used dropped past ``capacity_bytes`` (default 2 GiB)."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        super().__init__(capacity_bytes)
        self.cache_state: OrderedDict[tuple[int, ...], LlamaState] = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(_state_bytes(s) for s in self.cache_state.values())

    def _keys(self) -> list[tuple[int, ...]]:
        return list(self.cache_state)

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        with self._lock:
            found = self._find_longest_prefix_key(tuple(key))
            if found is None:
                raise KeyError("no cached state shares a prefix with these tokens")
            self.cache_state.move_to_end(found)
            return self.cache_state[found]

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if not isinstance(value, LlamaState):
            raise TypeError(f"a cache holds LlamaState values, not {type(value).__name__}")
        with self._lock:
            key = tuple(int(t) for t in key)
            self.cache_state.pop(key, None)
            self.cache_state[key] = value
            while self.cache_size > self.capacity_bytes and len(self.cache_state) > 1:
                self.cache_state.popitem(last=False)


#: llama-cpp-python's name for the RAM cache.
LlamaCache = LlamaRAMCache


class LlamaDiskCache(BaseLlamaCache):
    """States in a directory (``cache_dir``; default ``.cache/llama_cache``), one pickle file each, oldest
    dropped past ``capacity_bytes``. Pickles are code: point it only at a directory you own."""

    def __init__(self, cache_dir: str | os.PathLike = ".cache/llama_cache", capacity_bytes: int = 2 << 30) -> None:
        super().__init__(capacity_bytes)
        self.cache_dir = os.fspath(cache_dir)
        Path(self.cache_dir).mkdir(parents=True, exist_ok=True)

    def _file(self, key: tuple[int, ...]) -> Path:
        digest = hashlib.sha256(np.asarray(key, dtype=np.int64).tobytes()).hexdigest()[:32]
        return Path(self.cache_dir) / f"{digest}.llama_state"

    def _entries(self) -> list[Path]:
        return sorted(Path(self.cache_dir).glob("*.llama_state"), key=lambda p: p.stat().st_mtime)

    @property
    def cache_size(self) -> int:
        return sum(p.stat().st_size for p in self._entries())

    def _keys(self) -> list[tuple[int, ...]]:
        keys = []
        for path in self._entries():
            index = path.with_suffix(".tokens.npy")
            if index.exists():
                keys.append(tuple(np.load(index).tolist()))
        return keys

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        with self._lock:
            found = self._find_longest_prefix_key(tuple(key))
            if found is None:
                raise KeyError("no cached state shares a prefix with these tokens")
            path = self._file(found)
            with open(path, "rb") as f:
                state = pickle.load(f)
            os.utime(path)
            return state

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if not isinstance(value, LlamaState):
            raise TypeError(f"a cache holds LlamaState values, not {type(value).__name__}")
        with self._lock:
            key = tuple(int(t) for t in key)
            path = self._file(key)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            np.save(path.with_suffix(".tokens.npy"), np.asarray(key, dtype=np.int64))
            os.replace(tmp, path)
            entries = self._entries()
            total = sum(p.stat().st_size for p in entries)
            for old in entries[:-1]:
                if total <= self.capacity_bytes:
                    break
                total -= old.stat().st_size
                old.unlink(missing_ok=True)
                old.with_suffix(".tokens.npy").unlink(missing_ok=True)
