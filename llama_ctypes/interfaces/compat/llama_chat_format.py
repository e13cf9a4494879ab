"""llama-cpp-python's ``llama_chat_format``: chat formatters that turn messages into a prompt, and chat handlers.

``Llama.create_chat_completion`` renders with the model's own template (or ``chat_format``) itself;
these are for code that formats prompts by hand. Templates render in llama_ctypes' Jinja sandbox
(bounded in time and size), never in a plain ``jinja2.Environment``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from ...features.chat_template import ChatTemplate
from ._session import StoppingCriteriaList

__all__ = ["ChatFormatterResponse", "ChatFormatter", "Jinja2ChatFormatter", "hf_tokenizer_config_to_chat_formatter",
           "format_mistral_instruct", "LlamaChatCompletionHandler", "Llava15ChatHandler", "Llava16ChatHandler",
           "MoondreamChatHandler", "NanoLlavaChatHandler", "Llama3VisionAlphaChatHandler", "MiniCPMv26ChatHandler",
           "Qwen25VLChatHandler"]


@dataclass
class ChatFormatterResponse:
    """A rendered prompt; ``added_special``: it already starts with the BOS text (do not add BOS again)."""

    prompt: str
    stop: str | list[str] | None = None
    stopping_criteria: StoppingCriteriaList | None = None
    added_special: bool = False


class ChatFormatter(Protocol):
    def __call__(self, *, messages: list[Mapping[str, Any]], **kwargs: Any) -> ChatFormatterResponse: ...


class Jinja2ChatFormatter:
    """A Hugging Face style Jinja chat template, with ``bos_token``/``eos_token`` given as text."""

    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        self.template = template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.add_generation_prompt = add_generation_prompt
        self.stop_token_ids = set(int(t) for t in stop_token_ids) if stop_token_ids else None
        self._compiled = ChatTemplate(template, bos_token=bos_token, eos_token=eos_token)

    def __call__(self, *, messages: list[Mapping[str, Any]], functions: list[Mapping[str, Any]] | None = None,
                 function_call: Any = None, tools: list[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                 **kwargs: Any) -> ChatFormatterResponse:
        if functions and not tools:
            tools = [{"type": "function", "function": f} for f in functions]
        prompt = self._compiled.render(messages, add_generation_prompt=self.add_generation_prompt, tools=tools)
        stopping = None
        if self.stop_token_ids:
            ids = self.stop_token_ids
            stopping = StoppingCriteriaList([lambda input_ids, logits: bool(len(input_ids))
                                             and int(input_ids[-1]) in ids])
        return ChatFormatterResponse(prompt=prompt, stop=[self.eos_token], stopping_criteria=stopping,
                                     added_special=True)


def _special_text(value: Any) -> str:
    if isinstance(value, Mapping):  # (tokenizer_config.json may spell a token as an AddedToken dict)
        value = value.get("content")
    return value if isinstance(value, str) else ""


def hf_tokenizer_config_to_chat_formatter(tokenizer_config: Mapping[str, Any],
                                          add_generation_prompt: bool = True) -> ChatFormatter:
    """A formatter from a Hugging Face ``tokenizer_config.json`` (its ``chat_template``, ``bos_token``,
    ``eos_token``). As llama-cpp-python's: with ``add_generation_prompt`` an empty assistant message is
    appended and rendered (the template's own generation prompt is not used)."""
    if not isinstance(tokenizer_config.get("chat_template"), str):
        raise ValueError("tokenizer_config has no chat_template string")
    bos, eos = _special_text(tokenizer_config.get("bos_token")), _special_text(tokenizer_config.get("eos_token"))
    template = ChatTemplate(tokenizer_config["chat_template"], bos_token=bos, eos_token=eos)

    def format_tokenizer_config(messages: list[Mapping[str, Any]], **kwargs: Any) -> ChatFormatterResponse:
        if add_generation_prompt:
            messages = [*messages, {"role": "assistant", "content": ""}]
        prompt = template.render(messages, add_generation_prompt=False)
        return ChatFormatterResponse(prompt=prompt, stop=[eos, bos])

    return format_tokenizer_config


def format_mistral_instruct(messages: list[Mapping[str, Any]], **kwargs: Any) -> ChatFormatterResponse:
    """Mistral's ``[INST] ... [/INST]`` format, without the leading BOS (``added_special`` False); a system
    message goes before the next user turn's text."""
    eos, prompt, system = "</s>", "", ""
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if not isinstance(content, str):
            content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
        if role == "system":
            system += content + "\n\n"
        elif role == "user":
            prompt += f"[INST] {system}{content} [/INST]"
            system = ""
        elif role == "assistant" and content:
            prompt += content + eos
    return ChatFormatterResponse(prompt=prompt, stop=eos)


class LlamaChatCompletionHandler(Protocol):
    """A ``chat_handler``: ``Llama.create_chat_completion`` calls it with ``llama=`` and all its own arguments
    (messages, tools, sampling, stream, ...) and returns what it returns."""

    def __call__(self, *, llama: Any, messages: list[Mapping[str, Any]], **kwargs: Any) -> Any: ...


class Llava15ChatHandler:
    """A multimodal projector for ``Llama(chat_handler=...)``: ``Llama`` loads ``clip_model_path`` as the
    model's projector (libmtmd), and image parts in chat messages (``image_url``: a data URL, a file path
    or URL as :func:`llama_ctypes.chat` takes it) reach the model.

    Unlike llama-cpp-python's handler classes, which each hard-code one prompt format, the prompt is
    rendered with the model's own chat template (or ``chat_format``), as llama-server does; the subclasses
    differ only by name.
    """

    def __init__(self, clip_model_path: str, verbose: bool = True) -> None:
        if not isinstance(clip_model_path, (str, os.PathLike)):
            raise TypeError(f"clip_model_path must be a path, not {type(clip_model_path).__name__}")
        self.clip_model_path = os.fspath(clip_model_path)
        self.verbose = verbose

    def __call__(self, *, llama: Any, messages: list[Mapping[str, Any]], **kwargs: Any) -> Any:
        return llama.create_chat_completion(messages, **kwargs)


class Llava16ChatHandler(Llava15ChatHandler):
    pass


class MoondreamChatHandler(Llava15ChatHandler):
    pass


class NanoLlavaChatHandler(Llava15ChatHandler):
    pass


class Llama3VisionAlphaChatHandler(Llava15ChatHandler):
    pass


class MiniCPMv26ChatHandler(Llava15ChatHandler):
    pass


class Qwen25VLChatHandler(Llava15ChatHandler):
    pass
