"""Request bodies of the HTTP endpoints, validated with pydantic v2.

Unknown fields are ignored (as OpenAI does); a field of the wrong type or out of
range is refused with a 400 that names it (``error.param``, e.g.
``messages[0].content``). Validation is strict: ``"0.5"`` is not a number and
``true`` is not an integer, as in OpenAI's API.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadRequest
from .json_cost import check_json_cost

T = TypeVar("T", bound=BaseModel)

#: Most choices (``n``) one request may ask for: each one is a request to the batching server.
MAX_CHOICES = 16
#: Most alternatives per token in ``top_logprobs`` / ``logprobs`` (as llama-server and OpenAI).
MAX_TOP_LOGPROBS = 20
#: Most stop strings per request (OpenAI takes 4): every generated token is checked against each of
#: them in the model's scheduler thread, which serves every request of the model.
MAX_STOPS = 16
#: Longest stop string, in characters (llama-server has no bound). Matching costs each token its own length
#: whatever the stops' length (core/text.py), but every choice builds an automaton per stop string and holds
#: back from its stream the text that may begin one.
MAX_STOP_CHARS = 4096
_INT32_MAX = 2**31 - 1

_UNSUPPORTED_PARTS = {"file": "file", "input_image": "image"}

#: On every list field: validated up to its first wrong element. Pydantic otherwise reports every element (and
#: each member of a union each): a million wrong ones in a 1 MB body took 0.6 s to validate and 3 s to list, on
#: the event loop, and an 8 MB one stalled every client for 89 s.
FAIL_FAST = Field(fail_fast=True)


class _Body(BaseModel):
    # (allow_inf_nan: JSON has no infinities, but the parser reads Infinity and NaN literals)
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class LoraEntry(_Body):
    """One adapter of a request's ``lora`` list (llama-server's ``{"id", "scale"}``; or by ``name``)."""

    id: int | None = Field(None, ge=0)
    name: str | None = Field(None, min_length=1)
    scale: float = 0.0  # (llama-server's default: an entry without a scale turns its adapter off)

    @model_validator(mode="after")
    def _named(self) -> "LoraEntry":
        if (self.id is None) == (self.name is None):
            raise ValueError("a lora entry names its adapter by 'id' or by 'name' (one of them)")
        return self

    @property
    def key(self) -> int | str:
        return self.id if self.id is not None else self.name  # type: ignore[return-value]


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    #: llama-server's extension: a schema for ``json_object``.
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self

    def schema(self) -> Mapping[str, Any] | None:
        """The JSON schema the output must follow (None: free text)."""
        if self.type == "json_schema":
            return self.json_schema.schema_  # type: ignore[union-attr]
        if self.type == "json_object":
            return self.schema_ if self.schema_ is not None else {"type": "object"}
        return None


class Message(BaseModel):
    """One chat message. Extra fields travel to the chat template untouched."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    name: str | None = None
    tool_calls: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        for i, part in enumerate(content):
            kind = part.get("type")
            if not isinstance(kind, str):
                raise ValueError(f"content part {i}: 'type' must be a string")
            if kind in _UNSUPPORTED_PARTS:
                raise ValueError(f"content part {i}: {_UNSUPPORTED_PARTS[kind]} input is not supported by this "
                                 f"server ({kind!r}; text, image_url and input_audio are)")
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise ValueError(f"content part {i}: 'image_url.url' must be a non-empty string")
                continue
            if kind == "input_audio":
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise ValueError(f"content part {i}: 'input_audio.data' must be a base64 string")
                continue
            if kind != "text":
                raise ValueError(f"content part {i}: unknown type {kind!r} (expected 'text', 'image_url' or "
                                 "'input_audio')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: 'text' must be a string")
        return content

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs 'content'")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat feature takes it (text parts stay parts: it joins them as llama.cpp does)."""
        return self.model_dump(exclude_none=True)


