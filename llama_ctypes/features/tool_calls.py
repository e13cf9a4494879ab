"""Chat requests in OpenAI's shape: prompt, constraints and output parsing, tool calls included.

:func:`plan_chat` turns a request (messages, tools, ``tool_choice``, ...) into a
:class:`ChatPlan`: the prompt tokens, the options the generation needs (grammar,
lazy grammar triggers, stop strings) and a factory of :class:`ChatOutput`
objects that turn the generated text into OpenAI deltas and the final message.

Requests with tools run through llama.cpp's own chat code (``common/chat.cpp``,
through the C adapter): the template is rendered by llama.cpp's Jinja engine,
the tool-call grammar is built from the tools' schemas (``tool_choice="required"``
or a named function: a strict grammar, so even a small model emits a valid
call; ``"auto"``: a lazy grammar that starts at the format's trigger), and the
output is parsed by the format's PEG parser (Hermes/Qwen ``<tool_call>``,
Llama 3.x, Mistral ``[TOOL_CALLS]``, gpt-oss, DeepSeek, Functionary, Command R,
Granite, ... — the formats llama-server handles, because it is the same code).
(The native side — :class:`ChatFormatter`, :class:`OutputParser` — lives in
:mod:`.chat_native`.) Requests without tools keep the Python path of :mod:`.chat` (sandboxed Jinja,
reasoning split by markers), which the rest of the library uses.

Thread safety: a plan and the formatter cached on a model may be shared; a
:class:`ChatOutput` belongs to one request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

from ..core.json_schema.limits import SchemaLimits, check_schema_size
from ..core.media import MediaLimits
from ..core.model import Model
from ..core.projector import MEDIA_MARKER
from ..core.target import GenerationTarget, as_target
from ..errors import ArgumentTypeError, InvalidArgumentError, LlamaError
from .chat import ChatParams, content_text, media_prompt_tokens, prompt_tokens, render_prompt
from .chat_media import has_media, split_media
from .chat_native import ChatFormat, ChatFormatter, OutputParser, ToolCallError
from .chat_template import check_template_kwargs
from .openai.shapes import new_call_id
from .reasoning import ReasoningSplitter, budget_tokens, formats_for_template, opens_inside_reasoning
from .reasoning import reasoning_budget as reasoning_budget_for

logger = logging.getLogger(__name__)

__all__ = ["ChatFormatter", "ChatFormat", "OutputParser", "ChatOutput", "ChatPlan", "plan_chat",
           "ToolCallError"]


# ---- output: text -> deltas -> message ---------------------------------------------------------

class ChatOutput:
    """Turns one request's generated text into OpenAI deltas and the final message.

    ``feed(piece)`` returns the deltas the piece completes (dicts such as
    ``{"content": ...}``, ``{"reasoning_content": ...}`` or ``{"tool_calls": [...]}``);
    ``end()`` returns the last deltas, after which ``message`` holds the final
    assistant message (``content`` None when it only calls tools) and
    ``has_tool_calls`` tells whether it calls tools. The concatenated deltas always
    equal the final message. ``end(truncated=True)``: the output was cut short (the
    length limit), so it is read as the partial text it is. ``push(piece)`` adds text
    without computing deltas (a reply that is not streamed needs only the message);
    ``afeed`` / ``aend`` are the forms for an event loop (the parse runs in a thread).
    """

    def __init__(self, parse: Callable[[str, bool], dict[str, Any]], owner: Any = None,
                 aparse: Callable[[str, bool], Awaitable[dict[str, Any]]] | None = None):
        self._parse = parse
        self._aparse = aparse
        self._owner = owner  # keeps the native parser alive as long as this output
        self._text: list[str] = []
        self._sent_content = ""
        self._sent_reasoning = ""
        self._sent_calls: list[dict[str, str]] = []  # per index: id, name, arguments sent so far
        self.message: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The raw generated text so far."""
        return "".join(self._text)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._sent_calls)

    def _append(self, piece: str) -> None:
        if self.message is not None:
            raise InvalidArgumentError("this ChatOutput has ended")
        self._text.append(piece)

    def push(self, piece: str) -> None:
        """Add ``piece`` without computing deltas (``end()`` still returns the message's)."""
        self._append(piece)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._append(piece)
        try:
            msg = self._parse(self.text, True)
        except LlamaError:
            return []  # a partial parse can fail mid-marker; the next piece usually completes it
        return self._diff(msg, final=False)

    async def afeed(self, piece: str) -> list[dict[str, Any]]:
        """:meth:`feed` for an event loop."""
        if self._aparse is None:
            return self.feed(piece)
        self._append(piece)
        try:
            msg = await self._aparse(self.text, True)
        except LlamaError:
            return []
        return self._diff(msg, final=False)

    def end(self, truncated: bool = False) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        text = self.text
        try:
            msg = self._parse(text, truncated)
        except LlamaError as e:
            msg = self._unparsed(text, e)
        return self._close(msg)

    async def aend(self, truncated: bool = False) -> list[dict[str, Any]]:
        """:meth:`end` for an event loop."""
        if self._aparse is None:
            return self.end(truncated)
        if self.message is not None:
            return []
        text = self.text
        try:
            msg = await self._aparse(text, truncated)
        except LlamaError as e:
            msg = self._unparsed(text, e)
        return self._close(msg)

    def finish(self, truncated: bool = False) -> dict[str, Any]:
        """``end()`` and return the final message (for non-streamed replies)."""
        self.end(truncated)
        assert self.message is not None
        return self.message

    def _unparsed(self, text: str, error: Exception) -> dict[str, Any]:
        # The model left the format (possible with tool_choice="auto"): its text is the answer,
        # unless calls were already sent (their text would be sent a second time, as content).
        if self._sent_calls:
            logger.warning("%s; keeping the tool calls already read", error)
            return {"role": "assistant", "content": self._sent_content, "reasoning_content": self._sent_reasoning}
        logger.warning("%s; returning the raw output as content", error)
        return {"role": "assistant", "content": text}

    def _close(self, msg: Mapping[str, Any]) -> list[dict[str, Any]]:
        deltas = self._diff(msg, final=True)
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self._sent_calls]
        message: dict[str, Any] = {"role": "assistant", "content": self._sent_content or (None if calls else "")}
        if self._sent_reasoning:
            message["reasoning_content"] = self._sent_reasoning
        if calls:
            message["tool_calls"] = calls
        self.message = message
        return deltas

    def _diff(self, msg: Mapping[str, Any], final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        reasoning = msg.get("reasoning_content") or ""
        if reasoning != self._sent_reasoning and reasoning.startswith(self._sent_reasoning):
            deltas.append({"reasoning_content": reasoning[len(self._sent_reasoning):]})
            self._sent_reasoning = reasoning
        content = msg.get("content") or ""
        if not isinstance(content, str):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        if content != self._sent_content and content.startswith(self._sent_content):
            deltas.append({"content": content[len(self._sent_content):]})
            self._sent_content = content
        elif final and content != self._sent_content:
            # A partial parse showed text that the full parse gave to a tool call; what was sent stays.
            logger.debug("final content differs from the streamed content; keeping the streamed text")
        for i, call in enumerate(msg.get("tool_calls") or ()):
            fn = call.get("function") or {}
            name, args = fn.get("name") or "", fn.get("arguments") or ""
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            if i == len(self._sent_calls):
                if not name:
                    break  # the name is not complete yet
                sent = {"id": call.get("id") or new_call_id(), "name": name, "arguments": ""}
                self._sent_calls.append(sent)
                delta_call = {"index": i, "id": sent["id"], "type": "function",
                              "function": {"name": name, "arguments": ""}}
                if args:
                    delta_call["function"]["arguments"] = args
                    sent["arguments"] = args
                deltas.append({"tool_calls": [delta_call]})
                continue
            if i > len(self._sent_calls):
                break
            sent = self._sent_calls[i]
            if args != sent["arguments"] and args.startswith(sent["arguments"]):
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[len(sent["arguments"]):]}}]})
                sent["arguments"] = args
        return deltas


