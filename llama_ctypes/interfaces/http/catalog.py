"""The models a server may serve, loaded or not: llama-server's router mode over the ModelManager.

Every model of ``--config`` (and every GGUF of ``--models-dir``) is an entry. Entries load at start
unless they say ``load = false`` (those of ``--models-dir`` wait to be used); ``POST /models/load``
and ``/models/unload`` load and free them while serving; a request naming an entry that is not
loaded loads it first (unless ``--no-models-autoload``). With ``--models-max N`` at most N models
are loaded: loading another first frees the least recently used idle one (a model serving requests
is never freed under them; when all N are busy, the load is refused with 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping

import anyio

from ...engines.manager import ModelManager
from ...errors import AlreadyLoadedError
from .errors import BadRequest, NotFound, Unavailable

logger = logging.getLogger(__name__)

#: Seconds after its last request during which a model is not evicted for another (``--models-max``).
EVICTION_GRACE_S = 1.0


@dataclass
class CatalogEntry:
    """One model the server knows: how to load it (``ModelManager.load`` arguments, ``source`` included)."""

    id: str
    load: dict[str, Any]
    aliases: tuple[str, ...] = ()
    autoload: bool = True  # loaded at start (an entry of --models-dir waits to be used)


@dataclass
class Catalog:
    """The entries, the cap on loaded models, and when each was last used (for LRU eviction)."""

    manager: ModelManager
    entries: dict[str, CatalogEntry] = field(default_factory=dict)
    max_loaded: int | None = None
    autoload: bool = True  # a request naming an unloaded entry loads it
    _used: dict[str, float] = field(default_factory=dict)
    _failed: dict[str, str] = field(default_factory=dict)  # why an entry's last load failed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError(f"max_loaded={self.max_loaded!r}: expected a positive number of models (or None)")

    def add(self, entry: CatalogEntry) -> None:
        if entry.id in self.entries:
            raise ValueError(f"two models are named {entry.id!r}")
        self.entries[entry.id] = entry

    def find(self, name: str | None) -> CatalogEntry | None:
        """The entry a name (id or alias) means, loaded or not."""
        if not name:
            return None
        entry = self.entries.get(name)
        if entry is None:
            entry = next((e for e in self.entries.values() if name in e.aliases), None)
        return entry

    def touch(self, model_id: str) -> None:
        self._used[model_id] = time.monotonic()

    def status(self, model_id: str) -> str:
        """llama-server's model status: ``loaded``, ``loading``, ``unloaded`` or ``failed``."""
        try:
            info = self.manager.info(model_id)
        except KeyError:
            return "failed" if model_id in self._failed else "unloaded"
        return {"ready": "loaded", "loading": "loading", "failed": "failed"}.get(info.status, info.status)

    def busy(self, model_id: str) -> bool:
        """Whether a model runs or queues requests now (a direct-mode or unready one: never)."""
        try:
            server = self.manager.server(model_id)
        except Exception:  # (a direct-mode model, or one not ready: nothing of its runs through a server)
            return False
        stats = server.stats()
        return bool(stats.get("active_slots") or stats.get("queue_length"))

    def load(self, model_id: str) -> Future:
        """Start loading an entry (a Future of its ModelInfo), freeing the least recently used idle model
        first when the cap is reached. NotFound for an unknown id; Unavailable when all are busy.

        Blocking (an eviction closes a model): call it from a worker thread, not the event loop. A
        model used in the last :data:`EVICTION_GRACE_S` seconds counts as busy: a request that has
        just picked it may not have reached its server yet."""
        entry = self.entries.get(model_id)
        if entry is None:
            raise NotFound(f"the model {model_id!r} is not in this server's catalog", param="model")
        with self._lock:
            loaded = [i.id for i in self.manager.list()]
            if model_id in loaded:
                raise AlreadyLoadedError(f"the model {model_id!r} is already {self.status(model_id)}",
                                         model_id=model_id)
            if self.max_loaded is not None and len(loaded) >= self.max_loaded:
                now = time.monotonic()
                idle = sorted((m for m in loaded if self.status(m) != "loading" and not self.busy(m)
                               and now - self._used.get(m, 0.0) >= EVICTION_GRACE_S),
                              key=lambda m: self._used.get(m, 0.0))
                if not idle:
                    raise Unavailable(f"{len(loaded)} models are loaded (--models-max {self.max_loaded}) and all "
                                      "are in use: try again when one is idle")
                logger.info("unloading %r (least recently used) to load %r", idle[0], model_id)
                self.manager.unload(idle[0])
            self.touch(model_id)
            self._failed.pop(model_id, None)
            future = self.manager.load(**{**entry.load, "id": model_id}, wait=False)
        future.add_done_callback(lambda f: self._settled(model_id, f))
        return future

    def _settled(self, model_id: str, future: Future) -> None:
        """A failed load leaves the catalog entry ``failed`` (with its reason) and the manager without it,
        so one broken file does not keep the whole server unhealthy; ``/models/load`` tries again."""
        error = None if future.cancelled() else future.exception()
        if error is None:
            return
        self._failed[model_id] = str(error)
        try:
            self.manager.unload(model_id)
        except (KeyError, Exception):  # (already gone, or the manager is closing)
            pass

    def failure(self, model_id: str) -> str | None:
        """Why the entry's last load failed (None: it did not)."""
        return self._failed.get(model_id)

    def unload(self, model_id: str) -> None:
        try:
            self.manager.unload(model_id)
        except KeyError:
            raise BadRequest(f"the model {model_id!r} is not loaded", param="model") from None

    async def ensure(self, name: str | None) -> None:
        """Load the entry a request names when it is not loaded (and autoload is on), and wait for it.

        An entry whose last load failed is not tried again on a request (a client cannot make the server
        retry a broken file in a loop): 503 naming the reason, until ``/models/load``."""
        entry = self.find(name)
        if entry is None:
            return
        status = self.status(entry.id)
        if status == "failed" and entry.id in self._failed:
            raise Unavailable(f"the model {entry.id!r} failed to load: {self._failed[entry.id]} "
                              "(POST /models/load tries again)", code="model_failed")
        if status == "loaded" or not self.autoload:
            return
        if status == "unloaded":
            try:
                future = await anyio.to_thread.run_sync(self.load, entry.id)
            except AlreadyLoadedError:  # (another request started it meanwhile)
                return await self._wait(entry.id)
            try:
                await asyncio.wrap_future(future)
            except Exception as exc:  # noqa: BLE001 - the reason goes to the client, the entry stays failed
                raise Unavailable(f"the model {entry.id!r} failed to load: {exc}", code="model_failed") from None
        elif status == "loading":
            await self._wait(entry.id)

    async def _wait(self, model_id: str, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while self.status(model_id) == "loading" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def describe(self, model_id: str) -> Mapping[str, Any]:
        """llama-server's ``status`` object of a model (with ``failed``: the reason)."""
        entry = self.entries.get(model_id)
        source = entry.load.get("source") if entry is not None else None
        out: dict[str, Any] = {"value": self.status(model_id), "args": [str(source)] if source is not None else []}
        if out["value"] == "failed" and model_id in self._failed:
            out["error"] = self._failed[model_id]
        return out
