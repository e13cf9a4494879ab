"""ctypes mirror of the parts of ggml's ``ggml.h`` and ``ggml-backend.h`` llama_ctypes uses.

Declarations only: the log/abort callback types, ``enum ggml_type`` values used
for KV-cache types, and the backend registry / device API used by ``devices()``
and by the RPC backend (``ggml_rpc_h``: its functions come through the registry).
"""

from __future__ import annotations

from ctypes import CFUNCTYPE, POINTER, Structure, c_bool, c_char_p, c_int32, c_size_t, c_void_p

# ---- ggml.h -------------------------------------------------------------------------
# enum ggml_log_level
GGML_LOG_LEVEL_NONE = 0
GGML_LOG_LEVEL_DEBUG = 1
GGML_LOG_LEVEL_INFO = 2
GGML_LOG_LEVEL_WARN = 3
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5  # continues the previous message

# typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
ggml_log_callback = CFUNCTYPE(None, c_int32, c_char_p, c_void_p)
# typedef bool (*ggml_abort_callback)(void * data);
ggml_abort_callback = CFUNCTYPE(c_bool, c_void_p)
# typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
ggml_backend_sched_eval_callback = CFUNCTYPE(c_bool, c_void_p, c_bool, c_void_p)

# enum ggml_type (the values that make sense for a KV cache, by name)
GGML_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}

# enum ggml_numa_strategy
GGML_NUMA_STRATEGY_DISABLED = 0
GGML_NUMA_STRATEGY_DISTRIBUTE = 1
GGML_NUMA_STRATEGY_ISOLATE = 2
GGML_NUMA_STRATEGY_NUMACTL = 3
GGML_NUMA_STRATEGY_MIRROR = 4

# ---- ggml-backend.h -------------------------------------------------------------------
ggml_backend_dev_t = c_void_p
ggml_backend_reg_t = c_void_p

# enum ggml_backend_dev_type
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1
GGML_BACKEND_DEVICE_TYPE_IGPU = 2
GGML_BACKEND_DEVICE_TYPE_ACCEL = 3
GGML_BACKEND_DEVICE_TYPE_META = 4


class ggml_backend_dev_caps(Structure):
    _fields_ = [
        ("async", c_bool),
        ("host_buffer", c_bool),
        ("buffer_from_host_ptr", c_bool),
        ("events", c_bool),
        ("mmap_support", c_bool),
    ]


class ggml_backend_dev_props(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("description", c_char_p),
        ("memory_free", c_size_t),
        ("memory_total", c_size_t),
        ("type", c_int32),
        ("device_id", c_char_p),
        ("caps", ggml_backend_dev_caps),
    ]


STRUCTS = {
    "ggml_backend_dev_caps": ggml_backend_dev_caps,
    "ggml_backend_dev_props": ggml_backend_dev_props,
}

PROTOTYPES = [
    # size_t ggml_backend_reg_count(void);
    ("ggml_backend_reg_count", [], c_size_t),
    # ggml_backend_reg_t ggml_backend_reg_get(size_t index);
    ("ggml_backend_reg_get", [c_size_t], ggml_backend_reg_t),
    # const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
    ("ggml_backend_reg_name", [ggml_backend_reg_t], c_char_p),
    # size_t ggml_backend_dev_count(void);
    ("ggml_backend_dev_count", [], c_size_t),
    # ggml_backend_dev_t ggml_backend_dev_get(size_t index);
    ("ggml_backend_dev_get", [c_size_t], ggml_backend_dev_t),
    # ggml_backend_dev_t ggml_backend_dev_by_name(const char * name);
    ("ggml_backend_dev_by_name", [c_char_p], ggml_backend_dev_t),
    # const char * ggml_backend_dev_name(ggml_backend_dev_t device);
    ("ggml_backend_dev_name", [ggml_backend_dev_t], c_char_p),
    # const char * ggml_backend_dev_description(ggml_backend_dev_t device);
    ("ggml_backend_dev_description", [ggml_backend_dev_t], c_char_p),
    # void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
    ("ggml_backend_dev_memory", [ggml_backend_dev_t, POINTER(c_size_t), POINTER(c_size_t)], None),
    # enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
    ("ggml_backend_dev_type", [ggml_backend_dev_t], c_int32),
    # void ggml_backend_dev_get_props(ggml_backend_dev_t device, struct ggml_backend_dev_props * props);
    ("ggml_backend_dev_get_props", [ggml_backend_dev_t, POINTER(ggml_backend_dev_props)], None),
    # ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
    ("ggml_backend_dev_backend_reg", [ggml_backend_dev_t], ggml_backend_reg_t),
    # void ggml_backend_load_all_from_path(const char * dir_path);
    ("ggml_backend_load_all_from_path", [c_char_p], None),
    # ggml_backend_reg_t ggml_backend_load(const char * path);  (NULL when it cannot load or score is 0)
    ("ggml_backend_load", [c_char_p], ggml_backend_reg_t),
    # void ggml_backend_unload(ggml_backend_reg_t reg);
    ("ggml_backend_unload", [ggml_backend_reg_t], None),
    # size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
    ("ggml_backend_reg_dev_count", [ggml_backend_reg_t], c_size_t),
    # ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
    ("ggml_backend_reg_dev_get", [ggml_backend_reg_t, c_size_t], ggml_backend_dev_t),
    # ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);  (NULL when not registered)
    ("ggml_backend_reg_by_name", [c_char_p], ggml_backend_reg_t),
    # void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
    ("ggml_backend_reg_get_proc_address", [ggml_backend_reg_t, c_char_p], c_void_p),
    # void ggml_backend_register(ggml_backend_reg_t reg);  (its devices join ggml's device list)
    ("ggml_backend_register", [ggml_backend_reg_t], None),
]
