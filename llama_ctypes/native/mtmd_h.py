"""ctypes mirror of llama.cpp's ``tools/mtmd/mtmd.h`` and ``mtmd-helper.h`` (libmtmd: images and audio).

Declarations only, the part llama_ctypes uses. libmtmd is loaded on first use (``NativeLibrary.mtmd()``),
not with the other libraries: a text-only program never maps it. Its structs are checked against the
adapter's layout table with the others. Handles are plain ``c_void_p``: the owners in
``core/projector.py`` and ``core/media.py`` keep each pointer with the object that frees it.
"""

from __future__ import annotations

from ctypes import POINTER, Structure, c_bool, c_char_p, c_float, c_int32, c_int64, c_size_t, c_uint32, c_void_p

from .ggml_h import ggml_log_callback
from .llama_h import llama_context_p, llama_model_p, llama_pos, llama_token

# enum mtmd_input_chunk_type
MTMD_INPUT_CHUNK_TYPE_TEXT = 0
MTMD_INPUT_CHUNK_TYPE_IMAGE = 1
MTMD_INPUT_CHUNK_TYPE_AUDIO = 2

mtmd_context_p = c_void_p
mtmd_bitmap_p = c_void_p
mtmd_input_chunk_p = c_void_p
mtmd_input_chunks_p = c_void_p


class mtmd_input_text(Structure):
    _fields_ = [
        ("text", c_char_p),
        ("text_len", c_size_t),
        ("add_special", c_bool),
        ("parse_special", c_bool),
    ]


class mtmd_context_params(Structure):
    _fields_ = [
        ("use_gpu", c_bool),
        ("device", c_void_p),  # ggml_backend_dev_t (NULL: the first GPU when use_gpu)
        ("print_timings", c_bool),
        ("n_threads", c_int32),
        ("image_marker", c_char_p),  # deprecated by media_marker
        ("media_marker", c_char_p),
        ("flash_attn_type", c_int32),  # enum llama_flash_attn_type
        ("warmup", c_bool),
        ("image_min_tokens", c_int32),
        ("image_max_tokens", c_int32),
        ("cb_eval", c_void_p),  # ggml_backend_sched_eval_callback (left NULL)
        ("cb_eval_user_data", c_void_p),
        ("batch_max_tokens", c_int32),
        ("progress_callback", c_void_p),  # mtmd_progress_callback (left NULL)
        ("progress_callback_user_data", c_void_p),
    ]


class mtmd_caps(Structure):
    _fields_ = [("inp_vision", c_bool), ("inp_audio", c_bool)]


class mtmd_helper_video_init_params(Structure):
    _fields_ = [
        ("fps_target", c_float),
        ("ffmpeg_bin_dir", c_char_p),
        ("timestamp_interval_ms", c_int64),
    ]


class mtmd_helper_init_opt(Structure):
    _fields_ = [("video_params", mtmd_helper_video_init_params)]


class mtmd_helper_bitmap_wrapper(Structure):
    _fields_ = [("bitmap", mtmd_bitmap_p), ("video_ctx", c_void_p)]


STRUCTS = {
    "mtmd_input_text": mtmd_input_text,
    "mtmd_context_params": mtmd_context_params,
    "mtmd_caps": mtmd_caps,
    "mtmd_helper_video_init_params": mtmd_helper_video_init_params,
    "mtmd_helper_init_opt": mtmd_helper_init_opt,
    "mtmd_helper_bitmap_wrapper": mtmd_helper_bitmap_wrapper,
}

