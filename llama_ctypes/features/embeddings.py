"""Embeddings and reranking.

Many texts are packed into one decode as separate sequences (up to the
context's sequence and batch limits), so a list embeds in as few forward
passes as possible. Pooling comes from the model's metadata (``<arch>.pooling_type``)
unless overridden; a decoder model without one (e.g. Gemma) is mean-pooled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping, Sequence, overload

import numpy as np

from ..core.batch import Batch
from ..core.context import ContextLease
from ..core.context_pool import ContextPool
from ..core.model import Model
from ..core.params import POOLING, ContextParams, split_options
from ..core.tokenizer import Tokenizer
from ..errors import ArgumentTypeError, ContextOverflowError, DecodeError, InvalidArgumentError, LlamaError

AppliedPooling = Literal["none", "mean", "cls", "last", "rank"]
_POOLING_NAMES = {v: k for k, v in POOLING.items()}

#: Sequences in an embedding context: half hold texts, half the padding after each text.
MAX_SEQUENCES = 64

#: Every text starts at a row that is a multiple of this, and every decode is a multiple of it
#: (padding sequences fill the gaps). CPU matrix kernels round a row differently depending on
#: where it falls in the batch (the repacked Q4_K ones take 16-row, 4-row or 1-row paths), so
#: without this a text's vector depended on its batch-mates: up to 8e-3 (cosine 0.9992) on Gemma
#: 270M Q4_K_M, 1.5e-5 on f32 models. With it a list equals one-by-one (6e-8 on Gemma, 0 on f32).
ROW_ALIGN = 16


class EmbeddingError(LlamaError, ValueError):
    """The model or the options cannot produce the requested embeddings."""


@dataclass
class EmbedUsage:
    """What embedding calls cost, summed over the calls it is passed to (``usage=``): for metrics."""

    tokens: int = 0
    """Tokens evaluated (the texts' own, not the alignment padding)."""
    decodes: int = 0
    """Forward passes (``llama_decode`` or ``llama_encode`` calls)."""


def declared_pooling(model: Model, kv_overrides: Mapping[str, Any] | None = None) -> AppliedPooling | None:
    """The pooling a model declares (metadata, or a ``kv_overrides`` entry), None when it declares none."""
    key = f"{model.architecture}.pooling_type"
    raw = kv_overrides[key] if kv_overrides and key in kv_overrides else model.meta(key)
    try:
        name = _POOLING_NAMES.get(int(raw)) if raw is not None else None
    except (TypeError, ValueError):
        name = None
    return name if name not in (None, "unspecified", "none") else None  # type: ignore[return-value]


def model_pooling(model: Model) -> AppliedPooling:
    """The pooling a model declares in its metadata, or ``"mean"`` when it declares none."""
    return declared_pooling(model) or "mean"


def _max_tokens_per_text(model: Model, n_batch: int) -> int:
    # Non-causal (encoder) attention needs a whole text in one micro-batch; positions stop at n_ctx_train.
    n_train = model.n_ctx_train or n_batch
    return min(n_batch, n_train)


class _Embedder:
    """One embedding context (pooling, batch size) and the packing loop over it."""

    def __init__(self, model: Model, pooling: AppliedPooling, n_batch: int, ctx_opts: dict[str, Any],
                 usage: EmbedUsage | None = None, align: int = ROW_ALIGN):
        self.model = model
        self.align = align
        self.pooling = pooling
        self.usage = usage
        self.n_seq = MAX_SEQUENCES // 2  # texts per decode; text j's padding is sequence n_seq + j
        # A multiple of n_seq_max (llama.cpp reserves its graph for a multiple of n_seq_max tokens,
        # and mean pooling aborts otherwise) and so of ROW_ALIGN: an aligned n_batch-token text fits.
        self.capacity = -(-n_batch // MAX_SEQUENCES) * MAX_SEQUENCES
        self.params = ContextParams(**{
            "n_ctx": self.capacity, "n_batch": self.capacity, "n_ubatch": self.capacity,
            "n_seq_max": MAX_SEQUENCES, "kv_unified": True, "embeddings": True, "pooling": pooling,
            # CPU flash attention accumulates in f16 over the whole packed batch: a text's vector
            # would then depend on its batch-mates (1e-2 on Gemma).
            "flash_attn": "disabled",
            **ctx_opts,
        })
        self.max_tokens = _max_tokens_per_text(model, n_batch)
        self.encoder_only = model.has_encoder and not model.has_decoder

    def run(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        pool = ContextPool.of(self.model)
        ctx = pool.checkout(self.model, self.params)
        try:
            with ctx.lease() as lease:
                return self._run(lease, token_lists)
        finally:
            pool.checkin(ctx)

    def _run(self, lease: ContextLease, token_lists: list[list[int]]) -> list[np.ndarray]:
        actual = _POOLING_NAMES.get(lease.pooling_type(), "none")
        if self.pooling == "rank" and actual != "rank":
            raise EmbeddingError(f"{self.model.path.name} has no ranking head (rank pooling)")
        # Output rows are n_embd_out wide (it differs from n_embd for some embedding models).
        n_out = self.model.n_cls_out if actual == "rank" else self.model.n_embd_out
        n_out = n_out or 1
        batch = Batch(self.capacity, 1)
        results: list[np.ndarray | None] = [None] * len(token_lists)
        pending: list[tuple[int, int]] = []  # (text index, its first row in the batch)
        for i in sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]), reverse=True):
            ids = token_lists[i]
            size = -(-len(ids) // self.align) * self.align
            if pending and (len(pending) == self.n_seq or batch.n_tokens + size > self.capacity):
                self._decode(lease, batch, sum(len(token_lists[j]) for j, _ in pending))
                self._collect(lease, pending, token_lists, results, actual, n_out)
                batch.clear()
                pending = []
            pending.append((i, batch.n_tokens))
            seq = len(pending) - 1
            batch.add_sequence(ids, 0, seq, output_last=False)
            pad = size - len(ids)
            if pad:  # a throwaway sequence; its tokens are outputs too, as the last layer keeps only outputs
                batch.add_sequence([ids[0]] * pad, 0, self.n_seq + seq, output_last=False)
            batch.logits[pending[-1][1]:batch.n_tokens] = 1
        if pending:
            self._decode(lease, batch, sum(len(token_lists[j]) for j, _ in pending))
            self._collect(lease, pending, token_lists, results, actual, n_out)
        return results  # type: ignore[return-value]

    def _decode(self, lease: ContextLease, batch: Batch, n_tokens: int) -> None:
        if self.encoder_only:
            lease.encode(batch)
        else:
            lease.clear()
            lease.decode(batch)
        if self.usage is not None:
            self.usage.tokens += n_tokens
            self.usage.decodes += 1

    def _collect(self, lease: ContextLease, pending, token_lists, results, pooling, n_out) -> None:
        for seq, (i, row) in enumerate(pending):
            if pooling == "none":
                rows = [lease.embeddings_ith(row + k, n_out) for k in range(len(token_lists[i]))]
                if any(r is None for r in rows):
                    raise DecodeError("no token embeddings in the decode's output")
                results[i] = np.array(rows, dtype=np.float32)
            else:
                vec = lease.embeddings_seq(seq, n_out)
                if vec is None:
                    raise DecodeError(f"no pooled embedding for sequence {seq}")
                results[i] = vec.astype(np.float32, copy=False)


def _tokenize_all(model: Model, texts: Sequence[str], max_tokens: int, truncate: bool) -> list[list[int]]:
    out = []
    for text in texts:
        if not isinstance(text, str):
            raise ArgumentTypeError(f"texts must be str, not {type(text).__name__}")
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


#: Characters of text tokenized and packed at a time: a list of any length is embedded in bounded memory
#: besides the output (token lists take ~36 bytes per token as Python lists; 1 MiB of text ~ 9 MB).
CHUNK_CHARS = 1 << 20


def _chunks(items: Sequence[Any], weight, limit: int | None = None) -> Iterator[list[Any]]:
    """``items`` in consecutive runs whose ``weight`` sums stay near ``limit`` (one item at least)."""
    limit = CHUNK_CHARS if limit is None else limit
    run: list[Any] = []
    total = 0
    for item in items:
        w = weight(item)
        if run and total + w > limit:
            yield run
            run, total = [], 0
        run.append(item)
        total += w
    if run:
        yield run


def _normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


@overload
def embed(model: Model, texts: str, **opts: Any) -> np.ndarray: ...
@overload
def embed(model: Model, texts: Sequence[str], **opts: Any) -> np.ndarray | list[np.ndarray]: ...


def embed(model: Model, texts: str | Sequence[str], *, normalize: bool = True, pooling: AppliedPooling | None = None,
          truncate: bool = True, n_batch: int = 2048, usage: EmbedUsage | None = None, batch_invariant: bool = True,
          **ctx_opts: Any):
    """Embed one text (→ 1-D float32 array of ``model.n_embd_out``) or a list (→ 2-D array, one row per text).

    ``pooling`` overrides the model's (none/mean/cls/last/rank); with ``"none"``
    each text gives a (n_tokens, n_embd_out) array (a list of them for a list).
    Vectors are L2-normalised unless ``normalize=False``. Texts longer than
    what one embedding can take are cut (``truncate=True``) or raise
    :class:`ContextOverflowError`. Other options are :class:`ContextParams`
    fields (n_threads, type_k, ...). A list of any length is tokenized and packed
    a run of texts at a time (:data:`CHUNK_CHARS`), so memory beyond the output
    stays bounded. ``usage``: an :class:`EmbedUsage` this call's tokens and decodes are added to.
    ``batch_invariant`` (default True): every text starts at an aligned row (:data:`ROW_ALIGN`), so a
    list gives the vectors one-by-one calls give; False packs texts without padding, as llama-server and
    llama-cpp-python do (up to ~30% faster on short texts; a vector then depends on its batch-mates by up
    to 8e-3 on Q4 models).
    """
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    if not items:
        return np.zeros((0, model.n_embd_out), dtype=np.float32)
    if pooling is not None and pooling not in ("none", "mean", "cls", "last", "rank"):
        raise InvalidArgumentError(f"pooling={pooling!r}: expected none, mean, cls, last or rank")
    _check_context_options(ctx_opts, "embed")
    embedder = _Embedder(model, pooling or model_pooling(model), n_batch, ctx_opts, usage,
                         align=ROW_ALIGN if batch_invariant else 1)
    vectors: list[np.ndarray] = []
    for chunk in _chunks(items, lambda t: len(t) if isinstance(t, str) else 0):
        vectors += embedder.run(_tokenize_all(model, chunk, embedder.max_tokens, truncate))
    if embedder.pooling == "none":
        out = [_normalize(v) if normalize else v for v in vectors]
        return out[0] if single else out
    arr = np.stack(vectors)
    if normalize and embedder.pooling != "rank":
        arr = _normalize(arr)
    return arr[0] if single else arr


def rerank(model: Model, query: str, documents: Sequence[str], *, normalize: bool = False, truncate: bool = True,
           n_batch: int = 2048, any_model: bool = False, usage: EmbedUsage | None = None,
           **ctx_opts: Any) -> list[float]:
    """Relevance scores of ``documents`` for ``query``, in document order (a rank-pooling model).

    Scores are the model's raw outputs; ``normalize=True`` maps them through a
    sigmoid into (0, 1). A model that does not declare rank pooling raises EmbeddingError, unless
    ``any_model`` (llama-server's ``--reranking`` on any model): llama.cpp's rank pooling then reads its
    first token's state (its ranking head when it has one; else the state's first value, meaningless
    for a model never trained to rank). Documents are processed a run at a time, as in :func:`embed`;
    ``usage`` as there.
    """
    if model_pooling(model) != "rank" and not any_model:
        raise EmbeddingError(f"{model.path.name} is not a reranking model (its pooling is "
                             f"{model_pooling(model)!r}, not 'rank')")
    _check_context_options(ctx_opts, "rerank")
    embedder = _Embedder(model, "rank", n_batch, ctx_opts, usage)
    if model_pooling(model) != "rank":
        # llama.cpp reads n_cls_out floats per sequence at the sequence's index; without a ranking head
        # the pooled rows are n_embd wide, so only the first sequence of a decode is read where it is.
        embedder.n_seq = 1
    limit = embedder.max_tokens
    scores: list[float] = []
    start = 0  # index of the chunk's first document
    for chunk in _chunks(documents, lambda d: len(query) + (len(d) if isinstance(d, str) else 0)):
        pairs = [_rerank_tokens(model, query, doc) for doc in chunk]
        for i, ids in enumerate(pairs):
            if len(ids) > limit:
                if not truncate:
                    raise ContextOverflowError(f"query + document {start + i} is {len(ids)} tokens, over {limit}",
                                               n_tokens=len(ids), n_ctx=limit)
                pairs[i] = ids[:limit]
        scores += [float(v[0]) for v in embedder.run(pairs)]
        start += len(chunk)
    return [1.0 / (1.0 + math.exp(-s)) for s in scores] if normalize else scores


def _check_context_options(ctx_opts: dict[str, Any], what: str) -> None:
    """Context options known, and none of those the embedder sets itself (its context is sized from
    ``n_batch``: an ``n_ctx`` of the caller's would not hold the runs it packs)."""
    split_options(ctx_opts, ContextParams, where=f"{what}: unknown")
    for reserved in ("embeddings", "pooling", "n_seq_max", "n_ubatch", "n_ctx", "n_outputs_max"):
        if reserved in ctx_opts:
            raise ArgumentTypeError(f"{what} sets {reserved} itself (the longest text is n_batch tokens)")


def _rerank_tokens(model: Model, query: str, doc: str) -> list[int]:
    """llama.cpp's reranking input: the GGUF's ``rerank`` template, else BOS query EOS SEP doc EOS."""
    template = model.chat_template_named("rerank")
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", doc)
        return Tokenizer.encode(model, text, add_special=False, parse_special=True)
    vocab = model.vocab
    eos = vocab.eos if vocab.eos is not None else vocab.sep
    out: list[int | None] = []
    if vocab.add_bos:
        out.append(vocab.bos)
    out += vocab.tokenize(query, add_special=False)
    if vocab.add_eos:
        out.append(eos)
    if vocab.add_sep:
        out.append(vocab.sep)
    out += vocab.tokenize(doc, add_special=False)
    if vocab.add_eos:
        out.append(eos)
    return [t for t in out if t is not None]
