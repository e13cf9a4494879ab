"""llama-cpp-python's ``Llama`` over our Model and one-call API: the same arguments and return shapes.

One ``Llama`` is one Model; each call runs on the one-call API (a pooled context with the
constructor's context options), which keeps the last prompt's KV, as llama-cpp-python's single
context does: a prompt that extends the previous one decodes only its new tokens. Unlike
llama-cpp-python's, a ``Llama`` may be used from several threads at once (each call gets a context
of its own from the pool). A completion with ``logits_processor``/``stopping_criteria`` or with a
cache set, and the low-level methods (``eval``, ``sample``, ``generate``, ``save_state``), run on
the ``Llama``'s own context instead (``_session.py``), one call at a time.

What is not carried over raises at once, naming the argument (see docs/compat.md): never ignored.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ...core.model import Model, load_model
from ...core.params import ContextParams, split_options
from ...core.sampler import SamplingParams
from ...core.target import GenerationTarget, LocalTarget
from ...core.logprobs import MAX_TOP_LOGPROBS
from ...core.memory import detect_system_memory
from ...errors import ArgumentTypeError, BusyError, InvalidArgumentError
from ...features.embeddings import EmbedUsage
from ...features.embeddings import embed as lc_embed
from ...features.openai.chat import chat_completion, stream_chat_completion
from ...features.structured import generate as lc_generate
from ...engines.speculative.session import SpeculativeSession
from . import _fim
from ._draft import CallableDraft, draft_length
from ._hooked import HookedCalls
from ._shapes import collect, finish_reason, completion_logprobs, response_schema, restamp, token_usage
from ._session import (ContextView, LlamaState, LogitsProcessorList, MinTokensLogitsProcessor, Session,
                       StoppingCriteriaList)
from .llama_chat_format import Llava15ChatHandler
from .llama_grammar import LlamaGrammar
from .llama_tokenizer import LlamaModelHandle, LlamaTokenizer, llama_model_get_vocab, llama_token_to_piece

__all__ = ["Llama", "LlamaState", "LogitsProcessorList", "StoppingCriteriaList", "MinTokensLogitsProcessor",
           "LlamaTokenizer", "llama_model_get_vocab", "llama_token_to_piece"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
logger = logging.getLogger(__name__)
_OWN_SEED: Any = object()

# llama-cpp-python's integer enums (llama.h) → our option names.
_SPLIT = {0: "none", 1: "layer", 2: "row"}
_ROPE = {-1: "unspecified", 0: "none", 1: "linear", 2: "yarn", 3: "longrope"}
_POOLING = {-1: "unspecified", 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
_ATTENTION = {-1: "unspecified", 0: "causal", 1: "non_causal"}
_GGML_TYPE = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16"}

# llama-cpp-python's chat_format names → llama.cpp's built-in templates (llama_chat_apply_template).
CHAT_FORMATS = {
    "chatml": "chatml", "llama-2": "llama2", "llama-3": "llama3", "gemma": "gemma", "mistral-instruct": "mistral-v1",
    "zephyr": "zephyr", "vicuna": "vicuna", "openchat": "openchat", "chatglm3": "chatglm3", "phi-3": "phi3",
    "qwen": "chatml", "mistrallite": "mistral-v1", "intel": "chatml", "open-orca": "chatml",
}

# Constructor arguments taken only at these values (anything else: refused, naming it).
_ONLY = {
    "numa": (False, 0), "lora_base": (None,), "tokenizer": (None,),
}
# Arguments of older llama-cpp-python versions that frameworks still pass (LangChain: n_parts, f16_kv; its
# embeddings: device), taken at the values that mean what llama.cpp does now; llama-cpp-python ignores them.
_LEGACY = {"n_parts": (-1,), "device": (None,), "low_vram": (False,), "mul_mat_q": (True,)}


def _checked_seed(seed: Any) -> int:
    """A seed as llama.cpp takes it (a uint32; -1: its default, random)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not -1 <= seed <= 0xFFFFFFFF:
        raise InvalidArgumentError(f"seed={seed!r}: expected an integer 0..{0xFFFFFFFF} (or -1: random)")
    return LLAMA_DEFAULT_SEED if seed == -1 else int(seed)


def _refuse(name: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"llama_ctypes.compat does not support {name}: {why}")


