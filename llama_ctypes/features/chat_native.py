"""llama.cpp's chat code (``common/chat.cpp``) through the C adapter: templates and output parsers.

:class:`ChatFormatter` wraps ``common_chat_templates`` (render a request, build the
tool-call grammar, triggers, stops and the format's parser); :class:`OutputParser`
runs one request's PEG parser. Both cross the boundary as JSON text; every C++
exception comes back as :class:`ToolCallError`. llama.cpp recurses through the JSON
it reads, so requests are checked for nesting depth and the native calls run on
threads with a large stack (a stack overflow cannot be caught).
"""

from __future__ import annotations

import asyncio
import json
import threading
from ctypes import byref, c_void_p, string_at
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..core.backend import init
from ..core.deep_stack import DEEP_STACK
from ..core.handle import NativeHandle
from ..core.model import Model
from ..errors import ArgumentTypeError, InvalidArgumentError, LlamaError
from .chat_template import ChatTemplateError
from .json_nesting import MAX_JSON_DEPTH, check_nesting

__all__ = ["ChatFormatter", "ChatFormat", "OutputParser", "ToolCallError", "MAX_JSON_DEPTH"]

class ToolCallError(LlamaError, ValueError):
    """llama.cpp's chat code refused a request (template, tools, tool_choice) or its output."""


def _take_string(lib, ptr: int | None, error: c_void_p, what: str) -> str:
    """The malloc'd string an adapter call returned (freed here), or ToolCallError with its message."""
    if not ptr:
        message = string_at(error.value).decode("utf-8", "replace") if error.value else "unknown error"
        if error.value:
            lib.lcx_string_free(error.value)
        raise ToolCallError(f"{what}: {message}")
    try:
        return string_at(ptr).decode("utf-8", "replace")
    finally:
        lib.lcx_string_free(ptr)


def _error_text(lib, error: c_void_p) -> str:
    if not error.value:
        return "unknown error"
    try:
        return string_at(error.value).decode("utf-8", "replace")
    finally:
        lib.lcx_string_free(error.value)


# ---- native: common_chat_templates and one request's parser ------------------------------------

@dataclass(frozen=True)
class ChatFormat:
    """What llama.cpp's chat code made of one request (``common_chat_params``)."""

    format: str
    """The output format's name (e.g. ``"peg-native"``)."""
    format_id: int
    prompt: str
    """The rendered prompt text."""
    grammar: str
    """GBNF constraining the output ("" = none)."""
    grammar_lazy: bool
    """The grammar applies only from a trigger on (``tool_choice="auto"``)."""
    trigger_patterns: tuple[str, ...]
    """Regex patterns that start a lazy grammar."""
    preserved_tokens: tuple[str, ...]
    """Special tokens the parser needs to see in the text."""
    additional_stops: tuple[str, ...]
    generation_prompt: str
    """Text the template put after the last message; the parser reads it before the output."""
    parser: str
    """The serialised PEG parser of the output format."""
    supports_thinking: bool
    reasoning_format: str
    caps: Mapping[str, bool]
    """The template's capabilities as llama.cpp detects them (``supports_tool_calls``, ...)."""


