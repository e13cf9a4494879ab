// Thin extern "C" adapter over the C++-only parts of llama.cpp that the
// Python side needs. No logic lives here: every function forwards to
// llama.cpp and turns C++ exceptions into error strings, because an exception
// crossing a ctypes boundary aborts the process.

#include "llama.h"
#include "llama-ext.h"        // src/: MTP hidden-state calls (C++ linkage)
#include "json.h"             // common/
#include "json-schema-to-grammar.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#if defined(_WIN32)
#    define LCX_API extern "C" __declspec(dllexport)
#else
#    define LCX_API extern "C" __attribute__((visibility("default")))
#endif

// Bump when the meaning of an lcx_* function changes.
#define LCX_ABI_VERSION 2

// One device's share of a context's memory, in bytes (llama_get_memory_breakdown).
// dev is NULL for host buffers: system RAM, pinned host memory included.
struct lcx_device_memory {
    ggml_backend_dev_t dev;
    uint64_t model;    // weights
    uint64_t context;  // KV cache / recurrent state
    uint64_t compute;  // compute buffers
};

namespace {

struct layout_entry {
    const char * type;
    const char * field;   // "" for the whole struct
    size_t       offset;
    size_t       size;
};

#define LCX_STRUCT(T)   { #T, "", 0, sizeof(T) }
#define LCX_FIELD(T, f) { #T, #f, offsetof(T, f), sizeof(((T *) nullptr)->f) }

// Every struct the Python prototypes mirror, with every field. The Python side
// compares its ctypes layout against this table at import.
const layout_entry k_layout[] = {
    LCX_STRUCT(llama_token_data),
    LCX_FIELD(llama_token_data, id),
    LCX_FIELD(llama_token_data, logit),
    LCX_FIELD(llama_token_data, p),

    LCX_STRUCT(llama_token_data_array),
    LCX_FIELD(llama_token_data_array, data),
    LCX_FIELD(llama_token_data_array, size),
    LCX_FIELD(llama_token_data_array, selected),
    LCX_FIELD(llama_token_data_array, sorted),

    LCX_STRUCT(llama_batch),
    LCX_FIELD(llama_batch, n_tokens),
    LCX_FIELD(llama_batch, token),
    LCX_FIELD(llama_batch, embd),
    LCX_FIELD(llama_batch, pos),
    LCX_FIELD(llama_batch, n_seq_id),
    LCX_FIELD(llama_batch, seq_id),
    LCX_FIELD(llama_batch, logits),

    LCX_STRUCT(llama_model_kv_override),
    LCX_FIELD(llama_model_kv_override, tag),
    LCX_FIELD(llama_model_kv_override, key),
    LCX_FIELD(llama_model_kv_override, val_i64),
    LCX_FIELD(llama_model_kv_override, val_f64),
    LCX_FIELD(llama_model_kv_override, val_bool),
    LCX_FIELD(llama_model_kv_override, val_str),

    LCX_STRUCT(llama_model_tensor_buft_override),
    LCX_FIELD(llama_model_tensor_buft_override, pattern),
    LCX_FIELD(llama_model_tensor_buft_override, buft),

    LCX_STRUCT(llama_model_params),
    LCX_FIELD(llama_model_params, devices),
    LCX_FIELD(llama_model_params, tensor_buft_overrides),
    LCX_FIELD(llama_model_params, n_gpu_layers),
    LCX_FIELD(llama_model_params, split_mode),
    LCX_FIELD(llama_model_params, load_mode),
    LCX_FIELD(llama_model_params, lazy_mode),
    LCX_FIELD(llama_model_params, main_gpu),
    LCX_FIELD(llama_model_params, tensor_split),
    LCX_FIELD(llama_model_params, progress_callback),
    LCX_FIELD(llama_model_params, progress_callback_user_data),
    LCX_FIELD(llama_model_params, kv_overrides),
    LCX_FIELD(llama_model_params, vocab_only),
    LCX_FIELD(llama_model_params, check_tensors),
    LCX_FIELD(llama_model_params, use_extra_bufts),
    LCX_FIELD(llama_model_params, no_host),
    LCX_FIELD(llama_model_params, no_alloc),
    LCX_FIELD(llama_model_params, load_mtp),

    LCX_STRUCT(llama_sampler_seq_config),
    LCX_FIELD(llama_sampler_seq_config, seq_id),
    LCX_FIELD(llama_sampler_seq_config, sampler),

    LCX_STRUCT(llama_context_params),
    LCX_FIELD(llama_context_params, n_ctx),
    LCX_FIELD(llama_context_params, n_batch),
    LCX_FIELD(llama_context_params, n_ubatch),
    LCX_FIELD(llama_context_params, n_seq_max),
    LCX_FIELD(llama_context_params, n_rs_seq),
    LCX_FIELD(llama_context_params, n_outputs_max),
    LCX_FIELD(llama_context_params, n_outputs_max_per_seq),
    LCX_FIELD(llama_context_params, n_threads),
    LCX_FIELD(llama_context_params, n_threads_batch),
    LCX_FIELD(llama_context_params, ctx_type),
    LCX_FIELD(llama_context_params, rope_scaling_type),
    LCX_FIELD(llama_context_params, pooling_type),
    LCX_FIELD(llama_context_params, attention_type),
    LCX_FIELD(llama_context_params, flash_attn_type),
    LCX_FIELD(llama_context_params, rope_freq_base),
    LCX_FIELD(llama_context_params, rope_freq_scale),
    LCX_FIELD(llama_context_params, yarn_ext_factor),
    LCX_FIELD(llama_context_params, yarn_attn_factor),
    LCX_FIELD(llama_context_params, yarn_beta_fast),
    LCX_FIELD(llama_context_params, yarn_beta_slow),
    LCX_FIELD(llama_context_params, yarn_orig_ctx),
    LCX_FIELD(llama_context_params, defrag_thold),
    LCX_FIELD(llama_context_params, cb_eval),
    LCX_FIELD(llama_context_params, cb_eval_user_data),
    LCX_FIELD(llama_context_params, type_k),
    LCX_FIELD(llama_context_params, type_v),
    LCX_FIELD(llama_context_params, abort_callback),
    LCX_FIELD(llama_context_params, abort_callback_data),
    LCX_FIELD(llama_context_params, embeddings),
    LCX_FIELD(llama_context_params, offload_kqv),
    LCX_FIELD(llama_context_params, no_perf),
    LCX_FIELD(llama_context_params, op_offload),
    LCX_FIELD(llama_context_params, swa_full),
    LCX_FIELD(llama_context_params, kv_unified),
    LCX_FIELD(llama_context_params, samplers),
    LCX_FIELD(llama_context_params, n_samplers),
    LCX_FIELD(llama_context_params, ctx_other),

    LCX_STRUCT(llama_logit_bias),
    LCX_FIELD(llama_logit_bias, token),
    LCX_FIELD(llama_logit_bias, bias),

    LCX_STRUCT(llama_sampler_chain_params),
    LCX_FIELD(llama_sampler_chain_params, no_perf),

    LCX_STRUCT(llama_chat_message),
    LCX_FIELD(llama_chat_message, role),
    LCX_FIELD(llama_chat_message, content),

    LCX_STRUCT(llama_perf_context_data),
    LCX_FIELD(llama_perf_context_data, t_start_ms),
    LCX_FIELD(llama_perf_context_data, t_load_ms),
    LCX_FIELD(llama_perf_context_data, t_p_eval_ms),
    LCX_FIELD(llama_perf_context_data, t_eval_ms),
    LCX_FIELD(llama_perf_context_data, n_p_eval),
    LCX_FIELD(llama_perf_context_data, n_eval),
    LCX_FIELD(llama_perf_context_data, n_reused),

    LCX_STRUCT(llama_perf_sampler_data),
    LCX_FIELD(llama_perf_sampler_data, t_sample_ms),
    LCX_FIELD(llama_perf_sampler_data, n_sample),

    LCX_STRUCT(ggml_backend_dev_caps),
    LCX_FIELD(ggml_backend_dev_caps, async),
    LCX_FIELD(ggml_backend_dev_caps, host_buffer),
    LCX_FIELD(ggml_backend_dev_caps, buffer_from_host_ptr),
    LCX_FIELD(ggml_backend_dev_caps, events),
    LCX_FIELD(ggml_backend_dev_caps, mmap_support),

    LCX_STRUCT(ggml_backend_dev_props),
    LCX_FIELD(ggml_backend_dev_props, name),
    LCX_FIELD(ggml_backend_dev_props, description),
    LCX_FIELD(ggml_backend_dev_props, memory_free),
    LCX_FIELD(ggml_backend_dev_props, memory_total),
    LCX_FIELD(ggml_backend_dev_props, type),
    LCX_FIELD(ggml_backend_dev_props, device_id),
    LCX_FIELD(ggml_backend_dev_props, caps),

    LCX_STRUCT(lcx_device_memory),
    LCX_FIELD(lcx_device_memory, dev),
    LCX_FIELD(lcx_device_memory, model),
    LCX_FIELD(lcx_device_memory, context),
    LCX_FIELD(lcx_device_memory, compute),
};

#undef LCX_STRUCT
#undef LCX_FIELD

char * dup_string(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out != nullptr) {
        std::memcpy(out, s.c_str(), s.size() + 1);
    }
    return out;
}

} // namespace

