"""Anthropic's Messages API over the OpenAI chat pipeline: the request converted, the reply shaped.

    fields = to_openai(body)          # an Anthropic /v1/messages body -> OpenAI chat fields
    events = MessageEvents(...)       # OpenAI deltas -> Anthropic stream events
    message_response(...)             # a final OpenAI message -> an Anthropic ``message``

The conversion follows llama-server's (``server_chat_convert_anthropic_to_oai``) with two
deliberate differences: a user turn's ``tool_result`` blocks become ``tool`` messages placed
*before* the turn's text (Anthropic requires the results first, and chat templates expect a
tool call's result right after it), and ``tool_choice`` ``{"type": "tool", "name": ...}``
forces that tool (llama-server reads it as "any tool"). A leaf of plain dicts: the HTTP
route validates the body's types before it gets here.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Mapping, Sequence

from .fields import FieldError as RequestError
from .fields import function_tool
from .fields import string_field as _string

__all__ = ["RequestError", "to_openai", "stop_reason", "message_usage", "message_response", "MessageEvents",
           "new_message_id"]

#: Anthropic's ``max_tokens`` is required; llama-server is permissive and uses this when it is missing.
DEFAULT_MAX_TOKENS = 4096

_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs", "model")


def new_message_id() -> str:
    """A message id in Anthropic's form (``msg_`` and 24 random hex digits)."""
    return "msg_" + secrets.token_hex(12)


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise RequestError(f"{where}.source: expected an object", param=f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media = _string(source, "media_type", f"{where}.source") or "image/jpeg"
        url = f"data:{media};base64,{_string(source, 'data', f'{where}.source')}"
    elif kind == "url":
        url = _string(source, "url", f"{where}.source")
    else:
        raise RequestError(f"{where}.source.type: expected 'base64' or 'url' (got {kind!r})",
                                   param=f"{where}.source.type")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text: Any = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, c in enumerate(content):
            kind = c.get("type") if isinstance(c, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": _string(c, "text", f"{where}.content[{j}]")})
            elif kind == "image":
                parts.append(_image_part(c, f"{where}.content[{j}]"))
            else:
                raise RequestError(f"{where}.content[{j}].type: expected 'text' or 'image' (got {kind!r})",
                                           param=f"{where}.content[{j}].type")
        # text only: one string, which every chat template reads
        text = "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts
    else:
        raise RequestError(f"{where}.content: expected a string or a list of blocks",
                                   param=f"{where}.content")
    if block.get("is_error") is True and isinstance(text, str):
        text = f"Error: {text}"  # (a chat template has no field for it; the model must still see it)
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where), "content": text}


