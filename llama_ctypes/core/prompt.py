"""A prompt as token ids, and whether it fits a context (every generation path checks with these)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..errors import ArgumentTypeError, ContextOverflowError, InvalidArgumentError
from .vocab import encode_text

if TYPE_CHECKING:
    from .context import Context
    from .generation import GenerationParams
    from .model import Model
    from .vocab import Vocab

__all__ = ["prompt_tokens", "check_prompt", "common_prefix"]

# A prompt text of more bytes than this many per context token is checked against a
# lower bound of its token count before it is tokenized (tokenizing megabytes takes seconds).
_BYTES_PER_TOKEN_CHECK = 4


def prompt_tokens(model: "Model | Vocab", prompt: str | Sequence[int], params: GenerationParams,
                  n_ctx: int = 0) -> list[int]:
    """The prompt as token ids (text is tokenized as ``params`` says; ids are checked).

    With ``n_ctx``, a text too long to fit is refused before tokenizing it.
    """
    vocab = getattr(model, "vocab", model)  # a Model, or a Vocab (a Context's, which outlives Model.close)
    if isinstance(prompt, str):
        data_len = len(encode_text(prompt))
        if n_ctx and data_len > _BYTES_PER_TOKEN_CHECK * n_ctx and vocab.min_tokens(data_len) >= n_ctx:
            raise ContextOverflowError(
                f"a prompt of {data_len} bytes is at least {vocab.min_tokens(data_len)} tokens and does not fit "
                f"the context window of {n_ctx} tokens", n_tokens=vocab.min_tokens(data_len), n_ctx=n_ctx)
        return vocab.tokenize(prompt, add_special=params.add_special, parse_special=params.parse_special)
    if isinstance(prompt, (bytes, bytearray)):
        raise ArgumentTypeError("prompt must be str or a sequence of token ids, not bytes")
    return vocab.check_tokens(prompt).tolist()


def check_prompt(ctx: "Context", prompt: Sequence[int], n_ctx: int | None = None) -> None:
    """Raise if ``prompt`` is empty, holds unknown token ids, or leaves no room to generate."""
    if ctx.encoder_only:
        raise InvalidArgumentError(f"{ctx.model.path.name} is an encoder-only model: it embeds (lc.embed), it cannot generate")
    if ctx.embedding_only:  # (llama.cpp would compute every token's row in one encode and assert on the outputs)
        raise InvalidArgumentError(f"{ctx.model.path.name} is an embedding model (non-causal attention): it embeds "
                                   "(lc.embed), it cannot generate")
    n_ctx = n_ctx or ctx.n_ctx_seq
    if not prompt:
        raise InvalidArgumentError("the prompt is empty (no tokens)")
    if len(prompt) >= n_ctx:
        raise ContextOverflowError(
            f"prompt of {len(prompt)} tokens does not fit the context window of {n_ctx} tokens "
            "(at least one token must be generated); use a larger n_ctx or a shorter prompt",
            n_tokens=len(prompt), n_ctx=n_ctx,
        )
    spans = getattr(prompt, "spans", None)  # a MediaPrompt: its placeholders are no vocabulary ids
    ctx.vocab.check_tokens(prompt.text_tokens if spans is not None else prompt)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
