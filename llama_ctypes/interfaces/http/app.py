"""The Starlette app: routes, the error shape, the middleware and the app's lifetime.

    app = create_app(manager, api_key="secret", models={"chat": ModelSettings(chat_template="chatml")})
    uvicorn.run(app, host="127.0.0.1", port=8080)

Everything runs on one event loop: generation waits on the servers' async
streams, native work that would block (templating, tokenizing, embedding) runs
in worker threads, and concurrent requests meet in each model's batching server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import AsyncIterator, Mapping, Sequence

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from ...engines.manager import ModelManager
from .catalog import Catalog
from .common import MAX_BODY_BYTES, AppContext
from .cors import CorsPolicy
from .errors import APIError
from .limits import RequestLimits
from .media_urls import media_reader
from .metrics import Metrics
from .middleware import ServiceMiddleware
from .routes.chat import apply_template, chat_completions, control, input_tokens
from .routes.completions import completions
from .routes.embeddings import embeddings, rerank
from .routes.messages import count_tokens, messages
from .routes.native import completion, infill
from .routes.predict import make_predict
from .routes.responses import input_tokens as response_input_tokens
from .routes.responses import responses
from .routes.service import (
    detokenize,
    health,
    load_model,
    lora_adapters,
    lora_load,
    lora_unload,
    metrics,
    models,
    props,
    props_snapshot,
    slot_action,
    slots,
    tokenize,
    unload_model,
)
from .routes.tools import cors_proxy as cors_proxy_route
from .routes.tools import tools as tools_route
from .routing import ModelSettings, Router
from .sleep import IdleSleep
from .tools.box import ToolBox
from .webui import WebUI

logger = logging.getLogger(__name__)

#: (paths, methods, endpoint, the endpoint's label in the metrics)
_ROUTES = [
    (("/v1/chat/completions", "/chat/completions"), ["POST"], chat_completions, "chat_completions"),
    (("/v1/chat/completions/control",), ["POST"], control, "control"),
    (("/v1/completions",), ["POST"], completions, "completions"),
    (("/completion", "/completions"), ["POST"], completion, "completion"),  # (llama-server's own shape)
    (("/infill",), ["POST"], infill, "infill"),
    (("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"), ["POST"], input_tokens,
     "input_tokens"),
    (("/v1/responses", "/responses"), ["POST"], responses, "responses"),
    (("/v1/responses/input_tokens", "/responses/input_tokens"), ["POST"], response_input_tokens,
     "response_input_tokens"),
    (("/v1/messages",), ["POST"], messages, "messages"),
    (("/v1/messages/count_tokens",), ["POST"], count_tokens, "count_tokens"),
    (("/v1/embeddings", "/embeddings"), ["POST"], embeddings, "embeddings"),
    (("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"), ["POST"], rerank, "rerank"),
    (("/v1/models", "/models"), ["GET"], models, "models"),
    (("/models/load",), ["POST"], load_model, "models_load"),
    (("/models/unload",), ["POST"], unload_model, "models_unload"),
    (("/health", "/v1/health"), ["GET"], health, "health"),
    (("/metrics",), ["GET"], metrics, "metrics"),
    (("/tokenize",), ["POST"], tokenize, "tokenize"),
    (("/detokenize",), ["POST"], detokenize, "detokenize"),
    (("/props",), ["GET", "POST"], props, "props"),
    (("/slots",), ["GET"], slots, "slots"),
    (("/slots/{id_slot}",), ["POST"], slot_action, "slot_action"),
    (("/apply-template",), ["POST"], apply_template, "apply_template"),
    (("/lora-adapters",), ["GET", "POST"], lora_adapters, "lora_adapters"),
    (("/lora-adapters/load",), ["POST"], lora_load, "lora_load"),
    (("/lora-adapters/unload",), ["POST"], lora_unload, "lora_unload"),
    (("/tools",), ["GET", "POST"], tools_route, "tools"),
    (("/cors-proxy",), ["GET", "POST"], cors_proxy_route, "cors_proxy"),
]
_LABELS = {path: label for paths, _, _, label in _ROUTES for path in paths}


def _endpoint_label(path: str, webui: WebUI | None = None) -> str:
    label = _LABELS.get(path)
    if label is None and path.startswith("/slots/") and path.count("/") == 2:
        label = "slot_action"
    if label is None:  # (unknown paths share one label: no unbounded label values)
        label = "webui" if webui is not None and webui.serves(path) else "other"
    return label


_METHODS = {path: methods for paths, methods, _, _ in _ROUTES for path in paths}


async def _page(request: Request) -> Response:
    """A file of the web page (``GET /`` and the files beside it). Anything else is answered as
    without the page: 405 for an API path asked with another method, a redirect for an API path
    with a trailing slash, else 404."""
    context: AppContext = request.app.state.llama
    path = "/" + request.path_params.get("path", "")
    webui = context.webui
    if webui is not None and webui.serves(path):
        if request.method not in ("GET", "HEAD"):
            raise HTTPException(405, "Method Not Allowed", headers={"Allow": "GET, HEAD"})
        response = webui.response(request, path)
        assert response is not None
        return response
    if path in _METHODS:
        raise HTTPException(405, "Method Not Allowed", headers={"Allow": ", ".join(_METHODS[path])})
    if path.endswith("/") and path.rstrip("/") in _METHODS:
        url = request.url.replace(path=request.url.path.rstrip("/"))
        return RedirectResponse(str(url), status_code=307)
    raise HTTPException(404, "Not Found")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    error = APIError(exc.detail or "error")
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error.code = "not_found" if exc.status_code == 404 else None
    return JSONResponse(error.body(), status_code=exc.status_code, headers=dict(exc.headers or {}))


def create_app(manager: ModelManager, *, api_key: str | Sequence[str] | None = None,
               models: Mapping[str, ModelSettings] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               limits: RequestLimits | None = None, close_manager: bool = False,
               slots_endpoint: bool = True, metrics_endpoint: bool = True, verbose: bool = False,
               reasoning_format: str = "auto",
               enable_thinking: bool | None = True, reasoning_budget: int = -1, reasoning_budget_message: str = "",
               spm_infill: bool = False, cors_origins: str = "*", api_prefix: str = "",
               catalog: Catalog | None = None, router_mode: bool | None = None,
               slot_save_path: str | os.PathLike | None = None,
               webui: bool | str | os.PathLike = True, media_urls: bool = False,
               media_path: str | os.PathLike | None = None,
               predict_route: str | None = None, health_route: str | None = None,
               sleep_idle_seconds: float | None = None, tools: ToolBox | None = None,
               cors_proxy: bool = False) -> Starlette:
    """An OpenAI-compatible ASGI app over the models of ``manager``.

    Args:
        manager: the models, by id (generation needs a model in ``server`` mode, embeddings and
            reranking one in ``direct`` mode). Loads may still be running: the model answers 503
            (and /health too) until it is ready.
        api_key: when set, every endpoint but /health needs ``Authorization: Bearer <key>``
            (or ``X-Api-Key``); several keys: any of them.
        models: per-model HTTP settings by id (chat template, aliases).
        max_body_bytes: larger request bodies are refused with 413 while they are read.
        limits: what one request may ask for (:class:`RequestLimits`: choices, embedding inputs, tokenize
            bytes, schema sizes); beyond them, a 400 naming the limit.
        close_manager: close the manager when the app shuts down.
        slots_endpoint: serve ``/slots`` (False: 501, as llama-server's ``--no-slots``).
        metrics_endpoint: serve ``/metrics`` (False: 501, as llama-server without ``--metrics``; the CLI's
            default).
        verbose: generation responses carry llama-server's ``__verbose`` debug object (the rendered prompt,
            the raw output, ...) unless a request sets ``"verbose": false``.
        reasoning_format: ``"none"`` leaves a thinking model's reasoning in the content; ``"auto"``,
            ``"deepseek"`` and ``"deepseek-legacy"`` put it in ``reasoning_content`` (a request's own
            ``reasoning_format`` wins).
        enable_thinking: the ``enable_thinking`` template variable of chat requests that do not set it:
            True (the default) as llama-server (``--reasoning auto`` or ``on``), False (``--reasoning
            off``), or None for the template's own default (the library's ``lc.chat`` default).
        reasoning_budget: tokens a thinking model may reason before the end of its reasoning block is forced
            (after ``reasoning_budget_message``), for chat requests that set no ``reasoning_budget_tokens``
            (llama-server's ``--reasoning-budget``; -1: no limit, 0: end it at once).
        spm_infill: ``/infill`` prompts put the suffix before the prefix (for models trained that way).
        cors_origins: browser origins answered with CORS headers: ``"*"`` (any, as llama-server),
            ``"localhost"``, or a comma-separated list (see :class:`~.cors.CorsPolicy`).
        api_prefix: serve every path under this prefix (``"/llama"``: ``/llama/v1/models``), as
            llama-server's ``--api-prefix``.
        catalog: models the server may load and unload while serving (:class:`~.catalog.Catalog`:
            llama-server's router mode, ``/models/load``, ``/models/unload``, ``--models-max``).
        router_mode: llama-server's router mode: ``/models/load`` and ``/models/unload`` are served (404
            otherwise, as llama-server with one model), ``/props`` without ``?model=`` describes the router.
            None (default): on with a catalog that reads its models again (``source``) or holds other than
            one entry.
        slot_save_path: a folder for ``/slots/{id}?action=save|restore`` files (None: 501, as llama-server
            without ``--slot-save-path``); file names cannot leave it.
        webui: the chat page at ``/`` (True: the one in the package, ``docs/webui.md``; a folder: its
            ``index.html`` and the files beside it, as llama-server's ``--path``; False: none, as
            ``--no-webui``). Its files need no API key; the page asks for one.
        media_urls: fetch http(s) image and audio URLs of chat requests (off: only ``data:`` URLs and
            base64 are taken; a server that fetches what clients name can reach hosts they cannot).
        media_path: a folder whose files chat requests may name as ``file://PATH`` media (llama-server's
            ``--media-path``; PATH relative to it, never leaving it). None: ``file://`` URLs are refused.
        predict_route: serve Vertex AI's prediction protocol there (``"/predict"``; routes/predict.py), as
            llama-server does under ``AIP_MODE=PREDICTION``; ``health_route``: ``/health`` there too.
        sleep_idle_seconds: free the catalog's loaded models after that many seconds without a request,
            and load them again on the next request that needs one (llama-server's
            ``--sleep-idle-seconds``; sleep.py). None: never.
        tools: the tools ``/tools`` lists and calls (:class:`~.tools.box.ToolBox`: llama-server's
            ``--tools``, ``--tools-runtime``, ``--mcp-servers-json``); the app starts it and closes it
            with itself. None: ``/tools`` answers 403, as llama-server without them.
        cors_proxy: serve ``/cors-proxy`` (llama-server's ``--ui-mcp-proxy``; cors_proxy.py), else 403.
            It reaches any host this server can reach, for whoever holds the API key.
    """
    save_path = None
    if slot_save_path is not None:
        save_path = Path(slot_save_path).expanduser().resolve()
        if not save_path.is_dir():
            raise ValueError(f"slot_save_path={str(slot_save_path)!r}: no such folder")
    if media_path is not None and not Path(media_path).is_dir():
        raise ValueError(f"media_path={str(media_path)!r}: not a directory")
    if reasoning_format not in ("auto", "none", "deepseek", "deepseek-legacy"):
        raise ValueError(f"reasoning_format={reasoning_format!r}: expected auto, none, deepseek or deepseek-legacy")
    if isinstance(reasoning_budget, bool) or not isinstance(reasoning_budget, int) or reasoning_budget < -1:
        raise ValueError(f"reasoning_budget={reasoning_budget!r}: expected -1 (no limit), 0 or a number of tokens")
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: expected a positive integer")
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key) if api_key is not None else ()
    if api_key is not None and (not keys or not all(isinstance(k, str) and k for k in keys)):
        raise ValueError("api_key must be a non-empty string or a list of them (None disables the check)")
    if api_prefix and (not api_prefix.startswith("/") or api_prefix.endswith("/")):
        raise ValueError(f"api_prefix={api_prefix!r}: expected a path such as '/llama' (no trailing slash)")
    if limits is None:
        limits = RequestLimits()
    elif not isinstance(limits, RequestLimits):
        raise ValueError(f"limits={limits!r}: expected a RequestLimits")
    if catalog is not None and catalog.manager is not manager:
        raise ValueError("the catalog must be over the same manager")
    page = None if webui is False else WebUI(reserved=_LABELS) if webui is True else WebUI(webui, reserved=_LABELS)
    router = Router(manager, models, catalog)
    context = AppContext(router=router, metrics=Metrics(router.server_stats), api_keys=keys,
                         cors=CorsPolicy(cors_origins), api_prefix=api_prefix,
                         max_body_bytes=max_body_bytes, limits=limits, close_manager=close_manager,
                         slots_endpoint=slots_endpoint, metrics_endpoint=metrics_endpoint,
                         verbose=verbose, reasoning_format=reasoning_format,
                         enable_thinking=enable_thinking, reasoning_budget=reasoning_budget,
                         reasoning_budget_message=reasoning_budget_message,
                         spm_infill=spm_infill, slot_save_path=save_path,
                         router_mode=router_mode if router_mode is not None else catalog is not None and (
                             catalog.source is not None or len(catalog.entries) != 1),
                         webui=page, fetch_media=media_reader(limits.media, urls=media_urls, folder=media_path),
                         tools=tools, cors_proxy=bool(cors_proxy))

    if sleep_idle_seconds is not None:
        if catalog is None:
            raise ValueError("sleep_idle_seconds needs a catalog: the models it frees are loaded again from "
                             "their catalog entries")
        context.sleep = _idle_sleep(context, sleep_idle_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if tools is not None:
            await tools.start()
        watcher = asyncio.create_task(context.sleep.watch()) if context.sleep is not None else None
        try:
            yield
        finally:
            context.closing = True
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher  # (not freeing a model while the manager closes)
            try:
                if tools is not None:
                    await tools.close()
            finally:
                if context.close_manager:
                    await anyio.to_thread.run_sync(manager.close)

    routes = [Route(path, fn, methods=methods) for paths, methods, fn, _ in _ROUTES for path in paths]
    for extra in (predict_route, health_route):
        if extra is not None and (not extra.startswith("/") or extra in _LABELS):
            raise ValueError(f"{extra!r}: expected a path that is not one of the API's")
    if predict_route is not None:
        posts = {path: fn for paths, methods, fn, _ in _ROUTES for path in paths if "POST" in methods}
        routes.append(Route(predict_route, make_predict(posts), methods=["POST"]))
    if health_route is not None and health_route != predict_route:
        routes.append(Route(health_route, health, methods=["GET"]))
    extra_labels = {path: label for path, label in ((health_route, "health"), (predict_route, "predict"))
                    if path is not None}
    if page is not None:  # (last: the API's paths win)
        routes.append(Route("/{path:path}", _page, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(ServiceMiddleware, context=context,
                                           endpoint_of=lambda path: extra_labels.get(path)
                                           or _endpoint_label(path, page))])
    app.state.llama = context
    return app


def _idle_sleep(context: AppContext, seconds: float) -> IdleSleep:
    """The app's IdleSleep: on sleeping, /props and /metrics keep what they showed; on waking, the new
    servers' counters add to the old ones."""
    async def on_sleep() -> None:
        context.metrics.freeze()
        try:
            context.sleep_props = await props_snapshot(context)
        except Exception:  # (no props to show while asleep: /props then wakes the server)
            logger.exception("reading /props before sleeping failed")
            context.sleep_props = None

    def on_wake(freed: list[str]) -> None:
        context.metrics.thaw(freed)
        context.sleep_props = None

    return IdleSleep(context.router.catalog, seconds, on_sleep=on_sleep, on_wake=on_wake)


__all__ = ["create_app", "ModelSettings", "RequestLimits"]
