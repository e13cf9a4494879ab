"""Validated option groups for loading models and creating contexts.

Each dataclass is validated once, in ``__post_init__``; ``None`` means "llama.cpp's
default". ``split_options`` routes a flat ``**opts`` dict to these groups and
names any key none of them knows.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Mapping, Sequence

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..native import ggml_h
from ..native import llama_h as L

SplitMode = Literal["none", "layer", "row", "tensor"]
FlashAttn = Literal["auto", "enabled", "disabled"]
Pooling = Literal["unspecified", "none", "mean", "cls", "last", "rank"]
RopeScaling = Literal["unspecified", "none", "linear", "yarn", "longrope"]
Attention = Literal["unspecified", "causal", "non_causal"]

_SPLIT = {"none": L.LLAMA_SPLIT_MODE_NONE, "layer": L.LLAMA_SPLIT_MODE_LAYER,
          "row": L.LLAMA_SPLIT_MODE_ROW, "tensor": L.LLAMA_SPLIT_MODE_TENSOR}
_FLASH = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "enabled": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          "disabled": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}
POOLING = {"unspecified": L.LLAMA_POOLING_TYPE_UNSPECIFIED, "none": L.LLAMA_POOLING_TYPE_NONE,
           "mean": L.LLAMA_POOLING_TYPE_MEAN, "cls": L.LLAMA_POOLING_TYPE_CLS,
           "last": L.LLAMA_POOLING_TYPE_LAST, "rank": L.LLAMA_POOLING_TYPE_RANK}
_ROPE = {"unspecified": L.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, "none": L.LLAMA_ROPE_SCALING_TYPE_NONE,
         "linear": L.LLAMA_ROPE_SCALING_TYPE_LINEAR, "yarn": L.LLAMA_ROPE_SCALING_TYPE_YARN,
         "longrope": L.LLAMA_ROPE_SCALING_TYPE_LONGROPE}
_ATTN = {"unspecified": L.LLAMA_ATTENTION_TYPE_UNSPECIFIED, "causal": L.LLAMA_ATTENTION_TYPE_CAUSAL,
         "non_causal": L.LLAMA_ATTENTION_TYPE_NON_CAUSAL}


#: The largest value of a C ``int32_t``/``uint32_t`` field we pass (ctypes would wrap a larger one silently:
#: ``n_ctx=2**32`` would reach llama.cpp as 0).
INT32_MAX = 2 ** 31 - 1
#: Sequences one context may hold (``LLAMA_MAX_SEQ`` in llama-cparams.h).
LLAMA_MAX_SEQ = 256
#: Threads ggml's CPU backend can run (``GGML_MAX_N_THREADS`` in ggml.h).
GGML_MAX_N_THREADS = 512


def _choice(name: str, value: Any, table: Mapping[str, int]) -> int:
    if isinstance(value, str) and value.lower() in table:
        return table[value.lower()]
    raise InvalidArgumentError(f"{name}={value!r}: expected one of {', '.join(table)}")


def _non_negative(obj: Any, *names: str, most: int = INT32_MAX) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
            raise InvalidArgumentError(f"{name}={value!r}: expected an integer in [0, {most}]")


def _finite(obj: Any, *names: str, non_negative: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or (non_negative and value < 0)):
            raise InvalidArgumentError(f"{name}={value!r}: expected a finite number" + (" >= 0" if non_negative else ""))


def _flags(obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ArgumentTypeError(f"{name}={getattr(obj, name)!r}: expected True or False")


def check_positive(obj: Any, *names: str, integer: bool = True) -> None:
    """Each named field of ``obj`` is a number > 0 (an integer with ``integer``); InvalidArgumentError naming
    ``Class.field`` otherwise. For the small limit dataclasses (SchemaLimits, the HTTP server's limits)."""
    kind = "an integer" if integer else "a number"
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not value > 0:
            raise InvalidArgumentError(f"{type(obj).__name__}.{name}={value!r}: expected {kind} > 0")


@dataclass(frozen=True)
class ModelParams:
    """How a GGUF file is loaded (``llama_model_params``)."""

    n_gpu_layers: int = -1
    """Layers to offload to GPUs; -1 = all, 0 = CPU only."""
    split_mode: SplitMode = "layer"
    """How to spread the model over several GPUs."""
    main_gpu: int = 0
    """GPU (``Device.gpu_index``) holding the whole model when split_mode is "none"."""
    tensor_split: Sequence[float] | None = None
    """Share of the model per GPU, indexed by ``Device.gpu_index``."""
    use_mmap: bool | None = None
    """Memory-map the file; None lets llama.cpp decide."""
    use_mlock: bool = False
    """Pin the weights in RAM (no swapping)."""
    use_direct_io: bool = False
    """Read the file with direct I/O where supported (overrides use_mmap)."""
    vocab_only: bool = False
    """Load only the vocabulary (tokenize without weights)."""
    check_tensors: bool = False
    """Validate tensor data while loading (slower)."""
    use_extra_bufts: bool = True
    """Allow repacked weight buffers (faster CPU matmuls)."""
    no_host: bool = False
    """Bypass host buffers so extra buffer types can be used."""
    load_mtp: bool = False
    """Also load multi-token-prediction layers, where the model has them."""
    kv_overrides: Mapping[str, int | float | bool | str] | None = None
    """GGUF metadata overrides, by key."""
    rpc_servers: Sequence[str] | None = None
    """RPC workers (``llama-ctypes rpc-server``) to spread the model over: ``["host:port", ...]``.
    Their devices come first in the model's device list, in this order, then local GPUs:
    ``tensor_split`` indexes that list, and the layers not offloaded (``n_gpu_layers``) stay on
    the local CPU. Each worker is checked before use (connect and handshake, 3 s timeout);
    one that cannot be reached raises ``RPCConnectionError``. None = no workers."""
    progress_callback: Callable[[float], Any] | None = field(default=None, compare=False, hash=False)
    """Called with load progress in [0, 1]; returning False aborts the load."""

    def __post_init__(self) -> None:
        if isinstance(self.n_gpu_layers, bool) or not isinstance(self.n_gpu_layers, int) \
                or not -1 <= self.n_gpu_layers <= INT32_MAX:
            raise InvalidArgumentError(f"n_gpu_layers={self.n_gpu_layers!r}: expected -1 (all) or an integer >= 0")
        _choice("split_mode", self.split_mode, _SPLIT)
        _non_negative(self, "main_gpu")
        if self.tensor_split is not None:
            split = list(self.tensor_split)
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf for x in split):
                raise InvalidArgumentError(f"tensor_split={self.tensor_split!r}: expected finite non-negative numbers")
            object.__setattr__(self, "tensor_split", tuple(float(x) for x in split))
        if self.kv_overrides is not None:
            for key, value in self.kv_overrides.items():
                if not isinstance(key, str) or not 0 < len(key.encode()) < 128:
                    raise InvalidArgumentError(f"kv_overrides key {key!r}: expected a string of 1..127 bytes")
                if not isinstance(value, (bool, int, float, str)):
                    raise InvalidArgumentError(f"kv_overrides[{key!r}]={value!r}: expected bool, int, float or str")
                if isinstance(value, str) and len(value.encode()) >= 128:
                    raise InvalidArgumentError(f"kv_overrides[{key!r}]: string values are limited to 127 bytes")
            object.__setattr__(self, "kv_overrides", dict(self.kv_overrides))
        if self.progress_callback is not None and not callable(self.progress_callback):
            raise ArgumentTypeError("progress_callback must be callable")
        if self.rpc_servers is not None:
            from .rpc.endpoints import parse_endpoints

            if isinstance(self.rpc_servers, (str, bytes)) or not isinstance(self.rpc_servers, Sequence):
                raise InvalidArgumentError(f"rpc_servers={self.rpc_servers!r}: expected a list of 'host:port'")
            object.__setattr__(self, "rpc_servers", parse_endpoints(self.rpc_servers) or None)

    def to_native(self, lib, devices: Sequence[int] | None = None) -> tuple[L.llama_model_params, list]:
        """A ``llama_model_params`` struct (from llama.cpp's defaults) and the buffers it points into,
        which the caller must keep alive until the load returns. The progress callback is not set.

        ``devices``: an explicit device list (``ggml_backend_dev_t`` pointers) for the model, as
        ``core.rpc.client.use`` builds it; None keeps llama.cpp's default selection."""
        native = lib.llama_model_default_params()
        native.n_gpu_layers = self.n_gpu_layers
        native.split_mode = _SPLIT[self.split_mode]
        native.main_gpu = self.main_gpu
        native.load_mode = self.load_mode
        native.vocab_only = self.vocab_only
        native.check_tensors = self.check_tensors
        native.use_extra_bufts = self.use_extra_bufts
        native.no_host = self.no_host
        native.load_mtp = self.load_mtp
        keep_alive: list = []
        if devices is not None:
            arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
            keep_alive.append(arr)
            native.devices = ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))
        if self.tensor_split:
            n_max = lib.llama_max_devices()
            if len(self.tensor_split) > n_max:
                raise InvalidArgumentError(f"tensor_split has {len(self.tensor_split)} entries; this build supports {n_max} devices")
            arr = (ctypes.c_float * n_max)(*self.tensor_split)
            keep_alive.append(arr)
            native.tensor_split = ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))
        if self.kv_overrides:
            arr = (L.llama_model_kv_override * (len(self.kv_overrides) + 1))()  # zeroed sentinel at the end
            for item, (key, value) in zip(arr, self.kv_overrides.items()):
                item.key = key.encode()
                if isinstance(value, bool):
                    item.tag, item.val_bool = L.LLAMA_KV_OVERRIDE_TYPE_BOOL, value
                elif isinstance(value, int):
                    item.tag, item.val_i64 = L.LLAMA_KV_OVERRIDE_TYPE_INT, value
                elif isinstance(value, float):
                    item.tag, item.val_f64 = L.LLAMA_KV_OVERRIDE_TYPE_FLOAT, value
                else:
                    item.tag, item.val_str = L.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
            keep_alive.append(arr)
            native.kv_overrides = arr
        return native, keep_alive

    @property
    def load_mode(self) -> int:
        if self.use_direct_io:
            return L.LLAMA_LOAD_MODE_DIRECT_IO
        if self.use_mmap is None:
            return L.LLAMA_LOAD_MODE_MLOCK if self.use_mlock else L.LLAMA_LOAD_MODE_AUTO
        if self.use_mmap:
            return L.LLAMA_LOAD_MODE_MMAP_MLOCK if self.use_mlock else L.LLAMA_LOAD_MODE_MMAP
        return L.LLAMA_LOAD_MODE_MLOCK if self.use_mlock else L.LLAMA_LOAD_MODE_NONE


