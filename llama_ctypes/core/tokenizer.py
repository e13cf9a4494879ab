"""Tokenizer: text <-> token ids, and UTF-8-safe incremental detokenization.

The functions take the model first (``Tokenizer.encode(model, "Hello")``) and
forward to ``model.vocab`` (:class:`~llama_ctypes.core.vocab.Vocab`), which owns
the vocabulary and checks every token id before it reaches llama.cpp. Names:
``encode``/``decode`` here are ``tokenize``/``detokenize`` on Vocab and Model (the API
sketch's spelling for the model-first functions); every other name is Vocab's.
"""

from __future__ import annotations

import codecs
import warnings
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .model import Model
    from .vocab import Vocab


class Tokenizer:
    """Tokenizer functions taking the model first. All are thread-safe.

    Out-of-range token ids raise :class:`~llama_ctypes.TokenizationError`; text
    that cannot be UTF-8 encoded (a lone surrogate) raises it too.
    """

    @staticmethod
    def encode(model: "Model", text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize ``text``.

        ``add_special`` adds BOS/EOS as the model's metadata asks; ``parse_special``
        turns special-token text such as ``<|im_start|>`` into its token id
        instead of tokenizing the characters.
        """
        return model.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    @staticmethod
    def decode(model: "Model", tokens: Sequence[int], remove_special: bool = False,
               unparse_special: bool = False) -> str:
        """Detokenize ``tokens`` to text (invalid UTF-8 is replaced, never raised).

        ``remove_special`` drops BOS/EOS; ``unparse_special`` renders special
        tokens as their text.
        """
        return model.vocab.detokenize(tokens, remove_special=remove_special, unparse_special=unparse_special)

    @staticmethod
    def token_bytes(model: "Model", token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a multi-byte character)."""
        return model.vocab.token_bytes(token, special)

    @staticmethod
    def token_to_bytes(model: "Model", token: int, special: bool = False) -> bytes:
        """Deprecated spelling of :meth:`token_bytes`."""
        warnings.warn("Tokenizer.token_to_bytes is deprecated: use Tokenizer.token_bytes (as Vocab.token_bytes)",
                      DeprecationWarning, stacklevel=2)
        return model.vocab.token_bytes(token, special)

    @staticmethod
    def token_to_piece(model: "Model", token: int, special: bool = False) -> str:
        """One token as text; a partial UTF-8 sequence is shown as U+FFFD."""
        return model.vocab.token_bytes(token, special).decode("utf-8", errors="replace")

    @staticmethod
    def n_tokens(model: "Model") -> int:
        """Number of tokens in the vocabulary."""
        return model.vocab.n_tokens

    @staticmethod
    def vocab_size(model: "Model") -> int:
        """Deprecated spelling of :meth:`n_tokens`."""
        warnings.warn("Tokenizer.vocab_size is deprecated: use Tokenizer.n_tokens (as Vocab.n_tokens)",
                      DeprecationWarning, stacklevel=2)
        return model.vocab.n_tokens

    @staticmethod
    def bos(model: "Model") -> int | None:
        """Beginning-of-sequence token id, or None."""
        return model.vocab.bos

    @staticmethod
    def eos(model: "Model") -> int | None:
        """End-of-sequence token id, or None."""
        return model.vocab.eos

    @staticmethod
    def eot(model: "Model") -> int | None:
        """End-of-turn token id, or None."""
        return model.vocab.eot

    @staticmethod
    def nl(model: "Model") -> int | None:
        """Newline token id, or None."""
        return model.vocab.nl

    @staticmethod
    def is_eog(model: "Model", token: int) -> bool:
        """True when ``token`` ends generation (EOS, EOT and the like)."""
        return model.vocab.is_eog(token)

    @staticmethod
    def is_control(model: "Model", token: int) -> bool:
        """True for control tokens (special tokens not meant to be shown)."""
        return model.vocab.is_control(token)

    @staticmethod
    def add_bos(model: "Model") -> bool:
        """Whether tokenizing with ``add_special`` prepends BOS."""
        return model.vocab.add_bos


class StreamDecoder:
    """Turns a stream of token ids into text pieces, never splitting a UTF-8 character.

    Bytes of an incomplete character are held back until the character is
    complete, so each character is emitted exactly once, whole. Not
    thread-safe: one decoder per stream. Accepts a Model or its Vocab.
    """

    def __init__(self, model: "Model | Vocab", special: bool = False):
        vocab = getattr(model, "vocab", model)
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Token bytes never change: the vocab keeps one cache per rendering of special tokens.
        self._pieces = vocab.piece_cache(special)
        self._token_bytes = vocab.token_bytes

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        data = self._pieces.get(token)
        if data is None:
            data = self._token_bytes(token, self._special)
        if not self._utf8.buffer:  # (most pieces are whole characters: one C call, no decoder state)
            try:
                return data.decode()
            except UnicodeDecodeError:
                pass
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
