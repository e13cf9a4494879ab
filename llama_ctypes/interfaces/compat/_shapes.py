"""llama-cpp-python's response shapes, built from our results: chunks, usage, completion logprobs."""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

from ...errors import InvalidArgumentError

__all__ = ["completion_chunk", "collect", "token_usage", "finish_reason", "completion_logprobs", "response_schema",
           "restamp"]


def completion_chunk(envelope: dict[str, Any], text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {**envelope, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}


def collect(chunks: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """A streamed completion's chunks as the one ``text_completion`` dict."""
    text, last = [], None
    for last in chunks:
        text.append(last["choices"][0]["text"])
    assert last is not None
    choice = dict(last["choices"][0], text="".join(text))
    return {**{k: v for k, v in last.items() if k != "choices"}, "choices": [choice]}


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def completion_logprobs(entries: Any, offset: int) -> dict[str, Any]:
    """llama-cpp-python's completion logprobs: parallel lists, ``top_logprobs`` a dict per token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries or ():
        offsets.append(offset)
        text = entry.text
        tokens.append(text)
        token_logprobs.append(float(entry.logprob))
        alternatives = {alt.text: float(alt.logprob) for alt in entry.top}
        alternatives.setdefault(text, float(entry.logprob))
        top.append(alternatives)
        offset += len(text)
    return {"tokens": tokens, "text_offset": offsets, "token_logprobs": token_logprobs, "top_logprobs": top}


def response_schema(response_format: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """llama-cpp-python's ``{"type": "json_object", "schema": ...}`` and OpenAI's ``json_schema`` form."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return json.loads(schema) if isinstance(schema, str) else (schema or {"type": "object"})
    if kind == "json_schema":
        inner = response_format.get("json_schema") or {}
        return inner.get("schema") or {"type": "object"}
    raise InvalidArgumentError(f"response_format type {kind!r}: expected text, json_object or json_schema")


def restamp(out: Any, model: str) -> Any:
    out["model"] = model
    return out
