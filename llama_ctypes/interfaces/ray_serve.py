"""Replicas of the OpenAI-compatible HTTP server on Ray Serve, with session affinity.

    from ray import serve
    from llama_ctypes.interfaces.ray_serve import build_app

    serve.run(build_app("model.gguf", num_replicas=2, num_cpus=4), route_prefix="/")

Two deployments (see docs/scaling.md):

* :class:`LlamaReplica` (N replicas): each loads the model into its own :class:`ModelManager` and
  runs the app of ``llama-ctypes serve`` (:func:`create_app`) in-process; :meth:`LlamaReplica.forward`
  takes one HTTP request and streams back the response, with an ``X-Replica`` header naming the
  replica.
* :class:`SessionFront` (the HTTP entry, no CPU of its own): reads the request, derives its
  :func:`session_key` and calls the replicas through a handle with ``session_id=key``. The replicas'
  deployment routes with Ray Serve's ``ConsistentHashRouter`` (Ray 2.56+, experimental), so one
  session keeps reaching one replica, whose prefix cache still holds the conversation, while
  the set of replicas is unchanged.

Ray is imported only by the functions that need it; :func:`session_key` and :class:`LlamaReplica`
run without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle
    from starlette.requests import Request
    from starlette.responses import Response

logger = logging.getLogger(__name__)

#: A request header that names its session (Ray's proxy reads the same name, ``x-session-id``).
SESSION_HEADER = "x-session-id"
#: The response header that names the replica that answered.
REPLICA_HEADER = "x-replica"
#: Characters (or token ids) of a text-completion prompt that make its key: prompts that start alike go together.
PROMPT_KEY_LENGTH = 512
#: Ray Serve's consistent-hash request router (ray>=2.56).
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"

_CHAT_PATHS = ("/chat/completions",)
_COMPLETION_PATHS = ("/completions", "/completion")


def _digest(value: Any) -> str:
    data = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def conversation_start(messages: Any) -> list[Any] | None:
    """The messages up to and including the first user message: the same for every turn of a conversation."""
    if not isinstance(messages, list) or not messages:
        return None
    start = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        start.append([message.get("role"), message.get("content")])
        if message.get("role") == "user":
            break
    return start


def _prompt_start(prompt: Any) -> Any:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # (a batch of prompts: the first one)
    if isinstance(prompt, (str, list)) and prompt:
        return prompt[:PROMPT_KEY_LENGTH]
    return None


def session_key(path: str, headers: Mapping[str, str], body: bytes) -> str | None:
    """The routing key of one request, or None (any replica will do).

    In order: the ``X-Session-Id`` header; the OpenAI ``user`` field (one end user's conversations
    on one replica, which survives a client that trims old turns); a hash of how the conversation
    starts (chat: the messages through the first user message; text completion: the prompt's
    first :data:`PROMPT_KEY_LENGTH` characters or tokens). Conversations that start alike share a
    replica, and with it the cached prefix. ``headers`` lookups must ignore case (Starlette's
    ``Headers`` do) or use lower-case names.
    """
    value = headers.get(SESSION_HEADER)
    if value and value.strip():
        return "session:" + value.strip()
    path = path.rstrip("/")
    chat = path.endswith(_CHAT_PATHS)
    if not chat and not path.endswith(_COMPLETION_PATHS):
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # (the replica answers the 400)
    if not isinstance(data, dict):
        return None
    user = data.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    start = conversation_start(data.get("messages")) if chat else _prompt_start(data.get("prompt"))
    return None if start is None else "prefix:" + _digest(start)


def replica_name() -> str:
    """This replica's id inside Ray Serve (``Deployment#abc123``), else ``host:pid``."""
    serve = sys.modules.get("ray.serve")  # (a replica has imported it; elsewhere, no need to load Ray)
    if serve is not None:
        with contextlib.suppress(Exception):  # (not in a replica)
            rid = serve.get_replica_context().replica_id
            return f"{rid.deployment_id.name}#{rid.unique_id}"
    return f"{socket.gethostname()}:{os.getpid()}"