# ---- the plan of one request -------------------------------------------------------------------

@dataclass
class ChatPlan:
    """A chat request made ready for generation: tokens, generation options, output factory."""

    prompt: list[int]
    """Prompt tokens."""
    options: dict[str, Any]
    """Generation and sampling options the request needs (grammar, grammar_lazy_triggers, stop, special)."""
    output: Callable[[], ChatOutput]
    """A fresh :class:`ChatOutput` (one per choice)."""
    format: ChatFormat | None = None
    """llama.cpp's view of the request (requests with tools only)."""
    prompt_text: str = ""


_TOOL_CHOICES = ("auto", "none", "required")
#: Most tools one request may offer (OpenAI's limit too): each becomes part of the output's grammar.
MAX_TOOLS = 128


def _check_tools(tools: Any, tool_choice: Any,
                 limits: SchemaLimits | None = None) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """Validated tools, the tool_choice mode and the forced function name (if any). The tools' parameter
    schemas together must keep within ``limits`` (they become one grammar)."""
    if tools is not None:
        if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
            raise ArgumentTypeError("tools must be a list of {'type': 'function', 'function': {...}} objects")
        if len(tools) > MAX_TOOLS:
            raise InvalidArgumentError(f"{len(tools)} tools: at most {MAX_TOOLS} may be offered at once")
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping) or t.get("type", "function") != "function" \
                    or not isinstance(t.get("function"), Mapping):
                raise InvalidArgumentError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            fn = t["function"]
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise InvalidArgumentError(f"tools[{i}].function.name must be a non-empty string")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, Mapping):
                raise InvalidArgumentError(f"tools[{i}].function.parameters must be a JSON Schema object")
        # (before llama.cpp's chat code converts them: its cost grows faster than their size)
        check_schema_size([t["function"].get("parameters") or {} for t in tools], limits,
                          what="the tools' parameter schemas together")
        tools = [dict(t) for t in tools] or None
    forced = None
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidArgumentError("tool_choice must be 'auto', 'none', 'required' or "
                                       "{'type': 'function', 'function': {'name': ...}}")
        forced = fn["name"]
        tool_choice = "required"
    elif tool_choice is None:
        tool_choice = "auto"
    elif tool_choice not in _TOOL_CHOICES:
        raise InvalidArgumentError(f"tool_choice={tool_choice!r}: expected one of {_TOOL_CHOICES} or a named function")
    if forced is not None:
        chosen = [t for t in tools or () if t["function"]["name"] == forced]
        if not chosen:
            raise InvalidArgumentError(f"tool_choice names {forced!r}, which is not among the tools")
        tools = chosen  # llama.cpp has no named choice: offering only that tool, required, forces it
    if tool_choice == "required" and not tools:
        raise InvalidArgumentError("tool_choice='required' needs tools")
    return tools, tool_choice, forced


