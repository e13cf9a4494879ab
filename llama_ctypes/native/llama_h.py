"""ctypes mirror of llama.cpp's ``include/llama.h`` (the part llama_ctypes uses).

Declarations only: structs, enum values and function prototypes, each function
with its C signature beside it. Layouts are checked against the native library
at load time (see ``layout.py``). Deprecated and training functions are left out.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    Union,
    c_bool,
    c_char,
    c_char_p,
    c_double,
    c_float,
    c_int8,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)

from .ggml_h import ggml_abort_callback, ggml_backend_sched_eval_callback, ggml_log_callback

# ---- scalar typedefs ------------------------------------------------------------
llama_pos = c_int32
llama_token = c_int32
llama_seq_id = c_int32
llama_state_seq_flags = c_uint32

# Opaque handles: typed void pointers so that one cannot be passed for another.
class _Opaque(Structure):
    _fields_: list = []


class llama_model(_Opaque): ...
class llama_context(_Opaque): ...
class llama_vocab(_Opaque): ...
class llama_memory_i(_Opaque): ...
class llama_adapter_lora(_Opaque): ...
class llama_batch_ext(_Opaque): ...


llama_model_p = POINTER(llama_model)
llama_context_p = POINTER(llama_context)
llama_vocab_p = POINTER(llama_vocab)
llama_memory_t = POINTER(llama_memory_i)
llama_adapter_lora_p = POINTER(llama_adapter_lora)
llama_batch_ext_p = POINTER(llama_batch_ext)
llama_sampler_p = c_void_p  # struct llama_sampler * (only ever handled as a pointer)

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_TOKEN_NULL = -1

# ---- enums (values as in llama.h) -----------------------------------------------
# enum llama_vocab_type
LLAMA_VOCAB_TYPE_NONE, LLAMA_VOCAB_TYPE_SPM, LLAMA_VOCAB_TYPE_BPE, LLAMA_VOCAB_TYPE_WPM = 0, 1, 2, 3
LLAMA_VOCAB_TYPE_UGM, LLAMA_VOCAB_TYPE_RWKV, LLAMA_VOCAB_TYPE_PLAMO2 = 4, 5, 6

# enum llama_rope_type
LLAMA_ROPE_TYPE_NONE = -1
LLAMA_ROPE_TYPE_NORM = 0
LLAMA_ROPE_TYPE_NEOX = 2
LLAMA_ROPE_TYPE_MROPE = 8
LLAMA_ROPE_TYPE_IMROPE = 40
LLAMA_ROPE_TYPE_VISION = 24

# enum llama_token_attr (bit flags)
LLAMA_TOKEN_ATTR_CONTROL = 1 << 3

# enum llama_rope_scaling_type
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1
LLAMA_ROPE_SCALING_TYPE_NONE = 0
LLAMA_ROPE_SCALING_TYPE_LINEAR = 1
LLAMA_ROPE_SCALING_TYPE_YARN = 2
LLAMA_ROPE_SCALING_TYPE_LONGROPE = 3

# enum llama_pooling_type
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_POOLING_TYPE_MEAN = 1
LLAMA_POOLING_TYPE_CLS = 2
LLAMA_POOLING_TYPE_LAST = 3
LLAMA_POOLING_TYPE_RANK = 4

# enum llama_attention_type
LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1
LLAMA_ATTENTION_TYPE_CAUSAL = 0
LLAMA_ATTENTION_TYPE_NON_CAUSAL = 1

# enum llama_flash_attn_type
LLAMA_FLASH_ATTN_TYPE_AUTO = -1
LLAMA_FLASH_ATTN_TYPE_DISABLED = 0
LLAMA_FLASH_ATTN_TYPE_ENABLED = 1

# enum llama_split_mode
LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW, LLAMA_SPLIT_MODE_TENSOR = 0, 1, 2, 3

# enum llama_load_mode
LLAMA_LOAD_MODE_AUTO = -1
LLAMA_LOAD_MODE_NONE = 0
LLAMA_LOAD_MODE_MMAP = 1
LLAMA_LOAD_MODE_MLOCK = 2
LLAMA_LOAD_MODE_MMAP_MLOCK = 3
LLAMA_LOAD_MODE_DIRECT_IO = 4

# enum llama_lazy_mode
LLAMA_LAZY_MODE_OFF, LLAMA_LAZY_MODE_AUTO, LLAMA_LAZY_MODE_ON = 0, 1, 2

# enum llama_context_type
LLAMA_CONTEXT_TYPE_DEFAULT, LLAMA_CONTEXT_TYPE_MTP = 0, 1

# enum llama_process_type
LLAMA_PROCESS_TYPE_ENCODE, LLAMA_PROCESS_TYPE_DECODE = 0, 1

# enum llama_model_kv_override_type
LLAMA_KV_OVERRIDE_TYPE_INT, LLAMA_KV_OVERRIDE_TYPE_FLOAT, LLAMA_KV_OVERRIDE_TYPE_BOOL, LLAMA_KV_OVERRIDE_TYPE_STR = 0, 1, 2, 3

# ---- structs ----------------------------------------------------------------------
llama_progress_callback = CFUNCTYPE(c_bool, c_float, c_void_p)


class llama_token_data(Structure):
    _fields_ = [
        ("id", llama_token),
        ("logit", c_float),
        ("p", c_float),
    ]


class llama_token_data_array(Structure):
    _fields_ = [
        ("data", POINTER(llama_token_data)),
        ("size", c_size_t),
        ("selected", c_int64),
        ("sorted", c_bool),
    ]


class llama_batch(Structure):
    _fields_ = [
        ("n_tokens", c_int32),
        ("token", POINTER(llama_token)),
        ("embd", POINTER(c_float)),
        ("pos", POINTER(llama_pos)),
        ("n_seq_id", POINTER(c_int32)),
        ("seq_id", POINTER(POINTER(llama_seq_id))),
        ("logits", POINTER(c_int8)),
    ]


class _llama_model_kv_override_value(Union):
    _fields_ = [
        ("val_i64", c_int64),
        ("val_f64", c_double),
        ("val_bool", c_bool),
        ("val_str", c_char * 128),
    ]


class llama_model_kv_override(Structure):
    _anonymous_ = ("value",)
    _fields_ = [
        ("tag", c_int32),
        ("key", c_char * 128),
        ("value", _llama_model_kv_override_value),
    ]


class llama_model_tensor_buft_override(Structure):
    _fields_ = [
        ("pattern", c_char_p),
        ("buft", c_void_p),
    ]


class llama_model_params(Structure):
    _fields_ = [
        ("devices", POINTER(c_void_p)),  # NULL-terminated ggml_backend_dev_t list
        ("tensor_buft_overrides", POINTER(llama_model_tensor_buft_override)),
        ("n_gpu_layers", c_int32),
        ("split_mode", c_int32),
        ("load_mode", c_int32),
        ("lazy_mode", c_int32),
        ("main_gpu", c_int32),
        ("tensor_split", POINTER(c_float)),
        ("progress_callback", llama_progress_callback),
        ("progress_callback_user_data", c_void_p),
        ("kv_overrides", POINTER(llama_model_kv_override)),
        ("vocab_only", c_bool),
        ("check_tensors", c_bool),
        ("use_extra_bufts", c_bool),
        ("no_host", c_bool),
        ("no_alloc", c_bool),
        ("load_mtp", c_bool),
    ]


class llama_sampler_seq_config(Structure):
    _fields_ = [
        ("seq_id", llama_seq_id),
        ("sampler", llama_sampler_p),
    ]


class llama_context_params(Structure):
    _fields_ = [
        ("n_ctx", c_uint32),
        ("n_batch", c_uint32),
        ("n_ubatch", c_uint32),
        ("n_seq_max", c_uint32),
        ("n_rs_seq", c_uint32),
        ("n_outputs_max", c_uint32),
        ("n_outputs_max_per_seq", c_uint32),
        ("n_threads", c_int32),
        ("n_threads_batch", c_int32),
        ("ctx_type", c_int32),
        ("rope_scaling_type", c_int32),
        ("pooling_type", c_int32),
        ("attention_type", c_int32),
        ("flash_attn_type", c_int32),
        ("rope_freq_base", c_float),
        ("rope_freq_scale", c_float),
        ("yarn_ext_factor", c_float),
        ("yarn_attn_factor", c_float),
        ("yarn_beta_fast", c_float),
        ("yarn_beta_slow", c_float),
        ("yarn_orig_ctx", c_uint32),
        ("defrag_thold", c_float),
        ("cb_eval", ggml_backend_sched_eval_callback),
        ("cb_eval_user_data", c_void_p),
        ("type_k", c_int32),
        ("type_v", c_int32),
        ("abort_callback", ggml_abort_callback),
        ("abort_callback_data", c_void_p),
        ("embeddings", c_bool),
        ("offload_kqv", c_bool),
        ("no_perf", c_bool),
        ("op_offload", c_bool),
        ("swa_full", c_bool),
        ("kv_unified", c_bool),
        ("samplers", POINTER(llama_sampler_seq_config)),
        ("n_samplers", c_size_t),
        ("ctx_other", llama_context_p),
    ]


class llama_logit_bias(Structure):
    _fields_ = [
        ("token", llama_token),
        ("bias", c_float),
    ]


class llama_sampler_chain_params(Structure):
    _fields_ = [("no_perf", c_bool)]


class llama_chat_message(Structure):
    _fields_ = [
        ("role", c_char_p),
        ("content", c_char_p),
    ]


class llama_perf_context_data(Structure):
    _fields_ = [
        ("t_start_ms", c_double),
        ("t_load_ms", c_double),
        ("t_p_eval_ms", c_double),
        ("t_eval_ms", c_double),
        ("n_p_eval", c_int32),
        ("n_eval", c_int32),
        ("n_reused", c_int32),
    ]


class llama_perf_sampler_data(Structure):
    _fields_ = [
        ("t_sample_ms", c_double),
        ("n_sample", c_int32),
    ]


class llama_embd(Structure):
    """Rows of embeddings for the extended batch API, passed by value.

    Not in ``STRUCTS``: the adapter's layout table predates it (its layout, a pointer and two
    ``size_t``, has no padding to get wrong: 24 bytes on LP64, 12 on 32-bit).
    """

    _fields_ = [
        ("data", c_void_p),  # const float * (an address: the rows are copied during the call)
        ("n_rows", c_size_t),
        ("n_embd", c_size_t),
    ]


# Structs whose layout is checked against the adapter's table, by C name.
STRUCTS = {
    "llama_token_data": llama_token_data,
    "llama_token_data_array": llama_token_data_array,
    "llama_batch": llama_batch,
    "llama_model_kv_override": llama_model_kv_override,
    "llama_model_tensor_buft_override": llama_model_tensor_buft_override,
    "llama_model_params": llama_model_params,
    "llama_sampler_seq_config": llama_sampler_seq_config,
    "llama_context_params": llama_context_params,
    "llama_logit_bias": llama_logit_bias,
    "llama_sampler_chain_params": llama_sampler_chain_params,
    "llama_chat_message": llama_chat_message,
    "llama_perf_context_data": llama_perf_context_data,
    "llama_perf_sampler_data": llama_perf_sampler_data,
}

_p_token = POINTER(llama_token)
_p_char_p = POINTER(c_char_p)

# ---- functions: (name, argtypes, restype) -----------------------------------------
PROTOTYPES = [
    # const char * llama_version(void);
    ("llama_version", [], c_char_p),
    # struct llama_model_params llama_model_default_params(void);
    ("llama_model_default_params", [], llama_model_params),
    # struct llama_context_params llama_context_default_params(void);
    ("llama_context_default_params", [], llama_context_params),
    # struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
    ("llama_sampler_chain_default_params", [], llama_sampler_chain_params),
    # void llama_backend_init(void);
    ("llama_backend_init", [], None),
    # void llama_backend_free(void);
    ("llama_backend_free", [], None),
    # void llama_numa_init(enum ggml_numa_strategy numa);
    ("llama_numa_init", [c_int32], None),
    # const char * llama_ftype_name(enum llama_ftype ftype);
    ("llama_ftype_name", [c_int32], c_char_p),
    # const char * llama_flash_attn_type_name(enum llama_flash_attn_type flash_attn_type);
    ("llama_flash_attn_type_name", [c_int32], c_char_p),
    # struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
    ("llama_model_load_from_file", [c_char_p, llama_model_params], llama_model_p),
    # struct llama_model * llama_model_load_from_splits(const char ** paths, size_t n_paths, struct llama_model_params params);
    ("llama_model_load_from_splits", [_p_char_p, c_size_t, llama_model_params], llama_model_p),
    # void llama_model_save_to_file(const struct llama_model * model, const char * path_model);
    ("llama_model_save_to_file", [llama_model_p, c_char_p], None),
    # void llama_model_free(struct llama_model * model);
    ("llama_model_free", [llama_model_p], None),
    # struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
    ("llama_init_from_model", [llama_model_p, llama_context_params], llama_context_p),
    # void llama_free(struct llama_context * ctx);
    ("llama_free", [llama_context_p], None),
    # int64_t llama_time_us(void);
    ("llama_time_us", [], c_int64),
    # size_t llama_max_devices(void);
    ("llama_max_devices", [], c_size_t),
    # size_t llama_max_parallel_sequences(void);
    ("llama_max_parallel_sequences", [], c_size_t),
    # bool llama_supports_mmap(void);
    ("llama_supports_mmap", [], c_bool),
    # bool llama_supports_mlock(void);
    ("llama_supports_mlock", [], c_bool),
    # bool llama_supports_gpu_offload(void);
    ("llama_supports_gpu_offload", [], c_bool),
    # bool llama_supports_rpc(void);
    ("llama_supports_rpc", [], c_bool),
    # uint32_t llama_n_ctx(const struct llama_context * ctx);
    ("llama_n_ctx", [llama_context_p], c_uint32),
    # uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
    ("llama_n_ctx_seq", [llama_context_p], c_uint32),
    # uint32_t llama_n_batch(const struct llama_context * ctx);
    ("llama_n_batch", [llama_context_p], c_uint32),
    # uint32_t llama_n_ubatch(const struct llama_context * ctx);
    ("llama_n_ubatch", [llama_context_p], c_uint32),
    # uint32_t llama_n_seq_max(const struct llama_context * ctx);
    ("llama_n_seq_max", [llama_context_p], c_uint32),
    # uint32_t llama_n_rs_seq(const struct llama_context * ctx);
    ("llama_n_rs_seq", [llama_context_p], c_uint32),
    # const struct llama_model * llama_get_model(const struct llama_context * ctx);
    ("llama_get_model", [llama_context_p], llama_model_p),
    # llama_memory_t llama_get_memory(const struct llama_context * ctx);
    ("llama_get_memory", [llama_context_p], llama_memory_t),
    # enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);
    ("llama_pooling_type", [llama_context_p], c_int32),
    # const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
    ("llama_model_get_vocab", [llama_model_p], llama_vocab_p),
    # enum llama_rope_type llama_model_rope_type(const struct llama_model * model);
    ("llama_model_rope_type", [llama_model_p], c_int32),
    # int32_t llama_model_n_ctx_train(const struct llama_model * model);
    ("llama_model_n_ctx_train", [llama_model_p], c_int32),
    # int32_t llama_model_n_embd(const struct llama_model * model);
    ("llama_model_n_embd", [llama_model_p], c_int32),
    # int32_t llama_model_n_embd_inp(const struct llama_model * model);
    ("llama_model_n_embd_inp", [llama_model_p], c_int32),
    # int32_t llama_model_n_embd_out(const struct llama_model * model);
    ("llama_model_n_embd_out", [llama_model_p], c_int32),
    # int32_t llama_model_n_layer(const struct llama_model * model);
    ("llama_model_n_layer", [llama_model_p], c_int32),
    # int32_t llama_model_n_layer_nextn(const struct llama_model * model);
    ("llama_model_n_layer_nextn", [llama_model_p], c_int32),
    # int32_t llama_model_n_head(const struct llama_model * model);
    ("llama_model_n_head", [llama_model_p], c_int32),
    # int32_t llama_model_n_head_kv(const struct llama_model * model);
    ("llama_model_n_head_kv", [llama_model_p], c_int32),
    # int32_t llama_model_n_swa(const struct llama_model * model);
    ("llama_model_n_swa", [llama_model_p], c_int32),
    # float llama_model_rope_freq_scale_train(const struct llama_model * model);
    ("llama_model_rope_freq_scale_train", [llama_model_p], c_float),
    # uint32_t llama_model_n_cls_out(const struct llama_model * model);
    ("llama_model_n_cls_out", [llama_model_p], c_uint32),
    # const char * llama_model_cls_label(const struct llama_model * model, uint32_t i);
    ("llama_model_cls_label", [llama_model_p, c_uint32], c_char_p),
    # enum llama_vocab_type llama_vocab_type(const struct llama_vocab * vocab);
    ("llama_vocab_type", [llama_vocab_p], c_int32),
    # int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
    ("llama_vocab_n_tokens", [llama_vocab_p], c_int32),
    # int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
    ("llama_model_meta_val_str", [llama_model_p, c_char_p, c_char_p, c_size_t], c_int32),
    # int32_t llama_model_meta_count(const struct llama_model * model);
    ("llama_model_meta_count", [llama_model_p], c_int32),
    # int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
    ("llama_model_meta_key_by_index", [llama_model_p, c_int32, c_char_p, c_size_t], c_int32),
    # int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
    ("llama_model_meta_val_str_by_index", [llama_model_p, c_int32, c_char_p, c_size_t], c_int32),
    # int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
    ("llama_model_desc", [llama_model_p, c_char_p, c_size_t], c_int32),
    # enum llama_ftype llama_model_ftype(const struct llama_model * model);
    ("llama_model_ftype", [llama_model_p], c_int32),
    # uint64_t llama_model_size(const struct llama_model * model);
    ("llama_model_size", [llama_model_p], c_uint64),
    # const char * llama_model_chat_template(const struct llama_model * model, const char * name);
    ("llama_model_chat_template", [llama_model_p, c_char_p], c_char_p),
    # uint64_t llama_model_n_params(const struct llama_model * model);
    ("llama_model_n_params", [llama_model_p], c_uint64),
    # bool llama_model_has_encoder(const struct llama_model * model);
    ("llama_model_has_encoder", [llama_model_p], c_bool),
    # bool llama_model_has_decoder(const struct llama_model * model);
    ("llama_model_has_decoder", [llama_model_p], c_bool),
    # llama_token llama_model_decoder_start_token(const struct llama_model * model);
    ("llama_model_decoder_start_token", [llama_model_p], llama_token),
    # bool llama_model_is_recurrent(const struct llama_model * model);
    ("llama_model_is_recurrent", [llama_model_p], c_bool),
    # bool llama_model_is_hybrid(const struct llama_model * model);
    ("llama_model_is_hybrid", [llama_model_p], c_bool),
    # bool llama_model_is_diffusion(const struct llama_model * model);
    ("llama_model_is_diffusion", [llama_model_p], c_bool),
    # struct llama_adapter_lora * llama_adapter_lora_init(struct llama_model * model, const char * path_lora);
    ("llama_adapter_lora_init", [llama_model_p, c_char_p], llama_adapter_lora_p),
    # void llama_adapter_lora_free(struct llama_adapter_lora * adapter);
    ("llama_adapter_lora_free", [llama_adapter_lora_p], None),
    # int32_t llama_adapter_meta_val_str(const struct llama_adapter_lora * adapter, const char * key, char * buf, size_t buf_size);
    ("llama_adapter_meta_val_str", [llama_adapter_lora_p, c_char_p, c_char_p, c_size_t], c_int32),
    # int32_t llama_adapter_meta_count(const struct llama_adapter_lora * adapter);
    ("llama_adapter_meta_count", [llama_adapter_lora_p], c_int32),
    # int32_t llama_adapter_meta_key_by_index(const struct llama_adapter_lora * adapter, int32_t i, char * buf, size_t buf_size);
    ("llama_adapter_meta_key_by_index", [llama_adapter_lora_p, c_int32, c_char_p, c_size_t], c_int32),
    # int32_t llama_adapter_meta_val_str_by_index(const struct llama_adapter_lora * adapter, int32_t i, char * buf, size_t buf_size);
    ("llama_adapter_meta_val_str_by_index", [llama_adapter_lora_p, c_int32, c_char_p, c_size_t], c_int32),
    # uint64_t llama_adapter_get_alora_n_invocation_tokens(const struct llama_adapter_lora * adapter);
    ("llama_adapter_get_alora_n_invocation_tokens", [llama_adapter_lora_p], c_uint64),
    # const llama_token * llama_adapter_get_alora_invocation_tokens(const struct llama_adapter_lora * adapter);
    ("llama_adapter_get_alora_invocation_tokens", [llama_adapter_lora_p], _p_token),
    # int32_t llama_set_adapters_lora(struct llama_context * ctx, struct llama_adapter_lora ** adapters, size_t n_adapters, float * scales);
    ("llama_set_adapters_lora", [llama_context_p, POINTER(llama_adapter_lora_p), c_size_t, POINTER(c_float)], c_int32),
    # int32_t llama_set_adapter_cvec(struct llama_context * ctx, const float * data, size_t len, int32_t n_embd, int32_t il_start, int32_t il_end);
    ("llama_set_adapter_cvec", [llama_context_p, POINTER(c_float), c_size_t, c_int32, c_int32, c_int32], c_int32),
    # void llama_memory_clear(llama_memory_t mem, bool data);
    ("llama_memory_clear", [llama_memory_t, c_bool], None),
    # bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    ("llama_memory_seq_rm", [llama_memory_t, llama_seq_id, llama_pos, llama_pos], c_bool),
    # void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
    ("llama_memory_seq_cp", [llama_memory_t, llama_seq_id, llama_seq_id, llama_pos, llama_pos], None),
    # void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
    ("llama_memory_seq_keep", [llama_memory_t, llama_seq_id], None),
    # void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
    ("llama_memory_seq_add", [llama_memory_t, llama_seq_id, llama_pos, llama_pos, llama_pos], None),
    # void llama_memory_seq_div(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d);
    ("llama_memory_seq_div", [llama_memory_t, llama_seq_id, llama_pos, llama_pos, c_int32], None),
    # llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
    ("llama_memory_seq_pos_min", [llama_memory_t, llama_seq_id], llama_pos),
    # llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
    ("llama_memory_seq_pos_max", [llama_memory_t, llama_seq_id], llama_pos),
    # bool llama_memory_can_shift(llama_memory_t mem);
    ("llama_memory_can_shift", [llama_memory_t], c_bool),
    # size_t llama_state_get_size(struct llama_context * ctx);
    ("llama_state_get_size", [llama_context_p], c_size_t),
    # size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
    ("llama_state_get_data", [llama_context_p, POINTER(c_uint8), c_size_t], c_size_t),
    # size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
    ("llama_state_set_data", [llama_context_p, POINTER(c_uint8), c_size_t], c_size_t),
    # size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
    ("llama_state_seq_get_size", [llama_context_p, llama_seq_id], c_size_t),
    # size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
    ("llama_state_seq_get_data", [llama_context_p, POINTER(c_uint8), c_size_t, llama_seq_id], c_size_t),
    # size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
    ("llama_state_seq_set_data", [llama_context_p, POINTER(c_uint8), c_size_t, llama_seq_id], c_size_t),
    # size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
    ("llama_state_seq_get_size_ext", [llama_context_p, llama_seq_id, llama_state_seq_flags], c_size_t),
    # size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, llama_state_seq_flags flags);
    ("llama_state_seq_get_data_ext", [llama_context_p, POINTER(c_uint8), c_size_t, llama_seq_id, llama_state_seq_flags], c_size_t),
    # size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id, llama_state_seq_flags flags);
    ("llama_state_seq_set_data_ext", [llama_context_p, POINTER(c_uint8), c_size_t, llama_seq_id, llama_state_seq_flags], c_size_t),
    # struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
    ("llama_batch_init", [c_int32, c_int32, c_int32], llama_batch),
    # void llama_batch_free(struct llama_batch batch);
    ("llama_batch_free", [llama_batch], None),
    # int32_t llama_encode(struct llama_context * ctx, struct llama_batch batch);
    ("llama_encode", [llama_context_p, llama_batch], c_int32),
    # int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
    ("llama_decode", [llama_context_p, llama_batch], c_int32),
    # struct llama_batch_ext * llama_batch_ext_init(struct llama_context * ctx);
    ("llama_batch_ext_init", [llama_context_p], llama_batch_ext_p),
    # void llama_batch_ext_free(struct llama_batch_ext * batch);
    ("llama_batch_ext_free", [llama_batch_ext_p], None),
    # void llama_batch_ext_clear(struct llama_batch_ext * batch);
    ("llama_batch_ext_clear", [llama_batch_ext_p], None),
    # int32_t llama_batch_ext_add(struct llama_batch_ext * batch, llama_seq_id seq_id);
    ("llama_batch_ext_add", [llama_batch_ext_p, llama_seq_id], c_int32),
    # int32_t llama_batch_ext_add_token(struct llama_batch_ext * batch, llama_seq_id seq_id, llama_token id);
    ("llama_batch_ext_add_token", [llama_batch_ext_p, llama_seq_id, llama_token], c_int32),
    # int32_t llama_batch_ext_add_embd(struct llama_batch_ext * batch, llama_seq_id seq_id, struct llama_embd embd);
    ("llama_batch_ext_add_embd", [llama_batch_ext_p, llama_seq_id, llama_embd], c_int32),
    # bool llama_batch_ext_add_seq(struct llama_batch_ext * batch, int32_t idx, llama_seq_id seq_id);
    ("llama_batch_ext_add_seq", [llama_batch_ext_p, c_int32, llama_seq_id], c_bool),
    # bool llama_batch_ext_set_embd_token(struct llama_batch_ext * batch, int32_t idx, struct llama_embd embd);
    ("llama_batch_ext_set_embd_token", [llama_batch_ext_p, c_int32, llama_embd], c_bool),
    # bool llama_batch_ext_set_embd_state(struct llama_batch_ext * batch, int32_t idx, struct llama_embd embd);
    # (a stub that returns false in the pinned llama.cpp: an MTP context takes its state row
    # through llama_batch_ext_set_embd_token, as common_batch::set_embd does)
    ("llama_batch_ext_set_embd_state", [llama_batch_ext_p, c_int32, llama_embd], c_bool),
    # bool llama_batch_ext_set_output_embd(struct llama_batch_ext * batch, int32_t idx, bool value);
    ("llama_batch_ext_set_output_embd", [llama_batch_ext_p, c_int32, c_bool], c_bool),
    # bool llama_batch_ext_set_output_logits(struct llama_batch_ext * batch, int32_t idx, bool value);
    ("llama_batch_ext_set_output_logits", [llama_batch_ext_p, c_int32, c_bool], c_bool),
    # bool llama_batch_ext_set_pos(struct llama_batch_ext * batch, int32_t idx, const llama_pos * pos);
    ("llama_batch_ext_set_pos", [llama_batch_ext_p, c_int32, POINTER(llama_pos)], c_bool),
    # int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch);
    ("llama_process", [llama_context_p, c_int32, llama_batch_ext_p], c_int32),
    # void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
    ("llama_set_n_threads", [llama_context_p, c_int32, c_int32], None),
    # int32_t llama_n_threads(struct llama_context * ctx);
    ("llama_n_threads", [llama_context_p], c_int32),
    # int32_t llama_n_threads_batch(struct llama_context * ctx);
    ("llama_n_threads_batch", [llama_context_p], c_int32),
    # void llama_set_embeddings(struct llama_context * ctx, bool embeddings);
    ("llama_set_embeddings", [llama_context_p, c_bool], None),
    # void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);
    ("llama_set_causal_attn", [llama_context_p, c_bool], None),
    # void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
    ("llama_set_abort_callback", [llama_context_p, ggml_abort_callback, c_void_p], None),
    # void llama_synchronize(struct llama_context * ctx);
    ("llama_synchronize", [llama_context_p], None),
    # float * llama_get_logits(struct llama_context * ctx);
    ("llama_get_logits", [llama_context_p], POINTER(c_float)),
    # float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_logits_ith", [llama_context_p, c_int32], POINTER(c_float)),
    # backend sampling [EXPERIMENTAL]: tokens sampled inside the graph by a chain attached per sequence
    # bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
    ("llama_set_sampler", [llama_context_p, llama_seq_id, llama_sampler_p], c_bool),
    # llama_token llama_get_sampled_token_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_sampled_token_ith", [llama_context_p, c_int32], llama_token),
    # float * llama_get_sampled_probs_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_sampled_probs_ith", [llama_context_p, c_int32], POINTER(c_float)),
    # uint32_t llama_get_sampled_probs_count_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_sampled_probs_count_ith", [llama_context_p, c_int32], c_uint32),
    # uint32_t llama_get_sampled_logits_count_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_sampled_logits_count_ith", [llama_context_p, c_int32], c_uint32),
    # llama_token * llama_get_sampled_candidates_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_sampled_candidates_ith", [llama_context_p, c_int32], POINTER(llama_token)),
    # uint32_t llama_get_sampled_candidates_count_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_sampled_candidates_count_ith", [llama_context_p, c_int32], c_uint32),
    # float * llama_get_embeddings(struct llama_context * ctx);
    ("llama_get_embeddings", [llama_context_p], POINTER(c_float)),
    # float * llama_get_embeddings_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_embeddings_ith", [llama_context_p, c_int32], POINTER(c_float)),
    # float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
    ("llama_get_embeddings_seq", [llama_context_p, llama_seq_id], POINTER(c_float)),
    # const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
    ("llama_vocab_get_text", [llama_vocab_p, llama_token], c_char_p),
    # float llama_vocab_get_score(const struct llama_vocab * vocab, llama_token token);
    ("llama_vocab_get_score", [llama_vocab_p, llama_token], c_float),
    # enum llama_token_attr llama_vocab_get_attr(const struct llama_vocab * vocab, llama_token token);
    ("llama_vocab_get_attr", [llama_vocab_p, llama_token], c_int32),
    # bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
    ("llama_vocab_is_eog", [llama_vocab_p, llama_token], c_bool),
    # bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
    ("llama_vocab_is_control", [llama_vocab_p, llama_token], c_bool),
    # llama_token llama_vocab_bos(const struct llama_vocab * vocab);
    ("llama_vocab_bos", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_eos(const struct llama_vocab * vocab);
    ("llama_vocab_eos", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_eot(const struct llama_vocab * vocab);
    ("llama_vocab_eot", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_sep(const struct llama_vocab * vocab);
    ("llama_vocab_sep", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_nl(const struct llama_vocab * vocab);
    ("llama_vocab_nl", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_pad(const struct llama_vocab * vocab);
    ("llama_vocab_pad", [llama_vocab_p], llama_token),
    # bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
    ("llama_vocab_get_add_bos", [llama_vocab_p], c_bool),
    # bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);
    ("llama_vocab_get_add_eos", [llama_vocab_p], c_bool),
    # bool llama_vocab_get_add_sep(const struct llama_vocab * vocab);
    ("llama_vocab_get_add_sep", [llama_vocab_p], c_bool),
    # llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab);
    ("llama_vocab_fim_pre", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_fim_suf(const struct llama_vocab * vocab);
    ("llama_vocab_fim_suf", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_fim_mid(const struct llama_vocab * vocab);
    ("llama_vocab_fim_mid", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_fim_pad(const struct llama_vocab * vocab);
    ("llama_vocab_fim_pad", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_fim_rep(const struct llama_vocab * vocab);
    ("llama_vocab_fim_rep", [llama_vocab_p], llama_token),
    # llama_token llama_vocab_fim_sep(const struct llama_vocab * vocab);
    ("llama_vocab_fim_sep", [llama_vocab_p], llama_token),
    # int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len, llama_token * tokens,
    #                        int32_t n_tokens_max, bool add_special, bool parse_special);
    ("llama_tokenize", [llama_vocab_p, c_char_p, c_int32, _p_token, c_int32, c_bool, c_bool], c_int32),
    # int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
    #                              int32_t lstrip, bool special);
    ("llama_token_to_piece", [llama_vocab_p, llama_token, c_char_p, c_int32, c_int32, c_bool], c_int32),
    # int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens, char * text,
    #                          int32_t text_len_max, bool remove_special, bool unparse_special);
    ("llama_detokenize", [llama_vocab_p, _p_token, c_int32, c_char_p, c_int32, c_bool, c_bool], c_int32),
    # int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
    #                                   bool add_ass, char * buf, int32_t length);
    ("llama_chat_apply_template", [c_char_p, POINTER(llama_chat_message), c_size_t, c_bool, c_char_p, c_int32], c_int32),
    # int32_t llama_chat_builtin_templates(const char ** output, size_t len);
    ("llama_chat_builtin_templates", [_p_char_p, c_size_t], c_int32),
    # const char * llama_sampler_name(const struct llama_sampler * smpl);
    ("llama_sampler_name", [llama_sampler_p], c_char_p),
    # void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
    ("llama_sampler_accept", [llama_sampler_p, llama_token], None),
    # void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
    ("llama_sampler_apply", [llama_sampler_p, POINTER(llama_token_data_array)], None),
    # void llama_sampler_reset(struct llama_sampler * smpl);
    ("llama_sampler_reset", [llama_sampler_p], None),
    # struct llama_sampler * llama_sampler_clone(const struct llama_sampler * smpl);
    ("llama_sampler_clone", [llama_sampler_p], llama_sampler_p),
    # void llama_sampler_copy(const struct llama_sampler * src, struct llama_sampler * dst);
    ("llama_sampler_copy", [llama_sampler_p, llama_sampler_p], None),
    # void llama_sampler_free(struct llama_sampler * smpl);
    ("llama_sampler_free", [llama_sampler_p], None),
    # struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
    ("llama_sampler_chain_init", [llama_sampler_chain_params], llama_sampler_p),
    # void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
    ("llama_sampler_chain_add", [llama_sampler_p, llama_sampler_p], None),
    # struct llama_sampler * llama_sampler_chain_get(struct llama_sampler * chain, int32_t i);
    ("llama_sampler_chain_get", [llama_sampler_p, c_int32], llama_sampler_p),
    # int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
    ("llama_sampler_chain_n", [llama_sampler_p], c_int32),
    # struct llama_sampler * llama_sampler_init_greedy(void);
    ("llama_sampler_init_greedy", [], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
    ("llama_sampler_init_dist", [c_uint32], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_top_k(int32_t k);
    ("llama_sampler_init_top_k", [c_int32], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
    ("llama_sampler_init_top_p", [c_float, c_size_t], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
    ("llama_sampler_init_min_p", [c_float, c_size_t], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_typical(float p, size_t min_keep);
    ("llama_sampler_init_typical", [c_float, c_size_t], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_temp(float t);
    ("llama_sampler_init_temp", [c_float], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_temp_ext(float t, float delta, float exponent);
    ("llama_sampler_init_temp_ext", [c_float, c_float, c_float], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_xtc(float p, float t, size_t min_keep, uint32_t seed);
    ("llama_sampler_init_xtc", [c_float, c_float, c_size_t, c_uint32], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_top_n_sigma(float n);
    ("llama_sampler_init_top_n_sigma", [c_float], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_mirostat(int32_t n_vocab, uint32_t seed, float tau, float eta, int32_t m);
    ("llama_sampler_init_mirostat", [c_int32, c_uint32, c_float, c_float, c_int32], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_mirostat_v2(uint32_t seed, float tau, float eta);
    ("llama_sampler_init_mirostat_v2", [c_uint32, c_float, c_float], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * grammar_str,
    #                                                   const char * grammar_root);
    ("llama_sampler_init_grammar", [llama_vocab_p, c_char_p, c_char_p], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_grammar_lazy_patterns(const struct llama_vocab * vocab,
    #     const char * grammar_str, const char * grammar_root, const char ** trigger_patterns,
    #     size_t num_trigger_patterns, const llama_token * trigger_tokens, size_t num_trigger_tokens);
    ("llama_sampler_init_grammar_lazy_patterns",
     [llama_vocab_p, c_char_p, c_char_p, _p_char_p, c_size_t, _p_token, c_size_t], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
    #                                                     float penalty_freq, float penalty_present);
    ("llama_sampler_init_penalties", [c_int32, c_int32, c_float, c_float, c_float], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_dry(const struct llama_vocab * vocab, float dry_multiplier, float dry_base,
    #     int32_t dry_allowed_length, int32_t dry_penalty_last_n, const char ** seq_breakers, size_t num_breakers);
    ("llama_sampler_init_dry", [llama_vocab_p, c_float, c_float, c_int32, c_int32, _p_char_p, c_size_t], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_adaptive_p(float target, float decay, uint32_t seed);
    ("llama_sampler_init_adaptive_p", [c_float, c_float, c_uint32], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
    #                                                      const llama_logit_bias * logit_bias);
    ("llama_sampler_init_logit_bias", [c_int32, c_int32, POINTER(llama_logit_bias)], llama_sampler_p),
    # struct llama_sampler * llama_sampler_init_infill(const struct llama_vocab * vocab);
    ("llama_sampler_init_infill", [llama_vocab_p], llama_sampler_p),
    # uint32_t llama_sampler_get_seed(const struct llama_sampler * smpl);
    ("llama_sampler_get_seed", [llama_sampler_p], c_uint32),
    # llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
    ("llama_sampler_sample", [llama_sampler_p, llama_context_p, c_int32], llama_token),
    # int32_t llama_split_path(char * split_path, size_t maxlen, const char * path_prefix, int32_t split_no, int32_t split_count);
    ("llama_split_path", [c_char_p, c_size_t, c_char_p, c_int32, c_int32], c_int32),
    # int32_t llama_split_prefix(char * split_prefix, size_t maxlen, const char * split_path, int32_t split_no, int32_t split_count);
    ("llama_split_prefix", [c_char_p, c_size_t, c_char_p, c_int32, c_int32], c_int32),
    # const char * llama_print_system_info(void);
    ("llama_print_system_info", [], c_char_p),
    # void llama_log_set(ggml_log_callback log_callback, void * user_data);
    ("llama_log_set", [ggml_log_callback, c_void_p], None),
    # struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
    ("llama_perf_context", [llama_context_p], llama_perf_context_data),
    # void llama_perf_context_reset(struct llama_context * ctx);
    ("llama_perf_context_reset", [llama_context_p], None),
    # struct llama_perf_sampler_data llama_perf_sampler(const struct llama_sampler * chain);
    ("llama_perf_sampler", [llama_sampler_p], llama_perf_sampler_data),
    # void llama_perf_sampler_reset(struct llama_sampler * chain);
    ("llama_perf_sampler_reset", [llama_sampler_p], None),
]

del ctypes
