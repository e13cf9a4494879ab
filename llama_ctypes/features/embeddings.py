"""Embeddings and reranking.

Many texts are packed into one decode as separate sequences (up to the
context's sequence and batch limits), so a list embeds in as few forward
passes as possible. Pooling comes from the model's metadata (``<arch>.pooling_type``)
unless overridden; a decoder model without one (e.g. Gemma) is mean-pooled.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence, overload

import numpy as np

from ..core.batch import Batch
from ..core.model import Model
from ..core.params import POOLING, ContextParams, split_options
from ..core.tokenizer import Tokenizer
from ..errors import ContextOverflowError, DecodeError, LlamaError
from ..native import llama_h as L

PoolingName = Literal["none", "mean", "cls", "last", "rank"]
_POOLING_NAMES = {v: k for k, v in POOLING.items()}

#: Most sequences packed into one decode.
MAX_SEQUENCES = 64


class EmbeddingError(LlamaError, ValueError):
    """The model or the options cannot produce the requested embeddings."""


def model_pooling(model: Model) -> PoolingName:
    """The pooling a model declares in its metadata, or ``"mean"`` when it declares none."""
    raw = model.meta(f"{model.architecture}.pooling_type")
    try:
        name = _POOLING_NAMES.get(int(raw)) if raw is not None else None
    except ValueError:
        name = None
    return name if name not in (None, "unspecified", "none") else "mean"  # type: ignore[return-value]


def _max_tokens_per_text(model: Model, n_batch: int) -> int:
    # Non-causal (encoder) attention needs a whole text in one micro-batch; positions stop at n_ctx_train.
    n_train = model.n_ctx_train or n_batch
    return min(n_batch, n_train)


class _Embedder:
    """One embedding context (pooling, batch size) and the packing loop over it."""

    def __init__(self, model: Model, pooling: PoolingName, n_batch: int, ctx_opts: dict[str, Any]):
        self.model = model
        self.pooling = pooling
        self.n_seq = MAX_SEQUENCES
        self.params = ContextParams(**{
            "n_ctx": n_batch, "n_batch": n_batch, "n_ubatch": n_batch, "n_seq_max": self.n_seq,
            "kv_unified": True, "embeddings": True, "pooling": pooling,
            # CPU flash attention accumulates in f16 over the whole packed batch: a text's vector
            # would then depend on its batch-mates (1e-2 on Gemma). Off, a list equals one-by-one
            # to 1e-7 (f32 models) or 2e-3 (Q4_K kernels pick paths by batch shape).
            "flash_attn": "disabled",
            **ctx_opts,
        })
        self.max_tokens = _max_tokens_per_text(model, n_batch)
        self.encoder_only = model.has_encoder and not model.has_decoder

    def run(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        model = self.model
        ctx = model._checkout_context(self.params)
        try:
            ctx._begin_exclusive()
            try:
                return self._run(ctx, token_lists)
            finally:
                ctx._end_exclusive()
        finally:
            model._return_context(ctx)

    def _run(self, ctx, token_lists: list[list[int]]) -> list[np.ndarray]:
        lib = ctx._lib
        actual = _POOLING_NAMES.get(lib.llama_pooling_type(ctx._ptr), "none")
        if self.pooling == "rank" and actual != "rank":
            raise EmbeddingError(f"{self.model.path.name} has no ranking head (rank pooling)")
        n_out = lib.llama_model_n_cls_out(self.model._ptr) if actual == "rank" else self.model.n_embd
        n_out = n_out or 1
        batch = Batch(ctx.n_batch, 1)
        results: list[np.ndarray | None] = [None] * len(token_lists)
        order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]), reverse=True)
        pending: list[int] = []
        for i in order + [None]:  # type: ignore[list-item]
            fits = i is not None and len(pending) < self.n_seq and batch.free >= len(token_lists[i])
            if i is not None and fits:
                batch.add_sequence(token_lists[i], 0, len(pending), output_last=False)
                batch.logits[batch.n_tokens - len(token_lists[i]):batch.n_tokens] = 1
                pending.append(i)
                continue
            if pending:
                self._decode(ctx, batch)
                self._collect(ctx, batch, pending, token_lists, results, actual, n_out)
                batch.clear()
                pending = []
            if i is not None:
                batch.add_sequence(token_lists[i], 0, 0, output_last=False)
                batch.logits[:batch.n_tokens] = 1
                pending.append(i)
        return results  # type: ignore[return-value]

    def _decode(self, ctx, batch: Batch) -> None:
        lib = ctx._lib
        if not self.encoder_only:
            lib.llama_memory_clear(ctx._mem, True)
        fn = lib.llama_encode if self.encoder_only else lib.llama_decode
        rc = fn(ctx._ptr, batch.as_native())
        if rc != 0:
            raise DecodeError(f"embedding decode failed with {rc}", code=rc)

    def _collect(self, ctx, batch, pending, token_lists, results, pooling, n_out) -> None:
        lib = ctx._lib
        if pooling == "none":
            row = 0
            for seq, i in enumerate(pending):
                n = len(token_lists[i])
                rows = [np.ctypeslib.as_array(lib.llama_get_embeddings_ith(ctx._ptr, row + k), shape=(n_out,))
                        for k in range(n)]
                results[i] = np.array(rows, dtype=np.float32)
                row += n
            return
        for seq, i in enumerate(pending):
            ptr = lib.llama_get_embeddings_seq(ctx._ptr, seq)
            if not ptr:
                raise DecodeError(f"no pooled embedding for sequence {seq}")
            results[i] = np.ctypeslib.as_array(ptr, shape=(n_out,)).astype(np.float32, copy=True)


def _tokenize_all(model: Model, texts: Sequence[str], max_tokens: int, truncate: bool) -> list[list[int]]:
    out = []
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"texts must be str, not {type(text).__name__}")
        ids = Tokenizer.encode(model, text, add_special=True, parse_special=False)
        if not ids:
            raise EmbeddingError("cannot embed an empty text (it has no tokens)")
        if len(ids) > max_tokens:
            if not truncate:
                raise ContextOverflowError(
                    f"a text of {len(ids)} tokens is longer than the {max_tokens} tokens an embedding can take; "
                    "pass truncate=True or a larger n_batch", n_tokens=len(ids), n_ctx=max_tokens)
            ids = ids[:max_tokens]
        out.append(ids)
    return out


def _normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


@overload
def embed(model: Model, texts: str, **opts: Any) -> np.ndarray: ...
@overload
def embed(model: Model, texts: Sequence[str], **opts: Any) -> np.ndarray | list[np.ndarray]: ...


def embed(model: Model, texts: str | Sequence[str], *, normalize: bool = True, pooling: PoolingName | None = None,
          truncate: bool = True, n_batch: int = 2048, **ctx_opts: Any):
    """Embed one text (→ 1-D float32 array) or a list (→ 2-D array, one row per text).

    ``pooling`` overrides the model's (none/mean/cls/last/rank); with ``"none"``
    each text gives a (n_tokens, n_embd) array (a list of them for a list).
    Vectors are L2-normalised unless ``normalize=False``. Texts longer than
    what one embedding can take are cut (``truncate=True``) or raise
    :class:`ContextOverflowError`. Other options are :class:`ContextParams`
    fields (n_threads, type_k, ...).
    """
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    if not items:
        return np.zeros((0, model.n_embd), dtype=np.float32)
    if pooling is not None and pooling not in ("none", "mean", "cls", "last", "rank"):
        raise ValueError(f"pooling={pooling!r}: expected none, mean, cls, last or rank")
    split_options(ctx_opts, ContextParams, where="embed: unknown")
    for reserved in ("embeddings", "pooling", "n_seq_max", "n_ubatch", "n_ctx"):
        if reserved in ctx_opts:
            raise TypeError(f"embed sets {reserved} itself")
    embedder = _Embedder(model, pooling or model_pooling(model), n_batch, ctx_opts)
    vectors = embedder.run(_tokenize_all(model, items, embedder.max_tokens, truncate))
    if embedder.pooling == "none":
        out = [_normalize(v) if normalize else v for v in vectors]
        return out[0] if single else out
    arr = np.stack(vectors)
    if normalize and embedder.pooling != "rank":
        arr = _normalize(arr)
    return arr[0] if single else arr


def rerank(model: Model, query: str, documents: Sequence[str], *, normalize: bool = False, truncate: bool = True,
           n_batch: int = 2048, **ctx_opts: Any) -> list[float]:
    """Relevance scores of ``documents`` for ``query``, in document order (a rank-pooling model).

    Scores are the model's raw outputs; ``normalize=True`` maps them through a
    sigmoid into (0, 1). A model without a ranking head raises EmbeddingError.
    """
    if model_pooling(model) != "rank":
        raise EmbeddingError(f"{model.path.name} is not a reranking model (its pooling is "
                             f"{model_pooling(model)!r}, not 'rank')")
    embedder = _Embedder(model, "rank", n_batch, ctx_opts)
    pairs = [_rerank_tokens(model, query, doc) for doc in documents]
    limit = embedder.max_tokens
    for i, ids in enumerate(pairs):
        if len(ids) > limit:
            if not truncate:
                raise ContextOverflowError(f"query + document {i} is {len(ids)} tokens, over {limit}",
                                           n_tokens=len(ids), n_ctx=limit)
            pairs[i] = ids[:limit]
    scores = [float(v[0]) for v in embedder.run(pairs)]
    return [1.0 / (1.0 + math.exp(-s)) for s in scores] if normalize else scores


def _rerank_tokens(model: Model, query: str, doc: str) -> list[int]:
    """llama.cpp's reranking input: the GGUF's ``rerank`` template, else BOS query EOS SEP doc EOS."""
    template = model.chat_template_named("rerank")
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", doc)
        return Tokenizer.encode(model, text, add_special=False, parse_special=True)
    lib, vocab = model._lib, model._vocab
    eos = Tokenizer.eos(model)
    if eos is None:
        eos = int(lib.llama_vocab_sep(vocab))
    out: list[int] = []
    if lib.llama_vocab_get_add_bos(vocab):
        out.append(int(lib.llama_vocab_bos(vocab)))
    out += Tokenizer.encode(model, query, add_special=False)
    if lib.llama_vocab_get_add_eos(vocab):
        out.append(eos)
    if lib.llama_vocab_get_add_sep(vocab):
        out.append(int(lib.llama_vocab_sep(vocab)))
    out += Tokenizer.encode(model, doc, add_special=False)
    if lib.llama_vocab_get_add_eos(vocab):
        out.append(eos)
    return [t for t in out if t != L.LLAMA_TOKEN_NULL]
