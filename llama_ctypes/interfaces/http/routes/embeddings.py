"""POST /v1/embeddings (also /embeddings) and POST /v1/rerank (also /rerank, llama-server's shape).

Embedding and reranking run native code synchronously, so they run in a worker
thread (through the ModelManager, which sizes their contexts); the event loop
keeps serving meanwhile.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import anyio
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ....features.embeddings import EmbedUsage
from ....features.openai.shapes import input_usage
from ..common import AppContext, endpoint, read_body
from ..errors import BadRequest
from ..json_answer import json_response
from ..limits import RequestLimits, over_limit
from ..schemas import EmbeddingRequest, RerankRequest, parse


def _embed(manager: Any, model_id: str, texts: list[str], limits: RequestLimits,
           usage: EmbedUsage) -> tuple[list[np.ndarray], int]:
    """The vectors (a matrix per text when the pooling is "none") and the number of input tokens (a
    worker thread); what the work cost goes to ``usage``."""
    vocab = manager.model(model_id).vocab
    n_tokens = sum(len(vocab.tokenize(t, add_special=True, parse_special=False)) for t in texts)
    if n_tokens > limits.max_input_tokens:  # (tokenizing is linear and cheap; embedding is not)
        raise over_limit("input tokens", n_tokens, limits.max_input_tokens, "--max-input-tokens", param="input")
    return [np.asarray(v, dtype=np.float32) for v in manager.embed(model_id, texts, usage=usage)], n_tokens


@endpoint
async def embeddings(request: Request, app: AppContext) -> Response:
    body = parse(EmbeddingRequest, await read_body(request, app.max_body_bytes))
    texts = body.texts()
    if len(texts) > app.limits.max_inputs:
        raise over_limit("inputs", len(texts), app.limits.max_inputs, "--max-inputs", param="input")
    await app.router.prepare(body.model)
    info = app.router.resolve(body.model)
    if "embed" not in info.capabilities:
        raise BadRequest(f"the model {info.id!r} cannot embed (load it with mode='direct'; "
                         f"it can {', '.join(info.capabilities)})", param="model")
    usage = EmbedUsage()
    try:
        vectors, n_tokens = await anyio.to_thread.run_sync(
            functools.partial(_embed, app.router.manager, info.id, texts, app.limits, usage))
    finally:  # (the decodes done count even when a later one failed)
        app.metrics.embedding_done(usage)
    if any(v.ndim != 1 for v in vectors) and request.url.path.endswith("/v1/embeddings"):
        # (one vector per input is OpenAI's shape; /embeddings keeps a matrix per input, as llama-server)
        raise BadRequest("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
    if body.dimensions is not None and vectors and body.dimensions != vectors[0].shape[-1]:
        raise BadRequest(f"the model {info.id!r} makes {vectors[0].shape[-1]}-dimensional embeddings; "
                         f"dimensions={body.dimensions} is not supported", param="dimensions")
    data = []
    for i, vec in enumerate(vectors):
        if body.encoding_format == "base64":
            value: Any = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
        else:
            value = vec.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return await json_response({"object": "list", "data": data, "model": info.id,
                                "usage": input_usage(n_tokens)})


def _rerank(manager: Any, model_id: str, query: str, documents: list[str],
            limits: RequestLimits, usage: EmbedUsage) -> tuple[list[float], int]:
    vocab = manager.model(model_id).vocab
    n_query = len(vocab.tokenize(query, add_special=True, parse_special=False))
    n_tokens = sum(n_query + len(vocab.tokenize(d, add_special=False, parse_special=False)) for d in documents)
    if n_tokens > limits.max_input_tokens:
        raise over_limit("query and document tokens", n_tokens, limits.max_input_tokens, "--max-input-tokens",
                         param="documents")
    return manager.rerank(model_id, query, documents, usage=usage), n_tokens


@endpoint
async def rerank(request: Request, app: AppContext) -> Response:
    body = parse(RerankRequest, await read_body(request, app.max_body_bytes))
    documents = body.items
    field = "texts" if body.documents is None else "documents"
    if len(documents) > app.limits.max_inputs:
        raise over_limit(field, len(documents), app.limits.max_inputs, "--max-inputs", param=field)
    await app.router.prepare(body.model)
    info = app.router.resolve(body.model)
    if "rerank" not in info.capabilities:
        raise BadRequest(f"the model {info.id!r} is not a reranking model (it can {', '.join(info.capabilities)})",
                         param="model")
    usage = EmbedUsage()
    try:
        scores, n_tokens = await anyio.to_thread.run_sync(
            functools.partial(_rerank, app.router.manager, info.id, body.query, documents, app.limits, usage))
    finally:
        app.metrics.embedding_done(usage)
    ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n is not None:
        ranked = ranked[:body.top_n]
    if body.tei:  # (llama-server answers TEI's request, with "texts", in TEI's shape)
        return await json_response([{"index": i, "score": scores[i],
                                     **({"text": documents[i]} if body.return_text else {})} for i in ranked])
    return await json_response({"model": info.id, "object": "list",
                                "usage": input_usage(n_tokens),
                                "results": [{"index": i, "relevance_score": scores[i]} for i in ranked]})
