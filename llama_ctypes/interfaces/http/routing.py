"""Which model serves a request: the request's ``model`` field → a ModelManager id.

With one model, any name routes to it (as llama-server does); with several (or in
router mode, several catalog entries, even with one loaded), the name must be a model id
(or an alias), and an unknown one is a 404. A missing
``model`` goes to the manager's default. A model still loading, or one that
failed to load, answers 503.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ...core.model import Model
from ...engines.manager import ModelInfo, ModelManager, ModelNotReadyError
from ...engines.server import Server
from .catalog import FAILED_LOAD_RETRY_S, Catalog
from .errors import BadRequest, NotFound, Unavailable

logger = logging.getLogger(__name__)

#: llama-server's template for a model that has none (llama.cpp's common/chat.cpp, CHATML_TEMPLATE_SRC).
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")


@dataclass(frozen=True)
class ModelSettings:
    """Per-model settings of the HTTP layer (the manager holds the rest)."""

    chat_template: str | None = None
    """Jinja source or a built-in format name; None = the model's own template."""
    aliases: tuple[str, ...] = ()
    """More names the ``model`` field may use (listed in /v1/models; may include the id itself)."""
    tags: tuple[str, ...] = ()
    """Labels listed with the model in /v1/models (llama-server's ``--tags``)."""


class Router:
    """Resolves model names and hands out the Server (generation) or the Model (embeddings, tokens)."""

    def __init__(self, manager: ModelManager, settings: Mapping[str, ModelSettings] | None = None,
                 catalog: Catalog | None = None):
        self.manager = manager
        self.settings = dict(settings or {})
        self.catalog = catalog if catalog is not None else Catalog(manager, retry_failed_after=FAILED_LOAD_RETRY_S)
        self._aliases = {alias: mid for mid, s in self.settings.items() for alias in s.aliases}
        self._fallback_logged: set[str] = set()

    def reload(self) -> bool:
        """Read the catalog's models again (``GET /models?reload=1``) and take their settings; False when the
        catalog has no source to read (nothing changed). Blocking: call it from a worker thread."""
        settings = self.catalog.reload()
        if settings is None:
            return False
        self.settings = dict(settings)
        self._aliases = {alias: mid for mid, s in self.settings.items() for alias in s.aliases}
        return True

    async def prepare(self, name: str | None) -> None:
        """Before resolving a request's model: load it when it is a catalog entry not loaded yet (autoload)."""
        await self.catalog.ensure(name)

    def resolve(self, name: str | None) -> ModelInfo:
        """The model a request names (raises NotFound, or Unavailable while it loads or after it failed)."""
        infos = {i.id: i for i in self.manager.list()}
        entry = self.catalog.find(name)
        if entry is not None and entry.id not in infos:
            raise Unavailable(f"the model {entry.id!r} is not loaded (POST /models/load loads it)",
                              code="model_not_loaded")
        if name in infos:
            info = infos[name]  # type: ignore[index]
        elif name in self._aliases and self._aliases[name] in infos:
            info = infos[self._aliases[name]]
        elif (len(infos) == 1 and len(self.catalog.entries) <= 1) or (not name and self.manager.default in infos):
            # (any name means the one model; but not in router mode, where a name is one of the catalog's)
            one = len(infos) == 1 and len(self.catalog.entries) <= 1
            info = next(iter(infos.values())) if one else infos[self.manager.default]  # type: ignore[index]
        else:
            known = ", ".join(sorted(infos)) or "none"
            raise NotFound(f"the model {name!r} does not exist (models: {known})", param="model")
        self.catalog.touch(info.id)
        if info.status == "loading":
            raise Unavailable(f"the model {info.id!r} is loading")
        if info.status == "failed":
            raise Unavailable(f"the model {info.id!r} failed: {info.error}", code="model_failed")
        return info

    def settings_of(self, model_id: str) -> ModelSettings:
        return self.settings.get(model_id, ModelSettings())

    def chat_template_of(self, model_id: str, model: Model) -> str | None:
        """The chat template requests to ``model_id`` use: the configured one, else the model's own (None),
        else llama-server's fallback, ChatML (logged once per model)."""
        configured = self.settings_of(model_id).chat_template
        if configured is not None or model.chat_template is not None:
            return configured
        if model_id not in self._fallback_logged:
            self._fallback_logged.add(model_id)
            logger.warning("model %r has no chat template: using ChatML, as llama-server does (set one with "
                           "--chat-template)", model_id)
        return CHATML

    def server(self, name: str | None) -> tuple[str, Server]:
        """The batching server of the model a generation request names."""
        info = self.resolve(name)
        if "generate" not in info.capabilities:
            raise BadRequest(f"the model {info.id!r} cannot generate text (it can {', '.join(info.capabilities)})",
                             param="model")
        if info.mode != "server":
            raise BadRequest(f"the model {info.id!r} is loaded in direct mode; generation over HTTP needs "
                             "mode='server'", param="model")
        return info.id, _server_of(self.manager, info.id)

    def model(self, name: str | None) -> tuple[str, Model]:
        """The :class:`Model` of the model a request names (for tokenizing)."""
        info = self.resolve(name)
        with _gone(info.id):
            if not self.manager.loaded(info.id):  # (unloaded since: not waiting for a new load of it)
                raise KeyError(info.id)
            return info.id, self.manager.model(info.id)

    def servers(self) -> dict[str, Server]:
        """Every ready server-mode model's server (for the metrics and /health)."""
        out = {}
        for info in self.manager.list():
            if info.status == "ready" and info.mode == "server":
                try:
                    out[info.id] = _server_of(self.manager, info.id)
                except Exception:  # unloaded in between
                    continue
        return out

    def server_stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for model_id, server in self.servers().items():
            if not server.closed:
                out[model_id] = server.stats()
        return out


def _server_of(manager: ModelManager, model_id: str) -> Server:
    # Only called for a model resolved ready; if it was unloaded since, its id is not waited for (a new
    # load of it may have started: the event loop must not wait for that).
    with _gone(model_id):
        if not manager.loaded(model_id):
            raise KeyError(model_id)
        return manager.server(model_id)


@contextlib.contextmanager
def _gone(model_id: str) -> Iterator[None]:
    """The manager's errors for a model unloaded (or reloading) since it was resolved, as responses (503:
    the name is right, the model is just not there now)."""
    try:
        yield
    except KeyError:
        raise Unavailable(f"the model {model_id!r} was unloaded", code="model_not_loaded") from None
    except ModelNotReadyError as e:
        raise Unavailable(f"the model {model_id!r} is not available: {e}") from None
