"""Write tiny random-weight GGUF models with the ``gguf`` package.

The vocabulary is copied from one of llama.cpp's ``models/ggml-vocab-*.gguf``
files, so tokenization is real; the weights are random, so any output is valid
and tests assert invariants (determinism, equality of two paths), not text.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: Path) -> int:
    """Copy every ``tokenizer.*`` key of a vocab-only GGUF; return the vocabulary size."""
    reader = gguf.GGUFReader(str(vocab_path))
    n_vocab = 0
    for name, fld in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = fld.contents()
        vtype = fld.types[0]
        sub_type = fld.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise ValueError(f"{vocab_path} has no tokenizer.ggml.tokens")
    return n_vocab


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random(rng: np.random.Generator, default_scale: float):
    """A random float32 tensor factory: ``w(*shape, scale=...)``."""

    def w(*shape: int, scale: float = default_scale) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return w


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _add_lm_ends(writer, w, n_vocab: int, n_embd: int) -> None:
    """The token embeddings, the output norm and the output projection of a decoder."""
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    writer.add_tensor("output.weight", w(n_vocab, n_embd, scale=2.0))


def write_tiny_llama(path: Path, vocab_path: Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 2048, seed: int = 0,
                     chat_template: str | None = None, fim_tokens: tuple[int, ...] | None = None,
                     deltas: dict[str, np.ndarray] | None = None) -> Path:
    """A 2-layer ``llama`` model with random f32 weights (about 2 x n_vocab x n_embd floats).

    ``fim_tokens``: ids of the fill-in-the-middle tokens (pre, suf, mid[, pad, rep, sep]) to declare.
    ``deltas``: arrays added to the named tensors (the same random weights otherwise: a LoRA merged in)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, token in zip(("pre", "suf", "mid", "pad", "rep", "sep"), fim_tokens or ()):
        writer.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", token)

    w = _random(rng, 0.5)
    add_tensor = writer.add_tensor
    if deltas:
        def add_tensor(name: str, value: np.ndarray) -> None:  # noqa: F811 - the same writer, deltas added
            writer.add_tensor(name, (value + deltas[name]).astype(np.float32) if name in deltas else value)

    head_dim = n_embd // n_head
    add_tensor("token_embd.weight", w(n_vocab, n_embd))
    add_tensor("output_norm.weight", _ones(n_embd))
    add_tensor("output.weight", w(n_vocab, n_embd, scale=2.0))
    for i in range(n_layer):
        add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
        add_tensor(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
        add_tensor(f"blk.{i}.attn_k.weight", w(n_head_kv * head_dim, n_embd))
        add_tensor(f"blk.{i}.attn_v.weight", w(n_head_kv * head_dim, n_embd))
        add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd))
        add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
        add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
    _finish(writer)
    return path