def formatter_for(model: Model, template: str | None = None) -> ChatFormatter:
    """The :class:`ChatFormatter` of ``model`` for ``template`` (None = the model's own), created once and
    closed with the model."""
    key = "chat_formatter:" + (template or "")
    return model.attachment(key, lambda: ChatFormatter(model, template))


def plan_chat(model: Model, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
              tool_choice: Any = "auto", parallel_tool_calls: bool | None = None, chat_template: str | None = None,
              enable_thinking: bool | None = None, template_kwargs: Mapping[str, Any] | None = None,
              json_schema: Mapping[str, Any] | None = None, schema_limits: SchemaLimits | None = None,
              add_generation_prompt: bool = True, continue_final_message: bool = False,
              parse_reasoning: bool = True, media_limits: MediaLimits | None = None,
              allow_media_paths: bool = True, fetch_media: Callable[[str], bytes] | None = None,
              reasoning_budget: int | None = None, reasoning_budget_message: str = "") -> ChatPlan:
    """Prepare a chat request (OpenAI fields) for generation on ``model``.

    With tools (and ``tool_choice`` other than ``"none"``), llama.cpp's chat code renders
    the prompt and provides the tool-call grammar and parser; otherwise the library's
    chat path does (``json_schema`` then constrains the answer with the library's own
    schema converter). ``parallel_tool_calls`` defaults to False. ``enable_thinking``:
    None = the template's default. ``schema_limits`` bounds the tools' schemas (default
    :data:`~llama_ctypes.core.json_schema.limits.DEFAULT_SCHEMA_LIMITS`).
    ``add_generation_prompt`` and ``continue_final_message``: as :class:`~llama_ctypes.ChatParams`
    (a continued message cannot be combined with tools: their formats start a new turn).
    ``parse_reasoning=False``: a thinking model's reasoning stays in the content, markers included
    (llama-server's ``reasoning_format: none``).
    Images and audio in the messages' content parts (features/chat_media.py) need a model with a
    projector; ``media_limits``, ``allow_media_paths`` and ``fetch_media`` as :func:`split_media` takes them.
    ``reasoning_budget``: at most that many tokens of thinking, then the end of the reasoning block is forced
    (after ``reasoning_budget_message``), as llama-server's ``--reasoning-budget``; None or -1: no limit; a
    template that does not think ignores it.
    """
    budget = budget_tokens(reasoning_budget)
    tools, mode, _ = _check_tools(tools, tool_choice, schema_limits)
    media: list = []
    if has_media(messages):
        messages, media = split_media(messages, model.projector, media_limits, allow_paths=allow_media_paths,
                                      fetch=fetch_media)

    def tokens(text: str) -> list[int]:
        return media_prompt_tokens(model, text, media, media_limits) if media else prompt_tokens(model, text)

    def shown(text: str) -> str:  # (the prompt as /apply-template shows it: media as the public marker)
        return text.replace(model.projector.marker, MEDIA_MARKER) if media else text

    kwargs = check_template_kwargs(template_kwargs or {})
    if enable_thinking is None and isinstance(kwargs.get("enable_thinking"), bool):
        enable_thinking = kwargs["enable_thinking"]
    if not tools or mode == "none":
        params = ChatParams(chat_template=chat_template, enable_thinking=enable_thinking, template_kwargs=kwargs,
                            tools=tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message)
        text, template = render_prompt(model, messages, params)
        formats = formats_for_template(template.source)
        options: dict[str, Any] = {}
        if formats:
            options["special"] = True  # reasoning markers are often special tokens
        if json_schema is not None:
            options["json_schema"] = json_schema
        if budget is not None:
            options["reasoning_budget"] = reasoning_budget_for(model.vocab, formats, text, budget,
                                                               reasoning_budget_message)

        def output() -> ChatOutput:
            if not (formats and parse_reasoning):
                return _SplitterOutput(None)
            return _SplitterOutput(ReasoningSplitter(formats, opens_inside_reasoning(text, formats)))

        return ChatPlan(tokens(text), options, output, None, shown(text))

    if json_schema is not None:
        raise InvalidArgumentError("response_format with a JSON schema cannot be combined with tools")
    if continue_final_message:
        raise InvalidArgumentError("continuing the last assistant message cannot be combined with tools "
                                   "(a tool-call format starts a new turn)")
    if chat_template is not None and "{" not in chat_template:
        # A llama.cpp built-in format name: no Jinja for llama.cpp's chat code to analyse.
        plan = _generic_plan(model, messages, tools, mode, bool(parallel_tool_calls), chat_template,
                             enable_thinking, kwargs, add_generation_prompt, tokens)
        return dataclasses.replace(plan, prompt_text=shown(plan.prompt_text))
    formatter = formatter_for(model, chat_template)
    fmt = formatter.apply(messages, tools=tools, tool_choice=mode, parallel_tool_calls=bool(parallel_tool_calls),
                          enable_thinking=True if enable_thinking is None else enable_thinking,
                          template_kwargs=kwargs, add_generation_prompt=add_generation_prompt,
                          reasoning_format="deepseek" if parse_reasoning else "none")
    source = chat_template if chat_template is not None else (model.chat_template or "")
    if not fmt.caps.get("supports_tool_calls", False):
        plan = _generic_plan(model, messages, tools, mode, bool(parallel_tool_calls), chat_template,
                             enable_thinking, kwargs, add_generation_prompt, tokens)
        if budget is not None:
            plan.options["reasoning_budget"] = reasoning_budget_for(
                model.vocab, formats_for_template(source), plan.prompt_text, budget, reasoning_budget_message)
        return dataclasses.replace(plan, prompt_text=shown(plan.prompt_text))
    options = {}
    if fmt.grammar:
        if not fmt.grammar_lazy:
            options["grammar"] = fmt.grammar
            # The grammar starts with the generation prompt, which is already in the prompt.
            options["grammar_prefill"] = fmt.generation_prompt
        elif fmt.trigger_patterns:
            options["grammar"] = fmt.grammar
            options["grammar_lazy_triggers"] = list(fmt.trigger_patterns)
        # (a lazy grammar without triggers would never start)
    if fmt.additional_stops:
        options["stop"] = list(fmt.additional_stops)
    # The parser must see the format's special tokens (e.g. <tool_call>) in the text.
    options["special"] = True
    if budget is not None:
        options["reasoning_budget"] = reasoning_budget_for(model.vocab, formats_for_template(source), fmt.prompt,
                                                           budget, reasoning_budget_message)

    def output() -> ChatOutput:
        parser = OutputParser(fmt)
        return ChatOutput(parser.parse, parser, parser.aparse)

    return ChatPlan(tokens(fmt.prompt), options, output, fmt, shown(fmt.prompt))


