"""Embeddings (decoder and encoder models, pooling, batching) and reranking."""

from __future__ import annotations

import numpy as np
import pytest

import llama_ctypes as lc
from tiny_models import write_tiny_bert, write_tiny_gemma_embedding, write_tiny_t5_encoder

TEXTS = [f"Sentence {i} is about topic {i % 5}." + " More words." * (i % 4) for i in range(12)]


@pytest.fixture(scope="module")
def bert(tmp_path_factory, vocab_dir):
    path = write_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert.gguf", vocab_dir / "ggml-vocab-bert-bge.gguf",
                           pooling=1)
    with lc.load_model(path) as model:
        yield model


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, vocab_dir):
    path = write_tiny_bert(tmp_path_factory.mktemp("rerank") / "tiny-rerank.gguf",
                           vocab_dir / "ggml-vocab-bert-bge.gguf", pooling=4, seed=1)
    with lc.load_model(path) as model:
        yield model


@pytest.fixture(scope="module")
def t5_encoder(tmp_path_factory, vocab_dir):
    path = write_tiny_t5_encoder(tmp_path_factory.mktemp("t5") / "tiny-t5-encoder.gguf",
                                 vocab_dir / "ggml-vocab-llama-spm.gguf")
    with lc.load_model(path) as model:
        yield model


@pytest.fixture(scope="module")
def narrow_out(tmp_path_factory, vocab_dir):
    """A gemma-embedding whose dense_2 projection makes its output (48) narrower than n_embd (64)."""
    path = write_tiny_gemma_embedding(tmp_path_factory.mktemp("gemma-emb") / "tiny-gemma-embedding.gguf",
                                      vocab_dir / "ggml-vocab-llama-spm.gguf", n_embd=64, n_embd_out=48)
    with lc.load_model(path) as model:
        yield model


@pytest.mark.parametrize("name", ["tiny_model", "bert", "t5_encoder"])
def test_normalised_vectors_and_list_equals_one_by_one(request, name):
    model = request.getfixturevalue(name)
    one = lc.embed(model, TEXTS[0])
    assert one.shape == (model.n_embd,) and one.dtype == np.float32
    assert np.linalg.norm(one) == pytest.approx(1.0, abs=1e-5)
    many = lc.embed(model, TEXTS)
    assert many.shape == (len(TEXTS), model.n_embd)
    assert np.allclose(np.linalg.norm(many, axis=1), 1.0, atol=1e-5)
    alone = np.stack([lc.embed(model, t) for t in TEXTS])
    assert np.abs(many - alone).max() < 1e-6  # rows aligned: identical here (1.5e-5 on bert unaligned)
    raw = lc.embed(model, TEXTS[0], normalize=False)
    assert np.allclose(raw / np.linalg.norm(raw), one, atol=1e-6)


def test_rows_are_n_embd_out_wide_when_it_differs_from_n_embd(narrow_out):
    model = narrow_out
    assert (model.n_embd, model.n_embd_out) == (64, 48)
    one = lc.embed(model, TEXTS[0])
    assert one.shape == (48,) and np.isfinite(one).all()
    assert np.linalg.norm(one) == pytest.approx(1.0, abs=1e-5)
    raw = lc.embed(model, TEXTS[0], normalize=False)
    assert np.isfinite(raw).all() and np.allclose(raw / np.linalg.norm(raw), one, atol=1e-6)
    many = lc.embed(model, TEXTS)
    assert many.shape == (len(TEXTS), 48) and np.isfinite(many).all()
    assert np.allclose(np.linalg.norm(many, axis=1), 1.0, atol=1e-5)
    alone = np.stack([lc.embed(model, t) for t in TEXTS])
    assert np.abs(many - alone).max() < 1e-6
    assert np.allclose(many[0], one, atol=1e-6)
    rows = lc.embed(model, "Hello there world", pooling="none")
    assert rows.shape == (len(model.tokenize("Hello there world")), 48) and np.isfinite(rows).all()
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    per_text = lc.embed(model, ["a b", "Hello there world"], pooling="none")
    assert [r.shape for r in per_text] == [(len(model.tokenize("a b")), 48), rows.shape]
    assert np.abs(per_text[1] - rows).max() < 1e-4
    assert lc.embed(model, []).shape == (0, 48)


# Different lengths (2 to ~300 tokens), scripts and shapes: a text's place in a packed batch varies.
VARIED = TEXTS + [
    "A",
    "日本語のテキストです。埋め込みを計算します。",
    "def f(x):\n    return [i * x for i in range(10)]\n",
    " ".join(f"word{i % 17} and the {i}th clause of a long rambling paragraph," for i in range(20)),
]


