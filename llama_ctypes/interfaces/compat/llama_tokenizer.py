"""llama-cpp-python's tokenizer object and the two llama.h functions outlines builds its vocabulary with
(``llama_model_get_vocab``, ``llama_token_to_piece``), over handles that keep the model alive."""

from __future__ import annotations

import ctypes
from typing import Any

from ...core.model import Model
from ...errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["LlamaTokenizer", "LlamaModelHandle", "LlamaVocabHandle", "llama_model_get_vocab", "llama_token_to_piece"]


class LlamaTokenizer:
    """``Llama.tokenizer()``: bytes in and out (``tokenize``/``detokenize``), str (``encode``/``decode``)."""

    def __init__(self, llama: Any) -> None:
        self.llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return self.llama.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


class LlamaModelHandle:
    """What ``Llama.model`` gives: the model, held (llama-cpp-python gives a raw ``llama_model *``)."""

    def __init__(self, model: Model) -> None:
        self.model = model


class LlamaVocabHandle:
    """What :func:`llama_model_get_vocab` gives: the vocabulary, held."""

    def __init__(self, model: Model) -> None:
        self.model = model


def llama_model_get_vocab(model: LlamaModelHandle) -> LlamaVocabHandle:
    """llama.h's function, over ``Llama.model`` (outlines builds its vocabulary with it)."""
    if not isinstance(model, LlamaModelHandle):
        raise ArgumentTypeError("llama_model_get_vocab takes Llama.model (raw pointers are not carried over)")
    return LlamaVocabHandle(model.model)


def llama_token_to_piece(vocab: LlamaVocabHandle, token: int, buf: Any, length: int, lstrip: int,
                         special: bool) -> int:
    """llama.h's function: the token's piece into ``buf`` (a ctypes char array of at least ``length``),
    ``lstrip`` leading spaces dropped; the number of bytes written, or minus the size needed when ``length``
    is too small (nothing written then)."""
    if not isinstance(vocab, LlamaVocabHandle):
        raise ArgumentTypeError("llama_token_to_piece takes what llama_model_get_vocab returned")
    if not isinstance(length, int) or length < 0 or not isinstance(lstrip, int) or lstrip < 0:
        raise InvalidArgumentError("length and lstrip must be integers >= 0")
    if not isinstance(buf, ctypes.Array):  # (a pointer's sizeof says nothing of what it points to)
        raise ArgumentTypeError("buf must be a ctypes array, e.g. (ctypes.c_char * length)()")
    if ctypes.sizeof(buf) < length:
        raise InvalidArgumentError(f"a buffer of {ctypes.sizeof(buf)} bytes, not the {length} claimed")
    piece = vocab.model.vocab.token_bytes(vocab.model.vocab.check_token(int(token)), special=bool(special))
    for _ in range(lstrip):
        if not piece.startswith(b" "):
            break
        piece = piece[1:]
    if len(piece) > length:
        return -len(piece)
    ctypes.memmove(buf, piece, len(piece))
    return len(piece)
