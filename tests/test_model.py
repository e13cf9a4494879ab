"""Model loading and introspection, the tokenizer, handle lifetimes and bad input."""

from __future__ import annotations

import gc
import os
import threading

import pytest

import llama_ctypes as lc
from tiny_models import write_tiny_llama


def test_tiny_model_introspection(tiny_model):
    m = tiny_model
    assert m.architecture == "llama"
    assert m.n_layer == 2 and m.n_embd == 64 and m.n_head == 4 and m.n_head_kv == 2
    assert m.n_ctx_train == 2048
    assert m.n_vocab == 32000
    assert m.n_params > 0 and m.size > 0
    assert m.has_decoder and not m.has_encoder
    assert not m.is_recurrent and not m.is_hybrid
    assert m.rope_type == "norm"
    assert m.metadata["general.architecture"] == "llama"
    assert m.meta("llama.block_count") == "2"
    assert m.meta("no.such.key") is None
    assert m.chat_template is None
    assert "tiny" in repr(m) or "llama" in repr(m)


@pytest.mark.gemma
def test_gemma_introspection(gemma):
    assert gemma.architecture == "gemma3"
    assert "270M" in gemma.desc and "Q4_K" in gemma.desc
    assert 250e6 < gemma.n_params < 300e6
    assert gemma.n_ctx_train == 32768
    assert gemma.chat_template is None  # a base model: no template in its metadata
    info = gemma.info()
    assert info["n_layer"] == gemma.n_layer == 18


def test_tokenizer_round_trip_and_specials(tiny_model):
    text = "Hello world, héllo 世界 🌍!"
    ids = lc.Tokenizer.encode(tiny_model, text)
    assert ids[0] == lc.Tokenizer.bos(tiny_model)  # llama SPM adds BOS
    assert lc.Tokenizer.encode(tiny_model, text, add_special=False) == ids[1:]
    assert lc.Tokenizer.decode(tiny_model, ids, remove_special=True).strip() == text
    assert tiny_model.detokenize(tiny_model.tokenize(text, add_special=False)).strip() == text
    assert lc.Tokenizer.n_tokens(tiny_model) == tiny_model.vocab.n_tokens == 32000
    with pytest.warns(DeprecationWarning, match="n_tokens"):  # the old spellings still work, and say the new one
        assert lc.Tokenizer.vocab_size(tiny_model) == 32000
    with pytest.warns(DeprecationWarning, match="token_bytes"):
        assert lc.Tokenizer.token_to_bytes(tiny_model, ids[1]) == lc.Tokenizer.token_bytes(tiny_model, ids[1])
    eos = lc.Tokenizer.eos(tiny_model)
    assert lc.Tokenizer.is_eog(tiny_model, eos)
    assert not lc.Tokenizer.is_eog(tiny_model, ids[-1])
    # parse_special turns the text of a special token into the token
    assert lc.Tokenizer.encode(tiny_model, "</s>", add_special=False, parse_special=True) == [eos]
    assert lc.Tokenizer.encode(tiny_model, "</s>", add_special=False, parse_special=False) != [eos]
    assert lc.Tokenizer.token_to_piece(tiny_model, eos, special=True) == "</s>"


def test_stream_decoder_emits_split_characters_once_whole(tiny_model):
    text = "naïve 世界 🌍🚀 ok"
    ids = lc.Tokenizer.encode(tiny_model, text, add_special=False)
    # SPM byte fallback splits each emoji into 4 byte tokens
    assert len(ids) > len(text.split())
    decoder = lc.StreamDecoder(tiny_model)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces).strip() == text
    assert all("\ufffd" not in p for p in pieces)
    for ch in "ï世界🌍🚀":
        assert sum(p.count(ch) for p in pieces) == 1


def test_stream_decoder_matches_an_incremental_utf8_decoder(tiny_model):
    """Piece by piece, the decoder's fast path (a whole-character piece decoded at once) gives what an
    incremental UTF-8 decoder gives: split characters, stray and invalid bytes included."""
    import codecs
    import random

    rng = random.Random(5)
    byte_tokens = list(range(3, 259))  # SPM's <0x00>..<0xFF>
    for _ in range(20):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.6 else rng.randrange(259, tiny_model.n_vocab)
               for _ in range(60)]
        decoder, ref = lc.StreamDecoder(tiny_model), codecs.getincrementaldecoder("utf-8")(errors="replace")
        for t in ids:
            assert decoder.push(t) == ref.decode(lc.Tokenizer.token_bytes(tiny_model, t))
        assert decoder.flush() == ref.decode(b"", final=True)


def test_decode_rejects_out_of_range_tokens(tiny_model):
    with pytest.raises(lc.TokenizationError):
        lc.Tokenizer.decode(tiny_model, [1, 99999999])
    with pytest.raises(TypeError):
        lc.Tokenizer.encode(tiny_model, b"bytes")


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        lc.load_model(tmp_path / "missing.gguf")


