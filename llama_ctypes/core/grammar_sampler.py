"""Calls on a native grammar sampler that llama.cpp's C++ may answer with an exception (caught by the
adapter: through the C frames of ctypes one would end the process), the reset on a large-stack thread,
and the tokens that spell a grammar's prefill. Used by :mod:`.sampler`."""

from __future__ import annotations

import ctypes
from typing import Callable

from ..errors import GrammarError
from .deep_stack import DEEP_STACK


def taken_message(lib, error: ctypes.c_void_p) -> str:
    """The adapter's malloc'd error message, read and freed ("" when none)."""
    if not error.value:
        return ""
    message = ctypes.string_at(error.value).decode("utf-8", errors="replace")
    lib.lcx_string_free(error.value)
    return message


def reset_grammar(lib, grammar) -> None:
    """``llama_sampler_reset`` on a grammar sampler: it parses the grammar's text again, recursing once per
    nesting level, so it runs where init ran (a large stack; see ``Sampler._grammar_sampler``)."""
    DEEP_STACK.run(lib.llama_sampler_reset, grammar)


def grammar_accept_fn(lib) -> Callable[[object, int], None]:
    """``accept(grammar, token)`` for a grammar sampler, raising GrammarError where llama.cpp throws: a lazy
    grammar's trigger matched text the grammar does not allow from there on (the model wrote something
    else). The grammar is reset to its start then (it is left with no parse stack, on which llama.cpp's
    next apply asserts), and the generation ends with the error."""
    checked = lib.lcx_sampler_accept

    def accept(grammar, token: int) -> None:
        error = ctypes.c_void_p()
        if not checked(grammar, token, ctypes.byref(error)):
            message = taken_message(lib, error)
            reset_grammar(lib, grammar)
            if message.startswith("grammar too broad"):  # (build_scripts/patches/llama-grammar-work-bound.patch)
                raise GrammarError(f"{message}: the generation stops here, before the sampler takes seconds "
                                   "per token; make the grammar unambiguous (one way to read each text)")
            raise GrammarError(f"the text from a grammar_lazy_triggers match on does not fit the grammar "
                               f"(llama.cpp: {message})")

    return accept


def grammar_apply_fn(lib) -> Callable[[object, object], None]:
    """``apply(grammar, byref(array))`` for a grammar sampler, raising GrammarError where llama.cpp throws: the
    check of the candidates would take seconds (build_scripts/patches/llama-grammar-work-bound.patch). Every
    grammar apply goes through here: an exception through the C frames of ctypes ends the process."""
    checked = lib.lcx_sampler_apply

    def apply(grammar, arr_ref) -> None:
        error = ctypes.c_void_p()
        if not checked(grammar, arr_ref, ctypes.byref(error)):
            message = taken_message(lib, error)
            raise GrammarError(f"{message}: the generation stops here; make the grammar unambiguous (one way to "
                               "read each text) or narrower")

    return apply


def prefill_tokens(vocab, text: str) -> list[int] | None:
    """Tokens whose pieces spell exactly ``text`` (``grammar_prefill``), or None.

    The grammar must be fed the text itself. Tokenizing it is not always enough: SentencePiece
    vocabularies with ``add_space_prefix`` put a space before raw text at the start and after
    every special token (``<|im_start|>assistant`` → ``<|im_start|>``, `` assistant``), a space
    the grammar does not expect. Such a token is replaced by tokens spelling it without the
    space (common/sampling.cpp only skips a lone space token at the start, and refuses the rest).
    """
    data = text.encode("utf-8")

    def pieces(tokens: list[int]) -> list[bytes]:
        return [vocab.token_bytes(t, special=True) for t in tokens]

    def spell(rest: bytes) -> list[int] | None:
        # "\n" + rest: the tokenizer's inserted space goes before the newline, which stays apart
        try:
            tail = rest.decode("utf-8")
        except UnicodeDecodeError:
            return None
        tokens = vocab.tokenize("\n" + tail, add_special=False, parse_special=True)
        got = pieces(tokens)
        for k in range(1, len(tokens) + 1):
            head = b"".join(got[:k])
            if head in (b"\n", b" \n"):
                return tokens[k:] if b"".join(got[k:]) == rest else None
            if len(head) >= 2:
                return None
        return None

    tokens = vocab.tokenize(text, add_special=False, parse_special=True)
    out: list[int] = []
    pos = 0
    for token, piece in zip(tokens, pieces(tokens)):
        if piece and data.startswith(piece, pos):
            out.append(token)
            pos += len(piece)
        elif piece[:1] == b" " and data.startswith(piece[1:], pos):  # a space the tokenizer inserted
            if len(piece) > 1:
                fixed = spell(piece[1:])
                if fixed is None:
                    return None
                out += fixed
                pos += len(piece) - 1
        else:
            return None
    return out if pos == len(data) else None