class SamplingFields(_Body):
    """Fields chat and text completions share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None  # llama-server's extension: generate past end-of-generation
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # llama-server's extensions
    grammar: str | None = None  # GBNF the output must follow
    json_schema: dict[str, Any] | None = None  # a JSON Schema the output must follow
    cache_prompt: bool | None = None  # keep the slot's KV for a later request with the same prefix
    backend_sampling: bool | None = None  # sample inside the decode graph (default: serve --backend-sampling)
    timings_per_token: bool = False  # every streamed chunk carries ``timings``
    verbose: bool | None = None  # the response carries ``__verbose`` (default: ``serve --verbose``)
    id_slot: int | None = None  # the slot to run in (-1: any), as llama-server
    # adapters and scales (llama-server: those not listed get 0)
    lora: Annotated[list[LoraEntry], FAIL_FAST] | None = None
    return_progress: bool = False  # streamed: prompt_progress reports while the prompt is read

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # ('²'.isdigit(), and int('١٢') == 12)
                raise ValueError(f"key {key[:20]!r} is not a token id (a decimal integer string)")
            if len(key) > 10:  # (int() refuses more than 4300 digits; no token id has more than 10)
                raise ValueError(f"key {key[:20]!r}... is not a token id (over 10 digits)")
            if not -100 <= value <= 100:
                raise ValueError(f"the bias of token {key} is {value}, outside [-100, 100]")
        return bias

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(stop)})")
        longest = max(map(len, [stop] if isinstance(stop, str) else stop or [""]))
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {longest} characters, over the limit of {MAX_STOP_CHARS}")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], FAIL_FAST] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    reasoning_format: Literal["auto", "none", "deepseek", "deepseek-legacy"] | None = None
    # llama-server's reasoning budget: tokens of thinking before the end of the block is forced (-1: none)
    reasoning_budget_tokens: int | None = Field(None, ge=-1, le=_INT32_MAX)
    thinking_budget_tokens: int | None = Field(None, ge=-1, le=_INT32_MAX)
    reasoning_budget_message: str | None = Field(None, max_length=4096)
    reasoning_control: bool = False  # POST /v1/chat/completions/control may end its reasoning while it runs

    @model_validator(mode="after")
    def _logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        constraints = [name for name in ("grammar", "json_schema", "response_format")
                       if getattr(self, name) is not None and not (
                           name == "response_format" and self.response_format.schema() is None)]  # type: ignore
        if len(constraints) > 1:
            raise ValueError(f"{' and '.join(constraints)} cannot be combined: give one constraint")
        if self.grammar is not None and self.tools and self.tool_choice != "none":
            raise ValueError("a custom grammar cannot be combined with tools")
        return self

    def reasoning_budget(self, default: int = -1) -> int:
        """The reasoning budget in tokens (-1: none): ``reasoning_budget_tokens``, else
        ``thinking_budget_tokens``, else the server's ``--reasoning-budget``, as llama-server."""
        for value in (self.reasoning_budget_tokens, self.thinking_budget_tokens):
            if value is not None and value != -1:
                return value
        if default == -1 and self.reasoning_control:
            return _INT32_MAX  # (armed without a limit: only the control ends it)
        return default

    def output_schema(self) -> Mapping[str, Any] | None:
        """The JSON Schema the reply must follow (``response_format``, or llama-server's ``json_schema``)."""
        if self.json_schema is not None:
            return self.json_schema
        return self.response_format.schema() if self.response_format is not None else None

    def continuation(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message) as llama-server decides them: a conversation
        that ends with an assistant's text continues it (a prefill) unless continue_final_message says
        otherwise (an explicit false renders it as a finished turn) or the request offers tools."""
        add = True if self.add_generation_prompt is None else self.add_generation_prompt
        cont = bool(self.continue_final_message)
        msgs = self.messages
        tools = bool(self.tools) and self.tool_choice != "none"
        if self.continue_final_message is None and msgs and msgs[-1].role == "assistant" \
                and not msgs[-1].tool_calls and not tools:
            # (a pending tool call is no text to continue; with tools, a tool-call format starts a new turn,
            # so the message is rendered as a finished turn, as before llama-server's prefill existed)
            if len(msgs) >= 2 and msgs[-2].role == "assistant":
                raise BadRequest("cannot have 2 or more assistant messages at the end of the list",
                                 param="messages")
            return False, True
        if cont and add:
            raise BadRequest("add_generation_prompt and continue_final_message cannot both be true",
                             param="continue_final_message")
        return add, cont


class ControlRequest(_Body):
    """llama-server's ``/v1/chat/completions/control`` body."""

    id: str = ""
    action: str = ""


class MessagesCountRequest(_Body):
    """Anthropic's ``/v1/messages/count_tokens`` body (blocks are checked as they are converted:
    :func:`llama_ctypes.features.anthropic.to_openai`)."""

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], FAIL_FAST]
    system: str | Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tools: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(MessagesCountRequest):
    """Anthropic's ``/v1/messages`` body (``max_tokens`` may be left out, as llama-server allows)."""

    max_tokens: int | None = Field(None, ge=1)
    stop_sequences: Annotated[list[str], FAIL_FAST] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, le=_INT32_MAX)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stop: list[str] | None) -> list[str] | None:
        return SamplingFields._stops(stop)  # type: ignore[no-any-return]


class ResponsesCountRequest(_Body):
    """OpenAI's ``/v1/responses/input_tokens`` body (items are checked as they are converted:
    :func:`llama_ctypes.features.openai.responses.to_chat`)."""

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], FAIL_FAST] = ""
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesRequest(ResponsesCountRequest):
    """OpenAI's ``/v1/responses`` body (and llama-server's sampling extensions)."""

    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stream: bool = False
    store: bool | None = None  # (nothing is stored either way: the server is stateless)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    timings_per_token: bool = False
    verbose: bool | None = None
    cache_prompt: bool | None = None
    return_progress: bool = False


#: Most alternatives per token of llama-server's ``n_probs``.
MAX_N_PROBS = 100


