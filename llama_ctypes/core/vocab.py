"""Vocab: a model's vocabulary — tokenize, token bytes, end-of-generation flags.

One object owns the ``llama_vocab`` pointer and everything derived from it
(the piece and end-of-generation caches, the bounds every token id is checked
against). llama.cpp aborts the process on an out-of-range token id in several
vocab calls, so every id is checked here before it reaches C.
"""

from __future__ import annotations

import copy
from ctypes import create_string_buffer
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

import numpy as np

from ..errors import ArgumentTypeError, TokenizationError
from ..native import llama_h as L

if TYPE_CHECKING:
    from .model import Model

_PIECE_BUF = 64


def _token_array(tokens: Iterable[int]) -> np.ndarray:
    if not isinstance(tokens, np.ndarray):
        tokens = list(tokens)
        if any(isinstance(t, (bool, np.bool_)) for t in tokens):
            raise ArgumentTypeError("token ids are integers, not bools")
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":  # floats, bools, strings, nested lists
        raise ArgumentTypeError(f"token ids must be a flat sequence of integers, not {arr.dtype} "
                                f"with shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def encode_text(text: str) -> bytes:
    """UTF-8 bytes of ``text``; a lone surrogate raises TokenizationError (it has no UTF-8 form)."""
    if not isinstance(text, str):
        raise ArgumentTypeError(f"text must be str, not {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TokenizationError(
            f"text holds a character that cannot be encoded as UTF-8 at index {exc.start} "
            f"({text[exc.start:exc.end]!r}, a lone surrogate?)") from None


class FimTokens(NamedTuple):
    """A vocabulary's fill-in-the-middle tokens (``Vocab.fim``); None where it has none."""

    pre: int | None
    suf: int | None
    mid: int | None
    pad: int | None
    rep: int | None
    sep: int | None


class Vocab:
    """The vocabulary of a loaded :class:`Model` (``model.vocab``). Thread-safe: read-only in llama.cpp.

    Every call holds the model open for its duration, so a concurrent
    ``Model.close()`` waits for it instead of freeing the vocabulary under it.
    """

    def __init__(self, model: Model, ptr) -> None:
        self._model = model
        self._lib = model._lib
        self._ptr = ptr
        self.n_tokens = int(self._lib.llama_vocab_n_tokens(ptr))
        # token id -> bytes (plain and special renderings) and token id -> is end-of-generation,
        # filled lazily from any thread: a dict item assignment is atomic and a race only
        # computes the same value twice.
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})
        self._eog: dict[int, bool] = {}
        self._eog_all: list[tuple[int, ...]] = []  # (shared with the holders' copies: filled once)
        self._max_token_bytes: int | None = None
        self._held = False

    def for_holder(self) -> Vocab:
        """This vocabulary as seen by a holder of the model (a Context, a running stream).

        It shares the caches, and keeps working after ``Model.close()`` for as long as the
        holder keeps the model alive; the model's own ``vocab`` raises ClosedError then.
        """
        view = copy.copy(self)
        view._held = True
        return view

    def _guard(self):
        return self._model._shared(self._held)

    # ---- checks ------------------------------------------------------------------------------
    def check_token(self, token: int) -> int:
        """``token`` as an int, or TokenizationError when it is not an id of this vocabulary."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise ArgumentTypeError(f"token ids are integers, not {type(token).__name__}")
        token = int(token)
        if not 0 <= token < self.n_tokens:
            raise TokenizationError(f"token id {token} is outside the vocabulary [0, {self.n_tokens})")
        return token

    def check_tokens(self, tokens: Iterable[int]) -> np.ndarray:
        """The ids as an int32 array, or TokenizationError naming the first few bad ones."""
        arr = _token_array(tokens)
        if arr.size:
            bad = arr[(arr < 0) | (arr >= self.n_tokens)]
            if bad.size:
                raise TokenizationError(
                    f"token ids outside the vocabulary [0, {self.n_tokens}): {bad[:5].tolist()}")
        return arr.astype(np.int32)

    # ---- text <-> tokens -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize ``text`` (see :meth:`Tokenizer.encode`)."""
        data = encode_text(text)
        lib = self._lib
        with self._guard():
            capacity = len(data) + 8
            buf = (L.llama_token * capacity)()
            n = lib.llama_tokenize(self._ptr, data, len(data), buf, capacity, add_special, parse_special)
            if n < 0:
                capacity = -n
                buf = (L.llama_token * capacity)()
                n = lib.llama_tokenize(self._ptr, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            raise TokenizationError(f"llama_tokenize failed ({n}) for a text of {len(data)} bytes")
        return buf[:n]

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Token ids to text; invalid UTF-8 is replaced, never raised."""
        arr = self.check_tokens(tokens)
        lib = self._lib
        with self._guard():
            ptr = arr.ctypes.data_as(L._p_token)
            size = max(64, arr.size * 8)
            buf = create_string_buffer(size)
            n = lib.llama_detokenize(self._ptr, ptr, arr.size, buf, size, remove_special, unparse_special)
            if n < 0:
                size = -n
                buf = create_string_buffer(size)
                n = lib.llama_detokenize(self._ptr, ptr, arr.size, buf, size, remove_special, unparse_special)
        if n < 0:
            raise TokenizationError(f"llama_detokenize failed ({n})")
        return buf.raw[:n].decode("utf-8", errors="replace")

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a multi-byte character); cached."""
        cache = self._pieces[bool(special)]
        data = cache.get(token)
        if data is None:
            token = self.check_token(token)
            with self._guard():
                data = self._piece(token, special)
            cache[token] = data
        return data

    def _piece(self, token: int, special: bool) -> bytes:
        lib = self._lib
        buf = create_string_buffer(_PIECE_BUF)
        n = lib.llama_token_to_piece(self._ptr, token, buf, _PIECE_BUF, 0, special)
        if n < 0:
            buf = create_string_buffer(-n)
            n = lib.llama_token_to_piece(self._ptr, token, buf, -n, 0, special)
            if n < 0:
                raise TokenizationError(f"llama_token_to_piece failed for token {token}")
        return buf.raw[:n]

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token (plain or special rendering); computed once, on first use."""
        if self._max_token_bytes is None:
            with self._guard():
                longest = max((max(len(self._piece(t, False)), len(self._piece(t, True)))
                               for t in range(self.n_tokens)), default=1)
            self._max_token_bytes = max(1, longest)
        return self._max_token_bytes

    def min_tokens(self, n_bytes: int) -> int:
        """A lower bound on the tokens any text of ``n_bytes`` UTF-8 bytes tokenizes to (without specials)."""
        return -(-n_bytes // self.max_token_bytes)

    # ---- comparison ---------------------------------------------------------------------------------
    def difference(self, other: Vocab) -> str | None:
        """How ``other`` tokenizes differently from this vocabulary (the first difference found), or None
        when they agree: the size, BOS/EOS/EOT, which ids end generation and every token's bytes (as
        llama.cpp's ``common_speculative_are_compatible``). One pass over both, uncached (the piece
        caches would otherwise keep every token of both models in memory)."""
        if other is self or other._ptr == self._ptr:
            return None
        if self.n_tokens != other.n_tokens:
            return f"{other.n_tokens} vs {self.n_tokens} tokens"
        for name in ("bos", "eos", "eot"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name.upper()} ids {b} vs {a}"
        lib, mine, theirs = self._lib, self._ptr, other._ptr
        with self._guard(), other._guard():
            for tok in range(self.n_tokens):
                if bool(lib.llama_vocab_is_eog(mine, tok)) != bool(lib.llama_vocab_is_eog(theirs, tok)):
                    return f"token {tok} ends generation in one and not in the other"
                a, b = self._piece(tok, True), other._piece(tok, True)
                if a != b:
                    return f"token {tok} is {b!r} vs {a!r}"
        return None

    def same_as(self, other: Vocab) -> bool:
        """Whether ``other`` tokenizes exactly as this vocabulary does (see :meth:`difference`)."""
        return self.difference(other) is None

    # ---- token classes ------------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        """True when ``token`` ends generation (EOS, EOT and the like); cached, so cheap in hot loops."""
        eog = self._eog.get(token)
        if eog is None:
            token = self.check_token(token)
            with self._guard():
                eog = bool(self._lib.llama_vocab_is_eog(self._ptr, token))
            self._eog[token] = eog
        return eog

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token id, ascending (scanned once per model)."""
        if not self._eog_all:
            with self._guard():
                is_eog, ptr = self._lib.llama_vocab_is_eog, self._ptr
                found = tuple(t for t in range(self.n_tokens) if is_eog(ptr, t))
            self._eog_all.append(found)
        return self._eog_all[0]

    def is_control(self, token: int) -> bool:
        """True for control tokens (special tokens not meant to be shown)."""
        token = self.check_token(token)
        with self._guard():
            return bool(self._lib.llama_vocab_is_control(self._ptr, token))

    def _special(self, fn) -> int | None:
        with self._guard():
            tok = int(fn(self._ptr))
        return None if tok == L.LLAMA_TOKEN_NULL else tok

    @property
    def bos(self) -> int | None:
        return self._special(self._lib.llama_vocab_bos)

    @property
    def eos(self) -> int | None:
        return self._special(self._lib.llama_vocab_eos)

    @property
    def eot(self) -> int | None:
        return self._special(self._lib.llama_vocab_eot)

    @property
    def nl(self) -> int | None:
        return self._special(self._lib.llama_vocab_nl)

    @property
    def sep(self) -> int | None:
        return self._special(self._lib.llama_vocab_sep)

    @property
    def fim(self) -> FimTokens:
        """The fill-in-the-middle tokens (None where the vocabulary has none)."""
        lib = self._lib
        return FimTokens(*(self._special(fn) for fn in (lib.llama_vocab_fim_pre, lib.llama_vocab_fim_suf,
                                                        lib.llama_vocab_fim_mid, lib.llama_vocab_fim_pad,
                                                        lib.llama_vocab_fim_rep, lib.llama_vocab_fim_sep)))

    @property
    def add_bos(self) -> bool:
        with self._guard():
            return bool(self._lib.llama_vocab_get_add_bos(self._ptr))

    @property
    def add_eos(self) -> bool:
        with self._guard():
            return bool(self._lib.llama_vocab_get_add_eos(self._ptr))

    @property
    def add_sep(self) -> bool:
        with self._guard():
            return bool(self._lib.llama_vocab_get_add_sep(self._ptr))

    def eog_cache(self) -> dict[int, bool]:
        """The end-of-generation cache (token id -> bool), for hot loops (``is_eog`` fills it)."""
        return self._eog

    def piece_cache(self, special: bool) -> dict[int, bytes]:
        """The token-bytes cache of one rendering, for hot loops (``token_bytes`` fills it)."""
        return self._pieces[bool(special)]

    def native(self):
        """The ``llama_vocab *`` for samplers built over it (core use; the caller keeps the model open)."""
        return self._ptr
