"""Vertex AI's prediction protocol (llama-server's Google Cloud compat): ``POST /predict`` with
``{"instances": [{"@requestFormat": "chatCompletions", ...}, ...]}`` runs each instance through the
endpoint it names and answers ``{"predictions": [body, ...]}`` in order.

Enabled, as llama-server, by ``AIP_MODE=PREDICTION`` in the environment (``AIP_HTTP_PORT``,
``AIP_PREDICT_ROUTE``, ``AIP_HEALTH_ROUTE``: see ``serve.py``). An instance names its endpoint by path
(``/v1/chat/completions``) or by the camelCase alias of one (``chatCompletions``, ``applyTemplate``);
streaming is turned off; an instance that fails gets ``{"error": {...}}`` in its place.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..common import AppContext, endpoint, json_body, read_body
from ..errors import BadRequest

__all__ = ["MAX_INSTANCES", "gcp_alias", "make_predict"]

logger = logging.getLogger(__name__)

#: Instances one prediction request may hold (llama-server's bound).
MAX_INSTANCES = 128


def gcp_alias(path: str) -> str:
    """The ``@requestFormat`` alias of a path, as llama-server derives it: ``/v1/chat/completions`` →
    ``chatCompletions``, ``/apply-template`` → ``applyTemplate``."""
    s = path[3:] if path.startswith("/v1") and len(path) > 3 else path
    s = s.lstrip("/").split("{")[0]
    out, cap = [], False
    for c in s:
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


def _error(message: str, type_: str = "invalid_request_error", code: int = 400) -> dict:
    return {"error": {"code": code, "message": message, "type": type_}}


def make_predict(handlers: Mapping[str, Callable[[Request], Awaitable[Response]]]):
    """The predict endpoint over ``handlers`` (POST path → endpoint; the first path of an alias wins)."""
    aliases: dict[str, str] = {}
    for path in handlers:
        aliases.setdefault(gcp_alias(path), path)

    async def run(request: Request, app: AppContext, instance: Any) -> Any:
        if not isinstance(instance, dict):
            return _error("each instance must be a JSON object")
        fmt = instance.get("@requestFormat")
        if not isinstance(fmt, str):
            return _error("each instance must include a string @requestFormat")
        path = aliases.get(fmt) or (fmt if fmt in handlers else None)
        if path is None:
            return _error(f"no handler registered for @requestFormat: {fmt}")
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        if "stream" in payload:
            payload["stream"] = False  # (a prediction is one JSON body)
        raw = json.dumps(payload).encode()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if sent:  # (the body was read: wait as a connection would, for a disconnect)
                return await request.receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        root = request.scope.get("root_path", "")
        scope = {**request.scope, "path": root + path, "raw_path": (root + path).encode(), "query_string": b"",
                 "method": "POST", "path_params": {}}
        response = await handlers[path](Request(scope, receive))
        body = getattr(response, "body", None)
        if body is None:
            return _error("the predict route does not support streaming responses")
        try:
            return json.loads(body) if body else None
        except ValueError:
            return body.decode("utf-8", "replace")

    @endpoint
    async def predict(request: Request, app: AppContext) -> Response:
        data = json_body(await read_body(request, app.max_body_bytes))
        if not isinstance(data, dict):
            raise BadRequest("request body must be a JSON object")
        instances = data.get("instances")
        if not isinstance(instances, list):
            raise BadRequest("request body must include an array field named instances", param="instances")
        if len(instances) > MAX_INSTANCES:
            raise BadRequest(f"instances array exceeds maximum size of {MAX_INSTANCES}", param="instances")
        predictions = await asyncio.gather(*(run(request, app, i) for i in instances))
        return JSONResponse({"predictions": list(predictions)})

    return predict
