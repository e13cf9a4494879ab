"""Model: a loaded GGUF file, shareable across threads."""

from __future__ import annotations

import logging
import os
import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ClosedError, InvalidArgumentError, ModelLoadError
from ..native import llama_h as L
from .backend import clear_native_error, init, native_error
from .gguf_file import check_gguf_file
from .handle import NativeHandle
from .lora import AdapterGuard, LoraAdapter, read_string
from .params import ModelParams, split_options
from .rpc import client as rpc
from .vocab import Vocab

if TYPE_CHECKING:
    from .projector import Projector, ProjectorParams

logger = logging.getLogger(__name__)


class Model(NativeHandle):
    """A loaded model. Thread-safe: share one Model between threads and contexts.

    Create with :func:`load_model`. ``close()`` (or ``with``) frees the weights
    once no Context or Sampler made from it is still alive; using a closed
    Model raises :class:`~llama_ctypes.ClosedError`.
    """

    _kind = "Model"

    def __init__(self, path: str | os.PathLike, params: ModelParams | None = None):
        super().__init__()
        self._ptr = None
        # Held while llama.cpp changes or reads the model's set of LoRA adapters: loading and freeing
        # one, and a context reserving its graph (context creation, the first decode after its
        # adapters changed), which sizes the graph over every adapter of the model.
        self.adapter_lock = AdapterGuard()
        self._loras: list[LoraAdapter] = []
        self.path = Path(path)
        self.params = params or ModelParams()
        self._lib = init()
        try:
            self._ptr = self._load()
        except BaseException:
            self._mark_dead()
            raise
        self.vocab = Vocab(self, self._lib.llama_model_get_vocab(self._ptr))
        """The vocabulary: tokenize, token bytes, end-of-generation flags (see :class:`Vocab`)."""
        # Resources other layers attach to the model (the one-call API's context pool),
        # closed with it; the model itself knows nothing of them.
        self._attach_lock = threading.Lock()
        self._attached: dict[str, Any] = {}
        self._detaching = False  # set by close(): nothing new may attach

    # ---- loading ---------------------------------------------------------------------
    def _load(self):
        path = check_gguf_file(self.path)
        lib, p = self._lib, self.params
        # RPC workers are probed before llama.cpp connects (unpatched, it aborts when it cannot); the
        # model holds its use of them until it is freed, and its watch says when one is lost.
        self._rpc = rpc.use(lib, p.rpc_servers, p.split_mode)
        try:
            try:
                ptr = self._load_with(path, self._rpc.devices)
            except ModelLoadError as exc:
                lost = self._rpc.watch.attach()  # a worker lost during the load explains the refusal
                if lost is not None:
                    raise lost from exc
                raise
            lost = self._rpc.watch.attach()
            if lost is not None:  # loaded, but weights may be missing on the lost worker
                lib.llama_model_free(ptr)
                raise lost
            return ptr
        except BaseException:
            self._rpc.release()
            raise

    def _load_with(self, path: Path, devices: list[int] | None):
        lib, p = self._lib, self.params
        native, keep_alive = p.to_native(lib, devices)  # keep_alive: buffers that must outlive the load call
        callback_error: list[BaseException] = []
        if p.progress_callback is not None:
            user_cb = p.progress_callback

            def on_progress(progress: float, _user_data) -> bool:
                try:
                    return user_cb(float(progress)) is not False
                except BaseException as exc:  # never let an exception unwind into C
                    callback_error.append(exc)
                    return False

            cb = L.llama_progress_callback(on_progress)
            keep_alive.append(cb)
            native.progress_callback = cb
        clear_native_error()
        ptr = lib.llama_model_load_from_file(os.fsencode(path), native)
        del keep_alive
        if callback_error:
            if ptr:
                lib.llama_model_free(ptr)
            raise callback_error[0]
        if not ptr:
            reason = native_error("corrupt, truncated, or an unsupported architecture")
            raise ModelLoadError(f"could not load {path}: {reason}")
        return ptr

    def _free(self) -> None:
        self._close_attached()
        if self._ptr:
            self._lib.llama_model_free(self._ptr)
            self._ptr = None
            self._rpc.release()

    @property
    def uses_rpc(self) -> bool:
        """Whether the model's weights live (partly) on RPC workers (``rpc_servers``)."""
        return bool(self._rpc.endpoints)

    def check_workers(self) -> None:
        """Raise :class:`~llama_ctypes.RPCConnectionError` if an RPC worker this model uses was lost.

        Such a model (and every context of it) refuses further use: contexts raise the same
        error when used, and new contexts cannot be created. Close it, and load it again once
        the worker is back. A model without ``rpc_servers`` never raises here.
        """
        self._rpc.watch.check()

    def close(self) -> None:
        """Free the model once every Context and Sampler made from it is closed.

        Idle contexts kept for ``generate``/``stream`` are closed right away.
        """
        with self._attach_lock:
            self._detaching = True
            loras, self._loras = self._loras, []
        self._close_attached()
        for adapter in loras:
            adapter.close_when_unused()  # (freed once the contexts that apply it let go)
        super().close()

    # ---- LoRA adapters ---------------------------------------------------------------------
    def load_lora(self, path: str | os.PathLike, name: str | None = None) -> LoraAdapter:
        """Load a LoRA adapter (GGUF, ``general.type = adapter``) over this model.

        An adapter of another architecture, or whose tensors do not fit this model's, is refused
        with :class:`~llama_ctypes.ModelLoadError` before anything is applied. Apply it per context
        (``lease.set_loras``) or per call (``lora=`` on generate/stream/chat). ``name`` defaults to
        the file's ``general.name``, else its stem.
        """
        adapter = LoraAdapter(self, path, name)
        with self._attach_lock:
            refused = self._closed or self._detaching
            if not refused:
                self._loras = [a for a in self._loras if not a.closed] + [adapter]
        if refused:
            adapter.close()
            raise ClosedError("Model is closed")
        return adapter

    @property
    def loras(self) -> list[LoraAdapter]:
        """The open LoRA adapters loaded over this model, oldest first."""
        with self._attach_lock:
            return [a for a in self._loras if not a.closed]

    # ---- images and audio -------------------------------------------------------------------
    def attach_projector(self, path: str | os.PathLike, params: "ProjectorParams | None" = None,
                         **opts: Any) -> "Projector":
        """Load a multimodal projector (an ``mmproj`` GGUF) over this model: images and audio in prompts.

        Options are :class:`ProjectorParams`' (``use_gpu``, ``n_threads``, ``image_min_tokens``, ...).
        One projector per model: ModelLoadError for a file that is not one, or one made for another
        text model (its embedding size differs); InvalidArgumentError when one is attached already.
        It is closed with the model.
        """
        from .projector import Projector, ProjectorParams

        params = params or ProjectorParams(**opts)
        with self._attach_lock:
            if self._closed or self._detaching:
                raise ClosedError("Model is closed")
            if "projector" in self._attached:
                raise InvalidArgumentError(
                    f"{self.path.name} has a projector already ({self._attached['projector']!r})")
        projector = Projector(self, path, params)
        with self._attach_lock:
            refused = "Model is closed" if self._closed or self._detaching else (
                "a projector was attached meanwhile" if "projector" in self._attached else None)
            if refused is None:
                self._attached["projector"] = projector
        if refused is not None:
            projector.close()
            raise (ClosedError if refused == "Model is closed" else InvalidArgumentError)(refused)
        return projector

    @property
    def projector(self) -> "Projector | None":
        """The attached multimodal projector, if any (see :meth:`attach_projector`)."""
        with self._attach_lock:
            return self._attached.get("projector")

    @property
    def modalities(self) -> frozenset[str]:
        """What the attached projector adds to text: ``{"vision"}``, ``{"audio"}``, both, or nothing."""
        projector = self.projector
        return projector.modalities if projector is not None and not projector.closed else frozenset()

    def attachment(self, key: str, factory: Callable[[], Any]) -> Any:
        """The resource attached under ``key``, created by ``factory()`` on first use.

        Attached resources are closed (``close()``) when the model is closed; after
        that, asking for one raises :class:`ClosedError`.
        """
        with self._attach_lock:
            if self._closed or self._detaching:
                raise ClosedError("Model is closed")
            res = self._attached.get(key)
            if res is None:
                res = self._attached[key] = factory()
            return res

    def _close_attached(self) -> None:
        with self._attach_lock:
            attached, self._attached = list(self._attached.values()), {}
        for res in attached:
            res.close()

    # ---- introspection ------------------------------------------------------------------
    def _int(self, fn) -> int:
        with self._shared():
            return int(fn(self._ptr))

    @property
    def desc(self) -> str:
        """A short description, e.g. ``"gemma3 270M Q4_K - Medium"``."""
        with self._shared():
            return read_string(self._lib.llama_model_desc, self._ptr) or ""

    @property
    def n_params(self) -> int:
        """Number of parameters."""
        return self._int(self._lib.llama_model_n_params)

    @property
    def size(self) -> int:
        """Total size of all tensors, in bytes."""
        return self._int(self._lib.llama_model_size)

    @property
    def n_ctx_train(self) -> int:
        """Context length the model was trained with, in tokens."""
        return self._int(self._lib.llama_model_n_ctx_train)

    @property
    def n_embd(self) -> int:
        """Embedding (hidden) size."""
        return self._int(self._lib.llama_model_n_embd)

    @property
    def n_embd_inp(self) -> int:
        """Width of the input embeddings (what a projector's image and audio embeddings must match)."""
        return self._int(self._lib.llama_model_n_embd_inp)

    @property
    def n_layer(self) -> int:
        """Number of layers."""
        return self._int(self._lib.llama_model_n_layer)

    @property
    def n_head(self) -> int:
        """Number of attention heads (0 for a vocab_only model)."""
        # llama.cpp aborts the process when asked for heads of a model without layers.
        return self._int(self._lib.llama_model_n_head) if self.n_layer > 0 else 0

    @property
    def n_head_kv(self) -> int:
        """Number of key/value heads (0 for a vocab_only model)."""
        return self._int(self._lib.llama_model_n_head_kv) if self.n_layer > 0 else 0

    @property
    def n_swa(self) -> int:
        """Sliding-window size in tokens (0 when the model has no SWA layers)."""
        return self._int(self._lib.llama_model_n_swa)

    @property
    def n_vocab(self) -> int:
        """Vocabulary size."""
        return self.vocab.n_tokens

    @property
    def n_cls_out(self) -> int:
        """Outputs of a classifier (ranking) head; 0 when there is none."""
        return self._int(self._lib.llama_model_n_cls_out)

    @property
    def n_embd_out(self) -> int:
        """Width of the model's output embeddings (differs from n_embd for some embedding models)."""
        return self._int(self._lib.llama_model_n_embd_out)

    @property
    def architecture(self) -> str:
        """``general.architecture`` from the GGUF, e.g. ``"llama"``, ``"gemma3"``."""
        return self.meta("general.architecture") or ""

    @property
    def name(self) -> str:
        """``general.name`` from the GGUF, or the file name."""
        return self.meta("general.name") or self.path.name

    @property
    def has_encoder(self) -> bool:
        """True for encoder (BERT-like) and encoder-decoder (T5-like) models."""
        return bool(self._int(self._lib.llama_model_has_encoder))

    @property
    def has_decoder(self) -> bool:
        """True when the model has a decoder (every generative model)."""
        return bool(self._int(self._lib.llama_model_has_decoder))

    @property
    def causal_attention(self) -> bool:
        """Whether the model attends causally by default (``<arch>.attention.causal``; False for
        BERT-like embedding models, whose batches llama.cpp computes in one micro-batch)."""
        value = self.meta(f"{self.architecture}.attention.causal")
        return value is None or value.strip().lower() not in ("false", "0")

    @property
    def is_recurrent(self) -> bool:
        """True for recurrent models (Mamba, RWKV)."""
        return bool(self._int(self._lib.llama_model_is_recurrent))

    @property
    def is_hybrid(self) -> bool:
        """True for hybrid attention/recurrent models (Jamba, Qwen3.5 GDN)."""
        return bool(self._int(self._lib.llama_model_is_hybrid))

    @property
    def rope_type(self) -> str:
        """RoPE variant: none, norm, neox, mrope, imrope or vision."""
        value = self._int(self._lib.llama_model_rope_type)
        names = {L.LLAMA_ROPE_TYPE_NONE: "none", L.LLAMA_ROPE_TYPE_NORM: "norm", L.LLAMA_ROPE_TYPE_NEOX: "neox",
                 L.LLAMA_ROPE_TYPE_MROPE: "mrope", L.LLAMA_ROPE_TYPE_IMROPE: "imrope",
                 L.LLAMA_ROPE_TYPE_VISION: "vision"}
        return names.get(value, str(value))

    @property
    def ftype(self) -> str:
        """Quantization of the file, e.g. ``"Q4_K - Medium"``."""
        with self._shared():
            return (self._lib.llama_ftype_name(self._lib.llama_model_ftype(self._ptr)) or b"").decode()

    def native(self):
        """The ``llama_model *``, for native objects built from it (core and features use; the caller
        holds the model, see :meth:`hold`, for as long as the pointer is used)."""
        if self._freed:
            raise ClosedError("Model is closed")
        return self._ptr

    def chat_template_named(self, name: str | None = None) -> str | None:
        """The chat template stored under ``tokenizer.chat_template[.name]``, or None."""
        with self._shared():
            raw = self._lib.llama_model_chat_template(self._ptr, name.encode() if name else None)
        return raw.decode("utf-8", errors="replace") if raw else None

    @property
    def chat_template(self) -> str | None:
        """The default chat template from the GGUF metadata, or None."""
        return self.chat_template_named(None)

    def meta(self, key: str) -> str | None:
        """One GGUF metadata value as a string (arrays are not available), or None."""
        with self._shared():
            return read_string(self._lib.llama_model_meta_val_str, self._ptr, key.encode())

    @cached_property
    def metadata(self) -> dict[str, str]:
        """Every scalar GGUF metadata key/value (values as strings)."""
        with self._shared():
            lib, ptr = self._lib, self._ptr
            out = {}
            for i in range(lib.llama_model_meta_count(ptr)):
                key = read_string(lib.llama_model_meta_key_by_index, ptr, i)
                if key is not None:
                    out[key] = read_string(lib.llama_model_meta_val_str_by_index, ptr, i) or ""
            return out

    def info(self) -> dict[str, Any]:
        """A summary dict of the model (what ``llama-ctypes info`` prints)."""
        return {
            "path": str(self.path),
            "name": self.name,
            "architecture": self.architecture,
            "desc": self.desc,
            "ftype": self.ftype,
            "n_params": self.n_params,
            "size": self.size,
            "n_ctx_train": self.n_ctx_train,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "n_vocab": self.n_vocab,
            "rope_type": self.rope_type,
            "has_encoder": self.has_encoder,
            "has_decoder": self.has_decoder,
            "is_recurrent": self.is_recurrent,
            "is_hybrid": self.is_hybrid,
            "has_chat_template": self.chat_template is not None,
        }

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.desc
        return f"<Model {self.path.name!r} {state}>"

    # ---- conveniences (thin wrappers over the generation API) ------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (see :meth:`Tokenizer.encode`)."""
        from .tokenizer import Tokenizer

        return Tokenizer.encode(self, text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens, remove_special: bool = False, unparse_special: bool = False) -> str:
        """Token ids to text (see :meth:`Tokenizer.decode`)."""
        from .tokenizer import Tokenizer

        return Tokenizer.decode(self, tokens, remove_special=remove_special, unparse_special=unparse_special)

    def generate(self, prompt, **opts):
        """See :func:`llama_ctypes.generate`."""
        from .one_call import generate

        return generate(self, prompt, **opts)

    def stream(self, prompt, **opts):
        """See :func:`llama_ctypes.stream`."""
        from .one_call import stream

        return stream(self, prompt, **opts)


def load_model(path: str | os.PathLike, *, mmproj: str | os.PathLike | None = None,
               mmproj_params: "ProjectorParams | None" = None, **opts: Any) -> Model:
    """Load a GGUF model.

    Options are the fields of :class:`ModelParams` (``n_gpu_layers=-1``,
    ``use_mmap``, ``kv_overrides``, ``progress_callback``, ...). A missing file
    raises ``FileNotFoundError``; a file llama.cpp cannot load raises
    :class:`ModelLoadError`; an unknown option raises ``TypeError``.
    ``mmproj``: a multimodal projector to attach (:meth:`Model.attach_projector`, with ``mmproj_params``).
    """
    (model_opts,) = split_options(opts, ModelParams, where="load_model: unknown")
    model = Model(path, ModelParams(**model_opts))
    if mmproj is not None:
        try:
            model.attach_projector(mmproj, mmproj_params)
        except BaseException:
            model.close()
            raise
    return model