def test_truncated_and_garbage_files_raise_load_error(tmp_path, tiny_model_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model_path.read_bytes()[: 4096])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(8192))
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    for path in (truncated, garbage, not_gguf):
        with pytest.raises(lc.ModelLoadError):
            lc.load_model(path)
    # the process is healthy: a good model still loads and runs
    with lc.load_model(tiny_model_path) as model:
        assert lc.generate(model, "Hi", max_tokens=2, temp=0).tokens


def test_unknown_and_invalid_options(tiny_model_path):
    with pytest.raises(TypeError, match="n_gpu_layerz"):
        lc.load_model(tiny_model_path, n_gpu_layerz=1)
    with pytest.raises(ValueError, match="split_mode"):
        lc.load_model(tiny_model_path, split_mode="diagonal")
    with pytest.raises(ValueError, match="n_gpu_layers"):
        lc.load_model(tiny_model_path, n_gpu_layers=-5)


def test_progress_callback_reports_and_can_abort(tiny_model_path):
    seen = []
    with lc.load_model(tiny_model_path, progress_callback=seen.append):
        pass
    assert seen and seen[-1] == pytest.approx(1.0)
    with pytest.raises(lc.ModelLoadError):
        lc.load_model(tiny_model_path, progress_callback=lambda p: False)

    def boom(progress):
        raise RuntimeError("from the callback")

    with pytest.raises(RuntimeError, match="from the callback"):
        lc.load_model(tiny_model_path, progress_callback=boom)


def test_kv_overrides_change_metadata(tiny_model_path):
    with lc.load_model(tiny_model_path, kv_overrides={"llama.context_length": 1024}) as model:
        assert model.n_ctx_train == 1024


def test_vocab_only_model_tokenizes_but_refuses_contexts(tiny_model_path):
    with lc.load_model(tiny_model_path, vocab_only=True) as model:
        assert model.tokenize("hello")
        assert model.n_head == 0
        with pytest.raises(lc.ContextCreationError, match="vocab_only"):
            lc.Context.create(model)


def test_closed_handles_raise_and_never_crash(tiny_model_path):
    model = lc.load_model(tiny_model_path)
    ctx = lc.Context.create(model, n_ctx=256)
    smp = lc.Sampler.create(model, temp=0)
    # the context keeps the model alive after model.close()
    model.close()
    assert model.closed
    with pytest.raises(lc.ClosedError):
        _ = model.n_params
    with pytest.raises(lc.ClosedError):
        model.tokenize("x")
    done = ctx.generate(smp, [1, 15043], max_tokens=4)
    assert len(done.tokens) == 4
    smp.close()
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(lc.ClosedError):
        ctx.generate(smp, [1, 15043], max_tokens=4)
    with pytest.raises(lc.ClosedError):
        ctx.clear()
    with pytest.raises(lc.ClosedError):
        lc.Sampler.create(model)
    assert model._freed and ctx._freed and smp._freed


def test_garbage_collection_frees_handles(tiny_model_path):
    import weakref

    model = lc.load_model(tiny_model_path)
    ctx = lc.Context.create(model, n_ctx=128)
    model_ref, ctx_ref = weakref.ref(model), weakref.ref(ctx)
    del model
    gc.collect()
    assert model_ref() is not None  # the context keeps its model alive
    assert ctx.generate(lc.Sampler.create(ctx.model, temp=0), [1, 15043], max_tokens=2).tokens
    del ctx
    gc.collect()
    assert ctx_ref() is None and model_ref() is None


def test_model_is_shared_across_threads(tiny_model):
    prompts = [f"Thread {i} says" for i in range(6)]
    expected = {p: lc.generate(tiny_model, p, max_tokens=16, temp=0).tokens for p in prompts}
    results, errors = {}, []

    def work(prompt):
        try:
            with lc.Context.create(tiny_model, n_ctx=256) as ctx, lc.Sampler.create(tiny_model, temp=0) as smp:
                results[prompt] = ctx.generate(smp, tiny_model.tokenize(prompt), max_tokens=16).tokens
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == expected


def test_context_refuses_concurrent_use(tiny_model):
    ctx = lc.Context.create(tiny_model, n_ctx=256)
    smp = lc.Sampler.create(tiny_model, temp=0)
    running = ctx.stream(smp, [1, 15043, 3186], max_tokens=50)
    next(running)
    with pytest.raises(lc.BusyError):
        ctx.generate(lc.Sampler.create(tiny_model, temp=0), [1, 15043], max_tokens=2)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(lc.BusyError, ctx.clear)))
    t.start()
    t.join()
    assert errors
    running.close()
    ctx.clear()  # free again once the stream is closed
    ctx.close()
    smp.close()


def test_bigger_tiny_model_variants_load(tmp_path, vocab_dir):
    # A BPE vocabulary (Qwen2) also works through the same writer.
    path = write_tiny_llama(tmp_path / "tiny-qwen-vocab.gguf", vocab_dir / "ggml-vocab-qwen2.gguf", seed=3)
    with lc.load_model(path) as model:
        assert model.tokenize("Hello", add_special=False)
        assert lc.generate(model, "Hello", max_tokens=3, temp=0).finish_reason in ("length", "eog")
