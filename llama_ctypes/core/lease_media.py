"""The media operations of a ContextLease: decoding a prompt's images and audio.

A :class:`~llama_ctypes.core.projector.MediaPrompt` holds placeholder ids where its media chunks go;
the prefill decodes text runs as usual and, at each media span, the chunk's embeddings (encoded by the
projector, or handed in by a Server that encoded them ahead) through libmtmd's helper, which sets the
positions and switches to non-causal attention where the projector needs it. The context's
:class:`~llama_ctypes.core.kv_record.KVRecord` records the placeholders, so a later prompt with the
same media at the same place reuses the cells. Part of
:class:`~llama_ctypes.core.context.ContextLease` (a mixin: same object, same rules).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidArgumentError
from .decode_status import check_decode

if TYPE_CHECKING:
    from .context import Context
    from .projector import MediaPrompt, MediaSpan

__all__ = ["MediaOps", "check_media_prompt"]


def check_media_prompt(ctx: "Context", prompt: "MediaPrompt") -> None:
    """Raise unless ``ctx`` can decode ``prompt``'s media (checked before anything is decoded)."""
    prompt.check()
    projector = prompt.chunks.projector
    if projector.model is not ctx.model:
        raise InvalidArgumentError("this prompt's media were prepared by another model's projector")
    if prompt.spans and prompt.spans[-1].end >= len(prompt):
        raise InvalidArgumentError("a prompt must end with text after its last image or audio clip")
    for span in prompt.spans:
        if span.n_tokens > ctx.n_ubatch and projector.uses_non_causal(prompt.chunks, span.index):
            raise InvalidArgumentError(
                f"an {span.kind} of {span.n_tokens} tokens is decoded with non-causal attention, in one "
                f"micro-batch: n_ubatch={ctx.n_ubatch} is too small (use n_ubatch >= {span.n_tokens})")


class MediaOps:
    """ContextLease's media methods (see the module docs); the lease supplies ``ctx``, ``_ptr``,
    ``_check``, ``decode``, ``guarded``, ``_check_workers`` and ``clear``."""

    def check_media_prompt(self, prompt: "MediaPrompt") -> None:
        """:func:`check_media_prompt` for this lease's context."""
        check_media_prompt(self.ctx, prompt)

    def decode_media_rc(self, prompt: "MediaPrompt", span: "MediaSpan", embd: np.ndarray, pos: int,
                        seq: int) -> int:
        """Decode the embeddings of media ``span`` from position ``pos`` of sequence ``seq`` on (in
        ``n_batch`` chunks; it takes ``span.n_pos`` positions); llama.cpp's return code. No bookkeeping:
        a Server's slots keep their own. On failure some chunks may be in the sequence: the caller removes its cells from ``pos``."""
        self._check()
        ctx = self.ctx
        projector = prompt.chunks.projector
        if embd.shape != (span.n_tokens, projector.n_embd):
            raise InvalidArgumentError(f"embeddings of shape {embd.shape} for a chunk of "
                                       f"{span.n_tokens}×{projector.n_embd}")
        ctx._last_decoded = span.n_tokens
        ctx._record.forget_logits()
        rc = self.guarded(lambda: projector.decode_chunk_rc(
            prompt.chunks, span.index, embd, self._ptr, pos, seq, ctx.n_batch))
        self._check_workers()
        return rc

    def decode_media(self, prompt: "MediaPrompt", span: "MediaSpan") -> None:
        """Decode media ``span`` of ``prompt`` at the end of sequence 0 (which must hold exactly the prompt's
        entries before it), encoding it first unless it was. DecodeError on failure (the caller clears
        the sequence)."""
        self._check()
        record = self.ctx._record
        if len(record.tokens) != span.start:
            raise InvalidArgumentError(f"media at entry {span.start}, but the sequence holds {len(record.tokens)}")
        embd = prompt.embeddings(span)
        record.forget_snapshots()
        rc = self.decode_media_rc(prompt, span, embd, record.next_pos, 0)
        check_decode(rc, f"llama_decode ({span.kind})", span.n_tokens)
        record.decoded_media(prompt[span.start:span.end], span.n_pos)

    def _decode_media_prompt(self, prompt: "MediaPrompt", pos: int) -> None:
        """The prefill's loop for a prompt with media: text runs in ``n_batch`` chunks, media whole."""
        ctx, record = self.ctx, self.ctx._record
        batch = ctx._batch
        n = len(prompt)
        starts = [span.start for span in prompt.spans]
        try:
            while pos < n:
                span = prompt.span_at(pos)
                if span is not None:
                    self.decode_media(prompt, span)
                    pos = span.end
                    continue
                following = [s for s in starts if s > pos]
                end = min(following[0] if following else n, pos + ctx.n_batch)
                chunk = prompt[pos:end]
                batch.clear()
                at = record.next_pos  # (fewer than pos after an M-RoPE image: its grid takes max(nx, ny))
                batch.add_sequence(chunk, at, 0, output_last=end == n)
                self.decode(batch)
                if self.after_decode is not None:
                    self.after_decode(self, chunk, at)
                record.decoded(chunk)
                pos = end
        except BaseException:
            self.clear()  # a failed or interrupted decode leaves the cache state uncertain
            raise