def write_tiny_mamba(path: Path, vocab_path: Path, *, n_layer: int = 2, n_embd: int = 64, d_inner: int = 128,
                     d_state: int = 16, d_conv: int = 4, dt_rank: int = 8, n_ctx_train: int = 2048,
                     seed: int = 0) -> Path:
    """A 2-layer ``mamba`` model (a recurrent state per sequence, no KV cache) with random f32 weights."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_name("tiny-mamba-test")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)
    w = _random(rng, 0.3)
    # (numpy shapes are llama.cpp's {ne0, ne1} reversed)
    _add_lm_ends(writer, w, n_vocab, n_embd)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.ssm_in.weight", w(2 * d_inner, n_embd))
        writer.add_tensor(f"blk.{i}.ssm_conv1d.weight", w(d_inner, d_conv))
        writer.add_tensor(f"blk.{i}.ssm_conv1d.bias", w(d_inner))
        writer.add_tensor(f"blk.{i}.ssm_x.weight", w(dt_rank + 2 * d_state, d_inner))
        writer.add_tensor(f"blk.{i}.ssm_dt.weight", w(d_inner, dt_rank))
        writer.add_tensor(f"blk.{i}.ssm_dt.bias", w(d_inner))
        writer.add_tensor(f"blk.{i}.ssm_a", -np.abs(w(d_inner, d_state, scale=1.0)) - 0.1)  # (decaying states)
        writer.add_tensor(f"blk.{i}.ssm_d", _ones(d_inner))
        writer.add_tensor(f"blk.{i}.ssm_out.weight", w(n_embd, d_inner))
    _finish(writer)
    return path


def write_tiny_bert(path: Path, vocab_path: Path, *, pooling: int = 1, n_layer: int = 2, n_embd: int = 64,
                    n_head: int = 4, n_ff: int = 128, n_ctx_train: int = 512, seed: int = 0) -> Path:
    """A 2-layer ``bert`` encoder (non-causal attention, no KV cache) with random weights.

    ``pooling`` is a llama_pooling_type value: 1 = mean, 2 = cls, 4 = rank (adds a 1-output
    classifier head, so the model works as a reranker).
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("tiny-bert-test")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(pooling))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)
    if "tokenizer.ggml.token_type_count" not in gguf.GGUFReader(str(vocab_path)).fields:
        writer.add_token_type_count(2)

    w = _random(rng, 0.2)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("token_types.weight", w(2, n_embd))
    writer.add_tensor("position_embd.weight", w(n_ctx_train, n_embd))
    writer.add_tensor("token_embd_norm.weight", _ones(n_embd))
    writer.add_tensor("token_embd_norm.bias", zeros(n_embd))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", w(n_embd, n_embd))
            writer.add_tensor(f"blk.{i}.{name}.bias", w(n_embd))
        writer.add_tensor(f"blk.{i}.attn_output_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.attn_output_norm.bias", zeros(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.bias", w(n_ff))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
        writer.add_tensor(f"blk.{i}.ffn_down.bias", w(n_embd))
        writer.add_tensor(f"blk.{i}.layer_output_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.layer_output_norm.bias", zeros(n_embd))
    if pooling == 4:
        writer.add_tensor("cls.weight", w(n_embd, n_embd))
        writer.add_tensor("cls.bias", w(n_embd))
        writer.add_tensor("cls.output.weight", w(1, n_embd))
        writer.add_tensor("cls.output.bias", w(1))
    _finish(writer)
    return path


def write_tiny_qwen35(path: Path, vocab_path: Path, *, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                      n_ff: int = 128, n_ctx_train: int = 2048, seed: int = 0, mtp: str | None = None,
                      trunk_scale: float = 1.0) -> Path:
    """A 2-layer hybrid ``qwen35``: layer 0 is a gated-delta-net (recurrent) layer, layer 1 full attention.

    Its memory is hybrid (a KV cache plus a recurrent state), so a cached prefix can
    only be resumed exactly, never cut back.

    ``mtp`` adds a multi-token-prediction block (``blk.2``, ``qwen35.nextn_predict_layers = 1``;
    ``block_count`` counts it, as in Qwen3.6's MTP GGUFs): ``"random"`` weights; ``"token"``, a head
    that ignores the target's hidden state and predicts from the token alone through the target's
    LM head (its drafts are the target's when the trunk barely changes the token's embedding: pair it
    with a small ``trunk_scale``); ``"state"``, a head that passes the target's hidden state (of the
    previous position) straight to the LM head, so its first draft is the target's prediction for the
    previous position (a probe of which hidden row the drafter pairs with which token).
    ``trunk_scale`` scales what the two trunk layers add to the residual stream (1.0: as random).
    """
    if mtp not in (None, "random", "token", "state"):
        raise ValueError(f"mtp={mtp!r}: expected None, 'random', 'token' or 'state'")
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_k_heads, n_v_heads = 2, 4  # ssm.group_count, ssm.time_step_rank
    key_dim, value_dim = head_dim * n_k_heads, head_dim * n_v_heads
    conv_kernel = 4
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_name("tiny-qwen35-test")
    writer.add_block_count(3 if mtp else 2)
    if mtp:
        writer.add_uint32("qwen35.nextn_predict_layers", 1)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_array("qwen35.rope.dimension_sections", [head_dim // 4, head_dim // 4, head_dim // 4, 0])
    writer.add_uint32("qwen35.ssm.conv_kernel", conv_kernel)
    writer.add_uint32("qwen35.ssm.inner_size", value_dim)
    writer.add_uint32("qwen35.ssm.state_size", head_dim)
    writer.add_uint32("qwen35.ssm.time_step_rank", n_v_heads)
    writer.add_uint32("qwen35.ssm.group_count", n_k_heads)
    writer.add_uint32("qwen35.full_attention_interval", 2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)

    w = _random(rng, 0.3)

    _add_lm_ends(writer, w, n_vocab, n_embd)
    # layer 0: gated delta net
    writer.add_tensor("blk.0.attn_norm.weight", _ones(n_embd))
    writer.add_tensor("blk.0.post_attention_norm.weight", _ones(n_embd))
    writer.add_tensor("blk.0.attn_qkv.weight", w(key_dim * 2 + value_dim, n_embd))
    writer.add_tensor("blk.0.attn_gate.weight", w(value_dim, n_embd))
    writer.add_tensor("blk.0.ssm_conv1d.weight", w(key_dim * 2 + value_dim, conv_kernel))
    writer.add_tensor("blk.0.ssm_dt.bias", w(n_v_heads))
    writer.add_tensor("blk.0.ssm_a", -np.abs(w(n_v_heads)) - 0.1)
    writer.add_tensor("blk.0.ssm_beta.weight", w(n_v_heads, n_embd))
    writer.add_tensor("blk.0.ssm_alpha.weight", w(n_v_heads, n_embd))
    writer.add_tensor("blk.0.ssm_norm.weight", _ones(head_dim))
    writer.add_tensor("blk.0.ssm_out.weight", w(n_embd, value_dim) * trunk_scale)
    # layer 1: full attention (q carries a gate: twice the width)
    writer.add_tensor("blk.1.attn_norm.weight", _ones(n_embd))
    writer.add_tensor("blk.1.post_attention_norm.weight", _ones(n_embd))
    writer.add_tensor("blk.1.attn_q.weight", w(head_dim * n_head * 2, n_embd))
    writer.add_tensor("blk.1.attn_k.weight", w(head_dim * n_head_kv, n_embd))
    writer.add_tensor("blk.1.attn_v.weight", w(head_dim * n_head_kv, n_embd))
    writer.add_tensor("blk.1.attn_output.weight", w(n_embd, head_dim * n_head) * trunk_scale)
    writer.add_tensor("blk.1.attn_q_norm.weight", _ones(head_dim))
    writer.add_tensor("blk.1.attn_k_norm.weight", _ones(head_dim))
    for i in range(2):
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff) * trunk_scale)
    if mtp:
        # The MTP block: a full-attention decoder block fed eh_proj([enorm(embed(token)), hnorm(h)]),
        # with its own norm before the shared LM head.
        constructed = mtp != "random"
        eye, zero = np.eye(n_embd, dtype=np.float32), np.zeros((n_embd, n_embd), dtype=np.float32)
        eh_proj = {"token": np.hstack([eye, zero]), "state": np.hstack([zero, eye])}.get(mtp)
        writer.add_tensor("blk.2.nextn.eh_proj.weight", eh_proj if constructed else w(n_embd, 2 * n_embd))
        writer.add_tensor("blk.2.nextn.enorm.weight", _ones(n_embd))
        writer.add_tensor("blk.2.nextn.hnorm.weight", _ones(n_embd))
        writer.add_tensor("blk.2.nextn.shared_head_norm.weight", _ones(n_embd))
        writer.add_tensor("blk.2.attn_norm.weight", _ones(n_embd))
        writer.add_tensor("blk.2.post_attention_norm.weight", _ones(n_embd))
        writer.add_tensor("blk.2.attn_q.weight", w(head_dim * n_head * 2, n_embd))
        writer.add_tensor("blk.2.attn_k.weight", w(head_dim * n_head_kv, n_embd))
        writer.add_tensor("blk.2.attn_v.weight", w(head_dim * n_head_kv, n_embd))
        # (constructed heads: attention and FFN add nothing, the block passes eh_proj's output on)
        writer.add_tensor("blk.2.attn_output.weight", w(n_embd, head_dim * n_head) * (0.0 if constructed else 1.0))
        writer.add_tensor("blk.2.attn_q_norm.weight", _ones(head_dim))
        writer.add_tensor("blk.2.attn_k_norm.weight", _ones(head_dim))
        writer.add_tensor("blk.2.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor("blk.2.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor("blk.2.ffn_down.weight", w(n_embd, n_ff) * (0.0 if constructed else 1.0))
    _finish(writer)
    return path


def write_tiny_t5_encoder(path: Path, vocab_path: Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                          n_ff: int = 128, n_ctx_train: int = 512, seed: int = 0) -> Path:
    """A 2-layer ``t5encoder``: an encoder-only model, run with llama_encode (no decoder, no KV cache)."""
    rng = np.random.default_rng(seed)
    buckets = 32
    writer = gguf.GGUFWriter(str(path), "t5encoder")
    writer.add_name("tiny-t5-encoder-test")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_key_length(n_embd // n_head)
    writer.add_value_length(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_relative_attn_buckets_count(buckets)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)

    w = _random(rng, 0.3)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("enc.output_norm.weight", _ones(n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"enc.blk.{i}.attn_norm.weight", _ones(n_embd))
        if i == 0:  # T5 shares the first layer's relative position bias
            writer.add_tensor("enc.blk.0.attn_rel_b.weight", w(buckets, n_head))
        for name in ("attn_q", "attn_k", "attn_v", "attn_o"):
            writer.add_tensor(f"enc.blk.{i}.{name}.weight", w(n_embd, n_embd))
        writer.add_tensor(f"enc.blk.{i}.ffn_norm.weight", _ones(n_embd))
        writer.add_tensor(f"enc.blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"enc.blk.{i}.ffn_down.weight", w(n_embd, n_ff))
    _finish(writer)
    return path


def write_tiny_gemma_embedding(path: Path, vocab_path: Path, *, n_layer: int = 2, n_embd: int = 64,
                               n_embd_out: int = 48, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
                               n_ctx_train: int = 512, seed: int = 0) -> Path:
    """A 2-layer ``gemma-embedding`` (non-causal, mean-pooled) whose output is ``n_embd_out`` wide.

    llama.cpp applies the ``dense_2`` projection (n_embd -> n_embd_out) after pooling, and
    ``<arch>.embedding_length_out`` tells it (and callers, through llama_model_n_embd_out) the
    output width; with ``n_embd_out != n_embd`` an embedding row is not n_embd floats.
    """
    rng = np.random.default_rng(seed)
    arch = "gemma-embedding"
    head_dim = n_embd // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-gemma-embedding-test")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_uint32(f"{arch}.embedding_length_out", n_embd_out)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(32)
    writer.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)  # layer 0 sliding, layer 1 full
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_uint32(f"{arch}.dense_2_feat_in", n_embd)
    writer.add_uint32(f"{arch}.dense_2_feat_out", n_embd_out)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)

    w = _random(rng, 0.3)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd, scale=0.1))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    writer.add_tensor("dense_2.weight", w(n_embd_out, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(n_head * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_head * head_dim))
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", _ones(head_dim))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", _ones(head_dim))
        writer.add_tensor(f"blk.{i}.post_attention_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
        writer.add_tensor(f"blk.{i}.post_ffw_norm.weight", _ones(n_embd))
    _finish(writer)
    return path


def write_perturbed_copy(src: Path, dst: Path, *, scale: float, seed: int = 1,
                         token_edits: dict[int, str] | None = None) -> Path:
    """A copy of an f32 GGUF with every weight matrix nudged by relative noise ``scale``.

    The copy shares the vocabulary and the architecture, and predicts much like the
    original: a draft model whose proposals are mostly, not always, what the original
    would pick (speculative decoding's partly-rejected case). ``token_edits`` renames
    tokens (id -> new text): a vocabulary of the same size that is not the same.
    """
    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        vtype = fld.types[0]
        sub_type = fld.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = fld.contents()
        if name == "tokenizer.ggml.tokens" and token_edits:
            value = [token_edits.get(i, tok) for i, tok in enumerate(value)]
        writer.add_key_value(name, value, vtype, sub_type)
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{src}: tensor {t.name} is {t.tensor_type.name}; only f32 copies are supported")
        data = np.array(t.data, dtype=np.float32)
        if data.ndim >= 2:  # matrices only: norms stay ones
            data = data + rng.standard_normal(data.shape).astype(np.float32) * (scale * float(data.std()))
        writer.add_tensor(t.name, data)
    _finish(writer)
    return dst


def tiny_lora_pairs(*, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
                    n_vocab: int = 32000, rank: int = 4, seed: int = 1, scale: float = 0.5
                    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The low-rank pairs of :func:`write_tiny_lora`: tensor name -> (A: rank x n_in, B: n_out x rank),
    on every layer's attention q/v and FFN down projections and on the output head, random f32."""
    rng = np.random.default_rng(seed)
    w = _random(rng, scale)
    head_dim = n_embd // n_head
    shapes = {"output.weight": (n_embd, n_vocab)}
    for i in range(n_layer):
        shapes[f"blk.{i}.attn_q.weight"] = (n_embd, n_embd)
        shapes[f"blk.{i}.attn_v.weight"] = (n_embd, n_head_kv * head_dim)
        shapes[f"blk.{i}.ffn_down.weight"] = (n_ff, n_embd)
    return {name: (w(rank, n_in), w(n_out, rank)) for name, (n_in, n_out) in shapes.items()}


def merged_deltas(*adapters: tuple[dict[str, tuple[np.ndarray, np.ndarray]], float, float]) -> dict[str, np.ndarray]:
    """The weight deltas of adapters merged into the base, as llama.cpp applies them: for each
    ``(pairs, alpha, scale)``, ``scale * alpha / rank * B @ A`` per tensor (summed over adapters)."""
    out: dict[str, np.ndarray] = {}
    for pairs, alpha, scale in adapters:
        for name, (a, b) in pairs.items():
            factor = scale * alpha / a.shape[0] if alpha else scale
            out[name] = out.get(name, 0) + factor * (b.astype(np.float64) @ a.astype(np.float64))
    return out


def write_tiny_lora(path: Path, *, arch: str = "llama", n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                    n_head_kv: int = 2, n_ff: int = 128, n_vocab: int = 32000, rank: int = 4, alpha: float = 4.0,
                    seed: int = 1, scale: float = 0.5, name: str = "tiny-lora-test",
                    invocation_tokens: tuple[int, ...] | None = None) -> Path:
    """A LoRA adapter (``general.type = adapter``) for :func:`write_tiny_llama`'s model: the pairs of
    :func:`tiny_lora_pairs` (llama.cpp's convention: ``lora_a`` rank x n_in, ``lora_b`` n_out x rank, numpy
    order). ``n_embd`` other than the base's gives an adapter of the wrong shape; ``arch`` another
    architecture's; ``invocation_tokens`` makes it an activated LoRA (aLoRA)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_name(name)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    if invocation_tokens:
        writer.add_key_value("adapter.alora.invocation_tokens", [int(t) for t in invocation_tokens],
                             gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    pairs = tiny_lora_pairs(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                            n_vocab=n_vocab, rank=rank, seed=seed, scale=scale)
    for tensor, (a, b) in pairs.items():
        writer.add_tensor(f"{tensor}.lora_a", a)
        writer.add_tensor(f"{tensor}.lora_b", b)
    _finish(writer)
    return path


def write_tiny_control_vector(path: Path, *, n_layer: int = 2, n_embd: int = 64, seed: int = 3,
                              scale: float = 4.0, layers: tuple[int, ...] | None = None) -> Path:
    """A control vector (llama.cpp's ``cvector-generator`` layout: F32 ``direction.<layer>`` tensors,
    layers 1..n_layer-1 by default) for :func:`write_tiny_llama`'s model."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    chosen = layers if layers is not None else tuple(range(1, n_layer))
    writer.add_uint32("controlvector.layer_count", len(chosen))
    for layer in chosen:
        writer.add_tensor(f"direction.{layer}", (rng.standard_normal(n_embd) * scale).astype(np.float32))
    _finish(writer)
    return path


def _add_vit_layers(writer: gguf.GGUFWriter, w, prefix: str, *, n_layer: int, n_embd: int, n_ff: int,
                    k_bias: bool = True) -> None:
    """Pre-norm ViT / whisper encoder blocks (clip.cpp's names): LayerNorm (ones, zeros) before the
    attention and the FFN; q/k/v/out and up/down with biases (``k_bias=False``: none on attn_k, as whisper)."""
    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    for i in range(n_layer):
        blk = f"{prefix}.blk.{i}"
        writer.add_tensor(f"{blk}.ln1.weight", _ones(n_embd))
        writer.add_tensor(f"{blk}.ln1.bias", zeros(n_embd))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{blk}.{name}.weight", w(n_embd, n_embd))
            if name != "attn_k" or k_bias:
                writer.add_tensor(f"{blk}.{name}.bias", w(n_embd, scale=0.02))
        writer.add_tensor(f"{blk}.ln2.weight", _ones(n_embd))
        writer.add_tensor(f"{blk}.ln2.bias", zeros(n_embd))
        # numpy (out, in): ffn_up (n_ff, n_embd), ffn_down (n_embd, n_ff); clip.cpp swaps up/down of
        # llava-type projectors when ffn_down's ne[0] (its input width) equals n_embd, so keep n_ff != n_embd
        writer.add_tensor(f"{blk}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_up.bias", w(n_ff, scale=0.02))
        writer.add_tensor(f"{blk}.ffn_down.weight", w(n_embd, n_ff))
        writer.add_tensor(f"{blk}.ffn_down.bias", w(n_embd, scale=0.02))


def _clip_header(path: Path, name: str, modality: str, *, projector: str, n_embd: int, n_ff: int, n_layer: int,
                 n_head: int, projection_dim: int) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_string("clip.projector_type", projector)
    writer.add_bool("clip.has_vision_encoder", modality == "vision")
    writer.add_bool("clip.has_audio_encoder", modality == "audio")
    writer.add_uint32(f"clip.{modality}.embedding_length", n_embd)
    writer.add_uint32(f"clip.{modality}.feed_forward_length", n_ff)
    writer.add_uint32(f"clip.{modality}.block_count", n_layer)
    writer.add_uint32(f"clip.{modality}.projection_dim", projection_dim)
    writer.add_uint32(f"clip.{modality}.attention.head_count", n_head)
    writer.add_float32(f"clip.{modality}.attention.layer_norm_epsilon", 1e-6)
    return writer


def write_tiny_mmproj(path: Path, *, n_embd_text: int = 64, image_size: int = 32, patch_size: int = 8,
                      n_embd: int = 32, n_layer: int = 1, n_head: int = 2, n_ff: int = 64, seed: int = 0) -> Path:
    """A llava-style vision projector (``clip.projector_type = mlp``, libmtmd's PROJECTOR_TYPE_MLP)
    with random f32 weights, for :func:`write_tiny_llama`'s model (``n_embd_text`` must be the text
    model's n_embd: libmtmd refuses a mismatch when it loads the pair).

    An image becomes ``(image_size // patch_size) ** 2`` embeddings (16 by default), always, whatever
    its size: preprocessing resizes it (bicubic, aspect ratio kept) to fit an ``image_size`` square,
    centres it on a (122, 116, 104) grey background, then normalizes with mean 0.5 / std 0.5. The
    encoder is a ViT (conv patch embedding, learned positions, ``n_layer`` pre-norm blocks, all of
    them run: ``clip.vision.feature_layer = [n_layer]``) and a 2-layer GELU MLP to ``n_embd_text``.
    No begin/end-of-image marker tokens; the text model decodes the embeddings causally, at
    ordinary 1-D positions (no M-RoPE, no non-causal attention).
    """
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    rng = np.random.default_rng(seed)
    n_patches = (image_size // patch_size) ** 2
    writer = _clip_header(path, "tiny-mmproj-test", "vision", projector="mlp", n_embd=n_embd, n_ff=n_ff,
                          n_layer=n_layer, n_head=n_head, projection_dim=n_embd_text)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    # llava takes the penultimate layer by default; name the last one so all n_layer layers run
    writer.add_array("clip.vision.feature_layer", [n_layer])
    writer.add_bool("clip.use_gelu", True)

    w = _random(rng, 0.2)
    # conv2d kernel: numpy (out channels, in channels, kh, kw) = ggml ne [kw, kh, 3, n_embd]
    writer.add_tensor("v.patch_embd.weight", w(n_embd, 3, patch_size, patch_size, scale=0.1))
    writer.add_tensor("v.patch_embd.bias", w(n_embd, scale=0.02))
    writer.add_tensor("v.position_embd.weight", w(n_patches, n_embd))
    _add_vit_layers(writer, w, "v", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff)
    # mm.0 and mm.2 (weights and biases) are all required in practice: libmtmd reads n_embd_text from
    # mm.2.weight and adds both biases unconditionally
    writer.add_tensor("mm.0.weight", w(n_embd_text, n_embd))
    writer.add_tensor("mm.0.bias", w(n_embd_text, scale=0.02))
    writer.add_tensor("mm.2.weight", w(n_embd_text, n_embd_text))
    writer.add_tensor("mm.2.bias", w(n_embd_text, scale=0.02))
    _finish(writer)
    return path


def write_tiny_audio_mmproj(path: Path, *, n_embd_text: int = 64, n_mel: int = 32, n_embd: int = 32,
                            n_layer: int = 1, n_head: int = 2, n_ff: int = 64, stack_factor: int = 30,
                            n_embd_proj: int = 32, seed: int = 0) -> Path:
    """An Ultravox-style audio projector (``clip.projector_type = ultravox``) with random f32 weights,
    for :func:`write_tiny_llama`'s model (``n_embd_text``: the text model's n_embd).

    libmtmd computes the log-mel spectrogram itself (16 kHz, 25 ms window, 10 ms hop, ``n_mel`` bins;
    the filter bank is built in code, no tensor), pads the audio with 30 s of silence and encodes it in
    30 s windows of 3000 frames, dropping the last incomplete one; so a clip shorter than 30 s is one
    window, of ``1500 // stack_factor`` embeddings (50 by default). The encoder is whisper's (two
    conv1d, the second of stride 2, learned positions for 1500 frames, ``n_layer`` blocks), then
    ``stack_factor`` frames are stacked and projected (RMS norm, SwiGLU, RMS norm) to ``n_embd_text``.
    No begin/end-of-audio marker tokens; decoded causally at ordinary positions.
    ``stack_factor`` must divide 1500 (else libmtmd aborts: its token count and its graph's disagree).
    """
    if 1500 % stack_factor:
        raise ValueError(f"stack_factor {stack_factor} does not divide 1500")
    rng = np.random.default_rng(seed)
    writer = _clip_header(path, "tiny-audio-mmproj-test", "audio", projector="ultravox", n_embd=n_embd, n_ff=n_ff,
                          n_layer=n_layer, n_head=n_head, projection_dim=n_embd_text)
    writer.add_uint32("clip.audio.num_mel_bins", n_mel)
    writer.add_uint32("clip.audio.projector.stack_factor", stack_factor)

    w = _random(rng, 0.2)
    # conv1d kernels: numpy (out, in, kernel); biases (out, 1), as convert_hf_to_gguf writes whisper's
    writer.add_tensor("a.conv1d.1.weight", w(n_embd, n_mel, 3, scale=0.1))
    writer.add_tensor("a.conv1d.1.bias", w(n_embd, 1, scale=0.02))
    writer.add_tensor("a.conv1d.2.weight", w(n_embd, n_embd, 3, scale=0.1))
    writer.add_tensor("a.conv1d.2.bias", w(n_embd, 1, scale=0.02))
    writer.add_tensor("a.position_embd.weight", w(1500, n_embd, scale=0.1))
    _add_vit_layers(writer, w, "a", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, k_bias=False)
    n_stacked = n_embd * stack_factor
    writer.add_tensor("mm.a.norm_pre.weight", _ones(n_stacked))
    writer.add_tensor("mm.a.mlp.1.weight", w(2 * n_embd_proj, n_stacked, scale=0.05))  # SwiGLU: two halves
    writer.add_tensor("mm.a.norm_mid.weight", _ones(n_embd_proj))
    writer.add_tensor("mm.a.mlp.2.weight", w(n_embd_text, n_embd_proj))
    _finish(writer)
    return path


def write_tiny_gemma3_mmproj(path: Path, *, n_embd_text: int = 64, image_size: int = 32, patch_size: int = 8,
                             n_merge: int = 2, n_embd: int = 32, n_layer: int = 1, n_head: int = 2, n_ff: int = 64,
                             seed: int = 0) -> Path:
    """A Gemma-3-style vision projector (``clip.projector_type = gemma3``) with random f32 weights: a
    projector whose image embeddings libmtmd decodes with NON-causal attention (it switches the text
    context to non-causal for the image batch, whatever the text architecture).

    An image becomes ``(image_size // patch_size // n_merge) ** 2`` embeddings (4 by default), always:
    preprocessing resizes it (bilinear, aspect ratio kept) into an ``image_size`` square padded with
    black, normalized with mean 0.5 / std 0.5. The ViT's patches are average-pooled ``n_merge`` x
    ``n_merge``, RMS-normed and projected to ``n_embd_text``. libmtmd wraps them in the text
    ``<start_of_image>`` ... ``<end_of_image>`` (plain text for a vocabulary without those tokens).
    """
    side = image_size // patch_size
    if image_size % patch_size or side % n_merge:
        raise ValueError(f"image_size {image_size} / patch_size {patch_size} / n_merge {n_merge} do not divide")
    rng = np.random.default_rng(seed)
    writer = _clip_header(path, "tiny-gemma3-mmproj-test", "vision", projector="gemma3", n_embd=n_embd, n_ff=n_ff,
                          n_layer=n_layer, n_head=n_head, projection_dim=n_embd_text)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.projector.scale_factor", n_merge)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)

    w = _random(rng, 0.2)
    writer.add_tensor("v.patch_embd.weight", w(n_embd, 3, patch_size, patch_size, scale=0.1))
    writer.add_tensor("v.patch_embd.bias", w(n_embd, scale=0.02))
    writer.add_tensor("v.position_embd.weight", w(side * side, n_embd))
    _add_vit_layers(writer, w, "v", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff)
    writer.add_tensor("v.post_ln.weight", _ones(n_embd))
    writer.add_tensor("v.post_ln.bias", np.zeros(n_embd, dtype=np.float32))
    writer.add_tensor("mm.soft_emb_norm.weight", _ones(n_embd))
    # numpy (n_embd, n_embd_text): libmtmd multiplies by its transpose, and reads n_embd_text from ne[0]
    writer.add_tensor("mm.input_projection.weight", w(n_embd, n_embd_text))
    _finish(writer)
    return path


def write_tiny_qwen2vl(path: Path, vocab_path: Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                       n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 2048, seed: int = 0,
                       chat_template: str | None = None) -> Path:
    """A 2-layer ``qwen2vl`` text model with random f32 weights: a Qwen2 decoder (q/k/v biases, SwiGLU)
    whose RoPE is M-RoPE (llama_model_rope_type = LLAMA_ROPE_TYPE_MROPE), so each position is 4 numbers
    (temporal, height, width, unused) and libmtmd places an image's embeddings on a 2-D grid: an image
    chunk of nx x ny tokens advances the position by max(nx, ny) only (its n_pos, not its n_tokens).

    ``qwen2vl.rope.dimension_sections`` is required (the load fails without it); the sections split the
    head's head_dim / 2 rotary pairs among t/h/w as Qwen2-VL's [16, 24, 24, 0] does for head_dim 128.
    The output head is tied to the token embedding (no ``output.weight``: the arch falls back to
    ``token_embd``), which halves the file for a large vocabulary (qwen2's 151,936 tokens: ~39 MB).
    """
    head_dim = n_embd // n_head
    if n_embd % n_head or head_dim % 2 or head_dim < 4:
        raise ValueError(f"n_embd {n_embd} / n_head {n_head}: head_dim must be an even integer of at least 4")
    rng = np.random.default_rng(seed)
    arch = "qwen2vl"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-qwen2vl-test")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    half = head_dim // 2  # rotary pairs: t gets a quarter of them, h and w share the rest
    writer.add_array(f"{arch}.rope.dimension_sections", [half // 4, (half - half // 4) // 2,
                                                         half - half // 4 - (half - half // 4) // 2, 0])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = copy_tokenizer(writer, vocab_path)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    w = _random(rng, 0.5)
    n_embd_kv = n_head_kv * head_dim
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_q.bias", w(n_embd, scale=0.1))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_embd_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.bias", w(n_embd_kv, scale=0.1))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_embd_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.bias", w(n_embd_kv, scale=0.1))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
    _finish(writer)
    return path


def write_tiny_qwen2vl_mmproj(path: Path, *, n_embd_text: int = 64, image_size: int = 56, patch_size: int = 14,
                              n_embd: int = 32, n_layer: int = 1, n_head: int = 2, n_ff: int = 64,
                              seed: int = 0) -> Path:
    """A Qwen2-VL-style vision projector (``clip.projector_type = qwen2vl_merger``) with random f32 weights,
    for :func:`write_tiny_qwen2vl`'s model (``n_embd_text``: its n_embd); about 290 KB by default.

    Dynamic resolution: preprocessing resizes an image (bicubic, aspect ratio kept, no padding) so each side
    is a multiple of ``2 * patch_size`` (rounded), then scales it up to at least 8 and down to at most 4096
    merged tokens (libmtmd's fixed Qwen2-VL bounds, in pixels ``n * (2 * patch_size) ** 2``; a context's
    image_min/max_tokens override them); normalized with mean 0.5 / std 0.5. So with patch_size 14 a
    64 x 48 image becomes 112 x 84 pixels, 8 x 6 patches, 4 x 3 = 12 embeddings, which the M-RoPE text
    model places on a 4 x 3 grid: the chunk has n_tokens 12 and n_pos max(4, 3) = 4. ``image_size`` is
    only metadata (required); at load, libmtmd sizes its compute buffer for a fixed 46 x 46-token image
    (1288 x 1288 pixels: about 30 MiB on CPU with flash attention), without running it.

    The encoder: two conv patch embeddings without bias (``v.patch_embd.weight`` and ``.weight.1``, the
    temporal pair, summed for a still image), no learned positions (2-D M-RoPE in the ViT; head_dim
    = n_embd / n_head must be a multiple of 4), ``n_layer`` pre-LayerNorm blocks, a post LayerNorm; then
    the 2 x 2 patch merger: 4 x n_embd -> GELU MLP (``mm.0``, ``mm.2``) -> ``n_embd_text``. libmtmd wraps
    the embeddings in the text ``<|vision_start|>`` ... ``<|vision_end|>``. (``n_ff == n_embd`` would make
    libmtmd swap the blocks' ffn_up / ffn_down, as for legacy conversions: harmless here, both square.)
    """
    if n_embd % n_head or (n_embd // n_head) % 4:
        # else the ViT's rope (head_dim / 2 dims) is odd: libmtmd aborts at the first encode, not at load
        raise ValueError(f"n_embd {n_embd} / n_head {n_head}: head_dim must be an integer multiple of 4")
    rng = np.random.default_rng(seed)
    writer = _clip_header(path, "tiny-qwen2vl-mmproj-test", "vision", projector="qwen2vl_merger", n_embd=n_embd,
                          n_ff=n_ff, n_layer=n_layer, n_head=n_head, projection_dim=n_embd_text)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.spatial_merge_size", 2)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)

    w = _random(rng, 0.2)
    # two conv2d kernels, numpy (n_embd, 3, kh, kw); qwen2vl asserts there is no patch bias
    writer.add_tensor("v.patch_embd.weight", w(n_embd, 3, patch_size, patch_size, scale=0.05))
    writer.add_tensor("v.patch_embd.weight.1", w(n_embd, 3, patch_size, patch_size, scale=0.05))
    _add_vit_layers(writer, w, "v", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff)
    writer.add_tensor("v.post_ln.weight", _ones(n_embd))
    writer.add_tensor("v.post_ln.bias", np.zeros(n_embd, dtype=np.float32))
    # the merger: 2 x 2 neighbouring patches concatenated (4 * n_embd), numpy (out, in); libmtmd reads
    # n_embd_text from mm.2.bias
    n_merged = 4 * n_embd
    writer.add_tensor("mm.0.weight", w(n_merged, n_merged, scale=0.1))
    writer.add_tensor("mm.0.bias", w(n_merged, scale=0.02))
    writer.add_tensor("mm.2.weight", w(n_embd_text, n_merged, scale=0.1))
    writer.add_tensor("mm.2.bias", w(n_embd_text, scale=0.02))
    _finish(writer)
    return path
