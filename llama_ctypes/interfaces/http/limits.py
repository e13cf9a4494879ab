"""What one HTTP request may ask for, checked before any work is done for it.

A request's total work is bounded before anything is submitted, tokenized or
compiled: one 60 KB body asking for ``prompt: ["a"] * 12000, n: 16`` was 192,000
queued requests. Beyond a bound the request gets a 400 that names the limit and
the ``llama-ctypes serve`` option that raises it (``create_app(limits=...)`` from
Python). The queue has its own bound per model (``--max-queue``, a 429 with
Retry-After), and a request's choices are queued together or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ...core.json_schema.limits import DEFAULT_SCHEMA_LIMITS, SchemaLimits
from ...core.media import MediaLimits
from ...core.params import check_positive
from ...errors import InvalidArgumentError
from .errors import BadRequest

__all__ = ["RequestLimits", "over_limit"]


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds of the HTTP server (counts and bytes)."""

    max_choices: int = 64
    """Requests one completion may submit: prompts × ``n`` (``--max-choices``)."""
    max_inputs: int = 2048
    """Embedding inputs, or rerank documents, per request (``--max-inputs``; OpenAI's embeddings limit)."""
    max_input_tokens: int = 300_000
    """Tokens of all embedding inputs (or rerank query-document pairs) of one request (``--max-input-tokens``)."""
    max_tokenize_bytes: int = 256 << 10
    """UTF-8 bytes of one /tokenize request's content (``--max-tokenize-bytes``). llama.cpp looks for each of
    the vocabulary's special tokens in each piece of text between two found ones (Gemma 3 has 6,400), about
    25 µs per special token in the text: 256 KiB of them costs at most ~0.4 s."""
    schema: SchemaLimits = DEFAULT_SCHEMA_LIMITS
    """Bounds of a ``response_format`` schema and of a request's tool schemas together."""
    media: MediaLimits = MediaLimits()
    """Bounds of a request's images and audio: bytes and pixels of each, how many (``--media-max-mb``,
    ``--media-max-items``); over them a 413 (a 400 for the count)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self) if f.name not in ("schema", "media")))
        if not isinstance(self.schema, SchemaLimits):
            raise InvalidArgumentError(f"RequestLimits.schema={self.schema!r}: expected a SchemaLimits")
        if not isinstance(self.media, MediaLimits):
            raise InvalidArgumentError(f"RequestLimits.media={self.media!r}: expected a MediaLimits")


def over_limit(what: str, count: int, limit: int, option: str, param: str | None = None) -> BadRequest:
    """The 400 for a request over one of its limits."""
    return BadRequest(f"{what}: {count}, over this server's limit of {limit} per request (raise it with {option})",
                      param=param, code="request_too_large")
