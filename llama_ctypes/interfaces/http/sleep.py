"""llama-server's ``--sleep-idle-seconds``: the models are freed after that long without work and loaded
again by the next request that needs one.

Work is a request to an API endpoint, but not those that only read the server's state (``/health``,
``/metrics``, ``GET /props``, ``GET /models`` and ``/v1/models``) or manage the models themselves
(``/models/load``, ``/models/unload``): those neither wake a sleeping server nor keep it awake, as in
llama-server; nor do unknown paths and the web page. While asleep, ``/props`` answers as when the
server fell asleep (``is_sleeping``: true) and ``/metrics`` shows the stats of that moment (the two
throughput gauges still cover the time since the previous scrape, so a scrape during sleep reports the
last work once).

Sleeping unloads every loaded model of the catalog. Waking loads them again (``Catalog.load``, the same
options) when the catalog has one model or does not load models on demand; in router mode with autoload
the request's own model is loaded by the router, as for any unloaded model. A model that cannot be
loaded again is left ``failed`` in the catalog (503 for its requests, ``/models/load`` tries again); the
others are served. A model loaded while asleep (``/models/load``, a ``/props?model=`` of an unloaded
one) ends the sleep as a request would, and a model's idle time starts when it becomes ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import anyio

from ...errors import AlreadyLoadedError, ClosedError
from .catalog import Catalog
from .errors import BadRequest

logger = logging.getLogger(__name__)

#: Paths that never wake the server: GETs that read its state, and the model management endpoints.
_READ_ONLY = frozenset({"/health", "/v1/health", "/metrics", "/props", "/models", "/v1/models"})
_MANAGING = frozenset({"/models/load", "/models/unload", "/v1/chat/completions/control",
                       "/tools", "/cors-proxy"})  # (the last two never touch a model)


def wakes(method: str, path: str) -> bool:
    """Whether a request to an API path is work (it wakes a sleeping server and keeps it awake)."""
    return path not in _MANAGING and not (method in ("GET", "HEAD") and path in _READ_ONLY)


class IdleSleep:
    """When to free the catalog's models and how to bring them back. Runs on the app's event loop.

    ``on_sleep`` is awaited just before the models are freed (to keep what the read-only endpoints
    show); ``on_wake(freed)`` once the server is awake again, with the ids of the models it had freed.
    """

    def __init__(self, catalog: Catalog, idle_s: float, *,
                 on_sleep: Callable[[], Awaitable[None]] | None = None,
                 on_wake: Callable[[list[str]], None] | None = None):
        if not (isinstance(idle_s, (int, float)) and 0 < idle_s < float("inf")):
            raise ValueError(f"idle_s={idle_s!r}: expected a positive number of seconds")
        self.catalog = catalog
        self.idle_s = float(idle_s)
        self.sleeping = False
        self._on_sleep = on_sleep
        self._on_wake = on_wake
        self._in_flight = 0
        self._last = time.monotonic()
        self._asleep: list[str] = []  # the models freed
        self._seen: frozenset[str] = frozenset()  # the models loaded at the last look
        self._lock: asyncio.Lock | None = None

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:  # (made on the loop that uses it)
            self._lock = asyncio.Lock()
        return self._lock

    async def enter(self) -> None:
        """A request that is work starts: wake the models first if they sleep. Pair with :meth:`leave`."""
        self._in_flight += 1
        try:
            if self.sleeping:
                async with self._guard():
                    if self.sleeping:
                        await self._wake()
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        self._in_flight -= 1
        self._last = time.monotonic()

    async def watch(self) -> None:
        """Put the models to sleep whenever nothing ran for ``idle_s`` seconds (until cancelled)."""
        poll = min(0.25, self.idle_s / 4)
        while True:
            await asyncio.sleep(poll)
            loaded = frozenset(self._loaded())
            if loaded - self._seen:  # (a model just became ready: its idle time starts now)
                self._last = time.monotonic()
            self._seen = loaded
            if self.sleeping:
                if loaded:  # (something loaded a model meanwhile, /models/load say: awake again)
                    async with self._guard():
                        if self.sleeping and self._loaded():
                            await self._wake()
                continue
            if self._in_flight or time.monotonic() - self._last < self.idle_s:
                continue
            async with self._guard():
                if not self.sleeping and not self._in_flight and time.monotonic() - self._last >= self.idle_s:
                    await self._sleep()

    def _loaded(self) -> list[str]:
        return [i.id for i in self.catalog.manager.list() if i.id in self.catalog.entries and i.status == "ready"]

    async def _sleep(self) -> None:
        loaded = self._loaded()
        if not loaded:
            return
        if any(self.catalog.busy(m) for m in loaded):  # (work that did not come over HTTP)
            self._last = time.monotonic()
            return
        self.sleeping = True  # (first: a request arriving meanwhile waits for the lock, then wakes)
        if self._on_sleep is not None:
            try:
                await self._on_sleep()
            except Exception:  # (what the read-only endpoints show while asleep is a convenience)
                logger.exception("preparing the sleeping state failed")
        freed = []
        for model_id in loaded:
            try:
                await anyio.to_thread.run_sync(self.catalog.unload, model_id)
            except BadRequest:  # (unloaded meanwhile, /models/unload say: freed all the same)
                pass
            except Exception:
                logger.exception("freeing %r for the sleeping state failed", model_id)
                continue
            freed.append(model_id)
        self._asleep = freed
        if len(freed) < len(loaded):  # (a model still loaded: not asleep; its counters were never frozen)
            self._awake()
            return
        logger.info("server is entering sleeping state (idle for %g s): %s freed", self.idle_s, ", ".join(freed))

    async def _wake(self) -> None:
        catalog = self.catalog
        if len(catalog.entries) == 1 or not catalog.autoload:  # (router mode: requests load what they name)
            for model_id in self._asleep:
                await self._reload(model_id)
        self._awake()
        logger.info("server is exiting sleeping state")

    async def _reload(self, model_id: str) -> None:
        catalog = self.catalog
        if model_id not in catalog.entries or catalog.status(model_id) == "loaded":
            return
        try:
            if catalog.status(model_id) != "loading":
                future = await anyio.to_thread.run_sync(catalog.load, model_id)
                await asyncio.shield(asyncio.wrap_future(future))  # (a request's cancellation leaves the load)
        except AlreadyLoadedError:  # (loaded or loading meanwhile: wait for it below)
            pass
        except ClosedError:  # (unloaded meanwhile, or the server is closing: its next request loads it)
            return
        except Exception:  # noqa: BLE001 - the catalog keeps it failed; its requests hear why (503)
            logger.exception("loading %r again after sleeping failed", model_id)
            return
        deadline = time.monotonic() + 600
        while catalog.status(model_id) == "loading" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _awake(self) -> None:
        freed, self._asleep = self._asleep, []
        self.sleeping = False
        self._last = time.monotonic()
        if self._on_wake is not None:
            self._on_wake(freed)
