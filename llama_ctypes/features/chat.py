"""Chat over a Model: template → tokens → stream, with reasoning separated from the answer.

``chat``/``stream_chat`` return text (:class:`ChatReply`, :class:`ChatStream`); the OpenAI
chat-completion dicts are built from them in :mod:`.openai.chat`.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ..core.budget import ReasoningBudget
from ..core.generation import FinishReason, GenerationParams, LazyStream, Timings
from ..core.logprobs import TokenLogprob
from ..core.media import MediaData, MediaLimits
from ..core.model import Model
from ..core.params import ContextParams, split_options
from ..core.projector import MediaPrompt
from ..core.sampler import SamplingParams
from ..core.target import GenerationTarget, as_target
from ..core.tokenizer import Tokenizer
from ..errors import ArgumentTypeError, InvalidArgumentError, MediaError
from ..native import llama_h as L
from .chat_media import has_media, split_media
from .chat_template import ChatTemplate, ChatTemplateError, check_template_kwargs
from .openai.shapes import CompletionUsage, usage
from .reasoning import (
    ReasoningSplitter,
    budget_tokens,
    formats_for_template,
    opens_inside_reasoning,
    reasoning_budget,
)
from .structured import constrain_to, parse_completion

Message = Mapping[str, Any]


@dataclass(frozen=True)
class ChatParams:
    """How a conversation becomes a prompt."""

    chat_template: str | None = None
    """Jinja template source, or a llama.cpp built-in format name (``"chatml"``, ``"gemma"``, ...);
    None = the model's own template."""
    template_name: str | None = None
    """A named template variant stored in the GGUF (e.g. ``"tool_use"``)."""
    system: str | None = None
    """A system prompt put before the messages (unless they start with one)."""
    tools: Sequence[Mapping[str, Any]] | None = None
    """Tool (function) definitions, in the OpenAI format, passed to the template."""
    enable_thinking: bool | None = None
    """Ask a thinking model to think (True) or not (False); None = the template's default
    (llama-server instead passes True to every template that can think)."""
    preserve_reasoning: bool | None = None
    """Keep (True) or drop (False) the ``reasoning_content`` of past assistant turns, for templates
    that offer the choice; None = the template's default (llama-server passes True)."""
    add_generation_prompt: bool = True
    """End the prompt with the assistant turn's opening."""
    continue_final_message: bool = False
    """The last message is an assistant's reply to continue (a prefill): the prompt ends with its text,
    without the end of its turn. Needs ``add_generation_prompt=False``."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More variables for the template (``reasoning_effort="low"``, ...); not the renderer's own
    (``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``): InvalidArgumentError."""
    parse_reasoning: bool = True
    """Separate thinking from the answer for templates that think."""

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidArgumentError("continue_final_message=True needs add_generation_prompt=False (the prompt "
                                       "ends inside the last assistant message, not at a new turn)")
        if self.tools is not None and not all(isinstance(t, Mapping) for t in self.tools):
            raise InvalidArgumentError("tools must be a list of tool definitions (dicts)")
        check_template_kwargs(self.template_kwargs)


class BuiltinChatTemplate:
    """One of llama.cpp's built-in chat formats, rendered by ``llama_chat_apply_template``."""

    source = ""

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def names() -> list[str]:
        from ..core.backend import init

        lib = init()
        n = lib.llama_chat_builtin_templates(None, 0)
        arr = (ctypes.c_char_p * n)()
        lib.llama_chat_builtin_templates(arr, n)
        return [x.decode() for x in arr]

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tools=None,
               **kwargs: Any) -> str:
        from ..core.backend import init

        if tools:
            raise ChatTemplateError(f"the built-in {self.name!r} format does not support tools")
        lib = init()
        keep = [(str(m.get("role", "")).encode(), content_text(m.get("content")).encode()) for m in messages]
        arr = (L.llama_chat_message * len(keep))(*[L.llama_chat_message(r, c) for r, c in keep])
        size = 4096 + 2 * sum(len(c) + len(r) for r, c in keep)
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_chat_apply_template(self.name.encode(), arr, len(keep), add_generation_prompt, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n + 1)
            n = lib.llama_chat_apply_template(self.name.encode(), arr, len(keep), add_generation_prompt, buf, n + 1)
        if n < 0:
            raise ChatTemplateError(f"llama.cpp could not apply the built-in {self.name!r} format")
        return buf.raw[:n].decode("utf-8", errors="replace")


