"""The models a server may serve, loaded or not: llama-server's router mode over the ModelManager.

Every model of ``--config`` (and every GGUF of ``--models-dir``) is an entry. Entries load at start
unless they say ``load = false`` (those of ``--models-dir`` wait to be used); ``POST /models/load``
and ``/models/unload`` load and free them while serving; a request naming an entry that is not
loaded loads it first (unless ``--no-models-autoload``). With ``--models-max N`` at most N models
are loaded: loading another first frees the least recently used idle one (a model serving requests
is never freed under them; when all N are busy, the load is refused with 503).

The catalog owns each entry's state; the manager holds the models. An entry is ``loading``, ``loaded`` or
``failed`` while the manager has it, else ``failed`` when its last load failed, else ``unloaded``. Every
change (a load started, an unload, a load's end) happens under the catalog's lock, and a load's end counts
only while that load is still the entry's current one: an unload (``/models/unload``, a sleep, an
eviction) or a newer load supersedes it. So an unload during a load returns the entry to ``unloaded``,
never ``failed``; a request waiting for that load starts another (autoload) instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import anyio

from ...engines.manager import LoadCancelledError, ModelManager
from ...errors import AlreadyLoadedError, ClosedError
from .errors import BadRequest, NotFound, Unavailable

logger = logging.getLogger(__name__)

#: Seconds after its last request during which a model is not evicted for another (``--models-max``).
EVICTION_GRACE_S = 1.0
#: Loads a request starts for its model when unloads keep stopping them, before it is answered 503.
AUTOLOAD_TRIES = 3
#: Outside router mode (no ``/models/load``): seconds after a failed load before a request tries again.
FAILED_LOAD_RETRY_S = 10.0


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
    #: Seconds after a failed load from which a request tries the entry again; None: never on a request
    #: (router mode: ``/models/load`` does). A server of one model has no ``/models/load``: a wake-up from
    #: ``--sleep-idle-seconds`` that failed (the file briefly gone, the GPU memory taken) must not leave it
    #: answering 503 until it is restarted.
    retry_failed_after: float | None = None
    #: The entries anew, with the HTTP settings of each (``--models-preset``, ``--models-dir``): for :meth:`reload`.
    source: Callable[[], tuple[list[CatalogEntry], Mapping[str, Any]]] | None = None
    _used: dict[str, float] = field(default_factory=dict)
    _failed: dict[str, str] = field(default_factory=dict)  # why an entry's last load failed
    _failed_at: dict[str, float] = field(default_factory=dict)  # when (time.monotonic())
    _loads: dict[str, Future] = field(default_factory=dict)  # each entry's current load (its end counts)
    _lock: threading.RLock = field(default_factory=threading.RLock)

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
        if not self.manager.loaded(model_id):  # (never wait here for a load: the event loop calls this)
            return False
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
        with self._lock:
            entry = self.entries.get(model_id)
            if entry is None:
                raise NotFound(f"the model {model_id!r} is not in this server's catalog", param="model")
            infos = self.manager.list()
            loaded = [i.id for i in infos]
            if any(i.id == model_id and i.status != "failed" for i in infos):  # (a failed one is loaded anew)
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
                self._loads.pop(idle[0], None)
                self.manager.unload(idle[0])
            self.touch(model_id)
            self._failed.pop(model_id, None)
            future = self.manager.load(**{**entry.load, "id": model_id}, wait=False)
            self._loads[model_id] = future
        future.add_done_callback(lambda f: self._settled(model_id, f))
        return future

    def _settled(self, model_id: str, future: Future) -> None:
        """A load's end. A failed load leaves the entry ``failed`` (with its reason) and the manager without
        it, so one broken file does not keep the whole server unhealthy; ``/models/load`` tries again. A load
        stopped by an unload, or superseded by a newer load, changes nothing: the unload (or the newer load)
        already decided the entry's state."""
        error = None if future.cancelled() else future.exception()
        with self._lock:
            if self._loads.get(model_id) is not future:
                return
            if error is None:
                return
            del self._loads[model_id]
            if isinstance(error, ClosedError):  # (unloaded, cancelled, or the manager closed: not a failure)
                return
            self._failed[model_id] = str(error)
            self._failed_at[model_id] = time.monotonic()
            try:  # (this load is the entry's current one, so the manager's entry is the failed one)
                self.manager.unload(model_id)
            except Exception:  # noqa: BLE001 - already gone, or the manager is closing
                pass

    def reload(self) -> Mapping[str, Any] | None:
        """Read the entries again from :attr:`source` (llama-server's ``GET /models?reload=1``) and return
        their settings (None: no source, nothing changed). As llama-server: a model no longer listed is
        unloaded (or its load stopped) and removed; one whose load options changed is unloaded, to load
        with the new ones when next used; a new one is added, not loaded; every failed entry may load again.

        Blocking (the source reads files, an unload closes a model): call it from a worker thread."""
        if self.source is None:
            return None
        entries, settings = self.source()
        fresh = {e.id: e for e in entries}
        with self._lock:
            for model_id, old in self.entries.items():
                new = fresh.get(model_id)
                if new is not None and new.load == old.load:
                    continue
                self._loads.pop(model_id, None)
                try:
                    self.manager.unload(model_id)
                    logger.info("(reload) unloaded %r: %s", model_id, "its options changed" if new else "removed")
                except KeyError:  # (not loaded)
                    pass
                if new is None:
                    self._used.pop(model_id, None)
            self._failed.clear()
            self.entries = fresh  # (a new dict: readers iterating the old one are not disturbed)
        return settings

    def failure(self, model_id: str) -> str | None:
        """Why the entry's last load failed (None: it did not)."""
        return self._failed.get(model_id)

    def unload(self, model_id: str) -> None:
        """Free a model, or stop its load: the entry is ``unloaded`` at once (BadRequest when it was not
        loaded). Blocking (a model is closed): call it from a worker thread."""
        with self._lock:
            self._loads.pop(model_id, None)
            try:
                self.manager.unload(model_id)
            except KeyError:
                raise BadRequest(f"the model {model_id!r} is not loaded", param="model") from None

    async def ensure(self, name: str | None) -> None:
        """Load the entry a request names when it is not loaded (and autoload is on), and wait for it.

        An entry whose last load failed is not tried again on a request (a client cannot make the server
        retry a broken file in a loop): 503 naming the reason, until ``/models/load``. A load that an
        unload stopped is started again, up to :data:`AUTOLOAD_TRIES` times; after that the router answers
        503 (not loaded). The load goes on when the client leaves: others may wait for it."""
        entry = self.find(name)
        if entry is None:
            return
        for _ in range(AUTOLOAD_TRIES):
            status = self.status(entry.id)
            if status == "failed" and entry.id in self._failed:
                retry = self.retry_failed_after
                if retry is None:
                    raise Unavailable(f"the model {entry.id!r} failed to load: {self._failed[entry.id]} "
                                      "(POST /models/load tries again)", code="model_failed")
                left = self._failed_at.get(entry.id, 0.0) + retry - time.monotonic()
                if left > 0:
                    raise Unavailable(f"the model {entry.id!r} failed to load: {self._failed[entry.id]} (a request "
                                      f"tries again in {left:.0f} s)", code="model_failed")
                with self._lock:
                    self._failed.pop(entry.id, None)
                continue
            if status == "loaded" or not self.autoload:
                return
            if status == "loading":
                await self._wait(entry.id)
                continue
            if status != "unloaded":  # (failed in the manager: it lost an RPC worker; the router says so)
                return
            try:
                future = await anyio.to_thread.run_sync(self.load, entry.id)
            except AlreadyLoadedError:  # (another request started it meanwhile)
                continue
            except NotFound:  # (removed from the catalog meanwhile: the router answers for the name)
                return
            try:
                await asyncio.shield(asyncio.wrap_future(future))
                return
            except LoadCancelledError:  # (unloaded before it was ready: load it again)
                continue
            except ClosedError:  # (the server is closing)
                raise Unavailable("the server is shutting down") from None
            except Exception as exc:  # noqa: BLE001 - the reason goes to the client, the entry stays failed
                raise Unavailable(f"the model {entry.id!r} failed to load: {exc}", code="model_failed") from None

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
