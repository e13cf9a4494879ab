"""POST /v1/completions (also /completions): text completion of one or several prompts.

A prompt is a text or a list of token ids; texts are tokenized in a worker
thread. Each prompt gets ``n`` choices (choice ``p * n + j``), each a request
of its own to the batching server.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import Response

from ....core.generation import GenerationParams
from ....core.json_schema.convert import json_schema_to_gbnf
from ....core.prompt import prompt_tokens
from ....errors import SchemaError
from ....features.openai.shapes import Envelope, completion_logprobs, finish_reason, timings, usage
from ..common import SYSTEM_FINGERPRINT, AppContext, endpoint, read_body
from ..errors import BadRequest, from_exception
from ..generation import cancel_all, gather_all, new_logprobs, sampling_options, submit
from ..json_answer import json_response
from ..limits import over_limit
from ..schemas import CompletionRequest, parse
from ..streaming import EventStream, merge, until_disconnect


def _tokenize(model: Any, prompts: list, n_ctx: int, echo: bool) -> tuple[list[list[int]], list[str]]:
    """Token ids of every prompt, and their texts when they are echoed (a worker thread)."""
    params = GenerationParams()
    ids = [prompt_tokens(model, p, params, n_ctx) for p in prompts]
    texts = [p if isinstance(p, str) else model.vocab.detokenize(p) for p in prompts] if echo else []
    return ids, texts


def _constraint(body: CompletionRequest, limits: Any) -> dict[str, Any]:
    """The grammar option of llama-server's ``grammar`` or ``json_schema`` field (a worker thread)."""
    if body.grammar is not None and body.json_schema is not None:
        raise BadRequest("grammar and json_schema cannot be combined: give one constraint", param="json_schema")
    if body.grammar is not None:
        return {"grammar": body.grammar}
    if body.json_schema is not None:
        try:
            return {"grammar": json_schema_to_gbnf(body.json_schema, limits)}
        except SchemaError as e:
            raise from_exception(e, param="json_schema") from None
    return {}


@endpoint
async def completions(request: Request, app: AppContext) -> Response:
    body = parse(CompletionRequest, await read_body(request, app.max_body_bytes))
    prompts = body.prompts()
    if len(prompts) * body.n > app.limits.max_choices:  # (before tokenizing anything)
        raise over_limit(f"{len(prompts)} prompts × n={body.n} requests", len(prompts) * body.n,
                         app.limits.max_choices, "--max-choices", param="prompt")
    await app.router.prepare(body.model)
    model_id, server = app.router.server(body.model)
    ids, echoed = await anyio.to_thread.run_sync(
        functools.partial(_tokenize, server.model, prompts, server.n_ctx, body.echo))
    opts = sampling_options(body, body.max_tokens)
    opts.update(await anyio.to_thread.run_sync(functools.partial(_constraint, body, app.limits.schema)))
    if body.logprobs is not None:
        opts["logprobs"] = body.logprobs
    streams = await submit(request, server, ids, opts, body.n)
    reply = _Reply(app, model_id, body, streams, [len(t) for t in ids], echoed)
    if body.stream:
        return EventStream(reply.chunks(), on_close=lambda: cancel_all(streams))  # type: ignore[return-value]
    result = await until_disconnect(request.receive, reply.complete(), lambda: cancel_all(streams))
    return await json_response(result)


class _Reply:
    def __init__(self, app: AppContext, model_id: str, body: CompletionRequest, streams: list,
                 prompt_lengths: list[int], echoed: list[str]):
        self.app, self.model_id, self.body, self.streams = app, model_id, body, streams
        self.prompt_lengths, self.echoed = prompt_lengths, echoed
        self.envelope = Envelope("text", model_id, SYSTEM_FINGERPRINT, body.include_usage)

    def _prefix(self, index: int) -> str:
        return self.echoed[index // self.body.n] if self.body.echo else ""

    def _usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_lengths), sum(len(s.tokens) for s in self.streams),
                     sum(s.timings.cached_tokens for s in self.streams[::self.body.n]))

    def _done(self, stream: Any) -> None:
        self.app.metrics.generation_done(self.model_id, stream.prompt_tokens, len(stream.tokens), stream.timings)

    def _logprobs(self, lps: list, offset: int) -> dict[str, Any] | None:
        return completion_logprobs(lps, offset) if self.body.logprobs is not None else None

    async def _choice(self, index: int) -> dict[str, Any]:
        stream = self.streams[index]
        pieces = [piece async for piece in stream]
        self._done(stream)
        prefix = self._prefix(index)
        return {"index": index, "text": prefix + "".join(pieces),
                "logprobs": self._logprobs(stream.logprobs or [], len(prefix)),
                "finish_reason": finish_reason(stream.finish_reason)}

    async def complete(self) -> dict[str, Any]:
        choices = await gather_all([self._choice(i) for i in range(len(self.streams))], self.streams)
        return {**self.envelope.response(choices, self._usage()), "timings": timings(self.streams[0].timings)}

    def _chunk(self, index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return self.envelope.chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    async def _choice_chunks(self, index: int) -> AsyncIterator[dict[str, Any]]:
        stream = self.streams[index]
        offset = len(self._prefix(index))
        if offset:
            yield self._chunk(index, self._prefix(index), None, None)
        sent = 0
        async for piece in stream:
            new, sent = new_logprobs(stream, sent) if self.body.logprobs is not None else ([], 0)
            yield self._chunk(index, piece, self._logprobs(new, offset) if new else None, None)
            offset += len(piece)
        rest = new_logprobs(stream, sent)[0] if self.body.logprobs is not None else []
        self._done(stream)
        last = self._chunk(index, "", self._logprobs(rest, offset) if rest else None,
                           finish_reason(stream.finish_reason))
        last["timings"] = timings(stream.timings)
        yield last

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        async for chunk in merge([self._choice_chunks(i) for i in range(len(self.streams))]):
            yield chunk
        if self.body.include_usage:
            yield self.envelope.usage_chunk(self._usage())
