// Thin extern "C" adapter over the C++-only parts of llama.cpp that the
// Python side needs. No logic lives here: every function forwards to
// llama.cpp and turns C++ exceptions into error strings, because an exception
// crossing a ctypes boundary aborts the process.

#include "llama.h"
#include "llama-ext.h"        // src/: MTP hidden-state calls (C++ linkage)
#include "json.h"             // common/
#include "json-schema-to-grammar.h"
#include "chat.h"               // common/: chat templates, tool-call grammars and parsers
#include "ggml-backend.h"
#include "mtmd.h"               // tools/mtmd: struct layouts only (the adapter does not link libmtmd)
#include "mtmd-helper.h"

#include <algorithm>
#include <cmath>
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
#define LCX_ABI_VERSION 6

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

    LCX_STRUCT(mtmd_input_text),
    LCX_FIELD(mtmd_input_text, text),
    LCX_FIELD(mtmd_input_text, text_len),
    LCX_FIELD(mtmd_input_text, add_special),
    LCX_FIELD(mtmd_input_text, parse_special),

    LCX_STRUCT(mtmd_context_params),
    LCX_FIELD(mtmd_context_params, use_gpu),
    LCX_FIELD(mtmd_context_params, device),
    LCX_FIELD(mtmd_context_params, print_timings),
    LCX_FIELD(mtmd_context_params, n_threads),
    LCX_FIELD(mtmd_context_params, image_marker),
    LCX_FIELD(mtmd_context_params, media_marker),
    LCX_FIELD(mtmd_context_params, flash_attn_type),
    LCX_FIELD(mtmd_context_params, warmup),
    LCX_FIELD(mtmd_context_params, image_min_tokens),
    LCX_FIELD(mtmd_context_params, image_max_tokens),
    LCX_FIELD(mtmd_context_params, cb_eval),
    LCX_FIELD(mtmd_context_params, cb_eval_user_data),
    LCX_FIELD(mtmd_context_params, batch_max_tokens),
    LCX_FIELD(mtmd_context_params, progress_callback),
    LCX_FIELD(mtmd_context_params, progress_callback_user_data),

    LCX_STRUCT(mtmd_helper_video_init_params),
    LCX_FIELD(mtmd_helper_video_init_params, fps_target),
    LCX_FIELD(mtmd_helper_video_init_params, ffmpeg_bin_dir),
    LCX_FIELD(mtmd_helper_video_init_params, timestamp_interval_ms),

    LCX_STRUCT(mtmd_helper_init_opt),
    LCX_FIELD(mtmd_helper_init_opt, video_params),

    LCX_STRUCT(mtmd_helper_bitmap_wrapper),
    LCX_FIELD(mtmd_helper_bitmap_wrapper, bitmap),
    LCX_FIELD(mtmd_helper_bitmap_wrapper, video_ctx),

    LCX_STRUCT(mtmd_caps),
    LCX_FIELD(mtmd_caps, inp_vision),
    LCX_FIELD(mtmd_caps, inp_audio),

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

