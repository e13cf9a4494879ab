"""Tokenizer: text <-> token ids, and UTF-8-safe incremental detokenization."""

from __future__ import annotations

import codecs
from ctypes import create_string_buffer
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from ..errors import TokenizationError
from ..native import llama_h as L

if TYPE_CHECKING:
    from .model import Model


def _token_array(tokens: Iterable[int]) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype=np.int32)
    return np.fromiter(tokens, dtype=np.int32)


class Tokenizer:
    """Tokenizer functions taking the model first: ``Tokenizer.encode(model, "Hello")``.

    All functions are thread-safe (llama.cpp's vocabulary is read-only).
    """

    @staticmethod
    def encode(model: "Model", text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize ``text``.

        ``add_special`` adds BOS/EOS as the model's metadata asks; ``parse_special``
        turns special-token text such as ``<|im_start|>`` into its token id
        instead of tokenizing the characters.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        data = text.encode("utf-8")
        with model._shared():
            lib, vocab = model._lib, model._vocab
            capacity = len(data) + 8
            buf = (L.llama_token * capacity)()
            n = lib.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n < 0:
                capacity = -n
                buf = (L.llama_token * capacity)()
                n = lib.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n < 0:
                raise TokenizationError(f"llama_tokenize failed ({n}) for a text of {len(data)} bytes")
        return buf[:n]

    @staticmethod
    def decode(model: "Model", tokens: Sequence[int], remove_special: bool = False,
               unparse_special: bool = False) -> str:
        """Detokenize ``tokens`` to text (invalid UTF-8 is replaced, never raised).

        ``remove_special`` drops BOS/EOS; ``unparse_special`` renders special
        tokens as their text.
        """
        arr = _token_array(tokens)
        n_vocab = model.n_vocab
        if arr.size and (arr.min() < 0 or arr.max() >= n_vocab):
            raise TokenizationError(f"token ids must be in [0, {n_vocab}); got {arr.min()}..{arr.max()}")
        with model._shared():
            lib, vocab = model._lib, model._vocab
            ptr = arr.ctypes.data_as(L._p_token)
            size = max(64, arr.size * 8)
            buf = create_string_buffer(size)
            n = lib.llama_detokenize(vocab, ptr, arr.size, buf, size, remove_special, unparse_special)
            if n < 0:
                size = -n
                buf = create_string_buffer(size)
                n = lib.llama_detokenize(vocab, ptr, arr.size, buf, size, remove_special, unparse_special)
            if n < 0:
                raise TokenizationError(f"llama_detokenize failed ({n})")
        return buf.raw[:n].decode("utf-8", errors="replace")

    @staticmethod
    def token_to_bytes(model: "Model", token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a multi-byte character)."""
        with model._shared():
            return _piece(model._lib, model._vocab, token, special)

    @staticmethod
    def token_to_piece(model: "Model", token: int, special: bool = False) -> str:
        """One token as text; a partial UTF-8 sequence is shown as U+FFFD."""
        return Tokenizer.token_to_bytes(model, token, special).decode("utf-8", errors="replace")

    @staticmethod
    def vocab_size(model: "Model") -> int:
        """Number of tokens in the vocabulary."""
        return model.n_vocab

    @staticmethod
    def bos(model: "Model") -> int | None:
        """Beginning-of-sequence token id, or None."""
        return _opt(model, model._lib.llama_vocab_bos)

    @staticmethod
    def eos(model: "Model") -> int | None:
        """End-of-sequence token id, or None."""
        return _opt(model, model._lib.llama_vocab_eos)

    @staticmethod
    def eot(model: "Model") -> int | None:
        """End-of-turn token id, or None."""
        return _opt(model, model._lib.llama_vocab_eot)

    @staticmethod
    def nl(model: "Model") -> int | None:
        """Newline token id, or None."""
        return _opt(model, model._lib.llama_vocab_nl)

    @staticmethod
    def is_eog(model: "Model", token: int) -> bool:
        """True when ``token`` ends generation (EOS, EOT and the like)."""
        with model._shared():
            return bool(model._lib.llama_vocab_is_eog(model._vocab, token))

    @staticmethod
    def is_control(model: "Model", token: int) -> bool:
        """True for control tokens (special tokens not meant to be shown)."""
        with model._shared():
            return bool(model._lib.llama_vocab_is_control(model._vocab, token))

    @staticmethod
    def add_bos(model: "Model") -> bool:
        """Whether tokenizing with ``add_special`` prepends BOS."""
        with model._shared():
            return bool(model._lib.llama_vocab_get_add_bos(model._vocab))


def _opt(model: "Model", fn) -> int | None:
    with model._shared():
        tok = int(fn(model._vocab))
    return None if tok == L.LLAMA_TOKEN_NULL else tok


_PIECE_BUF = 64


def _piece(lib, vocab, token: int, special: bool) -> bytes:
    buf = create_string_buffer(_PIECE_BUF)
    n = lib.llama_token_to_piece(vocab, token, buf, _PIECE_BUF, 0, special)
    if n < 0:
        buf = create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buf, -n, 0, special)
        if n < 0:
            raise TokenizationError(f"llama_token_to_piece failed for token {token}")
    return buf.raw[:n]


class StreamDecoder:
    """Turns a stream of token ids into text pieces, never splitting a UTF-8 character.

    Bytes of an incomplete character are held back until the character is
    complete, so each character is emitted exactly once, whole. Not
    thread-safe: one decoder per stream.
    """

    def __init__(self, model: "Model", special: bool = False):
        self._lib = model._lib
        self._vocab = model._vocab
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Token bytes never change: the model keeps one cache per rendering of special tokens.
        self._pieces = model._piece_cache(special)

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        data = self._pieces.get(token)
        if data is None:
            data = self._pieces[token] = _piece(self._lib, self._vocab, token, self._special)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