class LlamaReplica:
    """One replica: a model in its own :class:`ModelManager` and the HTTP app over it.

    Args:
        model_path: the GGUF file (every replica loads it itself; it must exist on every node).
        model_id: the model's name in requests (default: the file name without ``.gguf``).
        chat_template: a built-in chat format name or Jinja source (default: the model's own).
        api_key: when set, requests need it (``Authorization: Bearer ...``), as in ``llama-ctypes serve``.
        max_body_bytes: the app's request body limit.
        load_options: :meth:`ModelManager.load` options (``n_parallel``, ``n_ctx``, ``n_threads``, ...).
    """

    def __init__(self, model_path: str, *, model_id: str | None = None, chat_template: str | None = None,
                 api_key: str | None = None, max_body_bytes: int | None = None,
                 load_options: Mapping[str, Any] | None = None):
        from ..engines.manager import ModelManager
        from .http import ModelSettings, create_app
        from .http.common import MAX_BODY_BYTES
        from .http.serve import DEFAULT_MAX_TOKENS, pin_mmap_threshold

        model_id = model_id or os.path.splitext(os.path.basename(model_path))[0]
        self.replica = replica_name()
        pin_mmap_threshold()  # (a replica is a long-running server process too)
        self.manager = ModelManager()
        try:
            # (loaded before the constructor returns: Ray routes to a replica only once it is ready)
            self.manager.load(model_id, model_path, **{"max_tokens": DEFAULT_MAX_TOKENS, **(load_options or {})})
            self.app = create_app(self.manager, api_key=api_key, close_manager=True,
                                  models={model_id: ModelSettings(chat_template=chat_template)},
                                  max_body_bytes=max_body_bytes or MAX_BODY_BYTES)
        except BaseException:
            self.manager.close()
            raise
        logger.info("replica %s serves %s as %r", self.replica, model_path, model_id)

    async def forward(self, method: str, path: str, query_string: bytes, headers: Sequence[tuple[bytes, bytes]],
                      body: bytes, root_path: str = "") -> AsyncIterator[dict[str, Any] | bytes]:
        """Run one HTTP request through the app: yields ``{"status", "headers"}``, then the body's chunks.

        Cancelling the generator (the caller left) cancels the request: the app's disconnect
        watch sees ``http.disconnect`` and its generations are cancelled.
        """
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        finished = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()  # (the caller is gone only when this generator ends)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await queue.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": root_path,
                 "query_string": query_string, "headers": [(k.lower(), v) for k, v in headers],
                 "client": None, "server": None, "state": {}}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        started = False
        try:
            while (message := await queue.get()) is not None:
                if message["type"] == "http.response.start":
                    started = True
                    yield {"status": message["status"],
                           "headers": [*message.get("headers", ()), (REPLICA_HEADER.encode(), self.replica.encode())]}
                elif message["type"] == "http.response.body" and message.get("body"):
                    yield bytes(message["body"])
            error = None if task.cancelled() else task.exception()
            if not started:
                raise RuntimeError(f"the app ended without a response to {method} {path}") from error
            if error is not None:  # (the app already answered 500; the traceback is for the log)
                logger.error("%s %s failed", method, path, exc_info=error)
        finally:
            finished.set()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        """Refuse new requests and free the model."""
        self.app.state.llama.closing = True
        self.manager.close()

    def __del__(self) -> None:  # (Ray Serve calls it when it stops a replica)
        if "app" in self.__dict__:
            self.close()


