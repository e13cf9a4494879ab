"""POST /v1/chat/completions (also /chat/completions).

The chat pipeline (:func:`~llama_ctypes.features.tool_calls.plan_chat`) renders
and tokenizes the conversation in a worker thread; the ``n`` choices go to the
model's batching server as requests of their own (``Server.asubmit``), and each
choice's :class:`ChatOutput` turns its text into OpenAI deltas (content,
reasoning_content, tool_calls) and the final message.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....core.json_schema.convert import json_schema_to_gbnf
from ....core.json_schema.limits import SchemaLimits, check_schema_size
from ....core.media import MediaLimits
from ....errors import SchemaError
from ....features.chat_template import RESERVED_VARIABLES
from ....features.openai.shapes import Envelope, chat_logprobs, finish_reason, role_delta, timings, usage
from ....features.tool_calls import plan_chat
from ..common import SYSTEM_FINGERPRINT, AppContext, endpoint, read_body
from ..errors import BadRequest, from_exception
from ..generation import (
    cancel_all,
    gather_all,
    items,
    merge_options,
    new_logprobs,
    progress_json,
    progress_timings,
    sampling_options,
    submit,
    verbose_fields,
)
from ..json_answer import json_response
from ..limits import over_limit
from ..schemas import ChatCompletionRequest, ControlRequest, parse
from ..streaming import EventStream, merge, until_disconnect


def _template_options(body: ChatCompletionRequest) -> tuple[bool | None, dict[str, Any]]:
    """(enable_thinking, the other template variables) from ``chat_template_kwargs`` and ``reasoning_effort``."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_VARIABLES & set(kwargs))
    if reserved:
        raise BadRequest(f"invalid 'chat_template_kwargs.{reserved[0]}': {reserved[0]!r} is set by the server itself "
                         f"(reserved: {', '.join(sorted(RESERVED_VARIABLES))})",
                         param=f"chat_template_kwargs.{reserved[0]}")
    thinking = kwargs.pop("enable_thinking", None)
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("invalid 'chat_template_kwargs.enable_thinking': expected true or false",
                         param="chat_template_kwargs.enable_thinking")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return thinking, kwargs


def _plan(model: Any, body: ChatCompletionRequest, chat_template: str | None, limits: SchemaLimits,
          reasoning_format: str = "auto", media_limits: MediaLimits | None = None,
          fetch_media: Any = None, default_thinking: bool | None = None,
          budget: tuple[int, str] = (-1, "")) -> tuple[Any, dict[str, Any]]:
    """The chat plan and the generation options it requires (a worker thread: it renders, tokenizes and
    converts the JSON schema to a grammar)."""
    thinking, kwargs = _template_options(body)
    if thinking is None:
        thinking = default_thinking
    add_generation_prompt, continue_final = body.continuation()
    schema = body.output_schema()
    if schema is not None:  # (tools are measured by plan_chat, before llama.cpp's chat code converts them)
        check_schema_size([schema], limits, what="the response_format schema", hint=_SCHEMA_HINT)
    plan = plan_chat(model, [m.for_template() for m in body.messages], tools=body.tools,
                     tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
                     parallel_tool_calls=body.parallel_tool_calls, chat_template=chat_template,
                     enable_thinking=thinking, template_kwargs=kwargs, json_schema=schema, schema_limits=limits,
                     add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
                     parse_reasoning=(body.reasoning_format or reasoning_format) != "none",
                     media_limits=media_limits, allow_media_paths=False, fetch_media=fetch_media,
                     reasoning_budget=body.reasoning_budget(budget[0]),
                     reasoning_budget_message=body.reasoning_budget_message
                     if body.reasoning_budget_message is not None else budget[1])
    options = dict(plan.options)
    if options.get("json_schema") is not None:
        # converted here, off the event loop (the server's sampler would do it on submission)
        options["grammar"] = json_schema_to_gbnf(options.pop("json_schema"), limits)
    if body.grammar is not None:
        options["grammar"] = body.grammar
    return plan, options


_SCHEMA_HINT = "the server's schema limits are set by create_app(limits=RequestLimits(schema=SchemaLimits(...)))"


def _finish_reason(stream: Any, message: dict[str, Any]) -> str:
    # (a reply cut by the length limit is "length", even in the middle of a tool call)
    return finish_reason(stream.finish_reason, bool(message.get("tool_calls")))


