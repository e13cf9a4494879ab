"""OpenAI's Responses API: POST /v1/responses and /v1/responses/input_tokens (stateless).

The request is converted to chat fields (:mod:`llama_ctypes.features.openai.responses`) and goes
through the chat pipeline of :mod:`.chat`; the reply comes back as a ``response`` object or as its
``response.*`` events. Nothing is stored: a request carries its whole conversation.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....features.openai.responses import (
    ResponseEvents,
    new_item_id,
    output_items,
    response_object,
    response_usage,
    to_chat,
)
from ....features.openai.shapes import timings
from ..common import AppContext, endpoint, read_body
from ..generation import items, progress_json, progress_timings, respond, verbose_fields
from ..schemas import ConvertedChatRequest, ResponsesCountRequest, ResponsesRequest, parse, parse_object
from .chat import plan_request, start_chat


@endpoint
async def responses(request: Request, app: AppContext) -> Response:
    body = parse(ResponsesRequest, await read_body(request, app.max_body_bytes))
    fields = body.model_dump(exclude_none=True)
    chat = parse_object(ConvertedChatRequest, to_chat(fields))
    model_id, plan, streams = await start_chat(request, app, chat)
    reply = _Reply(app, model_id, fields, chat, streams[0], plan.output(), plan.prompt_text)
    return await respond(request, streams, body.stream, reply.events, reply.complete, shape="responses")


@endpoint
async def input_tokens(request: Request, app: AppContext) -> Response:
    """The prompt's token count, as the input would be rendered (nothing is generated)."""
    body = parse(ResponsesCountRequest, await read_body(request, app.max_body_bytes))
    chat = parse_object(ConvertedChatRequest, to_chat(body.model_dump(exclude_none=True), count_only=True))
    _, _, plan, _ = await plan_request(app, chat)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(plan.prompt)})


class _Reply:
    """One Responses request's reply, whole or as events."""

    def __init__(self, app: AppContext, model_id: str, fields: dict[str, Any], chat: ConvertedChatRequest,
                 stream: Any, output: Any, prompt_text: str):
        self.app, self.model_id, self.fields, self.chat = app, model_id, fields, chat
        self.stream, self.output, self.prompt_text = stream, output, prompt_text
        self.id = new_item_id("resp")
        self.created = time.time()
        self.verbose = app.verbose if chat.verbose is None else chat.verbose

    def _truncated(self) -> bool:
        return self.stream.finish_reason in (None, "length")

    def _response(self, output: list[dict[str, Any]], status: str, usage: Any) -> dict[str, Any]:
        return response_object(self.id, self.model_id, self.fields, created=self.created, output=output,
                               status=status, usage=usage)

    def _final(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        s = self.stream
        self.app.metrics.generation_done(self.model_id, s.prompt_tokens, len(s.tokens), s.timings)
        usage = response_usage(s.prompt_tokens, len(s.tokens), s.timings.cached_tokens)
        return self._response(output, "incomplete" if self._truncated() else "completed", usage)

    def _extras(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["timings"] = timings(self.stream.timings)  # (llama-server's extension)
        if self.verbose:
            obj["__verbose"] = verbose_fields(self.stream, self.prompt_text, self.output.text)
        return obj

    async def complete(self) -> dict[str, Any]:
        try:
            async for piece in self.stream:
                self.output.push(piece)
        except BaseException:
            self.stream.cancel()
            raise
        await self.output.aend(self._truncated())
        status = "incomplete" if self._truncated() else "completed"
        return self._extras(self._final(output_items(self.output.message, status)))

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        events = ResponseEvents()
        for event in events.start(self._response([], "in_progress", None)):
            yield event
        per_token = self.chat.timings_per_token
        async for piece in items(self.stream, self.chat.return_progress):
            if not isinstance(piece, str):  # (llama-server's extension of the in_progress event)
                event = events.event("response.in_progress", response=self._response([], "in_progress", None))
                event["prompt_progress"] = progress_json(piece)
                if per_token:
                    event["timings"] = progress_timings(piece)
                yield event
                continue
            extra = {"timings": timings(self.stream.timings)} if per_token else {}
            for delta in await self.output.afeed(piece):
                for event in events.feed(delta, **extra):
                    yield event
        for delta in await self.output.aend(self._truncated()):
            for event in events.feed(delta):
                yield event
        final = events.finish(self._final([]))
        self._extras(final[-1])
        for event in final:
            yield event
