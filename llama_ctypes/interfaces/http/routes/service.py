"""GET /v1/models, /health, /metrics, /props, /slots; POST /tokenize, /detokenize (llama-server's shapes)."""

from __future__ import annotations

import functools
import math
import re
import time
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....errors import AlreadyLoadedError, BusyError, InvalidArgumentError, LlamaError, ModelLoadError
from ..common import AppContext, endpoint, json_body, read_body
from ..errors import APIError, BadRequest, NotFound, NotSupported, Unavailable
from ..limits import over_limit
from ..metrics import CONTENT_TYPE
from ..origin import check_origin
from ..schemas import DetokenizeRequest, ModelRequest, TokenizeRequest, parse


@endpoint
async def models(request: Request, app: AppContext) -> Response:
    """Every model: loaded, loading, failed, and (router mode) the catalog's unloaded ones. ``status`` is
    llama-server's object (``{"value": "loaded" | "loading" | "unloaded" | "failed", "args": [...]}``).
    ``?reload=1`` (any value) reads ``--models-preset`` and ``--models-dir`` again first, as llama-server."""
    if request.query_params.get("reload"):
        _admin(request, app, "GET /models?reload")  # (it unloads models whose options changed)
        try:
            await anyio.to_thread.run_sync(app.router.reload)
        except (LlamaError, ValueError, OSError) as exc:  # (the file's fault, not the client's: the list stays)
            raise APIError(f"reading the models again failed, the list is unchanged: {exc}") from None
    catalog = app.router.catalog
    data, ollama = [], []
    listed = set()
    for info in app.router.manager.list():
        listed.add(info.id)
        data.append({"id": info.id, "object": "model", "created": app.started, "owned_by": "llama_ctypes",
                     "status": catalog.describe(info.id), "capabilities": list(info.capabilities),
                     "aliases": list(app.router.settings_of(info.id).aliases),
                     "tags": list(app.router.settings_of(info.id).tags)})
        ollama.append(_ollama_entry(info.id, info.capabilities))
    for entry in catalog.entries.values():
        if entry.id not in listed:
            data.append({"id": entry.id, "object": "model", "created": app.started, "owned_by": "llama_ctypes",
                         "status": catalog.describe(entry.id), "capabilities": [],
                         "aliases": list(entry.aliases), "tags": list(app.router.settings_of(entry.id).tags)})
    # ("models": llama-server's Ollama-style list of the models it serves, beside OpenAI's "data")
    return JSONResponse({"models": ollama, "object": "list", "data": data})