def _truncated(stream: Any) -> bool:
    return stream.finish_reason in (None, "length")


async def plan_request(app: AppContext, body: ChatCompletionRequest) -> tuple[str, Any, Any, dict[str, Any]]:
    """(model id, its server, the chat plan, the generation options) of a chat request: rendered,
    tokenized and its schema compiled in a worker thread. Nothing is submitted."""
    await app.router.prepare(body.model)
    model_id, server = app.router.server(body.model)
    template = app.router.chat_template_of(model_id, server.model)
    try:
        plan, required = await anyio.to_thread.run_sync(
            functools.partial(_plan, server.model, body, template, app.limits.schema, app.reasoning_format,
                              app.limits.media, app.fetch_media, app.enable_thinking,
                              (app.reasoning_budget, app.reasoning_budget_message)))
    except SchemaError as e:  # (a tool's parameters, when there is no response_format)
        param = "json_schema" if body.json_schema is not None else \
            "response_format" if body.response_format is not None else "tools"
        raise from_exception(e, param=param) from None
    opts = merge_options(sampling_options(body, body.max_completion_tokens or body.max_tokens), required)
    if body.logprobs:
        opts["logprobs"] = body.top_logprobs or 0
    return model_id, server, plan, opts


async def start_chat(request: Request, app: AppContext, body: ChatCompletionRequest) -> tuple[str, Any, list]:
    """(model id, chat plan, the choices' async streams) of a chat request submitted to its model's server
    (``body.n`` requests, queued as one unit)."""
    if body.n > app.limits.max_choices:
        raise over_limit("n", body.n, app.limits.max_choices, "--max-choices", param="n")
    model_id, server, plan, opts = await plan_request(app, body)
    return model_id, plan, await submit(request, server, [plan.prompt], opts, body.n)


@endpoint
async def chat_completions(request: Request, app: AppContext) -> Response:
    body = parse(ChatCompletionRequest, await read_body(request, app.max_body_bytes))
    model_id, plan, streams = await start_chat(request, app, body)
    try:
        reply = _Reply(app, model_id, body, streams, [plan.output() for _ in streams], len(plan.prompt),
                       plan.prompt_text)
    except BaseException:
        cancel_all(streams)
        raise
    if body.stream:
        return EventStream(reply.chunks(), on_close=lambda: cancel_all(streams))  # type: ignore[return-value]
    result = await until_disconnect(request.receive, reply.complete(), lambda: cancel_all(streams))
    return await json_response(result)


