"""llama-server's own completion API: POST /completion and POST /infill (not OpenAI's shape).

A prompt is a text, token ids, a mix of both, ``{"prompt_string": ...}``, or a list of those
(several prompts: a list of results, or chunks with their ``index``). The response carries
llama-server's fields (``content``, ``tokens``, ``stop``, ``stop_type``, ``stopping_word``,
``generation_settings``, ``timings``, ``completion_probabilities`` with ``n_probs``, ...);
``response_fields`` picks some of them. ``/infill`` builds a fill-in-the-middle prompt from the
vocabulary's FIM tokens (:mod:`llama_ctypes.features.infill`) and answers in the same shape.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import random
from typing import Any, AsyncIterator, Sequence

import anyio
from starlette.requests import Request
from starlette.responses import Response

from ....core.generation import GenerationParams
from ....core.json_schema.convert import json_schema_to_gbnf
from ....core.media import MediaLimits, decode_data_url
from ....core.projector import MEDIA_MARKER
from ....core.prompt import prompt_tokens
from ....errors import InvalidArgumentError, MediaError, MediaTooLargeError, SchemaError
from ....features.infill import InfillError, infill_prompt
from ....features.openai.shapes import timings
from ..common import AppContext, endpoint, read_body
from ..errors import BadRequest, NotSupported, from_exception
from ..generation import gather_all, items, lora_option, progress_json, progress_timings, respond, submit
from ..limits import over_limit
from ..schemas import InfillRequest, NativeCompletionRequest, parse
from ..streaming import merge
from .service import generation_settings

_STOP_TYPES = {"eog": "eos", "stop": "word", "length": "limit"}
_SEED_MOD = 0xFFFFFFFF


# ---- the request --------------------------------------------------------------------------------

def _is_mixed(prompt: list) -> bool:
    """A list of token ids and texts that make one prompt (at least one id, nothing nested)."""
    return any(isinstance(x, int) and not isinstance(x, bool) for x in prompt) and all(
        isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in prompt)


def _one_prompt(vocab: Any, prompt: Any, n_ctx: int, where: str, model: Any = None,
                media_limits: MediaLimits | None = None, media_seen: list[int] | None = None) -> list[int]:
    params = GenerationParams()
    if isinstance(prompt, str):
        return prompt_tokens(vocab, prompt, params, n_ctx)
    if isinstance(prompt, dict):
        text = prompt.get("prompt_string")
        if not isinstance(text, str):
            raise BadRequest("a prompt object needs 'prompt_string' (a string)", param=f"{where}.prompt_string")
        if prompt.get("multimodal_data") is not None:
            return _media_prompt(model, text, prompt["multimodal_data"], params, f"{where}.multimodal_data",
                                 media_limits, media_seen if media_seen is not None else [0])
        return prompt_tokens(vocab, text, params, n_ctx)
    if isinstance(prompt, list) and _is_mixed(prompt):
        tokens: list[int] = []
        for i, part in enumerate(prompt):  # (as llama-server: special tokens added before the first text only)
            if isinstance(part, str):
                tokens += vocab.tokenize(part, add_special=i == 0, parse_special=True)
            else:
                tokens.append(part)
        return vocab.check_tokens(tokens).tolist()
    raise BadRequest("a prompt is a string, a list of token ids (and strings), or {'prompt_string': ...}",
                     param=where)


def _media_prompt(model: Any, text: str, data: Any, params: GenerationParams, where: str,
                  limits: MediaLimits | None, seen: list[int]) -> list[int]:
    """llama-server's ``{"prompt_string": "... <__media__> ...", "multimodal_data": [base64, ...]}``: one
    image or clip per marker (:data:`~llama_ctypes.MEDIA_MARKER`, /props' ``media_marker``). ``seen``: the
    media of the request's earlier prompts (its total is bounded by ``limits.max_items``, whatever the
    number of prompts)."""
    projector = getattr(model, "projector", None)
    if projector is None:
        raise BadRequest("multimodal prompts are not supported by this model (no projector is loaded)", param=where)
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise BadRequest("multimodal_data must be a list of base64 strings", param=where)
    limits = limits or MediaLimits()
    seen[0] += len(data)
    if seen[0] > limits.max_items:
        error = MediaTooLargeError(f"{where}: more than {limits.max_items} media in one request")
        error.param = where  # type: ignore[attr-defined]
        raise error
    items = []
    for j, item in enumerate(data):
        at = f"{where}[{j}]"
        try:
            raw = decode_data_url(item, limits) if item[:5].lower() == "data:" else \
                base64.b64decode(item, validate=True)
            items.append(dataclasses.replace(projector.read(raw, limits, allow_paths=False), source=at))
        except MediaError as exc:
            error = type(exc)(f"{at}: {exc}")
            error.param = at  # type: ignore[attr-defined]
            raise error from None
        except (binascii.Error, ValueError) as exc:
            raise BadRequest(f"{at}: not base64 ({exc})", param=at) from None
    return projector.tokenize(text.replace(MEDIA_MARKER, projector.marker), items, add_special=params.add_special,
                              parse_special=params.parse_special, limits=limits)


def prompt_text(vocab: Any, prompt: list[int]) -> str:
    """A prompt's text as /completion's ``prompt`` field shows it: media as :data:`MEDIA_MARKER`."""
    spans = getattr(prompt, "spans", None)
    if not spans:
        return vocab.detokenize(prompt, unparse_special=True)
    out, at = [], 0
    for span in spans:
        out += [vocab.detokenize(prompt[at:span.start], unparse_special=True), MEDIA_MARKER]
        at = span.end
    return "".join(out) + vocab.detokenize(prompt[at:], unparse_special=True)


def native_prompts(vocab: Any, prompt: Any, n_ctx: int, limit: int | None = None, model: Any = None,
                   media_limits: MediaLimits | None = None) -> list[list[int]]:
    """The token ids of each prompt of a /completion request (a worker thread); more than ``limit``
    prompts are refused before any is tokenized. ``model``: the model whose projector takes a prompt's
    ``multimodal_data``."""
    if isinstance(prompt, list) and prompt and not _is_mixed(prompt):
        if limit is not None and len(prompt) > limit:
            raise over_limit(f"{len(prompt)} prompts", len(prompt), limit, "--max-choices", param="prompt")
        seen = [0]
        return [_one_prompt(vocab, p, n_ctx, f"prompt[{i}]", model, media_limits, seen) for i, p in enumerate(prompt)]
    return [_one_prompt(vocab, prompt, n_ctx, "prompt", model, media_limits)]


def _logit_bias(vocab: Any, bias: Any) -> dict[int, float]:
    """llama-server's logit_bias: ``[[token or text, bias or false], ...]`` or ``{token or text: bias}``;
    a text biases each of its tokens; false (or -100 and below) bans."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    out: dict[int, float] = {}
    for i, pair in enumerate(pairs):
        if not isinstance(bias, dict) and (not isinstance(pair, list) or len(pair) != 2):
            raise BadRequest("logit_bias entries are [token or text, bias or false]", param=f"logit_bias[{i}]")
        key, value = pair
        if value is False:
            value = float("-inf")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest("a logit bias is a number or false", param="logit_bias")
        elif value <= -100:
            value = float("-inf")
        if isinstance(key, str) and key.isascii() and key.isdigit() and isinstance(bias, dict):
            if len(key) > 10:  # (int() refuses more than 4300 digits; no token id has more than 10)
                raise BadRequest(f"logit bias key {key[:20]}... is not a token id (over 10 digits)",
                                 param="logit_bias")
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [int(vocab.check_token(key))]
        elif isinstance(key, str):
            ids = vocab.tokenize(key, add_special=False, parse_special=False)
        else:
            raise BadRequest("a logit bias key is a token id or a text", param="logit_bias")
        for tok in ids:
            out[tok] = float(value)
    return out


