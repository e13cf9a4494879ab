"""ctypes mirror of the llama_ctypes adapter (``build_scripts/adapter/llama_ctypes_adapter.cpp``).

The adapter is a thin ``extern "C"`` layer over C++-only llama.cpp pieces:
struct layouts, JSON-schema-to-GBNF conversion (common/), the MTP
hidden-state calls of ``src/llama-ext.h``, and a C abort callback that reads a
flag (so cancelling a decode costs no Python call per graph node), and common/chat
(templates, tool-call grammars, output parsers; JSON in and out).
"""

from __future__ import annotations

from ctypes import POINTER, Structure, c_bool, c_char_p, c_float, c_int32, c_size_t, c_uint64, c_void_p

from .llama_h import (
    llama_context_p,
    llama_context_params,
    llama_model_p,
    llama_model_params,
    llama_sampler_p,
    llama_token_data_array,
    llama_vocab_p,
)

# Must equal LCX_ABI_VERSION in the adapter.
ABI_VERSION = 6


class lcx_device_memory(Structure):
    """One device's share of a context's memory, bytes; dev is NULL for host (RAM) buffers."""

    _fields_ = [
        ("dev", c_void_p),
        ("model", c_uint64),
        ("context", c_uint64),
        ("compute", c_uint64),
    ]


# Opaque handles of common/chat.
lcx_chat_templates_p = c_void_p
lcx_chat_parser_p = c_void_p

STRUCTS = {"lcx_device_memory": lcx_device_memory}

PROTOTYPES = [
    # int32_t lcx_abi_version(void);
    ("lcx_abi_version", [], c_int32),
    # int32_t lcx_layout_count(void);
    ("lcx_layout_count", [], c_int32),
    # bool lcx_layout_get(int32_t i, const char ** type, const char ** field, size_t * offset, size_t * size);
    ("lcx_layout_get", [c_int32, POINTER(c_char_p), POINTER(c_char_p), POINTER(c_size_t), POINTER(c_size_t)], c_bool),
    # void lcx_log_set_quiet(void);
    ("lcx_log_set_quiet", [], None),
    # ggml_log_callback lcx_quiet_log(void);   (a C no-op, for libmtmd's log setter at exit)
    ("lcx_quiet_log", [], c_void_p),
    # void lcx_string_free(char * s);   (takes the raw pointer, so restype of producers is c_void_p)
    ("lcx_string_free", [c_void_p], None),
    # char * lcx_json_schema_to_grammar(const char * schema_json, bool force_gbnf, char ** error);
    ("lcx_json_schema_to_grammar", [c_char_p, c_bool, POINTER(c_void_p)], c_void_p),
    # bool lcx_sampler_accept(llama_sampler * smpl, llama_token token, char ** error);
    ("lcx_sampler_accept", [llama_sampler_p, c_int32, POINTER(c_void_p)], c_bool),
    # bool lcx_sampler_apply(llama_sampler * smpl, llama_token_data_array * cur_p, char ** error);
    ("lcx_sampler_apply", [llama_sampler_p, POINTER(llama_token_data_array), POINTER(c_void_p)], c_bool),
    # int32_t lcx_sampler_sample_top_k(llama_sampler * smpl, llama_context * ctx, int32_t idx, int32_t k);
    ("lcx_sampler_sample_top_k", [llama_sampler_p, llama_context_p, c_int32, c_int32], c_int32),
    # void lcx_set_embeddings_nextn(llama_context * ctx, bool value, bool masked);
    ("lcx_set_embeddings_nextn", [llama_context_p, c_bool, c_bool], None),
    # void lcx_set_nextn_layer_offset(llama_context * ctx, int32_t offset);
    ("lcx_set_nextn_layer_offset", [llama_context_p, c_int32], None),
    # float * lcx_get_embeddings_nextn(llama_context * ctx);
    ("lcx_get_embeddings_nextn", [llama_context_p], POINTER(c_float)),
    # float * lcx_get_embeddings_nextn_ith(llama_context * ctx, int32_t i);
    ("lcx_get_embeddings_nextn_ith", [llama_context_p, c_int32], POINTER(c_float)),
    # llama_context * lcx_get_ctx_other(llama_context * ctx);
    ("lcx_get_ctx_other", [llama_context_p], llama_context_p),
    # int32_t lcx_model_n_expert(const llama_model * model);
    ("lcx_model_n_expert", [llama_model_p], c_int32),
    # int32_t lcx_model_n_devices(const llama_model * model);
    ("lcx_model_n_devices", [llama_model_p], c_int32),
    # llama_sampler * lcx_sampler_init_grammar(const llama_vocab * vocab, const char * grammar_str,
    #     const char * grammar_root, const char ** trigger_patterns, size_t num_trigger_patterns, char ** error);
    ("lcx_sampler_init_grammar", [llama_vocab_p, c_char_p, c_char_p, POINTER(c_char_p), c_size_t, POINTER(c_void_p)],
     llama_sampler_p),
    # bool lcx_abort_requested(void * flag);   (used by address, as a ggml_abort_callback)
    ("lcx_abort_requested", [c_void_p], c_bool),
    # ggml_backend_dev_t lcx_model_get_device(const llama_model * model, int32_t i);
    ("lcx_model_get_device", [llama_model_p, c_int32], c_void_p),
    # int32_t lcx_context_memory(const llama_context * ctx, lcx_device_memory * out, int32_t cap);
    ("lcx_context_memory", [llama_context_p, POINTER(lcx_device_memory), c_int32], c_int32),
    # int32_t lcx_estimate_memory(const char * path, const llama_model_params * mparams,
    #     const llama_context_params * cparams, lcx_device_memory * out, int32_t cap);
    ("lcx_estimate_memory",
     [c_char_p, POINTER(llama_model_params), POINTER(llama_context_params), POINTER(lcx_device_memory), c_int32],
     c_int32),
    # common_chat_templates * lcx_chat_templates_init(const llama_model * model, const char * template_src,
    #     const char * bos_override, const char * eos_override, char ** error);
    ("lcx_chat_templates_init", [llama_model_p, c_char_p, c_char_p, c_char_p, POINTER(c_void_p)],
     lcx_chat_templates_p),
    # void lcx_chat_templates_free(common_chat_templates * tmpls);
    ("lcx_chat_templates_free", [lcx_chat_templates_p], None),
    # char * lcx_chat_templates_apply(const common_chat_templates * tmpls, const char * inputs_json, char ** error);
    ("lcx_chat_templates_apply", [lcx_chat_templates_p, c_char_p, POINTER(c_void_p)], c_void_p),
    # lcx_chat_parser * lcx_chat_parser_init(const char * params_json, char ** error);
    ("lcx_chat_parser_init", [c_char_p, POINTER(c_void_p)], lcx_chat_parser_p),
    # void lcx_chat_parser_free(lcx_chat_parser * parser);
    ("lcx_chat_parser_free", [lcx_chat_parser_p], None),
    # char * lcx_chat_parse(const lcx_chat_parser * parser, const char * text, bool is_partial, char ** error);
    ("lcx_chat_parse", [lcx_chat_parser_p, c_char_p, c_bool, POINTER(c_void_p)], c_void_p),
]