def default_threads() -> int:
    """Threads a context (or projector) uses when not told: the CPUs this process may run on."""
    # llama.cpp's own default is a fixed 4; the physical core count is a better guess.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ContextParams:
    """Size and behaviour of an inference context (``llama_context_params``)."""

    n_ctx: int = 4096
    """Context window in tokens (all sequences together); 0 = the model's training context."""
    n_batch: int = 2048
    """Most tokens submitted to one llama_decode call."""
    n_ubatch: int = 512
    """Physical batch size; at most n_batch."""
    n_seq_max: int = 1
    """Distinct sequences (parallel slots) the context holds."""
    n_threads: int | None = None
    """Threads for generation; None = CPUs available to this process."""
    n_threads_batch: int | None = None
    """Threads for prompt processing; None = n_threads."""
    type_k: str = "f16"
    """K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl."""
    type_v: str = "f16"
    """V cache type (quantized V needs flash attention)."""
    flash_attn: FlashAttn = "auto"
    """Flash attention: auto, enabled or disabled."""
    rope_scaling: RopeScaling = "unspecified"
    """RoPE scaling type; unspecified = from the model."""
    rope_freq_base: float = 0.0
    """RoPE base frequency; 0 = from the model."""
    rope_freq_scale: float = 0.0
    """RoPE frequency scale; 0 = from the model."""
    yarn_ext_factor: float = -1.0
    """YaRN extrapolation mix factor; negative = from the model."""
    yarn_attn_factor: float = -1.0
    """YaRN magnitude scaling factor; negative = from the model."""
    yarn_beta_fast: float = -1.0
    """YaRN low correction dim; negative = from the model."""
    yarn_beta_slow: float = -1.0
    """YaRN high correction dim; negative = from the model."""
    yarn_orig_ctx: int = 0
    """YaRN original context size; 0 = from the model."""
    offload_kqv: bool = True
    """Keep the KV cache and attention on the GPU."""
    op_offload: bool = True
    """Offload host tensor operations to the device."""
    swa_full: bool = False
    """Keep the whole history in the sliding-window layers' cache. False (llama-server's default)
    keeps only the window: on Gemma 3, 61 MiB of KV instead of 144 MiB for a 4 x 2048 server. A
    cached prefix is then reused only while its window is still held (else it is recomputed)."""
    kv_unified: bool = False
    """One KV buffer shared by all sequences (helps when they share prefixes)."""
    embeddings: bool = False
    """Extract embeddings (with logits)."""
    pooling: Pooling = "unspecified"
    """Embedding pooling; unspecified = from the model."""
    attention: Attention = "unspecified"
    """Attention type for embeddings; unspecified = from the model."""
    n_rs_seq: int = 0
    """Recurrent-state snapshots per sequence for rollback (speculative decoding)."""
    n_outputs_max: int = 0
    """Most outputs (logit rows) per micro-batch; 0 = n_batch. Each row reserves n_vocab floats of
    compute buffer: ``generate``/``stream`` use 1, a Server one per slot."""

    def __post_init__(self) -> None:
        # Every check below stands for a llama.cpp assert (which aborts the process) or a value that
        # would reach it wrapped or meaningless; Context and ContextLease check what depends on the model.
        _non_negative(self, "n_ctx", "n_batch", "n_ubatch", "yarn_orig_ctx", "n_rs_seq", "n_outputs_max")
        _non_negative(self, "n_seq_max", most=LLAMA_MAX_SEQ)
        for name in ("n_batch", "n_ubatch", "n_seq_max"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}={getattr(self, name)}: expected >= 1")
        if self.n_ubatch > self.n_batch:
            raise InvalidArgumentError(f"n_ubatch={self.n_ubatch} must not exceed n_batch={self.n_batch}")
        if self.n_outputs_max and self.n_outputs_max < self.n_seq_max:
            # llama.cpp reserves an output row per sequence at creation (GGML_ASSERT in output_reserve)
            raise InvalidArgumentError(f"n_outputs_max={self.n_outputs_max} must be 0 (= n_batch) or at least "
                                       f"n_seq_max={self.n_seq_max}: every sequence needs an output row")
        for name in ("n_threads", "n_threads_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= GGML_MAX_N_THREADS):
                raise InvalidArgumentError(f"{name}={value!r}: expected an integer in [1, {GGML_MAX_N_THREADS}] "
                                           "or None")
        # 0 (and for YaRN a negative value) means "from the model"; anything else must be a usable number.
        _finite(self, "rope_freq_base", "rope_freq_scale", non_negative=True)
        _finite(self, "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")
        _flags(self, "offload_kqv", "op_offload", "swa_full", "kv_unified", "embeddings")
        for name in ("type_k", "type_v"):
            _choice(name, getattr(self, name), ggml_h.GGML_TYPES)
        _choice("flash_attn", self.flash_attn, _FLASH)
        _choice("rope_scaling", self.rope_scaling, _ROPE)
        _choice("pooling", self.pooling, POOLING)
        _choice("attention", self.attention, _ATTN)
        if _choice("attention", self.attention, _ATTN) == L.LLAMA_ATTENTION_TYPE_NON_CAUSAL and self.n_ubatch < self.n_batch:
            # llama.cpp cannot split a non-causal batch into micro-batches (GGML_ASSERT in decode)
            raise InvalidArgumentError(f"attention='non_causal' needs each batch in one micro-batch: n_ubatch="
                                       f"{self.n_ubatch} must equal n_batch={self.n_batch}")

    def to_native(self) -> L.llama_context_params:
        """A ``llama_context_params`` struct, starting from llama.cpp's defaults."""
        from .backend import init

        p = init().llama_context_default_params()
        threads = self.n_threads or default_threads()
        p.n_ctx = self.n_ctx
        p.n_batch = self.n_batch
        p.n_ubatch = self.n_ubatch
        p.n_seq_max = self.n_seq_max
        p.n_rs_seq = self.n_rs_seq
        p.n_outputs_max = self.n_outputs_max
        p.n_threads = threads
        p.n_threads_batch = self.n_threads_batch or threads
        p.type_k = ggml_h.GGML_TYPES[self.type_k.lower()]
        p.type_v = ggml_h.GGML_TYPES[self.type_v.lower()]
        p.flash_attn_type = _FLASH[self.flash_attn]
        p.rope_scaling_type = _ROPE[self.rope_scaling]
        p.rope_freq_base = self.rope_freq_base
        p.rope_freq_scale = self.rope_freq_scale
        p.yarn_ext_factor = self.yarn_ext_factor
        p.yarn_attn_factor = self.yarn_attn_factor
        p.yarn_beta_fast = self.yarn_beta_fast
        p.yarn_beta_slow = self.yarn_beta_slow
        p.yarn_orig_ctx = self.yarn_orig_ctx
        p.offload_kqv = self.offload_kqv
        p.op_offload = self.op_offload
        p.swa_full = self.swa_full
        p.kv_unified = self.kv_unified
        p.embeddings = self.embeddings
        p.pooling_type = POOLING[self.pooling]
        p.attention_type = _ATTN[self.attention]
        p.no_perf = True
        return p


def option_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def split_options(opts: Mapping[str, Any], *groups: type, where: str = "") -> list[dict[str, Any]]:
    """Split flat keyword options among dataclass groups; unknown names raise TypeError."""
    out: list[dict[str, Any]] = [{} for _ in groups]
    names = [option_names(g) for g in groups]
    unknown = []
    for key, value in opts.items():
        for i, known in enumerate(names):
            if key in known:
                out[i][key] = value
                break
        else:
            unknown.append(key)
    if unknown:
        valid = sorted(set().union(*names))
        raise ArgumentTypeError(
            f"{where or 'unexpected'} option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(valid)}"
        )
    return out


def replace(params: Any, **changes: Any) -> Any:
    """dataclasses.replace that keeps validation."""
    return dataclasses.replace(params, **changes)