class Llama(HookedCalls):
    """A model, as llama-cpp-python's ``Llama(model_path, ...)`` loads it (its defaults: n_ctx=512,
    n_batch=512, all layers on the CPU unless ``n_gpu_layers``)."""

    def __init__(self, model_path: str, *, n_gpu_layers: int = 0, split_mode: int = 1, main_gpu: int = 0,
                 tensor_split: Sequence[float] | None = None, vocab_only: bool = False, use_mmap: bool = True,
                 use_mlock: bool = False, kv_overrides: Mapping[str, bool | int | float | str] | None = None,
                 seed: int = LLAMA_DEFAULT_SEED, n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512,
                 n_threads: int | None = None, n_threads_batch: int | None = None, rope_scaling_type: int | None = -1,
                 pooling_type: int = -1, attention_type: int = -1, rope_freq_base: float = 0.0,
                 rope_freq_scale: float = 0.0, yarn_ext_factor: float = -1.0, yarn_attn_factor: float = 1.0,
                 yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0, yarn_orig_ctx: int = 0,
                 logits_all: bool = False, embedding: bool = False, offload_kqv: bool = True,
                 flash_attn: bool = False, op_offload: bool | None = None, swa_full: bool | None = None,
                 no_perf: bool = False, last_n_tokens_size: int = 64, lora_base: str | None = None,
                 lora_scale: float = 1.0, lora_path: str | None = None, numa: bool | int = False,
                 chat_format: str | None = None, chat_handler: Any = None, draft_model: Any = None,
                 tokenizer: Any = None, type_k: int | None = None, type_v: int | None = None,
                 spm_infill: bool = False, verbose: bool = True, **kwargs: Any) -> None:
        f16_kv = kwargs.pop("f16_kv", None)  # (older versions' KV cache type: f16, or f32 when False)
        if f16_kv is not None and not isinstance(f16_kv, bool):
            raise ArgumentTypeError(f"f16_kv={f16_kv!r}: expected a bool")
        if f16_kv is False:
            type_k = 0 if type_k is None else type_k
            type_v = 0 if type_v is None else type_v
        for name in [k for k in kwargs if k in _LEGACY]:
            value = kwargs.pop(name)
            if not any(value is a or value == a for a in _LEGACY[name]):
                raise _refuse(f"{name}={value!r}", f"an argument of older llama-cpp-python versions, taken only as "
                              f"{_LEGACY[name][0]!r} (docs/compat.md)")
        if kwargs:
            raise ArgumentTypeError(f"Llama() got unknown argument(s) {sorted(kwargs)}")
        # (-1: older llama.cpp's LLAMA_DEFAULT_SEED as a signed int, LangChain's default; checked before the load)
        seed = LLAMA_DEFAULT_SEED if seed is None else _checked_seed(seed)
        given = locals()
        for name, allowed in _ONLY.items():
            if not any(given[name] is a or given[name] == a for a in allowed):
                raise _refuse(f"{name}={given[name]!r}", "not carried over yet (docs/compat.md)")
        self.model_path = os.fspath(model_path)
        self.verbose = verbose
        self.spm_infill = bool(spm_infill)
        self.chat_format = chat_format
        if chat_format is not None and chat_format not in CHAT_FORMATS:
            raise _refuse(f"chat_format={chat_format!r}", f"known formats: {', '.join(sorted(CHAT_FORMATS))}")
        if split_mode not in _SPLIT:
            raise InvalidArgumentError(f"split_mode={split_mode!r}: expected one of {sorted(_SPLIT)}")
        if chat_handler is not None and not callable(chat_handler):
            raise ArgumentTypeError(f"chat_handler must be a callable (llama_chat_format.LlamaChatCompletionHandler), "
                                    f"not {type(chat_handler).__name__}")
        self.chat_handler = chat_handler
        drafter = CallableDraft(draft_model) if draft_model is not None else None  # (checked before the load)
        # (a projector handler: the projector is loaded with the model and our chat path reads the images)
        self._projector_handler = isinstance(chat_handler, Llava15ChatHandler)
        self._model: Model = load_model(
            self.model_path, mmproj=chat_handler.clip_model_path if self._projector_handler else None,
            n_gpu_layers=n_gpu_layers, split_mode=_SPLIT[split_mode], main_gpu=main_gpu,
            tensor_split=tensor_split, vocab_only=vocab_only, use_mmap=use_mmap, use_mlock=use_mlock,
            kv_overrides=kv_overrides)
        if self.chat_format is None and self._model.chat_template is None:
            # llama-cpp-python's fallback for a model without a template (Gemma 3 270M's Q4_K_M has none)
            self.chat_format = "llama-2"
            logger.info("%s has no chat template: using the llama-2 chat format", self.model_path)
        try:
            if lora_path is not None:
                self._lora = {self._model.load_lora(lora_path): float(lora_scale)}
            else:
                self._lora = None
            self._ctx_opts = self._context_options(
                n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads, n_threads_batch=n_threads_batch,
                rope_scaling_type=rope_scaling_type, pooling_type=pooling_type, attention_type=attention_type,
                rope_freq_base=rope_freq_base, rope_freq_scale=rope_freq_scale, yarn_ext_factor=yarn_ext_factor,
                yarn_attn_factor=yarn_attn_factor, yarn_beta_fast=yarn_beta_fast, yarn_beta_slow=yarn_beta_slow,
                yarn_orig_ctx=yarn_orig_ctx, offload_kqv=offload_kqv, flash_attn=flash_attn, op_offload=op_offload,
                swa_full=swa_full, type_k=type_k, type_v=type_v)
            if logits_all:
                self._check_logits_all_fits()
        except BaseException:
            self._model.close()
            raise
        self.embedding = bool(embedding)
        self._pooling = self._ctx_opts.pop("pooling", None)
        self._embed_opts = {k: v for k, v in self._ctx_opts.items() if k in ("n_threads", "type_k", "type_v",
                                                                             "flash_attn", "offload_kqv")}
        self._seed = seed
        self._seed_lock = threading.Lock()
        self.last_n_tokens_size = int(last_n_tokens_size)
        self._cold_next = threading.Event()  # reset(): the next call starts from an empty context
        self.cache: Any = None
        self._session = Session(self._model, dict(self._ctx_opts), self._lora, logits_all=bool(logits_all))
        self.draft_model = draft_model
        self._spec: SpeculativeSession | None = None
        if draft_model is not None:
            try:
                n_ubatch = int(self._ctx_opts.get("n_ubatch", n_ubatch))
                self._spec = SpeculativeSession(self._model, drafter,
                                                n_draft=draft_length(draft_model, n_ubatch), **self._ctx_opts)
            except BaseException:
                self._model.close()
                raise
        self._is_recurrent = self._model.is_recurrent
        self._is_hybrid = self._model.is_hybrid
        # (read by frameworks: LlamaIndex's LlamaCPP reads context_params.n_ctx)
        self.context_params = SimpleNamespace(
            n_ctx=self.n_ctx(), n_batch=int(self._ctx_opts.get("n_batch", n_batch)),
            n_ubatch=int(self._ctx_opts.get("n_ubatch", n_ubatch)), n_threads=self._ctx_opts.get("n_threads"),
            n_threads_batch=self._ctx_opts.get("n_threads_batch"), embeddings=self.embedding)
        self.model_params = SimpleNamespace(n_gpu_layers=n_gpu_layers, split_mode=split_mode, main_gpu=main_gpu,
                                            vocab_only=vocab_only, use_mmap=use_mmap, use_mlock=use_mlock)

    # ---- options ------------------------------------------------------------------------------------

    def _check_logits_all_fits(self) -> None:
        """logits_all keeps n_ctx x n_vocab float32 rows (filled as tokens are decoded): refused when that
        is more than half this machine's memory, rather than growing until the process is killed."""
        need = int(self._ctx_opts["n_ctx"]) * self._model.n_vocab * 4
        total = detect_system_memory()
        if total and need > total // 2:
            raise InvalidArgumentError(
                f"logits_all=True keeps a row of {self._model.n_vocab} logits per context position: "
                f"{need / 2**30:.1f} GiB for n_ctx={self._ctx_opts['n_ctx']}, more than half of this machine's "
                f"{total / 2**30:.1f} GiB; give a smaller n_ctx")

    def _context_options(self, *, n_ctx: int, type_k: int | None, type_v: int | None, rope_scaling_type: int | None,
                         pooling_type: int, attention_type: int, flash_attn: bool, op_offload: bool | None,
                         swa_full: bool | None, **rest: Any) -> dict[str, Any]:
        opts: dict[str, Any] = {k: v for k, v in rest.items() if v is not None}
        opts["n_ctx"] = n_ctx if n_ctx else self._model.n_ctx_train
        # (as llama-cpp-python and llama.cpp: the batch at most the context, the micro-batch at most the batch;
        # LangChain passes n_batch=8 with the default n_ubatch=512)
        if isinstance(opts.get("n_batch"), int) and isinstance(opts["n_ctx"], int) and opts["n_ctx"] > 0:
            opts["n_batch"] = min(opts["n_batch"], opts["n_ctx"])
        if isinstance(opts.get("n_ubatch"), int) and isinstance(opts.get("n_batch"), int):
            opts["n_ubatch"] = min(opts["n_ubatch"], opts["n_batch"])
        opts["flash_attn"] = "enabled" if flash_attn else "disabled"
        for name, value, table, key in (("rope_scaling_type", rope_scaling_type, _ROPE, "rope_scaling"),
                                        ("pooling_type", pooling_type, _POOLING, "pooling"),
                                        ("attention_type", attention_type, _ATTENTION, "attention")):
            if value is None:
                continue
            if value not in table:
                raise InvalidArgumentError(f"{name}={value!r}: expected one of {sorted(table)}")
            if table[value] != "unspecified":
                opts[key] = table[value]
        for name, value in (("type_k", type_k), ("type_v", type_v)):
            if value is not None:
                if value not in _GGML_TYPE:
                    raise InvalidArgumentError(f"{name}={value!r}: expected a GGML type id among {sorted(_GGML_TYPE)}")
                opts[name] = _GGML_TYPE[value]
        if op_offload is not None:
            opts["op_offload"] = bool(op_offload)
        if swa_full is not None:
            opts["swa_full"] = bool(swa_full)
        if opts.get("yarn_attn_factor") == 1.0:  # (llama-cpp-python's default is llama.cpp's "from the model")
            opts.pop("yarn_attn_factor")
        if opts.get("yarn_beta_fast") == 32.0:
            opts.pop("yarn_beta_fast")
        if opts.get("yarn_beta_slow") == 1.0:
            opts.pop("yarn_beta_slow")
        # (checked now, as the context will check them: the session sizes its token array by n_ctx first)
        (fields,) = split_options(opts, ContextParams, where="Llama: unknown")
        ContextParams(**fields)
        return opts

    def _sampling(self, *, temperature: float, top_p: float, min_p: float, typical_p: float, top_k: int,
                  repeat_penalty: float, frequency_penalty: float, presence_penalty: float, tfs_z: float,
                  mirostat_mode: int, mirostat_tau: float, mirostat_eta: float, seed: int | None,
                  logit_bias: Mapping[int, float] | None, grammar: LlamaGrammar | None) -> dict[str, Any]:
        if tfs_z != 1.0:
            raise _refuse(f"tfs_z={tfs_z!r}", "llama.cpp removed tail-free sampling")
        if mirostat_mode not in (0, 1, 2):
            raise InvalidArgumentError(f"mirostat_mode={mirostat_mode!r}: expected 0, 1 or 2")
        if seed is _OWN_SEED:  # (the low-level methods: the Llama's seed as it is, LLAMA_DEFAULT_SEED random)
            seed = self._seed if self._seed != LLAMA_DEFAULT_SEED else random.randint(0, 2 ** 32 - 2)
        else:
            if seed is not None:  # (checked before it becomes the Llama's: a refused one must not stay)
                seed = _checked_seed(seed)
            with self._seed_lock:  # (as llama-cpp-python: the call's seed becomes the Llama's, or one drawn from it)
                if seed is None:
                    seed = random.Random(self._seed).randint(0, 2 ** 32 - 2)
                self._seed = int(seed)
            if seed == LLAMA_DEFAULT_SEED:  # (-1 or LLAMA_DEFAULT_SEED for this call: a random draw)
                seed = random.randint(0, 2 ** 32 - 2)
        opts: dict[str, Any] = dict(
            temp=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p, top_k=top_k, penalty_repeat=repeat_penalty,
            penalty_freq=frequency_penalty, penalty_present=presence_penalty, penalty_last_n=self.last_n_tokens_size,
            mirostat=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, seed=seed)
        if logit_bias:
            opts["logit_bias"] = {int(k): float(v) for k, v in logit_bias.items()}
        if grammar is not None:
            if not isinstance(grammar, LlamaGrammar):
                raise ArgumentTypeError(f"grammar must be a LlamaGrammar, not {type(grammar).__name__}")
            opts["grammar"] = grammar.grammar
        return opts

    def _target(self, media: bool = False) -> GenerationTarget:
        """What the plain (not hooked) calls generate on: with a ``draft_model``, the speculative session
        while it is free; the model's context pool otherwise (a stream left unfinished keeps the session,
        and prompts with images are not drafted for). Two threads that find it free at once: one gets
        BusyError."""
        if self._spec is not None and not media:
            try:
                with self._spec.context.lease():
                    return self._spec
            except BusyError:
                logger.debug("the speculative session is in use: this call runs without drafts")
        return LocalTarget(self._model)

    def _run_options(self, target: GenerationTarget) -> dict[str, Any]:
        if target is self._spec:  # (a session has its context already; it reuses prefixes as the pool does)
            opts: dict[str, Any] = {"cache_prompt": not self._model.uses_rpc}
        else:
            opts = dict(self._ctx_opts)
        if self._lora is not None:
            opts["lora"] = self._lora
        if self._cold_next.is_set():
            self._cold_next.clear()
            opts["cache_prompt"] = False
        return opts

    def _max_tokens(self, max_tokens: int | None) -> int:
        return -1 if max_tokens is None or max_tokens <= 0 else int(max_tokens)

    # ---- completions --------------------------------------------------------------------------------

    def __call__(self, prompt: str | list[int], **kwargs: Any) -> Any:
        return self.create_completion(prompt, **kwargs)

    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                          logprobs: int | None = None, echo: bool = False, stop: str | list[str] | None = None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                          top_k: int = 40, stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria: Any = None, logits_processor: Any = None,
                          grammar: LlamaGrammar | None = None,
                          logit_bias: Mapping[int, float] | None = None) -> Any:
        """A ``text_completion`` dict (or, with ``stream=True``, an iterator of its chunks).

        ``suffix``: with a model that has fill-in-the-middle tokens, the prompt is laid out as
        ``[FIM_PRE] prompt [FIM_SUF] suffix [FIM_MID]`` (suffix first with ``spm_infill``) and the text is the
        middle; with one that has none, the suffix is appended to the generated text (llama-cpp-python's
        documented meaning; its 0.3 releases put token 0 where the FIM tokens go)."""
        if suffix is not None:
            if not isinstance(suffix, str):
                raise ArgumentTypeError("suffix must be a str")
            args = {k: v for k, v in locals().items() if k not in ("self", "suffix")}
            fim = _fim.fim_prompt(self._model.vocab, prompt, suffix, self.spm_infill)
            if fim is None:  # (no FIM tokens: the suffix follows the generated text)
                out = self.create_completion(**args)
                return _fim.with_tail(out, suffix) if stream else _fim.appended(out, suffix)
            if echo:  # (the prompt as given, not the FIM layout)
                shown = prompt if isinstance(prompt, str) else self._model.vocab.detokenize([int(t) for t in prompt])
                return _fim.echoed(shown, self.create_completion(**{**args, "prompt": fim, "echo": False}), stream)
            prompt = fim
        prompt_logprobs = echo and logprobs is not None
        if prompt_logprobs and not self._session.logits_all:  # (llama-cpp-python's rule for any logprobs)
            raise InvalidArgumentError("echo with logprobs needs Llama(logits_all=True): the prompt's own "
                                       "logprobs are read from the logits after every prompt token")
        opts = self._sampling(temperature=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p, top_k=top_k,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, seed=seed, logit_bias=logit_bias,
                              grammar=grammar)
        hooked = bool(logits_processor) or bool(stopping_criteria) or self.cache is not None or prompt_logprobs
        target = None if hooked else self._target()
        if target is not None:
            opts.update(self._run_options(target))
        opts["max_tokens"] = self._max_tokens(max_tokens)
        if opts["max_tokens"] == -1:  # (llama-cpp-python: what the context leaves after the prompt)
            n_prompt = len(prompt) if not isinstance(prompt, str) else len(
                self._model.vocab.tokenize(prompt, add_special=True, parse_special=True))
            opts["max_tokens"] = max(1, self.n_ctx() - n_prompt)
        opts["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        if logprobs is not None:
            # (llama-cpp-python takes any number: past the vocabulary each token keeps a dict of all of it,
            # ~50 MB per token on a 262k vocabulary; OpenAI's bound, as our own API)
            if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidArgumentError(f"logprobs={logprobs!r}: expected a number of alternatives "
                                           f"0..{MAX_TOP_LOGPROBS}")
            opts["logprobs"] = logprobs
        if isinstance(prompt, str):
            prompt_text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            prompt = [int(t) for t in prompt]
            prompt_text = self._model.vocab.detokenize(prompt) if echo else ""
        else:
            raise ArgumentTypeError("prompt must be a str or a list of token ids")
        envelope = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                    "model": model or self.model_path}
        prefix = prompt_text if echo else ""
        if hooked:
            chunks = self._hooked_completion(envelope, prompt, prefix, opts, logits_processor, stopping_criteria,
                                             prompt_logprobs=prompt_logprobs)
            return chunks if stream else collect(chunks)
        if stream:
            return self._stream_completion(target, envelope, prompt, prefix, opts)
        done = lc_generate(target, prompt, **opts)
        return {**envelope, "choices": [{
            "text": prefix + done.text, "index": 0,
            "logprobs": completion_logprobs(done.logprobs, len(prefix)) if logprobs is not None else None,
            "finish_reason": finish_reason(done.finish_reason)}],
            "usage": token_usage(done.prompt_tokens, len(done.tokens))}

    def _stream_completion(self, target: GenerationTarget, envelope: dict[str, Any], prompt: Any, prefix: str,
                           opts: dict[str, Any]) -> Iterator[dict[str, Any]]:
        text_stream = target.stream(prompt, **opts)
        want_logprobs = "logprobs" in opts

        def chunks() -> Iterator[dict[str, Any]]:
            with text_stream:
                if prefix:
                    yield {**envelope, "choices": [{"text": prefix, "index": 0, "logprobs": None,
                                                    "finish_reason": None}]}
                offset = len(prefix)
                for piece in text_stream:
                    if not piece:
                        continue
                    yield {**envelope, "choices": [{"text": piece, "index": 0, "logprobs": None,
                                                    "finish_reason": None}]}
                    offset += len(piece)
                done = text_stream.completion()
            last = {"text": "", "index": 0, "logprobs": None, "finish_reason": finish_reason(done.finish_reason)}
            if want_logprobs:
                last["logprobs"] = completion_logprobs(done.logprobs, len(prefix))
            yield {**envelope, "choices": [last]}

        return chunks()

    # ---- chat ---------------------------------------------------------------------------------------

    def create_chat_completion(self, messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None = None,
                               function_call: Any = None, tools: list[dict[str, Any]] | None = None,
                               tool_choice: Any = None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | list[str] | None = None, seed: int | None = None,
                               response_format: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                               logits_processor: Any = None, grammar: LlamaGrammar | None = None,
                               logit_bias: Mapping[int, float] | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None) -> Any:
        """A ``chat.completion`` dict (or an iterator of ``chat.completion.chunk`` dicts), rendered with
        ``chat_format`` or the model's own template, tool calls parsed from the model's format. With a
        ``chat_handler`` (other than a projector's), the handler is called instead, with ``llama=self`` and
        these arguments, as llama-cpp-python does."""
        if self.chat_handler is not None and not self._projector_handler:
            return self.chat_handler(
                llama=self, messages=messages, functions=functions, function_call=function_call, tools=tools,
                tool_choice=tool_choice, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                typical_p=typical_p, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream, stop=stop,
                seed=seed, response_format=response_format, max_tokens=max_tokens, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, tfs_z=tfs_z,
                mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
                logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias)
        if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                         or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidArgumentError(f"top_logprobs={top_logprobs!r}: expected an integer 0..{MAX_TOP_LOGPROBS}")
        opts = self._sampling(temperature=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p, top_k=top_k,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, seed=seed, logit_bias=logit_bias,
                              grammar=grammar)
        if logits_processor:
            if tools or functions or response_format is not None:
                raise _refuse("logits_processor with tools, functions or response_format",
                              "the processor decides what the model may write (docs/compat.md)")
            if logprobs:
                raise _refuse("logprobs with logits_processor on chat completions",
                              "not carried over yet (docs/compat.md)")
            if _has_media(messages):
                raise _refuse("logits_processor on chat messages with image or audio parts",
                              "not carried over yet (docs/compat.md)")
            return self._hooked_chat(messages, opts, max_tokens, stop, stream, logits_processor,
                                     model or self.model_path,
                                     CHAT_FORMATS[self.chat_format] if self.chat_format else None)
        target = self._target(media=_has_media(messages))
        opts.update(self._run_options(target))
        opts["max_tokens"] = self._max_tokens(max_tokens)
        opts["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        if logprobs:  # (OpenAI's meaning: the chosen tokens' logprobs, with top_logprobs alternatives each)
            opts["logprobs"] = top_logprobs or 0
        if self.chat_format is not None:
            opts["chat_template"] = CHAT_FORMATS[self.chat_format]
        if functions:  # (OpenAI's deprecated form: each function a tool)
            if tools:
                raise InvalidArgumentError("pass tools or functions, not both")
            tools = [{"type": "function", "function": f} for f in functions]
            if isinstance(function_call, Mapping):
                tool_choice = {"type": "function", "function": {"name": function_call.get("name")}}
            elif function_call in ("auto", "none"):
                tool_choice = function_call
        if tools:
            opts["tools"] = list(tools)
            if tool_choice is not None:
                opts["tool_choice"] = tool_choice
        schema = response_schema(response_format)
        if schema is not None:
            if grammar is not None:
                raise InvalidArgumentError("pass response_format or grammar, not both")
            opts["json_schema"] = schema
        out = stream_chat_completion(target, messages, **opts) if stream else chat_completion(target, messages, **opts)
        name = model or self.model_path  # (llama-cpp-python names the model by its path)
        if stream:
            return (restamp(chunk, name) for chunk in out)
        return restamp(out, name)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`create_chat_completion` as the ``openai`` package's types (``ChatCompletion``, or an
        iterator of ``ChatCompletionChunk``): needs ``openai`` installed."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError as exc:
            raise ImportError("create_chat_completion_openai_v1 needs the openai package") from exc
        out = self.create_chat_completion(*args, **kwargs)
        if kwargs.get("stream"):
            return (ChatCompletionChunk(**chunk) for chunk in out)
        return ChatCompletion(**out)

    # ---- embeddings ---------------------------------------------------------------------------------

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False) -> Any:
        """Vectors as lists of floats: one for a str, a list for a list (llama-cpp-python's shapes; without
        pooling, one vector per token)."""
        if not self.embedding:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        single = isinstance(input, str)
        texts = [input] if single else list(input)
        usage = EmbedUsage()
        # (packed without alignment padding, as llama-cpp-python packs them: its speed, and its dependence of
        # a vector on its batch-mates)
        vectors = lc_embed(self._model, texts, normalize=normalize, truncate=truncate, pooling=self._pooling,
                           usage=usage, batch_invariant=False, **self._embed_opts) if texts else []
        rows = [np.asarray(v).tolist() for v in vectors]
        result: Any = rows[0] if single else rows
        return (result, usage.tokens) if return_count else result

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict[str, Any]:
        """An OpenAI ``list`` of ``embedding`` objects, with usage."""
        single = isinstance(input, str)
        vectors, tokens = self.embed(input, return_count=True)
        rows = [vectors] if single else vectors
        return {"object": "list", "data": [{"object": "embedding", "embedding": row, "index": i}
                                           for i, row in enumerate(rows)],
                "model": model or self.model_path, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # ---- tokens and the model -----------------------------------------------------------------------

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        if not isinstance(text, (bytes, bytearray)):
            raise ArgumentTypeError("tokenize takes bytes (text.encode('utf-8'))")
        return self._model.vocab.tokenize(bytes(text).decode("utf-8"), add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        """The tokens' pieces as bytes (a leading space after BOS dropped, as llama-cpp-python does;
        ``prev_tokens`` is taken and, as there, not used)."""
        vocab = self._model.vocab
        out = b"".join(vocab.token_bytes(vocab.check_token(int(t)), special=special) for t in tokens)
        if tokens and int(tokens[0]) == vocab.bos and out.startswith(b" "):
            out = out[1:]
        return out

    def tokenizer(self) -> "LlamaTokenizer":
        """llama-cpp-python's tokenizer object over this model's vocabulary."""
        return LlamaTokenizer(self)

    @property
    def model(self) -> "LlamaModelHandle":
        """The model, for :func:`llama_model_get_vocab` (no raw pointer: the handle keeps the model alive)."""
        return LlamaModelHandle(self._model)

    def token_bos(self) -> int:
        return _id(self._model.vocab.bos)

    def token_eos(self) -> int:
        return _id(self._model.vocab.eos)

    def token_nl(self) -> int:
        return _id(self._model.vocab.nl)

    def n_ctx(self) -> int:
        return int(self._ctx_opts["n_ctx"])

    @property
    def _ctx(self) -> ContextView:
        # (llama-cpp-python's internal wrapper; its own tests and some user code read ``_ctx.ctx``)
        return ContextView(self._session.handle())

    def n_embd(self) -> int:
        return self._model.n_embd

    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._model.metadata)

    def set_seed(self, seed: int) -> None:
        seed = _checked_seed(seed)
        with self._seed_lock:
            self._seed = seed

    def reset(self) -> None:
        """The next call starts from an empty context (its prompt fully decoded); the own context of
        :meth:`eval` is emptied."""
        self._cold_next.set()
        with self._session.lock:
            self._session.reset()

    def set_cache(self, cache: Any) -> None:
        """Completions save their state into ``cache`` (a ``LlamaRAMCache`` or ``LlamaDiskCache``) and start
        from the longest cached prefix of their prompt (on this ``Llama``'s own context; ``None``: back to
        the pooled contexts, which keep their last prompts by themselves)."""
        self.cache = cache

    # ---- the low-level loop (the Llama's own context) -------------------------------------------------

    @property
    def n_tokens(self) -> int:
        """Tokens the own context holds (what :meth:`eval` decoded)."""
        return self._session.n_tokens

    @property
    def input_ids(self) -> np.ndarray:
        """The own context's token ids (n_ctx of them; the first :attr:`n_tokens` are held)."""
        return self._session.input_ids

    @property
    def scores(self) -> np.ndarray:
        """The logits after each token held, ``(n_tokens, n_vocab)``, with ``logits_all=True`` (a read-only
        view that the next eval overwrites); else those after the last one, as a (1, n_vocab) array."""
        with self._session.lock:
            if self._session.logits_all:
                return self._session.rows()
            return self._session.scores()[None, :]

    def eval(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` after those the own context holds."""
        with self._session.lock:
            self._session.eval(tokens)

    def _params(self, *, temp: float, top_k: int, top_p: float, min_p: float, typical_p: float,
                repeat_penalty: float, frequency_penalty: float, presence_penalty: float, tfs_z: float,
                mirostat_mode: int, mirostat_tau: float, mirostat_eta: float, grammar: LlamaGrammar | None,
                seed: int | None = None) -> SamplingParams:
        opts = self._sampling(temperature=temp, top_p=top_p, min_p=min_p, typical_p=typical_p, top_k=top_k,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                              seed=_OWN_SEED if seed is None else seed, logit_bias=None, grammar=grammar)
        return SamplingParams(**opts)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
               mirostat_eta: float = 0.1, mirostat_tau: float = 5.0, penalize_nl: bool = True,
               logits_processor: Any = None, grammar: LlamaGrammar | None = None, idx: int | None = None) -> int:
        """One token from the logits after the last token held, or after token ``idx`` (any held one with
        ``logits_all=True``; without it only the last row is kept, as in llama-cpp-python)."""
        from ...core.sampler import Sampler

        with self._session.lock:
            params = self._params(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                  repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                                  mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
            with Sampler(self._model, params) as sampler:
                return self._session.sample(sampler, logits_processor, idx)

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor: Any = None, stopping_criteria: Any = None,
                 grammar: LlamaGrammar | None = None) -> Iterator[int]:
        """Tokens after ``tokens``, endlessly (stop iterating to stop); the prefix the own context holds is
        reused. ``send(list_of_tokens)`` feeds other tokens than the one yielded, as llama-cpp-python's."""
        params = self._params(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)

        def tokens_out() -> Iterator[int]:
            with self._session.lock:
                yield from self._session.generate(tokens, params, reset=reset, logits_processor=logits_processor,
                                                  stopping_criteria=stopping_criteria)

        return tokens_out()

    def save_state(self) -> LlamaState:
        """The own context's state (tokens, last logits, KV) and the seed."""
        with self._session.lock:
            return self._session.save_state(self._seed, self.model_path)

    def load_state(self, state: LlamaState) -> None:
        """Restore a :meth:`save_state` (of a ``Llama`` of the same model and context options)."""
        seed = _checked_seed(getattr(state, "seed", None))
        with self._session.lock:
            self._session.load_state(state)
            with self._seed_lock:
                self._seed = seed

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, *, local_dir: str | None = None,
                        cache_dir: str | None = None, **kwargs: Any) -> "Llama":
        """Download (or find in the cache) ``filename`` of a Hugging Face repo through our Hub client."""
        from ...features import hub

        if local_dir is not None:
            raise _refuse("local_dir", "files live in the Hub client's cache (cache_dir=)")
        path = hub.download(repo_id, filename, **({"cache_dir": cache_dir} if cache_dir else {}))
        return cls(model_path=os.fspath(path), **kwargs)

    def close(self) -> None:
        if getattr(self, "_spec", None) is not None:
            self._spec.close()
        self._session.close()
        self._model.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        model = getattr(self, "_model", None)
        if model is not None:
            try:
                model.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def _has_media(messages: Any) -> bool:
    """Whether chat messages carry image or audio parts."""
    return isinstance(messages, Sequence) and any(
        isinstance(m, Mapping) and isinstance(m.get("content"), list)
        and any(isinstance(p, Mapping) and p.get("type") != "text" for p in m["content"]) for m in messages)


def _id(token: int | None) -> int:
    return -1 if token is None else int(token)
