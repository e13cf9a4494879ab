"""``llama_decode``/``llama_encode``/``llama_process`` return codes: one check for every caller (a leaf:
the context, its hidden-state operations and the server's engine all raise through it)."""

from __future__ import annotations

from ..errors import DecodeError

__all__ = ["ABORTED", "check_decode"]

#: The return code of a decode stopped by the abort callback.
ABORTED = 2

_REASONS = {
    1: "no KV-cache slot for the batch (the context is full; use a larger n_ctx or a shorter prompt)",
    ABORTED: "aborted",
    -1: "invalid batch",
}


def check_decode(rc: int, what: str, n_tokens: int) -> None:
    """Raise :class:`DecodeError` for a non-zero ``llama_decode``/``llama_encode`` return code."""
    if rc != 0:
        reason = _REASONS.get(rc, "error")
        raise DecodeError(f"{what} failed with {rc} for a batch of {n_tokens} tokens: {reason}", code=rc)
