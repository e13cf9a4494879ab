"""GET /v1/models, /health, /metrics; POST /tokenize, /detokenize (llama-server's shapes)."""

from __future__ import annotations

import functools
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..common import AppContext, endpoint, read_body
from ..errors import Unavailable
from ..limits import over_limit
from ..metrics import CONTENT_TYPE
from ..schemas import DetokenizeRequest, TokenizeRequest, parse


@endpoint
async def models(request: Request, app: AppContext) -> Response:
    data = []
    for info in app.router.manager.list():
        data.append({"id": info.id, "object": "model", "created": app.started, "owned_by": "llama_ctypes",
                     "status": info.status, "capabilities": list(info.capabilities),
                     "aliases": list(app.router.settings_of(info.id).aliases)})
    return JSONResponse({"object": "list", "data": data})


@endpoint
async def health(request: Request, app: AppContext) -> Response:
    """200 when every model is ready; 503 while one loads, after one failed, or while closing."""
    if app.closing:
        raise Unavailable("the server is shutting down")
    infos = app.router.manager.list()
    if not infos:
        raise Unavailable("no model is loaded")
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
    text = await anyio.to_thread.run_sync(app.metrics.render)
    return Response(text, media_type=CONTENT_TYPE)


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
    _, model = app.router.model(body.model)
    tokens = await anyio.to_thread.run_sync(functools.partial(_tokenize, model, body))
    return JSONResponse({"tokens": tokens})


@endpoint
async def detokenize(request: Request, app: AppContext) -> Response:
    body = parse(DetokenizeRequest, await read_body(request, app.max_body_bytes))
    _, model = app.router.model(body.model)
    text = await anyio.to_thread.run_sync(functools.partial(model.vocab.detokenize, body.tokens))
    return JSONResponse({"content": text})
