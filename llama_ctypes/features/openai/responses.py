"""OpenAI's Responses API over the chat pipeline: the request converted, the response and its events shaped.

    fields = to_chat(body)             # a /v1/responses body -> chat completion fields
    events = ResponseEvents(...)       # chat deltas -> response.* stream events
    response_object(...)               # a final chat message -> a ``response`` object

Stateless, as llama-server: nothing is stored, so ``previous_response_id`` and ``conversation`` are
refused (send the whole history as ``input`` items). Only function tools exist here. A reply cut
by ``max_output_tokens`` has ``status: "incomplete"`` and ``incomplete_details``; its stream still
ends with ``response.completed`` (llama-server's event, which OpenAI's client waits for).
A leaf of plain dicts: the HTTP route validates the body's types before it gets here.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Mapping, Sequence

from ..fields import FieldError as ResponseRequestError
from ..fields import function_tool
from ..fields import string_field as _string

__all__ = ["ResponseRequestError", "to_chat", "response_object", "response_usage", "ResponseEvents", "new_item_id"]

#: Fields passed to the chat request as they are (OpenAI's, and llama-server's sampling extensions).
_PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "top_k", "min_p", "seed",
           "timings_per_token", "verbose", "cache_prompt", "return_progress", "chat_template_kwargs", "user")


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's form: ``resp_``, ``msg_``, ``rs_``, ``fc_`` and 24 random hex digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content: Any, where: str) -> Any:
    """A message's content: a string, or chat content parts (text; images and files are passed on as
    the chat parts that say whether the model takes them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponseRequestError(f"{where}: expected a string or a list of content parts", param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append({"type": "text", "text": _string(part, "text", f"{where}[{i}]")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _string(part, "refusal", f"{where}[{i}]")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": _string(part, "image_url", f"{where}[{i}]")}})
        elif kind == "input_file":
            parts.append({"type": "file", "file": {k: v for k, v in part.items() if k != "type"}})
        elif kind == "input_audio":
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio") or {}})
        else:
            raise ResponseRequestError(f"{where}[{i}].type: unknown content part {kind!r}", param=f"{where}[{i}].type")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


class _History:
    """Input items to chat messages: an assistant's message, reasoning and function calls in a row
    make one assistant turn; a function call's output is a ``tool`` message."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the assistant turn items are being added to

    def _assistant(self) -> dict[str, Any]:
        if self._open is None:
            self._open = {"role": "assistant", "content": ""}
            self.messages.append(self._open)
        return self._open

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, Mapping):
            raise ResponseRequestError(f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponseRequestError(f"{where}.role: expected user, assistant, system or developer "
                                           f"(got {role!r})", param=f"{where}.role")
            content = _text_of(item.get("content", ""), f"{where}.content")
            if role == "assistant":
                turn = self._assistant()
                if not isinstance(content, str):
                    raise ResponseRequestError(f"{where}.content: an assistant message holds text only",
                                               param=f"{where}.content")
                turn["content"] += content
                return
            self._open = None
            self.messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ResponseRequestError(f"{where}.{key}: required (a string)", param=f"{where}.{key}")
            self._assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponseRequestError(f"{where}.call_id: required (a string)", param=f"{where}.call_id")
            self._open = None
            self.messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                  "content": _text_of(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text_of(parts, f"{where}.content") if parts else ""
            if text:
                turn = self._assistant()
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        elif kind == "item_reference":
            raise ResponseRequestError(f"{where}: item references need stored responses, and this server stores "
                                       "none (send the items themselves)", param=where)
        else:
            raise ResponseRequestError(f"{where}.type: {kind!r} is not an input item this server takes "
                                       "(message, function_call, function_call_output, reasoning)",
                                       param=f"{where}.type")


def _tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise ResponseRequestError(f"tools[{i}].type: {kind!r} tools are not available here (function tools only)",
                                       param=f"tools[{i}].type")
        out.append(function_tool(tool, "parameters", f"tools[{i}]"))
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponseRequestError("tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                               param="tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), Mapping):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": dict(fmt["schema"])}}
    raise ResponseRequestError("text.format: expected {'type': 'text'}, {'type': 'json_object'} or "
                               "{'type': 'json_schema', 'schema': {...}}", param="text.format")


def to_chat(body: Mapping[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """The chat completion fields of a Responses request (``count_only``: an ``input_tokens`` body).

    Raises :class:`ResponseRequestError` (an InvalidArgumentError with ``param``).
    """
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise ResponseRequestError(f"{key}: this server is stateless and stores no responses; send the "
                                       "conversation as input items", param=key)
    history = _History()
    if body.get("instructions"):
        history.add({"role": "system", "content": body["instructions"]}, "instructions")
    given = body.get("input", [])
    if isinstance(given, str):
        history.add({"role": "user", "content": given}, "input")
    elif isinstance(given, list):
        for i, item in enumerate(given):
            history.add(item, f"input[{i}]")
    else:
        raise ResponseRequestError("input: expected a string or a list of items", param="input")
    out: dict[str, Any] = {"messages": history.messages}
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    for key in _PASSED:
        if body.get(key) is not None:
            out[key] = body[key]
    if count_only:
        out.pop("stream", None)
    elif body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0,
                   reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage object."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: Mapping[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def output_items(message: Mapping[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """A chat reply's output items: reasoning, the message, function calls (in that order)."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(new_item_id("rs"), message["reasoning_content"], status))
    if message.get("content") or not message.get("tool_calls"):
        items.append(_message_item(new_item_id("msg"), message.get("content") or "", status))
    for call in message.get("tool_calls") or ():
        items.append(_call_item(new_item_id("fc"), call, status))
    return items


def response_object(response_id: str, model: str, body: Mapping[str, Any], *, created: float,
                    output: list[dict[str, Any]], status: str, usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``response`` object; its request's settings are echoed, as OpenAI does."""
    return {"id": response_id, "object": "response", "created_at": int(created), "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": output, "parallel_tool_calls": bool(body.get("parallel_tool_calls", False)),
            "previous_response_id": None, "reasoning": body.get("reasoning"), "store": False,
            "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": list(body.get("tools") or []),
            "top_p": body.get("top_p"), "truncation": "disabled", "usage": dict(usage) if usage else None,
            "user": body.get("user"), "metadata": dict(body.get("metadata") or {})}


class ResponseEvents:
    """The Responses stream's events for one reply, from the chat deltas of :class:`ChatOutput`.

    An output item opens when its kind first appears (reasoning, message text, a function call) and
    closes when another kind follows; every event carries its ``sequence_number``.
    """

    def __init__(self) -> None:
        self._seq = 0
        self._open: Any = None  # "reasoning", "message" or ("call", index)
        self._item: dict[str, Any] = {}
        self._text = ""
        self.items: list[dict[str, Any]] = []  # the closed items, in order

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One event, numbered in sequence."""
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item, index, text = self._item, len(self.items), self._text
        out = []
        if self._open == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            done = _message_item(item["id"], text, "completed")
        elif self._open == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            done = _reasoning_item(item["id"], text, "completed")
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=text))
            done = {**item, "arguments": text, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        self._open, self._item, self._text = None, {}, ""
        return out

    def _begin(self, kind: Any, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self._open, self._item, self._text = kind, item, ""
        index = len(self.items)
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}))
        elif kind == "reasoning":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def feed(self, delta: Mapping[str, Any], **extra: Any) -> list[dict[str, Any]]:
        """The events of one chat delta; ``extra`` fields (llama-server's ``timings``) go on its delta events."""
        out: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self._open != "reasoning":
                out += self._begin("reasoning", {"type": "reasoning", "id": new_item_id("rs"), "summary": [],
                                                 "content": [], "status": "in_progress"})
            self._text += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=self._item["id"],
                                   output_index=len(self.items), content_index=0,
                                   delta=delta["reasoning_content"], **extra))
        if delta.get("content"):
            if self._open != "message":
                out += self._begin("message", {"type": "message", "id": new_item_id("msg"), "status": "in_progress",
                                               "role": "assistant", "content": []})
            self._text += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self._item["id"],
                                   output_index=len(self.items), content_index=0, delta=delta["content"],
                                   logprobs=[], **extra))
        for call in delta.get("tool_calls") or ():
            kind = ("call", call["index"])
            fn = call.get("function") or {}
            if self._open != kind:
                out += self._begin(kind, {"type": "function_call", "id": new_item_id("fc"),
                                          "call_id": call.get("id", ""), "name": fn.get("name", ""), "arguments": "",
                                          "status": "in_progress"})
            if fn.get("arguments"):
                self._text += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self._item["id"],
                                       output_index=len(self.items), delta=fn["arguments"], **extra))
        return out

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open item and end with ``response.completed`` (``response["output"]`` is set to the items)."""
        out = self._close()
        if not self.items:  # (nothing was generated: an empty message, as the whole response has)
            out += self._begin("message", {"type": "message", "id": new_item_id("msg"), "status": "in_progress",
                                           "role": "assistant", "content": []})
            out += self._close()
        response["output"] = list(self.items)
        out.append(self.event("response.completed", response=response))
        return out