class _Reply:
    """One chat request's choices, as one response or as a stream of chunks."""

    def __init__(self, app: AppContext, model_id: str, body: ChatCompletionRequest, streams: list, outputs: list,
                 prompt_tokens: int, prompt_text: str):
        self.app, self.model_id, self.body = app, model_id, body
        self.streams, self.outputs = streams, outputs
        self.prompt_tokens, self.prompt_text = prompt_tokens, prompt_text
        self.envelope = Envelope("chat", model_id, SYSTEM_FINGERPRINT, body.include_usage)
        self.verbose = app.verbose if body.verbose is None else body.verbose
        app.running_chats[self.envelope.id] = self  # (for /v1/chat/completions/control)

    def _extras(self, response: dict[str, Any]) -> dict[str, Any]:
        """llama-server's fields on a finished response: ``timings`` (of the first choice), ``__verbose``."""
        first = self.streams[0]
        response["timings"] = timings(first.timings)
        if self.verbose:
            response["__verbose"] = verbose_fields(first, self.prompt_text, self.outputs[0].text)
        return response

    def _usage(self) -> dict[str, Any]:
        cached = min((s.timings.cached_tokens for s in self.streams), default=0)
        return usage(self.prompt_tokens, sum(len(s.tokens) for s in self.streams), cached)

    def _done(self, stream: Any) -> None:
        self.app.metrics.generation_done(self.model_id, stream.prompt_tokens, len(stream.tokens), stream.timings)

    # ---- one response ----
    async def _choice(self, index: int) -> dict[str, Any]:
        stream, out = self.streams[index], self.outputs[index]
        async for piece in stream:
            out.push(piece)  # (no deltas: the message is parsed once, at the end)
        await out.aend(_truncated(stream))
        message = out.message
        self._done(stream)
        logprobs = chat_logprobs(stream.logprobs or []) if self.body.logprobs else None
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish_reason(stream, message)}

    async def complete(self) -> dict[str, Any]:
        choices = await gather_all([self._choice(i) for i in range(len(self.streams))], self.streams)
        return self._extras(self.envelope.response(choices, self._usage()))

    # ---- a stream of chunks ----
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self.envelope.chunk(choices)

    async def _choice_chunks(self, index: int) -> AsyncIterator[dict[str, Any]]:
        stream, out = self.streams[index], self.outputs[index]
        want_logprobs = bool(self.body.logprobs)
        sent = 0
        pending: list[Any] = []  # token logprobs not yet attached to a chunk

        def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            nonlocal pending
            lp = None
            if want_logprobs and pending:
                lp, pending = chat_logprobs(pending), []
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        async for piece in items(stream, self.body.return_progress and self.body.stream):
            if not isinstance(piece, str):
                chunk = self._chunk([])
                chunk["prompt_progress"] = progress_json(piece)
                if self.body.timings_per_token:
                    chunk["timings"] = progress_timings(piece)
                yield chunk
                continue
            deltas = await out.afeed(piece)
            if want_logprobs:
                new, sent = new_logprobs(stream, sent)
                pending += new
            for delta in deltas:
                chunk = self._chunk([choice(delta)])
                if self.body.timings_per_token:
                    chunk["timings"] = timings(stream.timings)
                yield chunk
        for delta in await out.aend(_truncated(stream)):
            yield self._chunk([choice(delta)])
        if want_logprobs:
            pending += new_logprobs(stream, sent)[0]
        message = out.message
        self._done(stream)
        last = self._chunk([choice({}, _finish_reason(stream, message))])
        last["timings"] = timings(stream.timings)
        if self.verbose:
            last["__verbose"] = verbose_fields(stream, self.prompt_text, out.text)
        yield last

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        for i in range(len(self.streams)):
            yield self._chunk([{"index": i, "delta": role_delta(), "logprobs": None,
                                "finish_reason": None}])
        async for chunk in merge([self._choice_chunks(i) for i in range(len(self.streams))]):
            yield chunk
        if self.body.include_usage:
            yield self._extras(self.envelope.usage_chunk(self._usage()))


@endpoint
async def control(request: Request, app: AppContext) -> Response:
    """llama-server's ``POST /v1/chat/completions/control``: ``{"id": <a running chat completion's id>,
    "action": "reasoning_end"}`` ends that completion's reasoning now (it was sent with
    ``reasoning_control: true``). ``{"success": false, "message": ...}`` when there is nothing to end."""
    body = parse(ControlRequest, await read_body(request, app.max_body_bytes))
    if not body.id:
        raise BadRequest("missing completion id", param="id")
    if body.action != "reasoning_end":
        raise BadRequest("unknown control action", param="action")
    reply = app.running_chats.get(body.id)
    running = [s for s in reply.streams if s.finish_reason is None] if reply is not None else []
    if not running:
        return JSONResponse({"success": False, "message": "no active completion for this id"})
    if not reply.body.reasoning_control:  # type: ignore[union-attr]
        return JSONResponse({"success": False, "message": "reasoning control not enabled for this completion"})
    _, server = app.router.server(reply.model_id)
    ended = [await anyio.to_thread.run_sync(server.end_reasoning, s) for s in running]
    if not any(ended):
        return JSONResponse({"success": False, "message": "no reasoning to end for this completion (reasoning "
                                                          "control not enabled, or its reasoning is over)"})
    return JSONResponse({"success": True})


@endpoint
async def input_tokens(request: Request, app: AppContext) -> Response:
    """llama-server's ``/v1/chat/completions/input_tokens``: the prompt's token count (nothing generated)."""
    body = parse(ChatCompletionRequest, await read_body(request, app.max_body_bytes))
    _, _, plan, _ = await plan_request(app, body)
    return JSONResponse({"input_tokens": len(plan.prompt)})


@endpoint
async def apply_template(request: Request, app: AppContext) -> Response:
    """llama-server's /apply-template: the prompt text a chat request renders to (nothing generated)."""
    body = parse(ChatCompletionRequest, await read_body(request, app.max_body_bytes))
    _, _, plan, _ = await plan_request(app, body)
    return JSONResponse({"prompt": plan.prompt_text})
