"""Third-level prompt cache: the RAM tier's states also kept in files, so they outlive the process.

A server (or a script that makes an ``lc.Server`` at each run) with a long system prompt pays its whole
prefill at every start: Gemma 3 270M on 2 cores reads 1k tokens in ~2 s, where a saved state of them is
~20 MB that a restore reads back in a few ms. llama-server has no such tier (its ``--cache-ram`` is lost
with the process; ``--slot-save-path`` files are saved and restored by hand).

Every state the RAM tier stores is written here too, on a thread of its own (a write never holds up a
tick), and a lookup that the RAM tier cannot serve as far is tried here. A directory holds one
namespace per *key*: the model file and the context settings the states depend on (``key_for``), so
that a state is only ever restored into the computation that made it. Files are written whole or not at
all (a temporary name, then a rename), carry a checksum of their state, and are checked before any byte
reaches llama.cpp; a file that fails is skipped and removed. The directory is bounded in bytes: the
least recently used files (by modification time, touched at each hit) go first, also across restarts.

Not kept on disk: states computed under LoRA adapters (their tag names adapters by the ids of this
process) and prompts with images or audio (their placeholders stand for media a projector encoded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from .prompt_cache import NODE_BYTES, Entry, PromptCache

logger = logging.getLogger(__name__)

__all__ = ["DiskPromptCache", "key_for"]

MAGIC = b"LLAMA_CTYPES_PROMPT_STATE\x001\n"
SUFFIX = ".lcstate"
_HEAD = struct.Struct("<IQQIQ")  # header: floor, n_tokens, state bytes, crc32 of the state, crc32 of the tokens
#: A temporary file older than this (seconds) is a write that never finished: removed when a cache opens.
STALE_WRITE_S = 600.0
#: States waiting to be written, at most (bytes): past this a put is not written (the RAM tier still has it).
MAX_PENDING_BYTES = 512 * 2**20


def key_for(model_path: str | os.PathLike, settings: dict[str, Any]) -> str:
    """The namespace of the states computed by the model file at ``model_path`` under ``settings`` (the
    context's parameters that change what its KV cells hold or how a state is laid out): the file's real
    path, size and modification time, and the settings, hashed."""
    path = Path(model_path).resolve()
    try:
        st = path.stat()
    except OSError as exc:
        raise InvalidArgumentError(f"the disk prompt cache cannot identify the model file {str(path)!r}: {exc}") \
            from exc
    ident = json.dumps({"model": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                        "settings": settings}, sort_keys=True, default=repr)
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


@dataclass(eq=False)
class _OnDisk:
    """An index entry's state: the file that holds it (``len()``: its bytes, for the byte budget)."""

    path: Path
    nbytes: int

    def __len__(self) -> int:
        return self.nbytes


class DiskPromptCache:
    """Sequence states in files under ``directory/key``, at most ``budget_bytes`` of them, looked up by
    longest common prefix as the RAM tier is. Thread safety: :meth:`put`, :meth:`find` and :meth:`load` may
    be called from any thread (the scheduler's, in a server); writes happen on a thread of this object's own."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, key: str):
        if budget_bytes <= 0:
            raise InvalidArgumentError("the disk prompt cache needs a budget > 0 bytes")
        self.directory = Path(directory) / key
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            # (only this user: llama.cpp reads these states back, checked against damage, not against forgery)
            self.directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(f"prompt cache directory {str(directory)!r}: {exc}") from exc
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise InvalidArgumentError(f"prompt cache directory {str(self.directory)!r} is not writable")
        self._lock = threading.Lock()  # the index
        self._index = PromptCache(budget_bytes, on_evict=self._evicted)
        self.hits = self.writes = self.skipped = self.failed = 0
        self._pending: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._writer: threading.Thread | None = None
        self._closed = False
        self._scan()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used(self) -> int:
        """Bytes of the files indexed (and the index's approximate size)."""
        return self._index.used

    # ---- reading ----------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the files a previous run left, least recently used first (so that the budget drops those)."""
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                found.append((path.stat().st_mtime_ns, path))
            except OSError:
                continue
        for _, path in sorted(found):
            head = self._read_head(path)
            if head is None:
                self._unlink(path)
                continue
            tokens, floor, nbytes = head
            with self._lock:
                kept = self._index.put(tokens, _OnDisk(path, nbytes), floor=floor)
            if not kept:  # (larger than the whole budget)
                self._unlink(path)
        now = time.time()
        for stale in self.directory.glob("*.tmp"):  # (a write a process did not finish; not one going on now)
            try:
                if now - stale.stat().st_mtime > STALE_WRITE_S:
                    stale.unlink()
            except OSError:
                pass

    @staticmethod
    def _read_head(path: Path) -> tuple[list[int], int, int] | None:
        """(tokens, floor, file bytes) from a file's header, or None when it is not a whole state file."""
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                floor, n_tokens, n_state, _, crc_tokens = _HEAD.unpack(f.read(_HEAD.size))
                raw = f.read(4 * n_tokens) if n_tokens <= 2**24 else b""
                size = os.fstat(f.fileno()).st_size
        except (OSError, struct.error):
            return None
        if n_tokens == 0 or len(raw) != 4 * n_tokens or zlib.crc32(raw) != crc_tokens \
                or size != len(MAGIC) + _HEAD.size + 4 * n_tokens + n_state:
            return None
        tokens = np.frombuffer(raw, dtype="<i4").tolist()
        if min(tokens) < 0:
            return None
        return tokens, floor, size

    def find(self, prompt: list[int], exact_only: bool = False) -> tuple[Entry | None, int]:
        """The file sharing the longest prefix with ``prompt`` (as :meth:`PromptCache.lookup`) and that prefix's
        length, from the index (nothing is read: see :meth:`load`)."""
        with self._lock:
            return self._index.lookup(prompt, exact_only=exact_only)

    def load(self, found: Entry) -> Entry | None:
        """``found`` (from :meth:`find`) read back and checked: an Entry whose ``state`` is the bytes; None when
        its file fails its checks (then it is removed)."""
        state = self._read_state(found)
        if state is None:
            with self._lock:
                if self._index.contains(found.tokens):
                    self._index.remove(found)
            self._unlink(found.state.path)
            self.failed += 1
            return None
        self.hits += 1
        try:
            os.utime(found.state.path)  # (recently used: kept longest, also by the next process)
        except OSError:
            pass
        return Entry(found.tokens, state, found.tag, found.floor)

    @staticmethod
    def _read_state(entry: Entry) -> bytes | None:
        try:
            with open(entry.state.path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        start = len(MAGIC) + _HEAD.size
        if len(data) != entry.state.nbytes or not data.startswith(MAGIC):
            return None
        floor, n_tokens, n_state, crc_state, _ = _HEAD.unpack_from(data, len(MAGIC))
        body = start + 4 * n_tokens
        if n_tokens != len(entry.tokens) or floor != entry.floor or len(data) != body + n_state \
                or np.frombuffer(data, dtype="<i4", count=n_tokens, offset=start).tolist() != list(entry.tokens):
            return None
        state = data[body:]
        return state if zlib.crc32(state) == crc_state else None

    # ---- writing ----------------------------------------------------------------------------------------

    def put(self, tokens: list[int], state: Any, floor: int = 0) -> bool:
        """Write ``tokens``' ``state`` (a C-contiguous bytes-like object) to a file, on the writer thread; False
        when not queued (media placeholders in ``tokens``, already on disk, too much waiting, or closed)."""
        key = tuple(tokens)
        if not key or self._closed or min(key) < 0:
            return False
        state = memoryview(state).cast("B")  # (no copy: a stored state is never written to again)
        with self._lock:
            if self._index.contains(key) or self._pending_bytes + len(state) > MAX_PENDING_BYTES:
                self.skipped += 1
                return False
            self._pending_bytes += len(state)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="llama_ctypes-prompt-disk",
                                                daemon=True)
                self._writer.start()
        self._pending.put((key, state, floor))
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._pending.get()
            if job is None:
                return
            key, state, floor = job
            try:
                self._write(key, state, floor)
            except Exception as exc:  # (a full disk: the RAM tier still serves; the writer goes on)
                logger.warning("prompt cache: could not write a state to %s: %s", self.directory, exc)
                self.failed += 1
            finally:
                with self._lock:
                    self._pending_bytes -= len(state)
                self._pending.task_done()

    def _write(self, key: tuple[int, ...], state: bytes, floor: int) -> None:
        raw = np.asarray(key, dtype="<i4").tobytes()
        name = hashlib.sha256(raw).hexdigest()[:32]
        path = self.directory / (name + SUFFIX)
        tmp = self.directory / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        head = MAGIC + _HEAD.pack(floor, len(key), len(state), zlib.crc32(state), zlib.crc32(raw))
        if len(head) + len(raw) + len(state) + len(key) * NODE_BYTES > self._index.budget:
            self.skipped += 1  # (it alone would not fit)
            return
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(raw)
                f.write(state)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)  # (a full disk: what was written of it goes)
            raise
        with self._lock:
            self._index.put(list(key), _OnDisk(path, len(head) + len(raw) + len(state)), floor=floor)
        self.writes += 1

    def _evicted(self, entry: Entry) -> None:
        self._unlink(entry.state.path)

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def flush(self) -> None:
        """Wait until every queued state is written."""
        if self._writer is not None:
            self._pending.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (the files stay)."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join()