class _SplitterOutput(ChatOutput):
    """The output of a request without tools: reasoning split by markers, the rest is content."""

    def __init__(self, splitter: ReasoningSplitter | None):
        super().__init__(lambda text, partial: {})
        self._splitter = splitter

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._append(piece)
        parts = self._splitter.feed(piece) if self._splitter is not None else [("content", piece)]
        return self._deltas(parts)

    def push(self, piece: str) -> None:
        self.feed(piece)

    def _deltas(self, parts) -> list[dict[str, Any]]:
        deltas = []
        for kind, text in parts:
            if not text:
                continue
            if kind == "reasoning":
                self._sent_reasoning += text
                deltas.append({"reasoning_content": text})
            else:
                self._sent_content += text
                deltas.append({"content": text})
        return deltas

    def end(self, truncated: bool = False) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        deltas = self._deltas(self._splitter.flush()) if self._splitter is not None else []
        message: dict[str, Any] = {"role": "assistant", "content": self._sent_content}
        if self._sent_reasoning:
            message["reasoning_content"] = self._sent_reasoning
        self.message = message
        return deltas


# ---- templates that cannot express tool calls ---------------------------------------------------
#
# The pinned llama.cpp's chat code handles only templates that render tool calls (it has no
# "generic" format any more). For the others (Gemma 2/3, chatml, ...) the tools are described in
# a system message and the answer is constrained to JSON: {"tool_calls": [{"name", "arguments"}]}
# or, with tool_choice="auto", {"response": "..."} - the generic scheme llama.cpp used before.