def _message(msg: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages (a user turn with tool results becomes several)."""
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise RequestError(f"{where}.role: expected 'user' or 'assistant' (got {role!r})",
                                   param=f"{where}.role")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: expected a string or a list of content blocks",
                                   param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "thinking":
            reasoning += _string(block, "thinking", at)
        elif kind == "redacted_thinking":
            continue  # (encrypted by Anthropic's servers: nothing a local model can read)
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        else:
            raise RequestError(f"{at}.type: {kind!r} is not a content block a {role} message may hold",
                                       param=f"{at}.type")
    out = list(results)
    if parts or calls or reasoning:
        text_only = all(p["type"] == "text" for p in parts)
        new: dict[str, Any] = {"role": role,
                               "content": "".join(p["text"] for p in parts) if text_only else parts}
        if calls:
            new["tool_calls"] = calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    return out


def _system(system: Any) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(_string(b, "text", f"system[{i}]") for i, b in enumerate(system)
                       if isinstance(b, Mapping) and b.get("type") == "text")
    raise RequestError("system: expected a string or a list of text blocks", param="system")


def _tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}]: expected {{'name', 'description', 'input_schema'}}",
                                       param=f"tools[{i}]")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            # Anthropic's server tools (web search, code execution, ...) run on Anthropic's servers.
            raise RequestError(f"tools[{i}].type: server tool {kind!r} is not available here "
                                       "(only client tools with an input_schema)", param=f"tools[{i}].type")
        out.append(function_tool(tool, "input_schema", f"tools[{i}]"))
    return out


def _tool_choice(choice: Mapping[str, Any]) -> tuple[Any, bool | None]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    kind = choice.get("type")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use: expected true or false",
                           param="tool_choice.disable_parallel_tool_use")
    parallel = None if disable is None else not disable
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice.name: required with type 'tool'", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise RequestError(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none' (got {kind!r})",
                               param="tool_choice.type")


def to_openai(body: Mapping[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """The OpenAI chat completion fields of an Anthropic Messages request.

    ``count_only``: a ``count_tokens`` body (no ``max_tokens``; nothing is generated).
    Raises :class:`RequestError` (an InvalidArgumentError with ``param``) for a block or a
    tool it cannot carry over.
    """
    if "messages" not in body:
        raise RequestError("messages: this field is required", param="messages")
    messages: list[dict[str, Any]] = []
    system = _system(body.get("system"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, msg in enumerate(body["messages"]):
        if not isinstance(msg, Mapping):
            raise RequestError(f"messages[{i}]: expected an object", param=f"messages[{i}]")
        messages.extend(_message(msg, f"messages[{i}]"))
    out: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "disabled"):
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", thinking["type"] == "enabled")
        out["chat_template_kwargs"] = kwargs
        if thinking["type"] == "enabled":  # (llama-server's default budget when none is given)
            budget = thinking.get("budget_tokens", 10000)
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise RequestError("thinking.budget_tokens: expected a number of tokens",
                                   param="thinking.budget_tokens")
            out["thinking_budget_tokens"] = budget
    output = body.get("output_config")
    if isinstance(output, Mapping):
        fmt = output.get("format")
        if isinstance(fmt, Mapping):
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), Mapping):
                raise RequestError("output_config.format: expected {'type': 'json_schema', 'schema': {...}}",
                                   param="output_config.format")
            out["response_format"] = {"type": "json_schema", "json_schema": {"schema": dict(fmt["schema"])}}
        if isinstance(output.get("effort"), str):
            out["reasoning_effort"] = output["effort"]
    for key in _PASSED:
        if key in body and key not in out:
            out[key] = body[key]
    if not count_only:
        out["max_tokens"] = body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if body.get("stop_sequences"):
            out["stop"] = list(body["stop_sequences"])
    else:
        out.pop("stream", None)
    return out


def stop_reason(finish_reason: str | None, has_tool_calls: bool, stop_sequence: str | None = None) -> str:
    """Anthropic's stop reason for a generation's finish reason (``"eog"``, ``"stop"``, ``"length"``)."""
    if finish_reason is None or finish_reason == "length":
        return "max_tokens"
    if has_tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def message_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens *not* read from the cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}  # (a call cut by the length limit: its input is incomplete)
    return value if isinstance(value, dict) else {}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI assistant message's content as Anthropic blocks: thinking, text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        # (a local model's thinking carries no signature; the field is required by Anthropic's clients)
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _arguments(fn["arguments"])})
    return blocks


def message_response(message_id: str, model: str, message: Mapping[str, Any], reason: str,
                     stop_sequence: str | None, usage: Mapping[str, int]) -> dict[str, Any]:
    """A whole (non-streamed) Anthropic ``message``."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(message), "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": dict(usage)}


class MessageEvents:
    """Anthropic's stream events for one reply, from the OpenAI deltas of :class:`ChatOutput`.

    ``start()`` gives ``message_start``; ``feed(delta)`` the block events a delta makes (a block
    opens when its kind first appears and closes when another kind follows, so indices count up
    in the order the blocks were sent); ``finish()`` closes the open block and adds
    ``message_delta`` and ``message_stop``.
    """

    def __init__(self, message_id: str, model: str):
        self.message_id, self.model = message_id, model
        self._open: Any = None  # "thinking", "text" or ("tool", index): the block being sent
        self._index = -1

    def start(self, usage: Mapping[str, int]) -> dict[str, Any]:
        return {"type": "message_start",
                "message": {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                            "content": [], "stop_reason": None, "stop_sequence": None,
                            "usage": {**usage, "output_tokens": 0}}}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append({"type": "content_block_delta", "index": self._index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        out.append({"type": "content_block_stop", "index": self._index})
        self._open = None
        return out

    def _begin(self, kind: Any, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self._index += 1
        self._open = kind
        out.append({"type": "content_block_start", "index": self._index, "content_block": block})
        return out

    def feed(self, delta: Mapping[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self._open != "thinking":
                out += self._begin("thinking", {"type": "thinking", "thinking": ""})
            out.append({"type": "content_block_delta", "index": self._index,
                        "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
        if delta.get("content"):
            if self._open != "text":
                out += self._begin("text", {"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self._index,
                        "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or ():
            kind = ("tool", call["index"])
            fn = call.get("function") or {}
            if self._open != kind:
                out += self._begin(kind, {"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""),
                                          "input": {}})
            if fn.get("arguments"):
                out.append({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return out

    def finish(self, reason: str, stop_sequence: str | None, output_tokens: int) -> list[dict[str, Any]]:
        return [*self._close(),
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                 "usage": {"output_tokens": output_tokens}},
                {"type": "message_stop"}]