class NativeCompletionRequest(_Body):
    """llama-server's ``/completion`` body (its field names; the prompt is checked as it is tokenized)."""

    model: str | None = None
    prompt: Any = ""
    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)  # (llama-server's alias of n_predict)
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, le=_INT32_MAX)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None  # -1: a random one
    stop: Annotated[list[str], FAIL_FAST] | None = None
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_N_PROBS)
    post_sampling_probs: bool = False
    cache_prompt: bool | None = None
    backend_sampling: bool | None = None
    return_tokens: bool = False
    logit_bias: Annotated[list[Any], FAIL_FAST] | dict[str, Any] | None = None
    ignore_eos: bool | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    response_fields: Annotated[list[str], FAIL_FAST] | None = None
    timings_per_token: bool = False
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    id_slot: int | None = None  # the slot to run in (-1: any), as llama-server
    # adapters and scales (llama-server: those not listed get 0)
    lora: Annotated[list[LoraEntry], FAIL_FAST] | None = None
    return_progress: bool = False  # streamed: prompt_progress reports while the prompt is read

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: list[str] | None) -> list[str] | None:
        return SamplingFields._stops(stop)  # type: ignore[no-any-return]


class InfillRequest(NativeCompletionRequest):
    """llama-server's ``/infill`` body: the text around the gap, and more files for context."""

    input_prefix: str | Annotated[list[Any], FAIL_FAST]
    input_suffix: str | Annotated[list[Any], FAIL_FAST]
    input_extra: Annotated[list[Any], FAIL_FAST] | None = None
    prompt: str = ""


class ConvertedChatRequest(ChatCompletionRequest):
    """A chat request converted from another API: an empty conversation is allowed (llama-server renders
    whatever the template makes of it)."""

    messages: Annotated[list[Message], FAIL_FAST] = Field(default_factory=list)


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], FAIL_FAST] | Annotated[list[int], FAIL_FAST] \
        | Annotated[list[Annotated[list[int], FAIL_FAST]], FAIL_FAST]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | Annotated[list[str], FAIL_FAST]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
            raise ValueError("input must be a string or a list of strings (token arrays are not supported)")
        if value == []:
            raise ValueError("input must not be empty")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class RerankRequest(_Body):
    """Jina's shape (``documents``; results with ``relevance_score``) or, as llama-server, TEI's (``texts``;
    a bare list with ``score``, and the text with ``return_text``)."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], FAIL_FAST] | None = Field(None, min_length=1)
    texts: Annotated[list[str], FAIL_FAST] | None = Field(None, min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_text: bool = False

    @model_validator(mode="after")
    def _one_list(self) -> "RerankRequest":
        if self.documents is None and self.texts is None:
            raise ValueError("'documents' (or TEI's 'texts') is required: a non-empty list of strings")
        return self

    @property
    def tei(self) -> bool:
        return self.texts is not None

    @property
    def items(self) -> list[str]:
        return self.documents if self.documents is not None else self.texts  # type: ignore[return-value]


class TokenizeRequest(_Body):
    model: str | None = None
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class ModelRequest(_Body):
    """``{"model": id}`` (llama-server's /models/load and /models/unload)."""

    model: str = Field(min_length=1)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[int], FAIL_FAST]


# ---- parsing ---------------------------------------------------------------------------------

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def param_name(loc: Sequence[Any]) -> str | None:
    """``("messages", 0, "content")`` → ``"messages[0].content"`` (pydantic's union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper():
            continue  # a union member's tag ("str", "list[str]", "ResponseFormat"), not a field
        else:
            out += f".{part}" if out else part
    return out or None


#: Where a NaN or Infinity literal may stand (the JSON parser accepts them; JSON has no such values).
_NON_FINITE = re.compile(rb"[:,\[]\s*-?(?:NaN|Infinity)\b")


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"the body is not valid JSON: {name} is not a JSON value", code="invalid_json")


def parse(cls: type[T], body: bytes) -> T:
    """Validate a JSON body; raises :class:`BadRequest` naming the first wrong field (413 for a body that
    would cost too much to parse: :func:`~.json_cost.check_json_cost`)."""
    check_json_cost(body)
    if _NON_FINITE.search(body):  # (maybe inside a string: the exact check only then)
        try:
            json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            pass  # (not JSON: the parser below says why)
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise _bad_request(exc) from None


def parse_object(cls: type[T], fields: Mapping[str, Any]) -> T:
    """Validate fields built by the server (a request converted from another API) as :func:`parse` does."""
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise _bad_request(exc) from None


#: Past this many errors, only the first is read back (listing them all builds a dict per error: 3 s for a million).
_LISTED_ERRORS = 100


def _first_error(exc: ValidationError) -> dict[str, Any]:
    if exc.error_count() <= _LISTED_ERRORS:
        return exc.errors(include_url=False)[0]
    text = exc.json(include_url=False, include_context=False, include_input=False)  # (native; ~0.3 us an error)
    return json.JSONDecoder().raw_decode(text, 1)[0]


def _bad_request(exc: ValidationError) -> BadRequest:
    first = _first_error(exc)
    if first["type"] == "json_invalid":
        return BadRequest(f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return BadRequest("the body must be a JSON object")
    param = param_name(first["loc"])
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if first["type"] == "missing":
        msg = "this field is required"
    return BadRequest(f"invalid '{param}': {msg}" if param else msg, param=param)