def _generic_schema(tools: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
    variants = []
    for t in tools:
        fn = t["function"]
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": fn["name"]},
                                        "arguments": dict(fn.get("parameters") or {"type": "object"})}})
    calls: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    if not parallel:
        calls["maxItems"] = 1
    with_calls = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                  "properties": {"tool_calls": calls}}
    if mode == "required":
        return with_calls
    answer = {"type": "object", "additionalProperties": False, "required": ["response"],
              "properties": {"response": {"type": "string"}}}
    return {"anyOf": [with_calls, answer]}


def _generic_messages(messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]], mode: str,
                      parallel: bool) -> list[dict[str, Any]]:
    described = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    reply = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}' + \
        (", ...]}" if parallel else "]}")
    instructions = (f"You can call the following tools:\n{described}\n\n"
                    f"Respond with a JSON object: {reply} to call "
                    f"{'tools' if parallel else 'a tool'}")
    instructions += '.' if mode == "required" else ', or {"response": "<your answer>"} to answer directly.'
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidArgumentError(f"messages[{i}] must be a dict with a 'role'")
        role, content = m["role"], m.get("content")
        if role == "tool":
            if isinstance(content, list):
                content = content_text(content)
            result = {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": content}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        elif role == "assistant" and m.get("tool_calls"):
            calls = []
            given = m["tool_calls"]
            if not isinstance(given, Sequence) or isinstance(given, (str, bytes)):
                raise InvalidArgumentError(f"messages[{i}].tool_calls must be a list of tool calls")
            for j, c in enumerate(given):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping):
                    raise InvalidArgumentError(f"messages[{i}].tool_calls[{j}] must be "
                                               "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except (ValueError, RecursionError):
                        pass
                calls.append({"name": fn.get("name"), "arguments": args})
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        else:
            out.append(dict(m))
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        out[0] = {"role": "system", "content": f"{first.get('content') or ''}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


class _GenericOutput(ChatOutput):
    """Parses the generic JSON reply at the end (a partial JSON object has no safe deltas)."""

    def __init__(self):
        super().__init__(self._parse_json)

    @staticmethod
    def _parse_json(text: str, partial: bool) -> dict[str, Any]:
        if partial:
            return {}
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # (nested deeper than Python's parser goes)
            raise ToolCallError("the model's reply is not the JSON the tool grammar asks for") from None
        if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
            calls = [{"type": "function", "function": {"name": c.get("name"),
                                                       "arguments": json.dumps(c.get("arguments", {}),
                                                                               ensure_ascii=False)}}
                     for c in data["tool_calls"] if isinstance(c, dict)]
            return {"role": "assistant", "content": "", "tool_calls": calls}
        if isinstance(data, dict) and isinstance(data.get("response"), str):
            return {"role": "assistant", "content": data["response"]}
        raise ToolCallError("the model's reply is not the JSON the tool grammar asks for")

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._append(piece)
        return []

    def end(self, truncated: bool = False) -> list[dict[str, Any]]:
        return super().end(False)  # (cut short, the JSON does not parse: its text is the answer)


def _generic_plan(model: Model, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]], mode: str,
                  parallel: bool, chat_template: str | None, enable_thinking: bool | None,
                  kwargs: dict[str, Any], add_generation_prompt: bool = True,
                  tokens: Callable[[str], list[int]] | None = None) -> ChatPlan:
    params = ChatParams(chat_template=chat_template, enable_thinking=enable_thinking, template_kwargs=kwargs,
                        add_generation_prompt=add_generation_prompt)
    text, _ = render_prompt(model, _generic_messages(messages, tools, mode, parallel), params)
    options = {"json_schema": _generic_schema(tools, mode, parallel)}
    return ChatPlan((tokens or (lambda t: prompt_tokens(model, t)))(text), options, _GenericOutput, None, text)


