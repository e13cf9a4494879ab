"""``suffix`` on ``create_completion``: fill-in-the-middle prompts, and the text shapes around them."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ...errors import ArgumentTypeError

__all__ = ["fim_prompt", "echoed", "appended", "with_tail"]


def fim_prompt(vocab: Any, prompt: str | list[int], suffix: str, spm: bool) -> list[int] | None:
    """``[BOS] [FIM_PRE] prompt [FIM_SUF] suffix [FIM_MID]`` (the suffix part first with ``spm``), or None
    when the vocabulary has no FIM tokens. (llama-cpp-python 0.3 puts token 0 where the FIM tokens go.)"""
    fim = vocab.fim
    if fim.pre is None or fim.suf is None or fim.mid is None:
        return None
    if isinstance(prompt, str):
        head = vocab.tokenize(prompt, add_special=False, parse_special=False)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
        head = vocab.check_tokens([int(t) for t in prompt]).tolist()
    else:
        raise ArgumentTypeError("prompt must be a str or a list of token ids")
    pre = [fim.pre, *head]
    suf = [fim.suf, *vocab.tokenize(suffix, add_special=False, parse_special=False)]
    bos = [vocab.bos] if vocab.add_bos and vocab.bos is not None else []
    return [*bos, *(suf + pre if spm else pre + suf), fim.mid]


def echoed(text: str, out: Any, stream: bool) -> Any:
    """A completion (or its chunks) with ``text`` before the generated text: ``echo`` of a FIM prompt shows
    the prompt as given, not the FIM layout."""
    if not stream:
        choice = out["choices"][0]
        return {**out, "choices": [dict(choice, text=text + choice["text"])]}

    def chunks() -> Iterator[dict[str, Any]]:
        first = True
        for chunk in out:
            if first:
                first = False
                yield {**chunk, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}]}
            yield chunk
    return chunks()


def appended(out: dict[str, Any], tail: str) -> dict[str, Any]:
    """A completion with ``tail`` after its text (a suffix on a model without FIM tokens)."""
    choice = out["choices"][0]
    return {**out, "choices": [dict(choice, text=choice["text"] + tail)]}


def with_tail(chunks: Iterator[dict[str, Any]], tail: str) -> Iterator[dict[str, Any]]:
    """The chunks with one more holding ``tail`` before the one that finishes."""
    for chunk in chunks:
        if chunk["choices"][0]["finish_reason"] is not None:
            yield {**chunk, "choices": [{"text": tail, "index": 0, "logprobs": None, "finish_reason": None}]}
        yield chunk