LCX_API int32_t lcx_abi_version(void) {
    return LCX_ABI_VERSION;
}

// ---- struct layouts ---------------------------------------------------------

LCX_API int32_t lcx_layout_count(void) {
    return static_cast<int32_t>(sizeof(k_layout) / sizeof(k_layout[0]));
}

// Returns false when i is out of range.
LCX_API bool lcx_layout_get(int32_t i, const char ** type, const char ** field, size_t * offset, size_t * size) {
    if (i < 0 || i >= lcx_layout_count()) {
        return false;
    }
    const layout_entry & e = k_layout[i];
    *type   = e.type;
    *field  = e.field;
    *offset = e.offset;
    *size   = e.size;
    return true;
}

// ---- logging -------------------------------------------------------------------

namespace {
void quiet_log(ggml_log_level, const char *, void *) {}
} // namespace

// Route llama.cpp/ggml logs to a C no-op. Used at interpreter exit, when a
// Python log callback may no longer be called safely.
LCX_API void lcx_log_set_quiet(void) {
    llama_log_set(quiet_log, nullptr);
}

// ---- strings returned to Python ---------------------------------------------

LCX_API void lcx_string_free(char * s) {
    std::free(s);
}

// ---- common: JSON schema -> GBNF ----------------------------------------------

// Returns a malloc'd GBNF string, or NULL with *error set to a malloc'd message.
// Both are released with lcx_string_free.
LCX_API char * lcx_json_schema_to_grammar(const char * schema_json, bool force_gbnf, char ** error) {
    *error = nullptr;
    try {
        const common_json schema = common_json::parse(schema_json);
        return dup_string(json_schema_to_grammar(schema, force_gbnf));
    } catch (const std::exception & e) {
        *error = dup_string(e.what());
    } catch (...) {
        *error = dup_string("unknown error in json_schema_to_grammar");
    }
    return nullptr;
}

