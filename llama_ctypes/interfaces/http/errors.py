"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every endpoint raises :class:`APIError` for what it refuses itself; library errors
(:class:`~llama_ctypes.LlamaError` and its subclasses) are mapped to a status by
:func:`from_exception`, and anything else becomes a 500 whose body says nothing of
the internals (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from ...engines.server.scheduler import QueueFullError, ServerClosedError
from ...errors import (
    ArgumentTypeError,
    ClosedError,
    ContextOverflowError,
    InsufficientMemoryError,
    InvalidArgumentError,
    KVPoolFullError,
    LlamaError,
    MediaTooLargeError,
    RPCConnectionError,
    SchemaError,
)

logger = logging.getLogger(__name__)

#: Seconds a client is asked to wait after a 429 (queue full) or a 503 (loading).
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error response: HTTP status, OpenAI error type, the offending field (``param``) and a code."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        message, param = _utf8(message), _utf8(param)
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, shape: str = "openai") -> JSONResponse:
        """The JSON response; ``shape``: ``"openai"`` or ``"anthropic"`` (see :func:`shape_of`)."""
        body = self.anthropic_body() if shape == "anthropic" else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _utf8(text: str | None) -> str | None:
    """``text`` as it can be sent: a lone surrogate (from a header read with ``surrogateescape``, a file
    name, a tool's output) written as its escape, or the JSON answer would fail to encode (a 500)."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


#: Anthropic's error types by HTTP status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def shape_of(path: str) -> str:
    """The error shape of an endpoint: Anthropic's under ``/v1/messages``, OpenAI's elsewhere."""
    return "anthropic" if path.startswith(("/v1/messages", "/messages")) else "openai"


class BadRequest(APIError):
    status, type, code = 400, "invalid_request_error", None


class ContextExceeded(BadRequest):
    """A prompt that does not fit a slot: llama-server's type, OpenAI's code, and the two sizes."""

    type, code = "exceed_context_size_error", "context_length_exceeded"

    def __init__(self, message: str, *, n_prompt_tokens: int, n_ctx: int, param: str | None = None):
        super().__init__(message, param=param)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"].update(n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)
        return body


class Unauthorized(APIError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class NotFound(APIError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class BodyTooLarge(APIError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class TooManyRequests(APIError):
    status, type, code = 429, "rate_limit_error", "queue_full"

    def __init__(self, message: str, **kw: Any):
        super().__init__(message, headers={"Retry-After": str(RETRY_AFTER_S)}, **kw)


class Unavailable(APIError):
    status, type, code = 503, "unavailable_error", "unavailable"

    def __init__(self, message: str, **kw: Any):
        super().__init__(message, headers={"Retry-After": str(RETRY_AFTER_S)}, **kw)


class NotSupported(APIError):
    """An endpoint this server was started without (llama-server's ERROR_TYPE_NOT_SUPPORTED)."""

    status, type, code = 501, "not_supported_error", "not_supported"


class InternalError(APIError):
    status, type, code = 500, "server_error", None


def from_exception(exc: BaseException, *, param: str | None = None) -> APIError:
    """The response for an exception raised while serving a request (logs the unexpected ones)."""
    if isinstance(exc, APIError):
        return exc
    if param is None:
        param = getattr(exc, "param", None)  # (a library error that names its field)
    if isinstance(exc, QueueFullError):
        return TooManyRequests(str(exc))
    if isinstance(exc, (ServerClosedError, ClosedError, RPCConnectionError)):  # (RPC: the model lost a worker)
        return Unavailable(f"the model is not available: {exc}")
    if isinstance(exc, ContextOverflowError):
        return ContextExceeded(str(exc), n_prompt_tokens=exc.n_tokens, n_ctx=exc.n_ctx, param=param)
    if isinstance(exc, KVPoolFullError):  # (500 with its message, as llama-server's "Context size has been exceeded.")
        return InternalError(str(exc))
    if isinstance(exc, MediaTooLargeError):
        return BodyTooLarge(str(exc), param=param)
    if isinstance(exc, SchemaError):
        return BadRequest(str(exc), param=param or "response_format", code="invalid_schema")
    if isinstance(exc, InsufficientMemoryError):
        return Unavailable(str(exc))
    if isinstance(exc, (InvalidArgumentError, ArgumentTypeError)) or (
            isinstance(exc, LlamaError) and isinstance(exc, (ValueError, TypeError, IndexError))):
        return BadRequest(str(exc), param=param)
    logger.error("internal error while serving a request", exc_info=exc)
    return InternalError("internal server error")