@pytest.mark.gemma
def test_gemma_embeddings(gemma):
    many = lc.embed(gemma, VARIED)
    alone = np.stack([lc.embed(gemma, t) for t in VARIED])
    assert many.shape == (len(VARIED), 640)
    # Rows are aligned so the repacked Q4_K kernels treat every row alike: a list equals one-by-one
    # (measured 6e-8; unaligned it was 2e-3 here, 8e-3 and cosine 0.9992 on other texts).
    assert np.abs(many - alone).max() < 1e-4
    assert (many * alone).sum(axis=1).min() > 0.99999
    similar = lc.embed(gemma, ["The cat sat on the mat.", "A cat was sitting on the mat.", "Stock prices fell."])
    assert similar[0] @ similar[1] > similar[0] @ similar[2]


def test_packed_texts_start_on_aligned_rows(tiny_model, monkeypatch):
    """Repacked CPU kernels round a row by its place in the batch: every text starts on a multiple
    of ROW_ALIGN rows and every decode is a multiple of it, so a list equals one-by-one."""
    from llama_ctypes.core.context import ContextLease
    from llama_ctypes.features.embeddings import MAX_SEQUENCES, ROW_ALIGN

    decodes = []
    real = ContextLease.decode

    def recording(self, batch):
        n = batch.n_tokens
        decodes.append((batch.seq_ids[:n, 0].copy(), batch.pos[:n].copy(), batch.logits[:n].copy()))
        return real(self, batch)

    monkeypatch.setattr(ContextLease, "decode", recording)
    texts = TEXTS + ["x"]
    many = lc.embed(tiny_model, texts, n_batch=100)  # not a multiple of n_seq_max: llama.cpp used to abort
    assert len(decodes) > 1
    for seqs, pos, out in decodes:
        assert len(seqs) % ROW_ALIGN == 0 and out.all()
        starts = [r for r in range(len(seqs)) if pos[r] == 0 and seqs[r] < MAX_SEQUENCES // 2]
        assert starts and all(r % ROW_ALIGN == 0 for r in starts)
    n_texts = sum(int(((p == 0) & (s < MAX_SEQUENCES // 2)).sum()) for s, p, _ in decodes)
    assert n_texts == len(texts)
    monkeypatch.undo()
    alone = np.stack([lc.embed(tiny_model, t) for t in texts])
    assert np.abs(many - alone).max() < 1e-6


@pytest.mark.parametrize("name", ["tiny_model", "bert", "t5_encoder"])
def test_packing_without_alignment_pads_nothing_and_stays_close(request, name, monkeypatch):
    """batch_invariant=False (llama_ctypes.compat's choice, as llama-cpp-python packs): no padding rows, odd
    decode sizes and every pooling run (llama.cpp aborted on some batch shapes before), and the vectors stay
    close to the aligned ones."""
    from llama_ctypes.core.context import ContextLease

    model = request.getfixturevalue(name)
    texts = TEXTS + ["x", "a somewhat longer text than the others, with a few more words in it"]
    sizes = []
    real_decode, real_encode = ContextLease.decode, ContextLease.encode
    monkeypatch.setattr(ContextLease, "decode", lambda self, b: (sizes.append(b.n_tokens), real_decode(self, b))[1])
    monkeypatch.setattr(ContextLease, "encode", lambda self, b: (sizes.append(b.n_tokens), real_encode(self, b))[1])
    n_tokens = sum(len(lc.Tokenizer.encode(model, t)) for t in texts)
    for pooling in (None, "mean", "last", "cls"):
        if name == "t5_encoder" and pooling in ("last", "cls"):
            continue
        sizes.clear()
        packed = lc.embed(model, texts, pooling=pooling, batch_invariant=False, n_batch=64)
        assert sum(sizes) == n_tokens and len(sizes) > 1  # (no padding; more than one decode at n_batch=64)
        aligned = lc.embed(model, texts, pooling=pooling)
        assert np.abs(packed - aligned).max() < 1e-3, pooling


def test_per_token_output_has_one_row_per_token(tiny_model, bert):
    for model in (tiny_model, bert):
        rows = lc.embed(model, "Hello there world", pooling="none")
        assert rows.shape == (len(model.tokenize("Hello there world")), model.n_embd)
        assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
        per_text = lc.embed(model, ["a b", "c d e f"], pooling="none")
        assert [r.shape[0] for r in per_text] == [len(model.tokenize("a b")), len(model.tokenize("c d e f"))]


def test_pooling_override_and_model_default(tiny_model, bert):
    assert lc.features.embeddings.model_pooling(bert) == "mean"
    assert lc.features.embeddings.model_pooling(tiny_model) == "mean"  # a decoder without pooling metadata
    cls = lc.embed(bert, TEXTS[:3], pooling="cls")
    mean = lc.embed(bert, TEXTS[:3])
    assert not np.allclose(cls, mean)
    last = lc.embed(tiny_model, TEXTS[:3], pooling="last")
    rows = lc.embed(tiny_model, TEXTS[0], pooling="none")
    assert np.allclose(last[0], rows[-1], atol=1e-5)


def test_long_texts_truncate_or_raise(bert):
    long_text = "word " * 2000  # the tiny BERT takes 512 positions
    vec = lc.embed(bert, long_text)
    assert vec.shape == (bert.n_embd,)
    with pytest.raises(lc.ContextOverflowError, match="512"):
        lc.embed(bert, long_text, truncate=False)
    assert lc.embed(bert, []).shape == (0, bert.n_embd)
    with pytest.raises(TypeError):
        lc.embed(bert, [b"bytes"])
    with pytest.raises(ValueError, match="pooling"):
        lc.embed(bert, "x", pooling="max")
    assert lc.embed(bert, "still works").shape == (bert.n_embd,)


def test_rerank_scores_in_document_order(reranker, bert):
    docs = ["a cat is an animal", "the stock market", "cats purr", "x"]
    scores = lc.rerank(reranker, "what is a cat", docs)
    assert len(scores) == len(docs) and all(isinstance(s, float) for s in scores)
    one_by_one = [lc.rerank(reranker, "what is a cat", [d])[0] for d in docs]
    assert np.allclose(scores, one_by_one, atol=1e-4)
    probs = lc.rerank(reranker, "what is a cat", docs, normalize=True)
    assert all(0.0 < p < 1.0 for p in probs)
    with pytest.raises(lc.EmbeddingError, match="not a reranking model"):
        lc.rerank(bert, "q", ["d"])
    # llama-server's --reranking on any model: read through llama.cpp's rank pooling, one score each
    forced = lc.rerank(bert, "what is a cat", docs, any_model=True)
    assert len(forced) == len(docs) and len(set(forced)) > 1
    assert np.allclose(forced, [lc.rerank(bert, "what is a cat", [d], any_model=True)[0] for d in docs], atol=1e-4)
    # the context is sized from n_batch, as embed's: an n_ctx of the caller's is refused (it failed the decode)
    for reserved in ({"n_ctx": 64}, {"n_ubatch": 8}, {"pooling": "mean"}):
        with pytest.raises(lc.ArgumentTypeError, match="rerank sets"):
            lc.rerank(reranker, "q" * 3000, ["a" * 3000], **reserved)
    long = lc.rerank(reranker, "q " * 3000, ["a " * 3000], n_batch=64)  # (truncated to the 64-token run)
    assert len(long) == 1 and np.isfinite(long[0])


def test_a_manager_reranks_with_any_model_given_rank_pooling(tiny_model_path):
    """``pooling="rank"`` at load (``serve --reranking``) makes any model a reranker, as llama-server."""
    with lc.ModelManager() as manager:
        info = manager.load("r", tiny_model_path, mode="direct", pooling="rank")
        assert "rerank" in info.capabilities
        scores = manager.rerank("r", "what is a cat", ["a cat", "the stock market"])
        assert len(scores) == 2 and all(np.isfinite(scores))
        plain = manager.load("p", tiny_model_path, mode="direct")
        assert "rerank" not in plain.capabilities


def test_long_lists_are_embedded_a_run_at_a_time_in_order(bert, reranker, monkeypatch):
    """A list of any length is tokenized and packed a bounded run of texts at a time (memory beyond the
    output stays bounded); the results keep the list's order and equal one run of everything."""
    from llama_ctypes.features import embeddings

    texts = [f"text number {i} " * (1 + i % 5) for i in range(40)]
    whole = lc.embed(bert, texts)
    runs = []
    real = embeddings._Embedder.run
    monkeypatch.setattr(embeddings, "CHUNK_CHARS", 100)
    monkeypatch.setattr(embeddings._Embedder, "run", lambda self, lists: runs.append(len(lists)) or real(self, lists))
    chunked = lc.embed(bert, texts)
    assert len(runs) > 5 and sum(runs) == len(texts)
    assert np.abs(chunked - whole).max() < 1e-5
    runs.clear()
    scores = lc.rerank(reranker, "which number", texts)
    assert len(runs) > 5 and sum(runs) == len(texts)
    monkeypatch.setattr(embeddings, "CHUNK_CHARS", 1 << 20)
    assert np.allclose(scores, lc.rerank(reranker, "which number", texts), atol=1e-4)


def test_encoder_only_model_embeds_through_llama_encode(t5_encoder, monkeypatch):
    assert t5_encoder.has_encoder and not t5_encoder.has_decoder
    lib = lc.init()
    calls = {"encode": 0}
    real = lib.llama_encode

    def counting(ctx, batch):
        calls["encode"] += 1
        return real(ctx, batch)

    monkeypatch.setattr(lib, "llama_encode", counting)
    vecs = lc.embed(t5_encoder, TEXTS[:5])
    assert vecs.shape == (5, t5_encoder.n_embd) and calls["encode"] == 1  # five texts, one encoder pass
    rows = lc.embed(t5_encoder, "Hello there world", pooling="none")
    assert rows.shape[0] == len(t5_encoder.tokenize("Hello there world"))
    with pytest.raises(ValueError, match="encoder-only"):
        lc.generate(t5_encoder, "Hello", max_tokens=2)
