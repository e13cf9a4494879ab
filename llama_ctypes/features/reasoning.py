"""Separating a thinking model's reasoning from its answer, as text streams in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

from ..core.budget import ReasoningBudget
from ..core.text import partial_suffix
from ..errors import InvalidArgumentError

Kind = Literal["reasoning", "content"]


@dataclass(frozen=True)
class ReasoningFormat:
    """Markers around a reasoning block, as a template writes them."""

    start: str
    end: str
    #: Text that may follow ``end`` before the answer (a channel header), dropped.
    answer_prefix: str = ""


#: The reasoning markers used by the templates in llama.cpp's models/templates.
FORMATS = (
    ReasoningFormat("<think>", "</think>"),  # Qwen3/3.5, DeepSeek R1/V3.1+, GLM, SmolLM3, MiniMax M2, Nemotron, ...
    ReasoningFormat("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ReasoningFormat("<mm:think>", "</mm:think>"),  # MiniMax M3
    ReasoningFormat("[THINK]", "[/THINK]"),  # Mistral Magistral / Ministral reasoning
    ReasoningFormat("<|channel>thought", "<channel|>"),  # Gemma 4
    ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>",
                    answer_prefix="<|start|>assistant<|channel|>final<|message|>"),  # gpt-oss
    ReasoningFormat("<thinking>", "</thinking>"),  # Apriel 1.5
)


def formats_for_template(source: str) -> tuple[ReasoningFormat, ...]:
    """The reasoning formats whose start marker the template writes."""
    return tuple(f for f in FORMATS if f.start in source)


def opens_inside_reasoning(prompt: str, formats: Iterable[ReasoningFormat]) -> ReasoningFormat | None:
    """The format whose block the prompt leaves open (e.g. a generation prompt ending in ``<think>``)."""
    for fmt in formats:
        start = prompt.rfind(fmt.start)
        if start >= 0 and prompt.find(fmt.end, start + len(fmt.start)) < 0:
            return fmt
    return None


def budget_tokens(value: Any) -> int | None:
    """A ``reasoning_budget`` option as tokens: None for None or -1 (no limit), else an integer >= 0
    (InvalidArgumentError otherwise)."""
    if value is None or value == -1 and not isinstance(value, bool):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"reasoning_budget={value!r}: expected -1 (no limit), 0 or a number of tokens")
    return value


def reasoning_budget(vocab: Any, formats: Sequence[ReasoningFormat], prompt: str, tokens: int,
                     message: str = "") -> ReasoningBudget | None:
    """A :class:`ReasoningBudget` of ``tokens`` for a prompt rendered with a template that writes ``formats``
    (None when it writes none: nothing to limit). Markers and ``message`` are tokenized as the model writes
    them (special tokens parsed)."""
    if not formats:
        return None

    def ids(text: str) -> list[int]:
        return vocab.tokenize(text, add_special=False, parse_special=True)

    open_format = opens_inside_reasoning(prompt, formats)
    return ReasoningBudget(tokens, tuple((ids(f.start), ids(f.end)) for f in formats),
                           ids(message) if message else (), ids(open_format.end) if open_format else None)


class ReasoningSplitter:
    """Feed streamed text; get ``(kind, text)`` pieces with the markers removed.

    Text that could be the beginning of a marker is held back until it is
    known not to be one. Leading whitespace right after a marker is dropped.
    """

    def __init__(self, formats: Iterable[ReasoningFormat], open_format: ReasoningFormat | None = None):
        self.formats = tuple(formats)
        self._open = open_format  # the format whose block we are inside, if any
        self._pending = ""
        self._strip_leading = open_format is not None
        self._want_prefix: str = ""

    @property
    def in_reasoning(self) -> bool:
        return self._open is not None

    def _markers(self) -> list[str]:
        if self._open is not None:
            return [self._open.end]
        markers = [f.start for f in self.formats]
        if self._want_prefix:
            markers.append(self._want_prefix)
        return markers

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        self._pending += text
        while self._pending:
            if self._strip_leading:
                stripped = self._pending.lstrip()
                if not stripped:
                    self._pending = ""
                    break
                self._pending = stripped
                self._strip_leading = False
            if self._want_prefix and self._open is None:
                prefix = self._want_prefix
                if self._pending.startswith(prefix):
                    self._pending = self._pending[len(prefix):]
                    self._want_prefix = ""
                    self._strip_leading = True
                    continue
                if prefix.startswith(self._pending):
                    break  # could still become the prefix
                self._want_prefix = ""
            if self._open is not None:
                end = self._pending.find(self._open.end)
                if end >= 0:
                    self._emit(out, "reasoning", self._pending[:end])
                    self._pending = self._pending[end + len(self._open.end):]
                    self._want_prefix = self._open.answer_prefix
                    self._open = None
                    self._strip_leading = True
                    continue
            else:
                hits = [(self._pending.find(f.start), f) for f in self.formats]
                hits = [(i, f) for i, f in hits if i >= 0]
                if hits:
                    i, fmt = min(hits, key=lambda h: h[0])
                    self._emit(out, "content", self._pending[:i])
                    self._pending = self._pending[i + len(fmt.start):]
                    self._open = fmt
                    self._strip_leading = True
                    continue
            keep = partial_suffix(self._pending, self._markers())
            ready = self._pending[: len(self._pending) - keep]
            self._emit(out, "reasoning" if self._open is not None else "content", ready)
            self._pending = self._pending[len(ready):]
            break
        return out

    def flush(self) -> list[tuple[Kind, str]]:
        """Emit what is held back (at the end of the stream)."""
        out: list[tuple[Kind, str]] = []
        self._emit(out, "reasoning" if self._open is not None else "content", self._pending)
        self._pending = ""
        return out

    @staticmethod
    def _emit(out: list, kind: Kind, text: str) -> None:
        if text:
            out.append((kind, text))