# ---- running a plan (the OpenAI dicts are built in .openai.chat) -----------------------------------

_TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")


def wants_tools(opts: Mapping[str, Any]) -> bool:
    """Whether a chat call's options ask for tool calling (tools given, tool_choice not "none")."""
    return bool(opts.get("tools")) and opts.get("tool_choice", "auto") != "none"


def start_chat(target: Model | GenerationTarget, messages: Sequence[Mapping[str, Any]],
               opts: Mapping[str, Any]) -> tuple[ChatPlan, Any]:
    """Plan a chat request with tools and start it on ``target`` (a Model or a Server); returns the plan
    (whose ``output()`` parses the text) and the text stream (its ``completion()`` at the end)."""
    opts = dict(opts)
    tool_opts = {k: opts.pop(k) for k in _TOOL_OPTIONS if k in opts}
    target = as_target(target)
    model = target.model
    plan = plan_chat(model, messages, chat_template=opts.pop("chat_template", None),
                     enable_thinking=opts.pop("enable_thinking", None),
                     template_kwargs=opts.pop("template_kwargs", None), **tool_opts)
    request = {**opts, **plan.options}
    if "stop" in opts and "stop" in plan.options:
        request["stop"] = list(opts["stop"] if not isinstance(opts["stop"], str) else [opts["stop"]]) + \
            plan.options["stop"]
    return plan, target.stream_tokens(plan.prompt, **request)