def content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content list joined by a new
    line (as llama.cpp joins them for a template that takes strings)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)


def _joined_parts(message: Message) -> Message:
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return {**message, "content": content_text(content)}
    return message


_templates_lock = threading.Lock()


def template_for(model: Model, params: ChatParams) -> ChatTemplate | BuiltinChatTemplate:
    """The template a chat call uses: given, built-in by name, or the model's own (cached on the model)."""
    src = params.chat_template
    if src is not None and "{" not in src:
        if src in BuiltinChatTemplate.names():
            return BuiltinChatTemplate(src)
        raise ChatTemplateError(
            f"chat_template={src!r} is neither Jinja source nor a built-in format; built-in formats: "
            + ", ".join(BuiltinChatTemplate.names()))
    bos = Tokenizer.bos(model)
    eos = Tokenizer.eos(model)
    bos_text = Tokenizer.token_to_piece(model, bos, special=True) if bos is not None else ""
    eos_text = Tokenizer.token_to_piece(model, eos, special=True) if eos is not None else ""
    if src is not None:
        return ChatTemplate(src, bos_token=bos_text, eos_token=eos_text)
    key = params.template_name or ""
    with _templates_lock:
        cache = model.__dict__.setdefault("_chat_templates", {})
        if key not in cache:
            source = model.chat_template_named(params.template_name)
            if source is None:
                what = f"{params.template_name!r} chat template" if params.template_name else "chat template"
                raise ChatTemplateError(
                    f"{model.path.name} has no {what} in its metadata; pass chat_template=<Jinja source> or "
                    f"a built-in format name ({', '.join(BuiltinChatTemplate.names()[:8])}, ...)")
            cache[key] = ChatTemplate(source, bos_token=bos_text, eos_token=eos_text)
        return cache[key]


