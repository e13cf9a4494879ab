"""OpenAI's response shapes, built in one place for the Python API and the HTTP server.

The TypedDicts name the fields; :class:`Envelope` builds the objects one response
shares (id, created, model); :func:`usage` and :func:`finish_reason` give every
path the same usage object and the same finish reasons. A leaf: it imports
nothing of the library, so chat, tool calls and the HTTP routes can all use it.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, TypedDict

__all__ = ["role_delta", "ChatCompletionMessage", "ChatCompletionChoice", "PromptTokensDetails", "CompletionUsage",
           "ChatCompletion", "ChatCompletionChunk", "Envelope", "FINISH_REASONS", "finish_reason", "usage",
           "input_usage", "timings", "new_id", "new_call_id", "logprob_value", "chat_logprobs", "completion_logprobs"]


class ChatCompletionMessage(TypedDict, total=False):
    role: str
    content: str | None
    reasoning_content: str
    tool_calls: list[dict[str, Any]]


class ChatCompletionChoice(TypedDict):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(TypedDict):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class ChatCompletionChunk(TypedDict, total=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: CompletionUsage | None


#: OpenAI's finish reasons for a generation's ("eog": the model ended its turn).
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length"}


def finish_reason(reason: str | None, has_tool_calls: bool = False) -> str:
    """OpenAI's finish reason: ``"length"`` when the length limit cut the reply (even in the middle of a
    tool call, as llama-server does), else ``"tool_calls"`` when it calls tools, else ``"stop"``.

    ``reason``: the generation's (``"eog"``, ``"stop"``, ``"length"``; None counts as ``"length"``).
    """
    if reason is None or reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


#: What a log-probability of -inf (or NaN) becomes: JSON has no infinities (OpenAI sends -9999.0 too).
NO_LOGPROB = -9999.0


def logprob_value(value: float) -> float:
    """A log-probability as JSON can carry it."""
    return value if math.isfinite(value) else NO_LOGPROB


def _logprob_entry(lp: Any) -> dict[str, Any]:
    return {"token": lp.text, "logprob": logprob_value(lp.logprob), "bytes": list(lp.bytes)}


def chat_logprobs(lps: Sequence[Any]) -> dict[str, Any]:
    """Chat completions' ``logprobs`` from :class:`~llama_ctypes.TokenLogprob` entries:
    ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    return {"content": [{**_logprob_entry(lp), "top_logprobs": [_logprob_entry(alt) for alt in lp.top]}
                        for lp in lps],
            "refusal": None}


def completion_logprobs(lps: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """Text completions' ``logprobs``: parallel lists of tokens, logprobs, top alternatives, text offsets."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": [lp.text for lp in lps], "token_logprobs": [logprob_value(lp.logprob) for lp in lps],
            "top_logprobs": [{alt.text: logprob_value(alt.logprob) for alt in lp.top} for lp in lps],
            "text_offset": offsets}


def role_delta() -> dict[str, Any]:
    """The delta of a stream's first chunk: the role, and no content yet (``null``, as llama-server sends;
    OpenAI clients read it as no text)."""
    return {"role": "assistant", "content": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> CompletionUsage:
    """OpenAI's usage object: token counts, and the prompt tokens served from a cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def timings(t: Any) -> dict[str, Any]:
    """llama-server's ``timings`` object from a generation's :class:`~llama_ctypes.Timings` (milliseconds):
    the prompt tokens read from the cache (``cache_n``) and evaluated (``prompt_n``), the tokens generated
    (``predicted_n``), and their rates. As llama-server's, the generation's time runs from the first token
    to the last, and its rate is over the decode steps in it (``predicted_n - 1``: the first token comes
    with the prompt), 0 for a single token."""
    prompt_n = t.prompt_tokens - t.cached_tokens
    predicted_n = t.generated_tokens
    steps = max(0, predicted_n - 1)

    def per_token(ms: float, n: int) -> float:
        return ms / n if n > 0 and ms > 0 else 0.0

    def per_second(ms: float, n: int) -> float:
        return n * 1e3 / ms if ms > 0 and n > 0 else 0.0

    return {"cache_n": t.cached_tokens, "prompt_n": prompt_n, "prompt_ms": t.prompt_ms,
            "prompt_per_token_ms": per_token(t.prompt_ms, prompt_n),
            "prompt_per_second": per_second(t.prompt_ms, prompt_n),
            "predicted_n": predicted_n, "predicted_ms": t.generation_ms,
            "predicted_per_token_ms": per_token(t.generation_ms, steps),
            "predicted_per_second": per_second(t.generation_ms, steps)}


def input_usage(prompt_tokens: int) -> dict[str, int]:
    """The usage object of the embedding and rerank endpoints: input tokens only."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def new_id(prefix: str) -> str:
    """A response id: ``prefix-`` and 24 random hex digits (``chatcmpl``, ``cmpl``)."""
    return f"{prefix}-{secrets.token_hex(12)}"


def new_call_id() -> str:
    """A tool call's id, for a format whose calls carry none."""
    return "call_" + secrets.token_hex(12)


_KINDS = {"chat": ("chatcmpl", "chat.completion", "chat.completion.chunk"),
          "text": ("cmpl", "text_completion", "text_completion")}


@dataclass(frozen=True)
class Envelope:
    """The fields every object of one response shares (a whole response, or each of its chunks).

    kind: ``"chat"`` (chat.completion) or ``"text"`` (text_completion). system_fingerprint: included
    when given. include_usage: chunks carry ``"usage": null`` and a last chunk the usage, as OpenAI
    streams do with ``stream_options.include_usage``.
    """

    kind: Literal["chat", "text"]
    model: str
    system_fingerprint: str | None = None
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind={self.kind!r}: expected 'chat' or 'text'")
        if not self.id:
            object.__setattr__(self, "id", new_id(_KINDS[self.kind][0]))

    def _base(self, obj: str) -> dict[str, Any]:
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.system_fingerprint is not None:
            base["system_fingerprint"] = self.system_fingerprint
        return base

    def response(self, choices: list[dict[str, Any]], usage: CompletionUsage) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        return {**self._base(_KINDS[self.kind][1]), "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict[str, Any]], usage: CompletionUsage | None = None) -> dict[str, Any]:
        """One streamed chunk; ``usage`` given: it carries it (else ``null`` with include_usage)."""
        chunk = {**self._base(_KINDS[self.kind][2]), "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        elif self.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return chunk

    def usage_chunk(self, usage: CompletionUsage) -> dict[str, Any]:
        """The last chunk of an include_usage stream: no choices, the usage."""
        return self.chunk([], usage)
