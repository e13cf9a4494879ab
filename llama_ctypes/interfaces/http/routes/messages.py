"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The request is converted to OpenAI chat fields (:mod:`llama_ctypes.features.anthropic`) and
goes through the chat pipeline of :mod:`.chat` (template, tools, reasoning, the batching
server); the reply comes back as an Anthropic ``message`` or as its stream events
(``message_start``, content blocks, ``message_delta``, ``message_stop``). Errors are in
Anthropic's shape (``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....features.anthropic import (
    MessageEvents,
    message_response,
    message_usage,
    new_message_id,
    stop_reason,
    to_openai,
)
from ..common import AppContext, endpoint, read_body
from ..generation import respond
from ..schemas import ConvertedChatRequest, MessagesCountRequest, MessagesRequest, parse, parse_object
from .chat import plan_request, start_chat


def _chat_request(fields: dict[str, Any]) -> ConvertedChatRequest:
    return parse_object(ConvertedChatRequest, fields)


@endpoint
async def messages(request: Request, app: AppContext) -> Response:
    body = parse(MessagesRequest, await read_body(request, app.max_body_bytes))
    chat = _chat_request(to_openai(body.model_dump(exclude_none=True)))
    model_id, plan, streams = await start_chat(request, app, chat)
    reply = _Reply(app, model_id, streams[0], plan.output(), body.stop_sequences or ())
    return await respond(request, streams, body.stream, reply.events, reply.complete, shape="anthropic")


@endpoint
async def count_tokens(request: Request, app: AppContext) -> Response:
    """The prompt's token count, as the conversation would be rendered (nothing is generated)."""
    body = parse(MessagesCountRequest, await read_body(request, app.max_body_bytes))
    chat = _chat_request(to_openai(body.model_dump(exclude_none=True), count_only=True))
    _, _, plan, _ = await plan_request(app, chat)
    return JSONResponse({"input_tokens": len(plan.prompt)})


class _Reply:
    """One Messages request's reply (one choice), whole or as events."""

    def __init__(self, app: AppContext, model_id: str, stream: Any, output: Any, stops: Any):
        self.app, self.model_id, self.stream, self.output = app, model_id, stream, output
        self.stops = frozenset(stops)
        self.id = new_message_id()

    def _stop_sequence(self) -> str | None:
        # (only the client's own: a chat format's end marker is an end of turn)
        word = self.stream.stop_word if self.stream.finish_reason == "stop" else None
        return word if word in self.stops else None

    def _usage(self) -> dict[str, int]:
        s = self.stream
        return message_usage(s.prompt_tokens, len(s.tokens), s.timings.cached_tokens)

    def _end(self) -> tuple[str, str | None]:
        s = self.stream
        self.app.metrics.generation_done(self.model_id, s.prompt_tokens, len(s.tokens), s.timings)
        word = self._stop_sequence()
        return stop_reason(s.finish_reason, bool(self.output.message.get("tool_calls")), word), word

    async def complete(self) -> dict[str, Any]:
        try:
            async for piece in self.stream:
                self.output.push(piece)
        except BaseException:
            self.stream.cancel()
            raise
        await self.output.aend(self.stream.finish_reason in (None, "length"))
        reason, word = self._end()
        return message_response(self.id, self.model_id, self.output.message, reason, word, self._usage())

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        builder = MessageEvents(self.id, self.model_id)
        started = False
        async for piece in self.stream:
            if not started:  # (after the prompt is read: the usage then counts the cached tokens)
                started = True
                yield builder.start(self._usage())
            for delta in await self.output.afeed(piece):
                for event in builder.feed(delta):
                    yield event
        if not started:
            yield builder.start(self._usage())
        for delta in await self.output.aend(self.stream.finish_reason in (None, "length")):
            for event in builder.feed(delta):
                yield event
        reason, word = self._end()
        for event in builder.finish(reason, word, len(self.stream.tokens)):
            yield event