class ChatFormatter(NativeHandle):
    """llama.cpp's ``common_chat_templates`` for a model (or a template source).

    ``template``: Jinja source; None = the model's own (its ``tool_use`` variant for
    requests with tools, as llama-server does). ``apply`` may be called from any
    thread (calls are serialised).
    """

    _kind = "chat formatter"

    def __init__(self, model: Model | None, template: str | None = None, *, bos_token: str | None = None,
                 eos_token: str | None = None):
        super().__init__()
        if template is not None and not isinstance(template, str):
            raise ArgumentTypeError("template must be Jinja source text")
        if model is None and not template:
            raise InvalidArgumentError("a ChatFormatter needs a model or a template")
        self._lib = lib = init()
        self._ptr = None
        self._call_lock = threading.Lock()
        error = c_void_p()
        args = ((template or "").encode(), (bos_token or "").encode(), (eos_token or "").encode(), byref(error))
        if model is not None:
            # The templates copy what they read (template text, BOS/EOS pieces): the model is
            # needed only during this call.
            hold = model.hold()
            try:
                ptr = lib.lcx_chat_templates_init(model.native(), *args)
            finally:
                hold.release()
        else:
            ptr = lib.lcx_chat_templates_init(None, *args)
        if not ptr:
            self._mark_dead()
            raise ChatTemplateError(f"llama.cpp could not load the chat template: {_error_text(lib, error)}")
        self._ptr = ptr

    def apply(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
              tool_choice: str = "auto", parallel_tool_calls: bool = False,
              json_schema: Mapping[str, Any] | None = None, grammar: str | None = None,
              enable_thinking: bool = True, reasoning_format: str = "deepseek",
              template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True) -> ChatFormat:
        """Render ``messages`` (OpenAI shape) and build the output's grammar and parser.

        ``tool_choice``: ``"auto"``, ``"none"`` or ``"required"``. ``reasoning_format``:
        ``"deepseek"`` puts thinking in ``reasoning_content``, ``"none"`` leaves it in the content.
        """
        inputs = {
            "messages": list(messages), "tools": list(tools) if tools else None, "tool_choice": tool_choice,
            "parallel_tool_calls": bool(parallel_tool_calls), "add_generation_prompt": bool(add_generation_prompt),
            "enable_thinking": bool(enable_thinking), "reasoning_format": reasoning_format,
            "chat_template_kwargs": dict(template_kwargs or {}),
        }
        if json_schema is not None:
            inputs["json_schema"] = json_schema
        if grammar:
            inputs["grammar"] = grammar
        try:
            payload = json.dumps(inputs, ensure_ascii=False, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"the request is not JSON-serialisable: {e}") from None
        check_nesting(inputs)
        error = c_void_p()
        with self._call_lock, self._shared():
            # (on a thread with a large stack: llama.cpp recurses through the JSON it reads)
            out = _PARSE_THREADS.submit(self._lib.lcx_chat_templates_apply, self._ptr, payload,
                                        byref(error)).result()
        data = json.loads(_take_string(self._lib, out, error, "llama.cpp refused the chat request"))
        return ChatFormat(
            format=data["format"], format_id=int(data["format_id"]), prompt=data["prompt"],
            grammar=data["grammar"], grammar_lazy=bool(data["grammar_lazy"]),
            trigger_patterns=tuple(data["trigger_patterns"]), preserved_tokens=tuple(data["preserved_tokens"]),
            additional_stops=tuple(data["additional_stops"]), generation_prompt=data["generation_prompt"],
            parser=data["parser"], supports_thinking=bool(data["supports_thinking"]),
            reasoning_format=reasoning_format, caps=dict(data.get("caps") or {}))

    def _free(self) -> None:
        if self._ptr:
            self._lib.lcx_chat_templates_free(self._ptr)
            self._ptr = None


# ---- llama.cpp's output parsers recurse once per nesting level of the JSON they read ----------
#
# A model's output with arguments nested a few thousand levels deep ('[[[[...') overflows an
# 8 MiB stack (300 levels overflow a 512 KiB one, macOS's thread default) and the process dies.
# So the parses run on threads with a large stack (core/deep_stack.py), and an output with more
# opening brackets than that stack can take (the nesting can be no deeper) is not given to
# llama.cpp at all: it does not parse (ToolCallError), so its text becomes the answer.

_PARSE_THREADS = DEEP_STACK


class OutputParser(NativeHandle):
    """Parses one request's output with its format's parser (llama.cpp ``common_chat_parse``).

    The parse runs on a thread with a large stack (llama.cpp's parser recurses once per level of
    JSON nesting); :meth:`aparse` awaits it from an event loop without blocking the loop.
    """

    _kind = "chat output parser"

    def __init__(self, fmt: ChatFormat, *, parse_tool_calls: bool = True):
        super().__init__()
        self._lib = lib = init()
        self._ptr = None
        params = {"format_id": fmt.format_id, "generation_prompt": fmt.generation_prompt, "parser": fmt.parser,
                  "reasoning_format": fmt.reasoning_format, "parse_tool_calls": parse_tool_calls}
        error = c_void_p()
        ptr = lib.lcx_chat_parser_init(json.dumps(params).encode(), byref(error))
        if not ptr:
            self._mark_dead()
            raise ToolCallError(f"llama.cpp could not build the output parser: {_error_text(lib, error)}")
        self._ptr = ptr

    def parse(self, text: str, partial: bool) -> dict[str, Any]:
        """The OpenAI message in ``text`` (``partial``: more text will follow). Raises ToolCallError when
        complete output does not match the format (or is nested too deeply to parse safely)."""
        return _PARSE_THREADS.submit(self._parse, self._input(text), partial).result()

    async def aparse(self, text: str, partial: bool) -> dict[str, Any]:
        """:meth:`parse` from an event loop (the loop keeps running meanwhile)."""
        return await asyncio.wrap_future(_PARSE_THREADS.submit(self._parse, self._input(text), partial))

    @staticmethod
    def _input(text: str) -> bytes:
        limit = _PARSE_THREADS.max_openers
        if text.count("[") + text.count("{") > limit:
            raise ToolCallError(f"the model's output holds more than {limit} opening brackets: it is not parsed "
                                "(llama.cpp's parser would overflow its stack)")
        # (a NUL would end the C string early, and the text after it would be lost)
        return text.replace("\0", "\ufffd").encode("utf-8", "surrogatepass")

    def _parse(self, data: bytes, partial: bool) -> dict[str, Any]:
        error = c_void_p()
        with self._exclusively():
            out = self._lib.lcx_chat_parse(self._ptr, data, partial, byref(error))
        return json.loads(_take_string(self._lib, out, error, "the model's output does not match its chat format"))

    def _free(self) -> None:
        if self._ptr:
            self._lib.lcx_chat_parser_free(self._ptr)
            self._ptr = None