PROTOTYPES = [
    # const char * mtmd_default_marker(void);
    ("mtmd_default_marker", [], c_char_p),
    # struct mtmd_context_params mtmd_context_params_default(void);
    ("mtmd_context_params_default", [], mtmd_context_params),
    # mtmd_context * mtmd_init_from_file(const char * mmproj_fname, const llama_model * text_model,
    #                                    const struct mtmd_context_params ctx_params);
    ("mtmd_init_from_file", [c_char_p, llama_model_p, mtmd_context_params], mtmd_context_p),
    # void mtmd_free(mtmd_context * ctx);
    ("mtmd_free", [mtmd_context_p], None),
    # bool mtmd_decode_use_non_causal(const mtmd_context * ctx, const mtmd_input_chunk * chunk);
    ("mtmd_decode_use_non_causal", [mtmd_context_p, mtmd_input_chunk_p], c_bool),
    # bool mtmd_decode_use_mrope(const mtmd_context * ctx);
    ("mtmd_decode_use_mrope", [mtmd_context_p], c_bool),
    # bool mtmd_support_vision(const mtmd_context * ctx);
    ("mtmd_support_vision", [mtmd_context_p], c_bool),
    # bool mtmd_support_audio(const mtmd_context * ctx);
    ("mtmd_support_audio", [mtmd_context_p], c_bool),
    # int mtmd_get_audio_sample_rate(const mtmd_context * ctx);   (-1 without audio)
    ("mtmd_get_audio_sample_rate", [mtmd_context_p], c_int32),
    # mtmd_bitmap * mtmd_bitmap_init(uint32_t nx, uint32_t ny, const unsigned char * data);   (RGB, copied)
    ("mtmd_bitmap_init", [c_uint32, c_uint32, c_void_p], mtmd_bitmap_p),
    # mtmd_bitmap * mtmd_bitmap_init_from_audio(size_t n_samples, const float * data);   (PCM F32, copied)
    ("mtmd_bitmap_init_from_audio", [c_size_t, c_void_p], mtmd_bitmap_p),
    # uint32_t mtmd_bitmap_get_nx(const mtmd_bitmap * bitmap);
    ("mtmd_bitmap_get_nx", [mtmd_bitmap_p], c_uint32),
    # uint32_t mtmd_bitmap_get_ny(const mtmd_bitmap * bitmap);
    ("mtmd_bitmap_get_ny", [mtmd_bitmap_p], c_uint32),
    # size_t mtmd_bitmap_get_n_bytes(const mtmd_bitmap * bitmap);
    ("mtmd_bitmap_get_n_bytes", [mtmd_bitmap_p], c_size_t),
    # bool mtmd_bitmap_is_audio(const mtmd_bitmap * bitmap);
    ("mtmd_bitmap_is_audio", [mtmd_bitmap_p], c_bool),
    # void mtmd_bitmap_free(mtmd_bitmap * bitmap);
    ("mtmd_bitmap_free", [mtmd_bitmap_p], None),
    # const char * mtmd_bitmap_get_id(const mtmd_bitmap * bitmap);
    ("mtmd_bitmap_get_id", [mtmd_bitmap_p], c_char_p),
    # void mtmd_bitmap_set_id(mtmd_bitmap * bitmap, const char * id);   (copied)
    ("mtmd_bitmap_set_id", [mtmd_bitmap_p, c_char_p], None),
    # mtmd_input_chunks * mtmd_input_chunks_init(void);
    ("mtmd_input_chunks_init", [], mtmd_input_chunks_p),
    # size_t mtmd_input_chunks_size(const mtmd_input_chunks * chunks);
    ("mtmd_input_chunks_size", [mtmd_input_chunks_p], c_size_t),
    # const mtmd_input_chunk * mtmd_input_chunks_get(const mtmd_input_chunks * chunks, size_t idx);
    ("mtmd_input_chunks_get", [mtmd_input_chunks_p, c_size_t], mtmd_input_chunk_p),
    # void mtmd_input_chunks_free(mtmd_input_chunks * chunks);
    ("mtmd_input_chunks_free", [mtmd_input_chunks_p], None),
    # enum mtmd_input_chunk_type mtmd_input_chunk_get_type(const mtmd_input_chunk * chunk);
    ("mtmd_input_chunk_get_type", [mtmd_input_chunk_p], c_int32),
    # const llama_token * mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk * chunk, size_t * n_tokens_output);
    ("mtmd_input_chunk_get_tokens_text", [mtmd_input_chunk_p, POINTER(c_size_t)], POINTER(llama_token)),
    # size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk * chunk);
    ("mtmd_input_chunk_get_n_tokens", [mtmd_input_chunk_p], c_size_t),
    # const char * mtmd_input_chunk_get_id(const mtmd_input_chunk * chunk);
    ("mtmd_input_chunk_get_id", [mtmd_input_chunk_p], c_char_p),
    # llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk * chunk);
    ("mtmd_input_chunk_get_n_pos", [mtmd_input_chunk_p], llama_pos),
    # mtmd_input_chunk * mtmd_input_chunk_copy(const mtmd_input_chunk * chunk);
    ("mtmd_input_chunk_copy", [mtmd_input_chunk_p], mtmd_input_chunk_p),
    # void mtmd_input_chunk_free(mtmd_input_chunk * chunk);
    ("mtmd_input_chunk_free", [mtmd_input_chunk_p], None),
    # int32_t mtmd_tokenize(const mtmd_context * ctx, mtmd_input_chunks * output, const mtmd_input_text * text,
    #                       const mtmd_bitmap ** bitmaps, size_t n_bitmaps);   (0 ok, 1 marker count, 2 preprocess)
    ("mtmd_tokenize", [mtmd_context_p, mtmd_input_chunks_p, POINTER(mtmd_input_text), POINTER(c_void_p), c_size_t],
     c_int32),
    # int32_t mtmd_encode_chunk(mtmd_context * ctx, const mtmd_input_chunk * chunk);   (not thread-safe)
    ("mtmd_encode_chunk", [mtmd_context_p, mtmd_input_chunk_p], c_int32),
    # float * mtmd_get_output_embd(mtmd_context * ctx);   (the last encode's output, owned by ctx)
    ("mtmd_get_output_embd", [mtmd_context_p], POINTER(c_float)),
    # void mtmd_log_set(ggml_log_callback log_callback, void * user_data);
    ("mtmd_log_set", [ggml_log_callback, c_void_p], None),
    # struct mtmd_caps mtmd_get_cap_from_file(const char * mmproj_fname);
    ("mtmd_get_cap_from_file", [c_char_p], mtmd_caps),
    # ---- mtmd-helper.h
    # void mtmd_helper_log_set(ggml_log_callback log_callback, void * user_data);   (also sets mtmd_log_set)
    ("mtmd_helper_log_set", [ggml_log_callback, c_void_p], None),
    # struct mtmd_helper_init_opt mtmd_helper_init_opt_default(void);
    ("mtmd_helper_init_opt_default", [], mtmd_helper_init_opt),
    # struct mtmd_helper_bitmap_wrapper mtmd_helper_bitmap_init_from_buf(const mtmd_context * ctx,
    #     const unsigned char * buf, size_t len, bool placeholder, struct mtmd_helper_init_opt opt);   (thread-safe)
    ("mtmd_helper_bitmap_init_from_buf", [mtmd_context_p, c_void_p, c_size_t, c_bool, mtmd_helper_init_opt],
     mtmd_helper_bitmap_wrapper),
    # int32_t mtmd_helper_decode_image_chunk(mtmd_context * ctx, struct llama_context * lctx,
    #     const mtmd_input_chunk * chunk, float * encoded_embd, llama_pos n_past, llama_seq_id seq_id,
    #     int32_t n_batch, llama_pos * new_n_past, mtmd_helper_post_decode_callback callback, void * user_data);
    ("mtmd_helper_decode_image_chunk",
     [mtmd_context_p, llama_context_p, mtmd_input_chunk_p, c_void_p, llama_pos, c_int32, c_int32,
      POINTER(llama_pos), c_void_p, c_void_p], c_int32),
]