def _options(body: NativeCompletionRequest, vocab: Any, limits: Any) -> dict[str, Any]:
    """The server options of a /completion request (a worker thread: it tokenizes and converts schemas)."""
    opts: dict[str, Any] = {}
    for field, name in (("temperature", "temp"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                        ("repeat_penalty", "penalty_repeat"), ("presence_penalty", "penalty_present"),
                        ("frequency_penalty", "penalty_freq"), ("ignore_eos", "ignore_eos"),
                        ("cache_prompt", "cache_prompt"), ("backend_sampling", "backend_sampling")):
        value = getattr(body, field)
        if value is not None:
            opts[name] = value
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens
    if n_predict is not None:
        opts["max_tokens"] = -1 if n_predict < 0 else n_predict
    if body.seed is not None:
        opts["seed"] = random.getrandbits(31) if body.seed < 0 else body.seed % _SEED_MOD
    if body.stop:
        opts["stop"] = list(body.stop)
    if body.id_slot is not None:
        opts["id_slot"] = body.id_slot
    lora_option(body.lora, opts)
    if body.return_progress and body.stream:
        opts["progress"] = True
    if body.n_probs:
        opts["logprobs"] = body.n_probs
        if body.post_sampling_probs:
            opts["post_sampling"] = True
    if body.logit_bias:
        opts["logit_bias"] = _logit_bias(vocab, body.logit_bias)
    if body.grammar is not None and body.json_schema is not None:
        raise BadRequest("grammar and json_schema cannot be combined: give one constraint", param="json_schema")
    if body.grammar is not None:
        opts["grammar"] = body.grammar
    elif body.json_schema is not None:
        try:
            opts["grammar"] = json_schema_to_gbnf(body.json_schema, limits)
        except SchemaError as e:
            raise from_exception(e, param="json_schema") from None
    return opts


# ---- the response -------------------------------------------------------------------------------

def _probs(entries: Sequence[Any], post: bool = False) -> list[dict[str, Any]]:
    """``completion_probabilities`` entries (logprobs of the chosen token and of the top alternatives;
    ``post``: probabilities after the sampler chain, as llama-server's ``post_sampling_probs``)."""
    key, top = ("prob", "top_probs") if post else ("logprob", "top_logprobs")

    def one(lp: Any) -> dict[str, Any]:
        return {"id": lp.token, "token": lp.text, "bytes": list(lp.bytes),
                key: math.exp(lp.logprob) if post else lp.logprob}

    return [{**one(lp), top: [one(alt) for alt in lp.top]} for lp in entries]


def _pick(result: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: the named fields (``a/b`` reaches into objects), by those names."""
    out = {}
    for path in fields:
        node: Any = result
        for key in path.split("/"):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            out[path] = node
    return out


class _Reply:
    """One /completion or /infill request's results (one per prompt)."""

    def __init__(self, app: AppContext, model_id: str, server: Any, body: NativeCompletionRequest,
                 streams: list, prompts: list[list[int]], settings: dict[str, Any]):
        self.app, self.model_id, self.server, self.body = app, model_id, server, body
        self.streams, self.prompts, self.settings = streams, prompts, settings

    def _final(self, index: int, content: str) -> dict[str, Any]:
        s = self.streams[index]
        self.app.metrics.generation_done(self.model_id, s.prompt_tokens, len(s.tokens), s.timings)
        vocab = self.server.model.vocab
        result: dict[str, Any] = {
            "index": index, "content": content, "tokens": list(s.tokens) if self.body.return_tokens else [],
            "id_slot": s.request.seq_id if s.request.seq_id is not None else -1, "stop": True,
            "model": self.model_id, "tokens_predicted": len(s.tokens), "tokens_evaluated": s.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": prompt_text(vocab, self.prompts[index]),
            "has_new_line": "\n" in content, "truncated": False,
            "stop_type": _STOP_TYPES.get(s.finish_reason or "", "none"), "stopping_word": s.stop_word or "",
            "tokens_cached": s.timings.cached_tokens, "timings": timings(s.timings)}
        if self.body.n_probs and not self.body.stream:
            result["completion_probabilities"] = _probs(s.logprobs or [], self.body.post_sampling_probs)
        return _pick(result, self.body.response_fields) if self.body.response_fields else result

    async def _one(self, index: int) -> dict[str, Any]:
        pieces = [piece async for piece in self.streams[index]]
        return self._final(index, "".join(pieces))

    async def complete(self) -> Any:
        results = await gather_all([self._one(i) for i in range(len(self.streams))], self.streams)
        return results[0] if len(results) == 1 else results

    async def _chunks(self, index: int) -> AsyncIterator[dict[str, Any]]:
        s = self.streams[index]
        k = sent = 0
        async for piece in items(s, self.body.return_progress):
            if not isinstance(piece, str):
                report = {"index": index, "content": "", "tokens": [], "stop": False, "id_slot": s.request.seq_id,
                          "tokens_predicted": 0, "tokens_evaluated": s.prompt_tokens,
                          "prompt_progress": progress_json(piece)}
                if self.body.timings_per_token:
                    report["timings"] = progress_timings(piece)
                yield report
                continue
            chunk: dict[str, Any] = {"index": index, "content": piece, "tokens": s.piece_tokens(k), "stop": False,
                                     "id_slot": s.request.seq_id, "tokens_predicted": len(s.tokens),
                                     "tokens_evaluated": s.prompt_tokens}
            k += 1
            if self.body.n_probs:
                entries = s.logprobs or []
                chunk["completion_probabilities"] = _probs(entries[sent:], self.body.post_sampling_probs)
                sent = len(entries)
            if self.body.timings_per_token:
                chunk["timings"] = timings(s.timings)
            yield chunk
        yield self._final(index, "")

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        async for chunk in merge([self._chunks(i) for i in range(len(self.streams))]):
            yield chunk


async def _serve(request: Request, app: AppContext, body: NativeCompletionRequest, model_id: str, server: Any,
                 prompts: list[list[int]], opts: dict[str, Any]) -> Response:
    if len(prompts) > app.limits.max_choices:
        raise over_limit(f"{len(prompts)} prompts", len(prompts), app.limits.max_choices, "--max-choices",
                         param="prompt")
    settings = generation_settings(server, {**opts, "stream": body.stream, "n_probs": body.n_probs})
    streams = await submit(request, server, prompts, opts, 1)
    reply = _Reply(app, model_id, server, body, streams, prompts, settings)
    return await respond(request, streams, body.stream, reply.chunks, reply.complete, shape="native")


@endpoint
async def completion(request: Request, app: AppContext) -> Response:
    body = parse(NativeCompletionRequest, await read_body(request, app.max_body_bytes))
    await app.router.prepare(body.model)
    model_id, server = app.router.server(body.model)
    vocab = server.model.vocab

    def prepare() -> tuple[list[list[int]], dict[str, Any]]:
        return (native_prompts(vocab, body.prompt, server.n_ctx, app.limits.max_choices, server.model,
                               app.limits.media),
                _options(body, vocab, app.limits.schema))

    prompts, opts = await anyio.to_thread.run_sync(prepare)
    return await _serve(request, app, body, model_id, server, prompts, opts)


@endpoint
async def infill(request: Request, app: AppContext) -> Response:
    body = parse(InfillRequest, await read_body(request, app.max_body_bytes))
    await app.router.prepare(body.model)
    model_id, server = app.router.server(body.model)
    vocab = server.model.vocab
    fim = vocab.fim
    missing = [name for name, tok in (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid)) if tok is None]
    if missing:
        raise NotSupported(f"infill is not supported by this model: its vocabulary has no FIM "
                           f"{', '.join(missing)} token")

    def prepare() -> tuple[list[int], dict[str, Any]]:
        opts = _options(body, vocab, app.limits.schema)
        n_predict = opts.get("max_tokens", server.defaults.get("max_tokens", -1))
        try:
            tokens = infill_prompt(vocab, body.input_prefix, body.input_suffix, body.input_extra or [],
                                   prompt=body.prompt, n_batch=server.n_batch, n_predict=max(n_predict, 0),
                                   n_ctx=server.n_ctx, spm=app.spm_infill)
        except (InfillError, InvalidArgumentError) as exc:
            raise BadRequest(str(exc), param=getattr(exc, "param", None)) from None
        return tokens, opts

    tokens, opts = await anyio.to_thread.run_sync(prepare)
    return await _serve(request, app, body, model_id, server, [tokens], opts)


__all__ = ["completion", "infill", "native_prompts"]
