"""``chat_completion``/``stream_chat_completion``: a chat reply (or a stream of it) as OpenAI's dicts.

Requests with tools go through :mod:`..tool_calls` (llama.cpp's chat code plans the prompt and
parses the calls), the others through :mod:`..chat`; both come out in the same shapes, built by
:mod:`.shapes` (one usage object, one set of finish reasons, one kind of id).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from ...core.model import Model
from ...core.target import GenerationTarget, as_target
from .. import tool_calls
from ..chat import ChatStream, Message, chat, stream_chat
from .shapes import (ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, Envelope, chat_logprobs,
                     finish_reason, role_delta, usage)

__all__ = ["chat_completion", "stream_chat_completion"]


def _model_id(target: Model | GenerationTarget) -> str:
    return as_target(target).model.path.stem


def _without_tool_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k not in ("tool_choice", "parallel_tool_calls")}


def chat_completion(model: Model | GenerationTarget, messages: Sequence[Message], **opts: Any) -> ChatCompletion:
    """An OpenAI ``chat.completion`` dict for ``messages`` (a Model or a Server); options as
    :func:`~llama_ctypes.stream_chat`.

    With ``tools`` (and ``tool_choice``: ``"auto"``, ``"required"``, ``"none"`` or a named function;
    ``parallel_tool_calls``) the reply's ``tool_calls`` are parsed from the model's format
    (see :mod:`llama_ctypes.features.tool_calls`). With ``logprobs=k`` (0 for the chosen tokens only) the
    choice carries OpenAI's ``logprobs`` (``{"content": [...]}``, reasoning tokens included), else None.
    """
    envelope = Envelope("chat", _model_id(model))
    want_logprobs = opts.get("logprobs") is not None
    if tool_calls.wants_tools(opts):
        plan, text_stream = tool_calls.start_chat(model, messages, opts)
        out = plan.output()
        with text_stream:
            for piece in text_stream:
                out.push(piece)
            completion = text_stream.completion()
        message = out.finish(truncated=completion.finish_reason == "length")
        finish = finish_reason(completion.finish_reason, out.has_tool_calls)
        lps = chat_logprobs(completion.logprobs or []) if want_logprobs else None
        return envelope.response([{"index": 0, "message": message, "logprobs": lps, "finish_reason": finish}],
                                 usage(completion.prompt_tokens, len(completion.tokens),
                                       completion.timings.cached_tokens))  # type: ignore[return-value]
    reply = chat(model, messages, **_without_tool_options(opts))
    message: ChatCompletionMessage = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    lps = chat_logprobs(reply.logprobs or []) if want_logprobs else None
    return envelope.response([{"index": 0, "message": message, "logprobs": lps,
                               "finish_reason": finish_reason(reply.finish_reason)}],
                             reply.usage)  # type: ignore[return-value]


def stream_chat_completion(model: Model | GenerationTarget, messages: Sequence[Message], **opts: Any) -> Iterator[ChatCompletionChunk]:
    """OpenAI ``chat.completion.chunk`` dicts: a role chunk, content/reasoning deltas, a finish chunk.

    The last chunk carries ``usage``. Closing the iterator stops generation. With ``tools``,
    ``tool_calls`` arrive as deltas (see :func:`chat_completion`). With ``logprobs=k`` each chunk carries
    the log-probabilities of the tokens generated since the previous one (``{"content": [...]}``), as
    OpenAI's stream does; a chunk without new tokens carries None.
    """
    envelope = Envelope("chat", _model_id(model))
    logprobs = _NewLogprobs(opts.get("logprobs") is not None)
    if tool_calls.wants_tools(opts):
        plan, text_stream = tool_calls.start_chat(model, messages, opts)
        return _tool_chunks(envelope, plan, text_stream, logprobs)
    return _chunks(envelope, stream_chat(model, messages, **_without_tool_options(opts)), logprobs)


class _NewLogprobs:
    """A stream's token logprobs not yet sent in a chunk, as a chunk's ``logprobs`` (None when off or none)."""

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted
        self.sent = 0

    def take(self, source: Any) -> dict[str, Any] | None:
        lps = source.logprobs if self.wanted else None
        if not lps or len(lps) <= self.sent:
            return None
        new, self.sent = list(lps[self.sent:]), len(lps)
        return chat_logprobs(new)


def _choice(delta: dict[str, Any], finish: str | None = None,
            logprobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]


def _chunks(envelope: Envelope, chat_stream: ChatStream, logprobs: _NewLogprobs) -> Iterator[ChatCompletionChunk]:
    try:
        yield envelope.chunk(_choice(role_delta()))  # type: ignore[misc]
        for kind, text in chat_stream.deltas():
            delta = {"reasoning_content" if kind == "reasoning" else "content": text}
            yield envelope.chunk(_choice(delta, logprobs=logprobs.take(chat_stream)))  # type: ignore[misc]
        reply = chat_stream.reply()
        yield envelope.chunk(_choice({}, finish_reason(reply.finish_reason), logprobs.take(reply)),  # type: ignore[misc]
                             reply.usage)
    finally:
        chat_stream.close()


def _tool_chunks(envelope: Envelope, plan: Any, text_stream: Any,
                 logprobs: _NewLogprobs) -> Iterator[ChatCompletionChunk]:
    out = plan.output()
    with text_stream:
        yield envelope.chunk(_choice(role_delta()))  # type: ignore[misc]
        for piece in text_stream:
            for delta in out.feed(piece):
                yield envelope.chunk(_choice(delta, logprobs=logprobs.take(text_stream)))  # type: ignore[misc]
        completion = text_stream.completion()
        for delta in out.end(truncated=completion.finish_reason == "length"):
            yield envelope.chunk(_choice(delta, logprobs=logprobs.take(completion)))  # type: ignore[misc]
    yield envelope.chunk(_choice({}, finish_reason(completion.finish_reason, out.has_tool_calls),  # type: ignore[misc]
                                 logprobs.take(completion)),
                         usage(completion.prompt_tokens, len(completion.tokens), completion.timings.cached_tokens))