def render_prompt(model: Model, messages: Sequence[Message], params: ChatParams) -> tuple[str, Any]:
    """Render ``messages`` with the chat template; returns (prompt text, template)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ArgumentTypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidArgumentError(f"messages[{i}] must be a dict with a 'role'")
    msgs = [_joined_parts(m) for m in messages]
    if params.continue_final_message and msgs:
        msgs[-1] = messages[-1]  # (continue_final joins its parts itself)
    if params.system is not None and not (msgs and msgs[0].get("role") == "system"):
        msgs.insert(0, {"role": "system", "content": params.system})
    template = template_for(model, params)
    if params.continue_final_message:
        return continue_final(lambda ms: template.render(ms, add_generation_prompt=False, tools=params.tools,
                                                         **chat_variables(params)), msgs), template
    text = template.render(msgs, add_generation_prompt=params.add_generation_prompt, tools=params.tools,
                           **chat_variables(params))
    return text, template


#: Put after the text of a message to continue, to find where that text ends in the rendered prompt.
_CONTINUE_MARK = "\u2063lc-continue\u2063"


def continue_final(render: Any, messages: Sequence[Message]) -> str:
    """The prompt that continues the last message (an assistant's, with text and no tool calls):
    ``render(messages)`` cut right after that message's text, so the model goes on writing it.

    Raises InvalidArgumentError when the conversation cannot be continued, or when the template
    does not keep the message's text as it is.
    """
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidArgumentError("continue_final_message needs an assistant message last")
    last = messages[-1]
    if last.get("tool_calls"):
        raise InvalidArgumentError("cannot continue an assistant message that contains tool calls")
    content = last.get("content") or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        # text parts become one text, joined as llama.cpp's continuation joins them (blank line between)
        content = "\n\n".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise InvalidArgumentError("the assistant message to continue must have text content")
    text = render([*messages[:-1], {**last, "content": content + _CONTINUE_MARK}])
    cut = text.rfind(_CONTINUE_MARK)
    if cut < 0:
        raise InvalidArgumentError("the chat template does not write the last assistant message as it is, "
                                   "so it cannot be continued")
    return text[:cut]


def chat_variables(params: ChatParams) -> dict[str, Any]:
    """The template variables a request sets: ``template_kwargs``, then ``enable_thinking`` and
    ``preserve_reasoning`` where given."""
    kwargs = dict(params.template_kwargs)
    if params.enable_thinking is not None:
        kwargs["enable_thinking"] = params.enable_thinking
    if params.preserve_reasoning is not None:
        kwargs["preserve_reasoning"] = params.preserve_reasoning
    return kwargs


def prompt_tokens(model: Model, text: str) -> list[int]:
    """Tokenize a rendered prompt without doubling or dropping the template's special tokens.

    Specials written by the template are parsed as tokens; BOS is added only
    when the model wants one and the template did not write it; a trailing EOS
    added by the tokenizer is removed (the assistant must be free to answer).
    """
    ids = Tokenizer.encode(model, text, add_special=True, parse_special=True)
    bos, eos = Tokenizer.bos(model), Tokenizer.eos(model)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    if eos is not None and len(ids) >= 2 and ids[-1] == eos and not text.endswith(
            Tokenizer.token_to_piece(model, eos, special=True)):
        ids = ids[:-1]
    return ids


def media_prompt_tokens(model: Model, text: str, media: Sequence[MediaData],
                        limits: MediaLimits | None = None) -> MediaPrompt:
    """:func:`prompt_tokens` for a rendered prompt holding the projector's media markers: the media go
    where the markers are (BOS added only when the template did not write it)."""
    projector = model.projector
    if projector is None:
        raise MediaError(f"{model.path.name} has no multimodal projector")
    bos = Tokenizer.bos(model)
    bos_text = Tokenizer.token_to_piece(model, bos, special=True) if bos is not None else ""
    add_special = not (bos_text and text.startswith(bos_text))
    return projector.tokenize(text, media, add_special=add_special, parse_special=True, limits=limits)


class ChatReply(str):
    """The assistant's answer (a ``str``), with ``reasoning``, ``finish_reason``, ``usage`` and ``timings``;
    ``logprobs`` (one :class:`~llama_ctypes.TokenLogprob` per token, reasoning included) when asked
    for with ``logprobs=k``, else None."""

    reasoning: str
    finish_reason: FinishReason
    tokens: list[int]
    prompt_tokens: int
    timings: Timings
    logprobs: list[TokenLogprob] | None

    def __new__(cls, content: str, reasoning: str, finish_reason: FinishReason, tokens: list[int],
                prompt_tokens: int, timings: Timings, logprobs: list[TokenLogprob] | None = None) -> "ChatReply":
        self = super().__new__(cls, content)
        self.reasoning = reasoning
        self.finish_reason = finish_reason
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.timings = timings
        self.logprobs = logprobs
        return self

    @property
    def content(self) -> str:
        return str.__str__(self)

    @property
    def usage(self) -> CompletionUsage:
        """OpenAI usage: prompt, completion and total tokens, and the prompt tokens served from cache."""
        return usage(self.prompt_tokens, len(self.tokens), self.timings.cached_tokens if self.timings else 0)


def _chat_deltas(text_stream: Any, splitter: ReasoningSplitter | None, content: list[str],
                 reasoning: list[str]) -> Iterator[tuple[str, str]]:
    # A function, not a method: the generator must not refer back to its ChatStream, so that
    # dropping the stream closes the generator (and stops generation) at once.
    for piece in text_stream:
        parts = splitter.feed(piece) if splitter is not None else [("content", piece)]
        for kind, text in parts:
            (reasoning if kind == "reasoning" else content).append(text)
            yield kind, text
    if splitter is not None:
        for kind, text in splitter.flush():
            (reasoning if kind == "reasoning" else content).append(text)
            yield kind, text


class ChatStream(LazyStream):
    """A lazy chat response. Iterating yields the answer's text pieces.

    ``deltas()`` yields ``(kind, text)`` with kind ``"reasoning"`` or
    ``"content"``, for callers that show thinking. ``close()``, ``cancel()``
    (from any thread), or breaking out and dropping the stream stops
    generation. After the end, ``content``, ``reasoning``, ``finish_reason``
    and ``reply()`` describe the result.
    """

    def __init__(self, text_stream: Any, splitter: ReasoningSplitter | None):
        self._stream = text_stream
        self._splitter = splitter
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._deltas = _chat_deltas(text_stream, splitter, self._content, self._reasoning)
        self._gen = (text for kind, text in self._deltas if kind == "content")

    def deltas(self) -> Iterator[tuple[str, str]]:
        return self._deltas

    def cancel(self) -> None:
        """Stop generation from any thread; the iterating thread then gets CancelledError."""
        self._stream.cancel()

    def close(self) -> None:
        for gen in (self._gen, self._deltas):
            try:
                gen.close()
            except ValueError:  # running in another thread
                self._stream.cancel()
        self._stream.close()

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._stream.finish_reason

    @property
    def in_reasoning(self) -> bool:
        """True when the output so far ends inside an unfinished thinking block."""
        return self._splitter is not None and self._splitter.in_reasoning

    def reply(self) -> ChatReply:
        """Run to the end and return the :class:`ChatReply`."""
        for _ in self._deltas:
            pass
        s = self._stream
        logprobs = s.logprobs
        return ChatReply(self.content, self.reasoning, s.finish_reason or "length", list(s.tokens),
                         s.prompt_tokens, s.timings, list(logprobs) if logprobs is not None else None)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Log-probabilities of the tokens so far (``logprobs=k``), else None."""
        return self._stream.logprobs

    @property
    def prompt_tokens(self) -> int:
        return self._stream.prompt_tokens


def _split_chat_options(opts: Mapping[str, Any]):
    chat_opts, gen_opts, sampling_opts, ctx_opts = split_options(
        opts, ChatParams, GenerationParams, SamplingParams, ContextParams, where="unknown")
    return ChatParams(**chat_opts), {**gen_opts, **sampling_opts, **ctx_opts}


def stream_chat(model: Model | GenerationTarget, messages: Sequence[Message], **opts: Any) -> ChatStream:
    """Stream the assistant's answer to ``messages``; see :class:`ChatStream`.

    ``model`` may also be a :class:`~llama_ctypes.Server`: templating and
    tokenization then happen in the caller's thread and the server gets the
    tokens (its prefix cache serves the conversation's earlier turns; pass
    ``session=`` to keep a conversation on its slot).

    Options: :class:`ChatParams` (chat_template, system, tools, enable_thinking,
    template_kwargs, ...) plus everything :func:`llama_ctypes.stream` (or the
    server's ``stream``) takes. ``reasoning_budget=N`` (tokens; -1: no limit) forces the end of a
    thinking model's reasoning block after N tokens, after ``reasoning_budget_message`` when given.
    """
    target = as_target(model)
    model = target.model
    session = opts.pop("session", None)
    media_limits = opts.pop("media_limits", None)
    params, rest = _split_chat_options(opts)
    media: list = []
    if has_media(messages):
        messages, media = split_media(messages, model.projector, media_limits)
    text, template = render_prompt(model, messages, params)
    formats = formats_for_template(template.source) if params.parse_reasoning else ()
    splitter = ReasoningSplitter(formats, opens_inside_reasoning(text, formats)) if formats else None
    if formats:
        rest.setdefault("special", True)  # reasoning markers are often special tokens
    if not isinstance(rest.get("reasoning_budget"), (ReasoningBudget, type(None))):  # (a number of tokens)
        n = budget_tokens(rest.pop("reasoning_budget"))
        message = rest.pop("reasoning_budget_message", "")
        if n is not None:
            rest["reasoning_budget"] = reasoning_budget(model.vocab, formats_for_template(template.source), text, n,
                                                        message)
    tokens = media_prompt_tokens(model, text, media, media_limits) if media else prompt_tokens(model, text)
    return ChatStream(target.stream_tokens(tokens, session=session, **rest), splitter)


def chat(model: Model | GenerationTarget, messages: Sequence[Message], *, response_model: Any = None, **opts: Any) -> ChatReply | Any:
    """The assistant's answer to ``messages`` (a ``str``; ``.reasoning`` holds any thinking).

    With ``response_model`` (Pydantic model, dataclass or TypedDict) the answer is
    constrained to its JSON schema and returned as a validated instance.
    """
    if response_model is None:
        return stream_chat(model, messages, **opts).reply()
    reply = stream_chat(model, messages, **constrain_to(response_model, opts)).reply()
    return parse_completion(reply.content, reply.finish_reason, response_model)