def _ollama_entry(model_id: str, capabilities: tuple[str, ...]) -> dict:
    """A model as llama-server lists it under ``models`` (Ollama's shape; its capability names)."""
    names = {"generate": "completion", "multimodal": "multimodal", "embed": "embedding", "rerank": "rerank"}
    return {"name": model_id, "model": model_id, "modified_at": "", "size": "", "digest": "", "type": "model",
            "description": "", "tags": [""], "capabilities": [names[c] for c in capabilities if c in names],
            "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                          "parameter_size": "", "quantization_level": ""}}


async def _model_field(request: Request, app: AppContext) -> str:
    body = parse(ModelRequest, await read_body(request, app.max_body_bytes))
    return body.model


def _admin(request: Request, app: AppContext, what: str) -> None:
    """An endpoint that changes what the server serves: no page of another site may call it (a "simple"
    cross-site POST needs no preflight; ``--cors-origins *`` does not count here, named origins do)."""
    check_origin(request, app, wildcard=False, what=what)


def _router_only(app: AppContext) -> None:
    if not app.router_mode:  # (llama-server serves these in router mode only: with one model they only harm)
        raise NotFound("/models/load and /models/unload are served in router mode (a server started without a "
                       "model: --models-dir, --models-preset or --config)", code="not_found")


@endpoint
async def load_model(request: Request, app: AppContext) -> Response:
    """llama-server's POST /models/load ``{"model": id}``: starts loading a catalog entry (poll /models).
    Router mode only; refused to pages of other sites."""
    _router_only(app)
    _admin(request, app, "/models/load")
    model_id = await _model_field(request, app)
    try:
        await anyio.to_thread.run_sync(app.router.catalog.load, model_id)  # (an eviction blocks)
    except AlreadyLoadedError as exc:
        raise BadRequest(str(exc), param="model") from None
    return JSONResponse({"success": True})


@endpoint
async def unload_model(request: Request, app: AppContext) -> Response:
    """llama-server's POST /models/unload ``{"model": id}``: frees a model (its requests end with 503).
    Router mode only; refused to pages of other sites."""
    _router_only(app)
    _admin(request, app, "/models/unload")
    model_id = await _model_field(request, app)
    await anyio.to_thread.run_sync(app.router.catalog.unload, model_id)
    return JSONResponse({"success": True})


@endpoint
async def health(request: Request, app: AppContext) -> Response:
    """200 when every model is ready; 503 while one loads, after one failed, or while closing."""
    if app.closing:
        raise Unavailable("the server is shutting down")
    infos = app.router.manager.list()
    if not infos:  # (started without a model, as llama-server's router: nothing to wait for)
        return JSONResponse({"status": "ok", "models": {}})
    loading = [i.id for i in infos if i.status == "loading"]
    if loading:
        raise Unavailable(f"loading model(s): {', '.join(loading)}", code="loading")
    failed = [i.id for i in infos if i.status == "failed"]
    if failed:  # (a load failed, or a loaded model lost an RPC worker)
        raise Unavailable(f"model(s) failed: {', '.join(failed)}", code="model_failed")
    stats = await anyio.to_thread.run_sync(app.router.server_stats)
    detail: dict[str, Any] = {}
    for info in infos:
        s = stats.get(info.id)
        detail[info.id] = {"status": info.status, "mode": info.mode}
        if s is not None:
            detail[info.id].update(slots_total=s["n_parallel"], slots_processing=s["active_slots"],
                                   slots_idle=s["n_parallel"] - s["active_slots"], queue_length=s["queue_length"])
    return JSONResponse({"status": "ok", "models": detail})


@endpoint
async def metrics(request: Request, app: AppContext) -> Response:
    """Prometheus text; 501 unless enabled (``serve --metrics``), as llama-server."""
    if not app.metrics_endpoint:
        raise NotSupported("this server does not support metrics endpoint (start it with --metrics)")
    window = app.metrics.take_window()  # (here, on the loop that records the generations)
    text = await anyio.to_thread.run_sync(app.metrics.render, window)
    # (llama-server's header: when the counters started, for rates across restarts)
    return Response(text, media_type=CONTENT_TYPE, headers={"Process-Start-Time-Unix": str(app.started)})


def _pieces(vocab: Any, tokens: list[int]) -> list[dict[str, Any]]:
    out = []
    for t in tokens:
        raw = vocab.token_bytes(t, special=True)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)  # (part of a character: llama-server sends the bytes)
        out.append({"id": t, "piece": piece})
    return out


def _tokenize(model: Any, body: TokenizeRequest) -> Any:
    vocab = model.vocab
    tokens = vocab.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
    return _pieces(vocab, tokens) if body.with_pieces else tokens


@endpoint
async def tokenize(request: Request, app: AppContext) -> Response:
    body = parse(TokenizeRequest, await read_body(request, app.max_body_bytes))
    size = len(body.content.encode("utf-8", "surrogatepass"))
    if size > app.limits.max_tokenize_bytes:
        raise over_limit("content bytes", size, app.limits.max_tokenize_bytes, "--max-tokenize-bytes", param="content")
    await app.router.prepare(body.model)
    _, model = app.router.model(body.model)
    tokens = await anyio.to_thread.run_sync(functools.partial(_tokenize, model, body))
    return JSONResponse({"tokens": tokens})