class SessionFront:
    """The HTTP entry: each request goes to the replica its :func:`session_key` hashes to.

    Ray Serve calls it with a Starlette ``Request``; it answers with a streamed ``Response``.
    """

    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int | None = None, affinity: bool = True):
        from .http.common import MAX_BODY_BYTES

        self.replicas = replicas  # (a DeploymentHandle of LlamaReplica, routed by ConsistentHashRouter)
        self.max_body_bytes = max_body_bytes or MAX_BODY_BYTES
        self.affinity = affinity

    async def __call__(self, request: Request) -> Response:
        from starlette.responses import StreamingResponse

        from .http.common import read_body
        from .http.errors import APIError, Unavailable

        try:
            body = await read_body(request, self.max_body_bytes)
        except APIError as exc:
            return exc.response()
        key = session_key(request.url.path, request.headers, body) if self.affinity else None
        handle = self.replicas.options(stream=True, **({"session_id": key} if key else {}))
        scope = request.scope
        stream = handle.forward.remote(scope["method"], scope["path"], scope.get("query_string", b""),
                                       list(request.headers.raw), body, scope.get("root_path", ""))
        try:
            start = await stream.__anext__()
        except asyncio.CancelledError:  # (the client left before the response began)
            stream.cancel()
            raise
        except Exception as exc:  # (no replica could take it, or it died)
            logger.warning("no replica answered %s %s: %s", scope["method"], scope["path"], exc)
            return Unavailable("no replica could answer the request").response()

        async def chunks() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in stream:
                    yield chunk
                done = True
            finally:
                if not done:  # (the client left: cancel the replica's request, and with it the generation)
                    stream.cancel()

        response = StreamingResponse(chunks(), status_code=start["status"])
        response.raw_headers = list(start["headers"])
        return response


def build_app(model_path: str, *, model_id: str | None = None, chat_template: str | None = None,
              api_key: str | None = None, num_replicas: int = 2, autoscaling_config: Mapping[str, Any] | None = None,
              num_cpus: float = 1, num_gpus: float = 0, max_ongoing_requests: int | None = None,
              num_fallback_replicas: int = 2, affinity: bool = True, max_body_bytes: int | None = None,
              **load_options: Any) -> Application:
    """A Ray Serve application: :class:`SessionFront` → ``num_replicas`` × :class:`LlamaReplica`.

    Args:
        model_path, model_id, chat_template, api_key, max_body_bytes: as :class:`LlamaReplica`.
        num_replicas: fixed replica count (ignored with ``autoscaling_config``).
        autoscaling_config: Ray Serve's autoscaling (``min_replicas``, ``max_replicas``,
            ``target_ongoing_requests``, ...); a change of the replica set moves about 1/N of
            the sessions.
        num_cpus: CPUs Ray reserves per replica; also the default ``n_threads`` of its model.
        num_gpus: GPUs Ray reserves per replica (it sets ``CUDA_VISIBLE_DEVICES``; pass ``n_gpu_layers``).
        max_ongoing_requests: requests one replica takes at once (default: twice ``n_parallel``,
            so a session's burst queues at its own replica); past it a request goes to the next
            replica on the ring.
        num_fallback_replicas: replicas tried after a session's own one is full (0: wait for it).
        affinity: False sends every request to a random replica (to measure what affinity gives).
        load_options: :meth:`ModelManager.load` options (``n_parallel``, ``n_ctx``, ``n_threads``, ...).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    load_options.setdefault("n_threads", max(1, int(num_cpus)))
    load_options.setdefault("n_threads_batch", load_options["n_threads"])
    n_parallel = int(load_options.get("n_parallel", 4))
    scaling: dict[str, Any] = ({"autoscaling_config": dict(autoscaling_config)} if autoscaling_config
                               else {"num_replicas": num_replicas})
    replicas = serve.deployment(LlamaReplica).options(
        name="LlamaReplica", ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=max_ongoing_requests or 2 * n_parallel,
        request_router_config=RequestRouterConfig(
            request_router_class=CONSISTENT_HASH_ROUTER,
            request_router_kwargs={"num_fallback_replicas": num_fallback_replicas}),
        **scaling,
    ).bind(model_path, model_id=model_id, chat_template=chat_template, api_key=api_key,
           max_body_bytes=max_body_bytes, load_options=load_options)
    # (the front only relays bytes: no CPU reserved, many requests at once)
    front = serve.deployment(SessionFront).options(
        name="SessionFront", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return front.bind(replicas, max_body_bytes=max_body_bytes, affinity=affinity)


__all__ = ["LlamaReplica", "SessionFront", "build_app", "conversation_start", "replica_name", "session_key",
           "SESSION_HEADER", "REPLICA_HEADER"]
