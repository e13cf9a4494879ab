"""Chat templates: a conversation rendered to prompt text by the model's Jinja template, with the
variables and message shapes real templates expect.

The template runs in the bounded sandbox of :mod:`.jinja_sandbox`, over deep copies of the inputs (a
template may build and append to its own lists, as several real ones do, but never touches the caller's).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, Mapping, Sequence

from ..errors import ArgumentTypeError, InvalidArgumentError
from .jinja_sandbox import MAX_SECONDS, ChatTemplateError, compile_template, render_template
from .json_nesting import check_nesting

__all__ = ["RESERVED_VARIABLES", "ChatTemplate", "ChatTemplateError", "check_template_kwargs", "default_variables"]

_PRESERVE_REASONING_VARIABLES = (("preserve_thinking", True), ("clear_thinking", False),
                                 ("truncate_history_thinking", False), ("drop_thinking", False))


#: Template variables the renderer sets itself; a request's own template variables may not name them
#: (a ``messages`` or ``tools`` variable would bypass their validation and the output parser that goes
#: with them; ``timeout`` is the render budget). llama-server lets ``chat_template_kwargs`` override
#: them; we refuse instead.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "timeout"})


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``kwargs`` as a dict of template variables; InvalidArgumentError naming a reserved or non-string key."""
    if not isinstance(kwargs, Mapping):
        raise ArgumentTypeError("template_kwargs must be a mapping of template variables")
    for key in kwargs:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"template_kwargs key {key!r}: template variable names are strings")
        if key in RESERVED_VARIABLES:
            raise InvalidArgumentError(
                f"template_kwargs[{key!r}]: {key!r} is set by the chat renderer itself and cannot be passed as a "
                f"template variable (reserved: {', '.join(sorted(RESERVED_VARIABLES))})")
    return dict(kwargs)


