"""Fill-in-the-middle prompts from a vocabulary's FIM tokens, laid out as llama-server's ``/infill`` does.

    tokens = infill_prompt(model.vocab, prefix, suffix, extra=[{"filename": "a.h", "text": "..."}],
                           prompt="", n_batch=512, n_predict=64, n_ctx=4096)

The layout (the repository-level pattern of Qwen2.5-Coder, arXiv 2409.12186, when the vocabulary
has ``FIM_REP``/``FIM_SEP``)::

    [FIM_REP]myproject\\n[FIM_SEP]a.h\\n<text of a.h>...[FIM_SEP]filename\\n
    [FIM_PRE]<prefix><prompt>[FIM_SUF]<suffix>[FIM_MID]

The prefix keeps its last 3/4 of a batch, the suffix its first part of the rest, and the extra
files fill what the context leaves after a batch and twice ``n_predict`` (the oldest text goes
first). ``spm=True`` puts the suffix before the prefix (SPM order). A vocabulary without the
three FIM tokens raises :class:`InfillError`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import InvalidArgumentError

__all__ = ["InfillError", "infill_prompt"]

#: Between extra chunks when the vocabulary has no FIM_SEP token (llama-server's separator).
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


class InfillError(InvalidArgumentError):
    """An infill request that cannot be laid out; ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


def _text_tokens(vocab: Any, value: Any, where: str) -> list[int]:
    """A prefix or suffix: text, or token ids (and texts) as llama-server's mixed prompts."""
    if isinstance(value, str):
        return vocab.tokenize(value, add_special=False, parse_special=False)
    if isinstance(value, list):
        out: list[int] = []
        for item in value:
            if isinstance(item, str):
                out += vocab.tokenize(item, add_special=False, parse_special=False)
            elif isinstance(item, int) and not isinstance(item, bool):
                out.append(int(vocab.check_token(item)))
            else:
                raise InfillError(f"{where}: expected a string or a list of token ids and strings", param=where)
        return out
    raise InfillError(f"{where}: expected a string or a list of token ids and strings", param=where)


def infill_prompt(vocab: Any, prefix: Any, suffix: Any, extra: Sequence[Mapping[str, Any]] = (), *,
                  prompt: str = "", n_batch: int = 512, n_predict: int = 0, n_ctx: int = 4096,
                  spm: bool = False) -> list[int]:
    """The token ids of a fill-in-the-middle prompt (see the module docstring).

    ``extra``: context files, each ``{"text": str, "filename": str (optional)}``. ``prompt``: text the
    middle starts with. Budgets in tokens.
    """
    fim = vocab.fim
    if fim.pre is None or fim.suf is None or fim.mid is None:
        raise InfillError("the model's vocabulary has no fill-in-the-middle tokens (FIM_PRE, FIM_SUF, FIM_MID)")
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text"), str):
            raise InfillError("an input_extra chunk needs a 'text' string", param=f"input_extra[{i}].text")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise InfillError("an input_extra chunk's 'filename' must be a string",
                              param=f"input_extra[{i}].filename")
    if not isinstance(prompt, str):
        raise InfillError("prompt: expected a string", param="prompt")

    def tok(text: str) -> list[int]:
        return vocab.tokenize(text, add_special=False, parse_special=False)

    tokens_prefix = _text_tokens(vocab, prefix, "input_prefix")
    tokens_suffix = _text_tokens(vocab, suffix, "input_suffix")
    tokens_prompt = vocab.tokenize(prompt, add_special=False, parse_special=True) if prompt else []
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *tok("myproject\n")]
    for chunk in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep, *tok(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_tokens += tok(_CHUNK_SEPARATOR)
        extra_tokens += tok(chunk["text"])
    if fim.sep is not None:
        extra_tokens += [fim.sep, *tok("filename\n")]

    n_prefix = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix = min(len(tokens_suffix), max(0, n_batch // 4 - (2 + len(tokens_prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim.pre, *tokens_prefix[len(tokens_prefix) - n_prefix:], *tokens_prompt]
    tail = [fim.suf, *tokens_suffix[:n_suffix]]
    first, second = (tail, head) if spm else (head, tail)
    if vocab.add_bos and vocab.bos is not None:
        first = [vocab.bos, *first]
    return [*(extra_tokens[len(extra_tokens) - n_extra:] if n_extra else []), *first, *second, fim.mid]