@endpoint
async def detokenize(request: Request, app: AppContext) -> Response:
    body = parse(DetokenizeRequest, await read_body(request, app.max_body_bytes))
    await app.router.prepare(body.model)
    _, model = app.router.model(body.model)
    text = await anyio.to_thread.run_sync(functools.partial(model.vocab.detokenize, body.tokens))
    return JSONResponse({"content": text})


#: llama-server's name of each request default it reports (``default_generation_settings.params``).
_PARAM_NAMES = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typ_p",
                "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n",
                "penalty_freq": "frequency_penalty", "penalty_present": "presence_penalty",
                "dry_multiplier": "dry_multiplier", "mirostat": "mirostat", "seed": "seed",
                "max_tokens": "n_predict", "stop": "stop", "ignore_eos": "ignore_eos", "cache_prompt": "cache_prompt",
                "backend_sampling": "backend_sampling"}
#: llama-server's "default seed" (a random one per request)
_RANDOM_SEED = 0xFFFFFFFF


def generation_settings(server: Any, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """llama-server's generation settings (its names) of a request with ``options`` (server option names;
    the rest from the server's defaults). Extra keys of ``options`` without a server name (``stream``,
    ``n_probs``) pass as they are."""
    from ....core.generation import GenerationParams
    from ....core.params import split_options
    from ....core.sampler import SamplingParams

    merged = {**server.defaults, **{k: v for k, v in (options or {}).items() if k in _PARAM_NAMES or k == "logit_bias"}}
    sampling, gen = split_options(merged, SamplingParams, GenerationParams, where="server defaults")
    values = {**vars(SamplingParams(**sampling)), **vars(GenerationParams(**gen))}
    params = {name: values[ours] for ours, name in _PARAM_NAMES.items()}
    params["stop"] = list(params["stop"])
    if params["seed"] is None:
        params["seed"] = _RANDOM_SEED
    params.update({k: v for k, v in (options or {}).items() if k not in _PARAM_NAMES and k in ("stream", "n_probs")})
    # llama-server lists its logit biases, ignore_eos's -inf on every end-of-generation token included
    # (JSON has no -inf: null)
    bias = {int(t): float(b) for t, b in dict(values.get("logit_bias") or {}).items()}
    if params["ignore_eos"]:
        bias.update({t: -math.inf for t in server.model.vocab.eog_tokens()})
    params["logit_bias"] = [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in bias.items()]
    return params


def _generation_settings(server: Any) -> dict[str, Any]:
    return {"n_ctx": server.n_ctx, "params": generation_settings(server)}


def _props(app: AppContext, model_id: str, model: Any, server: Any) -> dict[str, Any]:
    from ....core.backend import version_info
    from ....core.projector import MEDIA_MARKER

    template = app.router.chat_template_of(model_id, model)
    vocab = model.vocab
    info = version_info()
    return {
        "default_generation_settings": _generation_settings(server) if server is not None else {},
        "total_slots": server.n_parallel if server is not None else 0,
        "model_alias": model_id,
        "model_path": str(model.path),
        "modalities": {"vision": "vision" in model.modalities, "video": False, "audio": "audio" in model.modalities},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": app.slots_endpoint, "endpoint_props": False, "endpoint_metrics": app.metrics_endpoint,
        "ui": False,
        "chat_template": template or model.chat_template or "",
        "bos_token": vocab.token_bytes(vocab.bos, True).decode("utf-8", "replace") if vocab.bos is not None else "",
        "eos_token": vocab.token_bytes(vocab.eos, True).decode("utf-8", "replace") if vocab.eos is not None else "",
        "build_info": info.build_info,
        "is_sleeping": False,
    }


@endpoint
async def props(request: Request, app: AppContext) -> Response:
    """llama-server's /props for the model named by ``?model=`` (default: the default model).

    POST (changing the properties) is refused with 501, as llama-server does without ``--props``."""
    if request.method == "POST":
        raise NotSupported("this server does not support changing global properties")
    name = request.query_params.get("model") or None
    if app.router_mode and name is None:
        from ....core.backend import version_info

        catalog = app.router.catalog
        info = version_info()
        return JSONResponse({"role": "router", "max_instances": catalog.max_loaded or 0,
                             "models_autoload": catalog.autoload,
                             "build_info": info.build_info})
    cached = app.sleep_props
    if cached is not None and app.sleep is not None and app.sleep.sleeping \
            and (name is None or name == cached["model_alias"] or len(app.router.catalog.entries) == 1
                 or name in app.router.settings_of(cached["model_alias"]).aliases):
        return JSONResponse(cached)  # (asleep: as it was, without loading the model again)
    await app.router.prepare(name)
    return JSONResponse(await _current_props(app, name))


async def _current_props(app: AppContext, name: str | None) -> dict[str, Any]:
    info = app.router.resolve(name)
    model_id, model = app.router.model(info.id)
    server = None
    if info.mode == "server":
        _, server = app.router.server(info.id)
    return await anyio.to_thread.run_sync(_props, app, model_id, model, server)


async def props_snapshot(app: AppContext) -> dict[str, Any]:
    """The default model's /props as shown while the server sleeps (``is_sleeping``: true)."""
    return {**await _current_props(app, None), "is_sleeping": True}


def _slot_json(slot: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": slot.id, "n_ctx": slot.n_ctx, "speculative": slot.speculative,
                           "is_processing": slot.is_processing}
    if slot.is_processing:
        out.update(id_task=slot.request_id, n_prompt_tokens=slot.n_prompt_tokens,
                   n_prompt_tokens_processed=slot.n_prompt_tokens_processed,
                   n_prompt_tokens_cache=slot.n_prompt_tokens_cache,
                   next_token=[{"has_next_token": True, "n_remain": slot.n_remaining, "n_decoded": slot.n_decoded}])
    return out


@endpoint
async def slots(request: Request, app: AppContext) -> Response:
    """llama-server's /slots: each slot of the model named by ``?model=``; 501 when started with
    ``--no-slots``; with ``?fail_on_no_slot=1``, 503 when no slot is idle."""
    if not app.slots_endpoint:
        raise NotSupported("this server does not support the slots endpoint (started with --no-slots)")
    _, server = app.router.server(request.query_params.get("model") or None)
    infos = await anyio.to_thread.run_sync(server.slots)
    if request.query_params.get("fail_on_no_slot") and not any(not s.is_processing for s in infos):
        raise Unavailable("no slot available", code="no_slot_available")
    return JSONResponse([_slot_json(s) for s in infos])


#: A slot file's name: one path component, no control or reserved characters (llama-server's check), no
#: lone surrogate (no file system takes one)
_FILENAME = re.compile(r'^[^/\\\x00-\x1f\x7f<>:"|?*\ud800-\udfff]{1,255}$')
#: A slot id as a path segment: ASCII digits only (int() also takes '١', '1_0', '+0' and ' 0')
_SLOT_ID = re.compile(r"[0-9]{1,9}")


def _slot_file(app: AppContext, filename: Any) -> Path:
    """The path of a slot file inside ``--slot-save-path``; a name that could leave that folder is refused."""
    if not isinstance(filename, str) or not _FILENAME.match(filename) or filename in (".", "..") \
            or filename != filename.strip():
        raise BadRequest("invalid filename: one file name, without a path", param="filename")
    folder = app.slot_save_path
    path = (folder / filename).resolve()
    if path.parent != folder:  # (a symbolic link in the folder that points elsewhere)
        raise BadRequest("invalid filename: it leads out of the slot save folder", param="filename")
    if path.is_dir():
        raise BadRequest("invalid filename: a folder has that name", param="filename")
    return path


@endpoint
async def slot_action(request: Request, app: AppContext) -> Response:
    """llama-server's ``POST /slots/{id}?action=save|restore|erase`` (``{"filename": ...}`` for the first two),
    on the model named by ``?model=``; 501 unless started with ``--slot-save-path``."""
    if app.slot_save_path is None:
        raise NotSupported("this server does not support slots actions: start it with --slot-save-path")
    _admin(request, app, "slot actions")
    raw_id = request.path_params["id_slot"]
    if not _SLOT_ID.fullmatch(raw_id):
        raise BadRequest("Invalid slot ID", param="id_slot")  # (llama-server's message)
    slot_id = int(raw_id)
    action = request.query_params.get("action")
    if action not in ("save", "restore", "erase"):
        raise BadRequest(f"invalid action {action!r}: expected save, restore or erase", param="action")
    raw = await read_body(request, app.max_body_bytes)
    name = request.query_params.get("model") or None
    await app.router.prepare(name)
    _, server = app.router.server(name)
    start = time.perf_counter()
    try:
        if action == "erase":
            n = await anyio.to_thread.run_sync(server.erase_slot, slot_id)
            return JSONResponse({"id_slot": slot_id, "n_erased": n})
        body = json_body(raw) if raw.strip() else {}
        path = _slot_file(app, body.get("filename") if isinstance(body, dict) else None)
        if action == "save":
            n = await anyio.to_thread.run_sync(server.save_slot, slot_id, path)
            return JSONResponse({"id_slot": slot_id, "filename": path.name, "n_saved": n,
                                 "n_written": path.stat().st_size,
                                 "timings": {"save_ms": (time.perf_counter() - start) * 1e3}})
        if not path.is_file():
            raise BadRequest(f"no slot file named {path.name!r}", param="filename")
        try:
            n = await anyio.to_thread.run_sync(server.restore_slot, slot_id, path)
        except InvalidArgumentError as exc:  # (the folder's path is the server's business, not the client's)
            raise BadRequest(str(exc).replace(str(path), path.name), param="filename") from None
        return JSONResponse({"id_slot": slot_id, "filename": path.name, "n_restored": n,
                             "n_read": path.stat().st_size,
                             "timings": {"restore_ms": (time.perf_counter() - start) * 1e3}})
    except BusyError as exc:
        raise Unavailable(str(exc), code="slot_busy") from None


def _lora_json(server: Any, i: int, name: str, adapter: Any, scale: float) -> dict[str, Any]:
    entry = {"id": i, "name": name, "path": str(adapter.path), "scale": scale,
             "task_name": adapter.metadata.get("adapter.lora.task_name", ""),
             "prompt_prefix": adapter.metadata.get("adapter.lora.prompt_prefix", "")}
    if adapter.invocation_tokens:
        vocab = server.model.vocab
        entry["alora_invocation_string"] = b"".join(
            vocab.token_bytes(t, True) for t in adapter.invocation_tokens).decode("utf-8", "replace")
        entry["alora_invocation_tokens"] = list(adapter.invocation_tokens)
    return entry


@endpoint
async def lora_adapters(request: Request, app: AppContext) -> Response:
    """llama-server's ``/lora-adapters`` on the model named by ``?model=``: GET lists the adapters (``id``
    as requests name it: never reused after an unload; ``scale``: what a request naming none gets);
    POST ``[{"id": i, "scale": s}, ...]``
    sets those scales (adapters not listed get 0) and answers ``{"success": true}``."""
    _, server = app.router.server(request.query_params.get("model") or None)
    if request.method == "POST":
        _admin(request, app, "/lora-adapters")
        body = await _json_body(request, app, list, "Request body must be an array")
        scales: dict[Any, float] = {}
        for entry in body:
            key = entry.get("id", entry.get("name")) if isinstance(entry, dict) else None
            scale = entry.get("scale", 0.0) if isinstance(entry, dict) else None
            if isinstance(key, bool) or not isinstance(key, (int, str)) or isinstance(scale, bool) \
                    or not isinstance(scale, (int, float)):
                raise BadRequest('each entry is {"id": <adapter id>, "scale": <number>}')
            if key in scales:  # (as a request's own "lora" list: one scale per adapter)
                raise BadRequest(f"the adapter {key!r} is listed twice")
            scales[key] = float(scale)
        try:
            server.set_lora_scales(scales)
        except (InvalidArgumentError, TypeError) as exc:
            raise BadRequest(str(exc)) from None
        return JSONResponse({"success": True})
    return JSONResponse([_lora_json(server, i, adapter.name, adapter, scale)
                         for i, adapter, scale in server.lora_table()])


async def _json_body(request: Request, app: AppContext, kind: type, refusal: str) -> Any:
    body = json_body(await read_body(request, app.max_body_bytes))
    if not isinstance(body, kind):
        raise BadRequest(refusal)
    return body


async def _lora_admin_body(request: Request, app: AppContext) -> dict[str, Any]:
    _admin(request, app, "/lora-adapters/load and /unload")
    if not app.api_keys:
        # (it names files on this machine: never offered to anyone who can reach the port)
        raise NotSupported("loading and unloading LoRA adapters over HTTP needs the server started with an API key")
    return await _json_body(request, app, dict, "the request body must be an object")


@endpoint
async def lora_load(request: Request, app: AppContext) -> Response:
    """``POST /lora-adapters/load`` ``{"path": "x.gguf", "name": ..., "scale": 0}`` (beyond llama-server,
    behind the API key): load an adapter while serving; answers its ``/lora-adapters`` entry."""
    body = await _lora_admin_body(request, app)
    path, name, scale = body.get("path"), body.get("name"), body.get("scale", 0.0)
    if not isinstance(path, str) or not path.endswith(".gguf") or not Path(path).is_file():
        raise BadRequest("path: expected an existing .gguf file on the server", param="path")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise BadRequest("name: expected a non-empty string", param="name")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise BadRequest("scale: expected a number", param="scale")
    _, server = app.router.server(body.get("model") if isinstance(body.get("model"), str) else None)
    try:
        adapter = await anyio.to_thread.run_sync(lambda: server.load_lora(path, name, float(scale)))
    except (InvalidArgumentError, ModelLoadError) as exc:
        raise BadRequest(str(exc), param="path") from None
    row = next((r for r in server.lora_table() if r[1] is adapter), None)
    if row is None:  # (unloaded at once by another request)
        raise BadRequest(f"the LoRA adapter {adapter.name!r} was unloaded meanwhile", param="path")
    return JSONResponse(_lora_json(server, row[0], adapter.name, adapter, row[2]))


@endpoint
async def lora_unload(request: Request, app: AppContext) -> Response:
    """``POST /lora-adapters/unload`` ``{"name": ...}`` or ``{"id": i}`` (beyond llama-server, behind the API
    key): new requests naming it are refused at once; answers when the requests using it have ended."""
    body = await _lora_admin_body(request, app)
    _, server = app.router.server(body.get("model") if isinstance(body.get("model"), str) else None)
    key = body.get("name", body.get("id"))
    if isinstance(key, int) and not isinstance(key, bool):
        row = next((r for r in server.lora_table() if r[0] == key), None)
        if row is None:
            raise BadRequest(f"no LoRA adapter with id {key}", param="id")
        key = row[1].name
    if not isinstance(key, str):
        raise BadRequest('name the adapter: {"name": ...} or {"id": ...}', param="name")
    try:
        await anyio.to_thread.run_sync(lambda: server.unload_lora(key, timeout=600.0))
    except InvalidArgumentError as exc:
        raise BadRequest(str(exc), param="name") from None
    except TimeoutError as exc:
        raise Unavailable(str(exc)) from None
    return JSONResponse({"success": True})