// ---- src/llama-ext.h: MTP hidden states and model placement ------------------

LCX_API void lcx_set_embeddings_nextn(llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

LCX_API void lcx_set_nextn_layer_offset(llama_context * ctx, int32_t offset) {
    llama_set_nextn_layer_offset(ctx, offset);
}

LCX_API float * lcx_get_embeddings_nextn(llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

LCX_API float * lcx_get_embeddings_nextn_ith(llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

LCX_API llama_context * lcx_get_ctx_other(llama_context * ctx) {
    return llama_get_ctx_other(ctx);
}

LCX_API int32_t lcx_model_n_expert(const llama_model * model) {
    return llama_model_n_expert(model);
}

LCX_API int32_t lcx_model_n_devices(const llama_model * model) {
    return llama_model_n_devices(model);
}

LCX_API ggml_backend_dev_t lcx_model_get_device(const llama_model * model, int32_t i) {
    return llama_model_get_device(model, i);
}

// ---- cancellation -----------------------------------------------------------

// A ggml_abort_callback that reads a 32-bit flag owned by the Python side. ggml
// calls it before every graph node; a C function keeps that check free of the
// Python interpreter (a Python callback would take the GIL hundreds of times per
// token). Any thread may set the flag; an aligned 32-bit load is atomic on every
// platform ggml supports.
LCX_API bool lcx_abort_requested(void * flag) {
    return flag != nullptr && *static_cast<const volatile int32_t *>(flag) != 0;
}

// ---- grammar samplers -------------------------------------------------------

// llama_sampler_init_grammar(_lazy_patterns) compile the trigger patterns with std::regex,
// which throws on a pattern it cannot parse; an exception crossing into ctypes aborts the
// process, so it becomes an error string here.
LCX_API llama_sampler * lcx_sampler_init_grammar(const llama_vocab * vocab, const char * grammar_str,
                                                 const char * grammar_root, const char ** trigger_patterns,
                                                 size_t num_trigger_patterns, char ** error) {
    try {
        if (num_trigger_patterns > 0) {
            return llama_sampler_init_grammar_lazy_patterns(vocab, grammar_str, grammar_root, trigger_patterns,
                                                            num_trigger_patterns, nullptr, 0);
        }
        return llama_sampler_init_grammar(vocab, grammar_str, grammar_root);
    } catch (const std::exception & e) {
        if (error != nullptr) {
            *error = dup_string(e.what());
        }
        return nullptr;
    }
}

// ---- memory breakdown (model manager) ------------------------------------------

namespace {

// Sums a context's buffers per device; returns the number of rows (which may exceed cap).
int32_t memory_rows(const llama_context * ctx, lcx_device_memory * out, int32_t cap) {
    std::vector<lcx_device_memory> rows;
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        ggml_backend_dev_t dev = ggml_backend_buft_is_host(buft) ? nullptr : ggml_backend_buft_get_device(buft);
        lcx_device_memory * row = nullptr;
        for (auto & r : rows) {
            if (r.dev == dev) {
                row = &r;
                break;
            }
        }
        if (row == nullptr) {
            rows.push_back({dev, 0, 0, 0});
            row = &rows.back();
        }
        row->model   += mb.model;
        row->context += mb.context;
        row->compute += mb.compute;
    }
    for (size_t i = 0; i < rows.size() && static_cast<int32_t>(i) < cap; i++) {
        out[i] = rows[i];
    }
    return static_cast<int32_t>(rows.size());
}

} // namespace

// The memory a live context (and its model) holds, per device. -1 on failure.
LCX_API int32_t lcx_context_memory(const llama_context * ctx, lcx_device_memory * out, int32_t cap) {
    try {
        return memory_rows(ctx, out, cap);
    } catch (const std::exception &) {
        return -1;
    }
}

// What loading path with these parameters would take, per device, without
// allocating anything: the model and a context are created with no_alloc and
// freed again (common/fit.cpp does the same). Returns the number of rows, or
// -1 (model refused), -2 (context refused), -3 (exception).
LCX_API int32_t lcx_estimate_memory(const char * path, const llama_model_params * mparams,
                                    const llama_context_params * cparams, lcx_device_memory * out, int32_t cap) {
    try {
        llama_model_params mp = *mparams;
        mp.no_alloc  = true;
        mp.load_mode = LLAMA_LOAD_MODE_NONE;
        llama_model * model = llama_model_load_from_file(path, mp);
        if (model == nullptr) {
            return -1;
        }
        llama_context * ctx = llama_init_from_model(model, *cparams);
        if (ctx == nullptr) {
            llama_model_free(model);
            return -2;
        }
        int32_t n = memory_rows(ctx, out, cap);
        llama_free(ctx);
        llama_model_free(model);
        return n;
    } catch (const std::exception &) {
        return -3;
    }
}