// The same no-op as a function pointer, for libraries with a log setter of their own (libmtmd).
LCX_API ggml_log_callback lcx_quiet_log(void) {
    return quiet_log;
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

// ---- sampler accept, exceptions caught --------------------------------------

// llama_sampler_accept, with llama.cpp's C++ exceptions turned into false and *error (a malloc'd message,
// released with lcx_string_free): a lazy grammar throws when the text from its trigger on does not fit the
// grammar, and an exception through the C frames of ctypes ends in std::terminate.
LCX_API bool lcx_sampler_accept(llama_sampler * smpl, llama_token token, char ** error) {
    *error = nullptr;
    try {
        llama_sampler_accept(smpl, token);
        return true;
    } catch (const std::exception & e) {
        *error = dup_string(e.what());
    } catch (...) {
        *error = dup_string("unknown error in llama_sampler_accept");
    }
    return false;
}

// llama_sampler_apply of a grammar sampler, its exceptions turned into false and *error as above: the
// grammar-work patch (build_scripts/patches/llama-grammar-work-bound.patch) throws when checking the
// candidates against its parse stacks would take seconds.
LCX_API bool lcx_sampler_apply(llama_sampler * smpl, llama_token_data_array * cur_p, char ** error) {
    *error = nullptr;
    try {
        llama_sampler_apply(smpl, cur_p);
        return true;
    } catch (const std::exception & e) {
        *error = dup_string(e.what());
    } catch (...) {
        *error = dup_string("unknown error in llama_sampler_apply");
    }
    return false;
}

// llama_sampler_sample of a chain whose first sampler is top_k(k), with nothing before it that reads or
// changes logits (the caller checks; k < n_vocab): the candidate array holds only the k largest logits of
// row idx, found in one pass over the row, where llama_sampler_sample first writes all n_vocab entries
// (12 bytes each: 3 MB per row of a 262k vocabulary) for top-k to cut. The chain then runs as there (its
// top-k keeps all k and sorts them), so the draw has the same distribution; of logits tied at the k-th
// place the lowest ids are kept (llama.cpp's partial sort keeps an arbitrary few). Returns the token, which
// the chain has accepted, or -1 where the row has no logits or the chain selected nothing (there
// llama_sampler_sample aborts the process) or threw.
LCX_API int32_t lcx_sampler_sample_top_k(llama_sampler * smpl, llama_context * ctx, int32_t idx, int32_t k) {
    try {
        const float * logits = llama_get_logits_ith(ctx, idx);
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        if (logits == nullptr || k <= 0 || k > n_vocab) {
            return -1;
        }
        // a heap whose front is the weakest candidate kept: the lowest logit, the highest id among equals
        const auto stronger = [](const llama_token_data & a, const llama_token_data & b) {
            return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
        };
        thread_local std::vector<llama_token_data> tls_cur;  // (one per sampling thread)
        std::vector<llama_token_data> & cur = tls_cur;       // (its address looked up once)
        cur.clear();
        cur.reserve(k);
        // A NaN logit is refused (-1): it would break the heap's order, and so which logits are kept.
        int32_t i = 0;
        for (; i < k; ++i) {
            if (std::isnan(logits[i])) {
                return -1;
            }
            cur.push_back({i, logits[i], 0.0f});
            std::push_heap(cur.begin(), cur.end(), stronger);
        }
        float floor = cur.front().logit;
        // Blocks of the row are first tested whole for any logit above the floor or NaN (one comparison,
        // !(v <= floor), that the compiler vectorizes); only the rare block that has one is walked.
        constexpr int32_t block = 64;
        while (i < n_vocab) {
            const int32_t end = std::min(n_vocab, i + block);
            int above = 0;  // (an int: a bool accumulator is not vectorized)
            if (end - i == block) {
                for (int32_t j = 0; j < block; ++j) {
                    above |= !(logits[i + j] <= floor);
                }
            } else {
                above = 1;
            }
            if (above) {
                for (int32_t j = i; j < end; ++j) {
                    const float v = logits[j];
                    if (v > floor) {  // (one equal to the floor loses to the lower id already kept)
                        std::pop_heap(cur.begin(), cur.end(), stronger);
                        cur.back() = {j, v, 0.0f};
                        std::push_heap(cur.begin(), cur.end(), stronger);
                        floor = cur.front().logit;
                    } else if (std::isnan(v)) {
                        return -1;
                    }
                }
            }
            i = end;
        }
        llama_token_data_array cur_p = {cur.data(), cur.size(), -1, false};
        llama_sampler_apply(smpl, &cur_p);
        if (cur_p.selected < 0 || cur_p.selected >= static_cast<int64_t>(cur_p.size)) {
            return -1;
        }
        const llama_token token = cur_p.data[cur_p.selected].id;
        llama_sampler_accept(smpl, token);
        return token;
    } catch (...) {
        return -1;
    }
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

// ---- common/chat: templates, tool-call grammars, output parsing ------------------
//
// The same code llama-server runs for /v1/chat/completions. Everything crosses as
// JSON text so no C++ type reaches ctypes; every exception becomes an error string.

namespace {

void set_error(char ** error, const char * what) {
    if (error != nullptr) {
        *error = dup_string(what);
    }
}

// Every trigger as a regex pattern (the grammar sampler's lazy form), as
// common/sampling.cpp converts them. A TOKEN trigger matches its piece, which the
// lazy grammar sees with special tokens rendered.
std::string trigger_pattern(const common_grammar_trigger & trigger) {
    switch (trigger.type) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:
            return regex_escape(trigger.value);
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:
            return trigger.value;
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: {
            const std::string & p = trigger.value;
            if (p.empty()) {
                return "^$";
            }
            return (p.front() != '^' ? "^" : "") + p + (p.back() != '$' ? "$" : "");
        }
    }
    throw std::runtime_error("unknown grammar trigger type");
}

} // namespace

// Chat templates of a model (model may be NULL when template_src is given).
// template_src "" = the model's own templates. Free with lcx_chat_templates_free.
LCX_API common_chat_templates * lcx_chat_templates_init(const llama_model * model, const char * template_src,
                                                        const char * bos_override, const char * eos_override,
                                                        char ** error) {
    try {
        if (model == nullptr && (template_src == nullptr || template_src[0] == '\0')) {
            set_error(error, "a template source is required without a model");
            return nullptr;
        }
        return common_chat_templates_init(model, template_src ? template_src : "", bos_override ? bos_override : "",
                                          eos_override ? eos_override : "").release();
    } catch (const std::exception & e) {
        set_error(error, e.what());
    } catch (...) {
        set_error(error, "unknown error initialising the chat templates");
    }
    return nullptr;
}

LCX_API void lcx_chat_templates_free(common_chat_templates * tmpls) {
    common_chat_templates_free(tmpls);
}

// Renders a request. inputs_json: {"messages": [OpenAI messages], "tools": [OpenAI tools],
// "tool_choice": "auto"|"none"|"required", "parallel_tool_calls": bool, "json_schema": {...},
// "grammar": str, "add_generation_prompt": bool, "enable_thinking": bool,
// "reasoning_format": "none"|"auto"|"deepseek"|"deepseek-legacy", "chat_template_kwargs": {name: value}}.
// Returns malloc'd JSON: {"format", "prompt", "grammar", "grammar_lazy", "trigger_patterns",
// "preserved_tokens", "additional_stops", "generation_prompt", "parser", "supports_thinking",
// "thinking_start_tag", "thinking_end_tags", "caps": {"supports_tool_calls": bool, ...}}, or NULL
// with *error set.
LCX_API char * lcx_chat_templates_apply(const common_chat_templates * tmpls, const char * inputs_json,
                                        char ** error) {
    try {
        const common_json in = common_json::parse(inputs_json);
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(in.value("messages", common_json::array()));
        if (in.contains("tools") && !in.at("tools").is_null()) {
            inputs.tools = common_chat_tools_parse_oaicompat(in.at("tools"));
        }
        inputs.tool_choice           = common_chat_tool_choice_parse_oaicompat(in.value("tool_choice", std::string("auto")));
        inputs.parallel_tool_calls   = in.value("parallel_tool_calls", false);
        inputs.add_generation_prompt = in.value("add_generation_prompt", true);
        inputs.enable_thinking       = in.value("enable_thinking", true);
        inputs.reasoning_format      = common_reasoning_format_from_name(in.value("reasoning_format", std::string("deepseek")));
        inputs.grammar               = in.value("grammar", std::string());
        inputs.use_jinja             = true;
        if (in.contains("json_schema") && !in.at("json_schema").is_null()) {
            inputs.json_schema = in.at("json_schema").dump();
        }
        if (in.contains("chat_template_kwargs")) {
            for (const auto & item : in.at("chat_template_kwargs").items()) {
                inputs.chat_template_kwargs[item.key()] = item.value().dump();
            }
        }
        const common_chat_params params = common_chat_templates_apply(tmpls, inputs);

        common_json out = common_json::object();
        out["format"]            = std::string(common_chat_format_name(params.format));
        out["format_id"]         = static_cast<int>(params.format);
        out["prompt"]            = params.prompt;
        out["grammar"]           = params.grammar;
        out["grammar_lazy"]      = params.grammar_lazy;
        out["generation_prompt"] = params.generation_prompt;
        out["parser"]            = params.parser;
        out["supports_thinking"] = params.supports_thinking;
        out["thinking_start_tag"] = params.thinking_start_tag;
        common_json end_tags = common_json::array();
        for (const auto & t : params.thinking_end_tags) {
            end_tags.push_back(t);
        }
        out["thinking_end_tags"] = end_tags;
        common_json triggers = common_json::array();
        for (const auto & t : params.grammar_triggers) {
            triggers.push_back(trigger_pattern(t));
        }
        out["trigger_patterns"] = triggers;
        common_json preserved = common_json::array();
        for (const auto & t : params.preserved_tokens) {
            preserved.push_back(t);
        }
        out["preserved_tokens"] = preserved;
        common_json stops = common_json::array();
        for (const auto & t : params.additional_stops) {
            stops.push_back(t);
        }
        out["additional_stops"] = stops;
        common_json caps = common_json::object();
        for (const auto & [name, value] : common_chat_templates_get_caps(tmpls)) {
            caps[name] = value;
        }
        out["caps"] = caps;
        return dup_string(out.dump());
    } catch (const std::exception & e) {
        set_error(error, e.what());
    } catch (...) {
        set_error(error, "unknown error applying the chat template");
    }
    return nullptr;
}

// A parser for one request's output, from what lcx_chat_templates_apply returned.
struct lcx_chat_parser {
    common_chat_parser_params params;
};

// params_json: {"format_id", "generation_prompt", "parser", "reasoning_format", "parse_tool_calls"}.
LCX_API lcx_chat_parser * lcx_chat_parser_init(const char * params_json, char ** error) {
    try {
        const common_json in = common_json::parse(params_json);
        auto * p = new lcx_chat_parser();
        try {
            const int format = in.value("format_id", 0);
            if (format < 0 || format >= COMMON_CHAT_FORMAT_COUNT) {
                throw std::invalid_argument("unknown chat format id");
            }
            p->params.format            = static_cast<common_chat_format>(format);
            p->params.generation_prompt = in.value("generation_prompt", std::string());
            p->params.reasoning_format  = common_reasoning_format_from_name(in.value("reasoning_format", std::string("deepseek")));
            p->params.parse_tool_calls  = in.value("parse_tool_calls", true);
            const std::string parser = in.value("parser", std::string());
            if (!parser.empty()) {
                p->params.parser.load(parser);
            }
        } catch (...) {
            delete p;
            throw;
        }
        return p;
    } catch (const std::exception & e) {
        set_error(error, e.what());
    } catch (...) {
        set_error(error, "unknown error creating the chat parser");
    }
    return nullptr;
}

LCX_API void lcx_chat_parser_free(lcx_chat_parser * parser) {
    delete parser;
}

// Parses the generated text so far (is_partial) or in full into an OpenAI message:
// malloc'd JSON {"role", "content", "reasoning_content"?, "tool_calls"?}, or NULL with *error.
LCX_API char * lcx_chat_parse(const lcx_chat_parser * parser, const char * text, bool is_partial, char ** error) {
    try {
        const common_chat_msg msg = common_chat_parse(text, is_partial, parser->params);
        return dup_string(msg.to_json_oaicompat().dump());
    } catch (const std::exception & e) {
        set_error(error, e.what());
    } catch (...) {
        set_error(error, "unknown error parsing the model's output");
    }
    return nullptr;
}