def default_variables(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Variables llama.cpp gives every template, derived from the caller's ``kwargs``.

    * ``date_string`` ("26 Jul 2024" style) and ``datetime`` ("Jul 26 2024" style): today
      (Llama 3.x and FireFunction print them; their own fallback is a fixed date);
    * ``preserve_reasoning=True/False``: also ``preserve_thinking``, ``clear_thinking``,
      ``truncate_history_thinking`` and ``drop_thinking``, the names templates use for it;
    * ``reasoning_effort``: also ``reasoning_strength``.

    The caller's own ``kwargs`` take precedence over all of these.
    """
    now = datetime.now()
    out: dict[str, Any] = {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}
    preserve = kwargs.get("preserve_reasoning")
    if isinstance(preserve, bool):
        out.update((name, preserve if keep else not preserve) for name, keep in _PRESERVE_REASONING_VARIABLES)
    effort = kwargs.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        out["reasoning_strength"] = effort
    return out


def _normalise_tool_arguments(messages: list, as_object: bool) -> list:
    """Give every tool call's ``arguments`` the form the template expects (object or JSON text).

    A ``None`` content (OpenAI clients send it with tool calls) becomes ``""``, as llama.cpp passes it.
    """
    for message in messages:
        if isinstance(message, dict) and "content" in message and message["content"] is None:
            message["content"] = ""
        for call in message.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or "arguments" not in fn:
                continue
            args = fn["arguments"]
            if as_object and isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except (ValueError, RecursionError):  # (depth: refused by check_nesting before)
                    pass
            elif not as_object and not isinstance(args, str):
                fn["arguments"] = json.dumps(args, ensure_ascii=False)
    return messages


# A template that reads past reasoning from content blocks ({"type": "thinking", "thinking": ...}), as
# Mistral's reasoning models do.
_THINKING_BLOCKS = re.compile(r"""\[\s*['"]type['"]\s*\]\s*==\s*['"]thinking['"]|\.type\s*==\s*['"]thinking['"]""")


def _adapt_reasoning(messages: list, as_blocks: bool) -> list:
    """Give an assistant turn's ``reasoning_content`` the shape the template reads.

    Templates read past reasoning as ``reasoning_content`` (most), ``thinking`` (gpt-oss,
    LFM2) or, for Mistral's, a ``thinking`` content block before the text; llama.cpp's
    server adapts the message the same way.
    """
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("reasoning_content"), str):
            continue
        message.setdefault("thinking", message["reasoning_content"])
        if as_blocks and message.get("role") in ("assistant", "system"):
            content = message.get("content")
            blocks = [{"type": "thinking", "thinking": message.pop("reasoning_content")}]
            if isinstance(content, str):
                blocks.append({"type": "text", "text": content})
            elif isinstance(content, list):
                blocks.extend(content)
            message["content"] = blocks
            del message["thinking"]
    return messages


def _merge_system(messages: list) -> list | None:
    # Joined with one newline, as llama.cpp's server does for these templates.
    system, rest = messages[0], messages[1:]
    for i, message in enumerate(rest):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            merged = dict(message, content=f"{system.get('content', '')}\n{message['content']}")
            return rest[:i] + [merged] + rest[i + 1:]
    return None


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled Jinja chat template.

    ``bos_token``/``eos_token`` are the texts of the model's special tokens,
    passed to the template as the Hugging Face convention does.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ChatTemplateError("the chat template is empty")
        object.__setattr__(self, "_template", compile_template(self.source))

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads a ``tools`` variable."""
        return "tools" in self.source

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, timeout: float = MAX_SECONDS,
               **kwargs: Any) -> str:
        """Render a conversation to prompt text.

        ``kwargs`` become template variables (``enable_thinking=False``,
        ``reasoning_effort="low"``, ...), over the defaults of :func:`default_variables`
        (today's date, ...). Errors from the template, and budget overruns, raise
        :class:`ChatTemplateError`. A variable the renderer sets itself (:data:`RESERVED_VARIABLES`)
        raises InvalidArgumentError.
        """
        kwargs = check_template_kwargs(kwargs)
        messages = list(messages)  # (an iterator is read once)
        # (before the copy and the arguments' parse below, which recurse as deep as the request goes)
        check_nesting({"messages": messages, "tools": tools, "variables": kwargs})
        msgs = _normalise_tool_arguments(copy.deepcopy(messages), self.tool_arguments_as_object)
        msgs = _adapt_reasoning(msgs, self.reads_thinking_blocks)
        try:
            return self._render(msgs, add_generation_prompt, tools, timeout, kwargs)
        except ChatTemplateError as exc:
            # Templates without a system role (Gemma 2, ...) refuse a system message; fold it into
            # the first user turn, as those models' own chat code does.
            if "system" not in str(exc).lower() or not msgs or msgs[0].get("role") != "system":
                raise
            merged = _merge_system(msgs)
            if merged is None:
                raise
            return self._render(merged, add_generation_prompt, tools, timeout, kwargs)

    @cached_property
    def reads_thinking_blocks(self) -> bool:
        """Whether past reasoning goes to the template as a ``thinking`` content block (it reads
        such blocks and not ``reasoning_content``)."""
        return "reasoning_content" not in self.source and bool(_THINKING_BLOCKS.search(self.source))

    @cached_property
    def tool_arguments_as_object(self) -> bool:
        """Whether tool-call ``arguments`` reach the template as objects (else JSON strings).

        Found by rendering a probe conversation both ways, as llama.cpp does:
        most templates index into the arguments, a few concatenate them as text.
        """
        if "tool_calls" not in self.source:
            return True
        probe = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_000000001", "type": "function",
                      "function": {"name": "probe", "arguments": {"arg": "value"}}}]},
                 {"role": "tool", "tool_call_id": "call_000000001", "name": "probe", "content": "ok"},
                 {"role": "assistant", "content": "done"}, {"role": "user", "content": "y"}]
        for as_object in (True, False):
            try:
                self._render(_normalise_tool_arguments(copy.deepcopy(probe), as_object), True, None, MAX_SECONDS, {})
                return as_object
            except ChatTemplateError:
                continue
        return True

    def _render(self, messages: list, add_generation_prompt: bool, tools, timeout: float,
                kwargs: Mapping[str, Any]) -> str:
        context = {
            **default_variables(kwargs),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **copy.deepcopy(dict(kwargs)),
        }
        if tools is not None:
            context["tools"] = copy.deepcopy(list(tools))
        return render_template(self._template, context, timeout)  # type: ignore[attr-defined]
