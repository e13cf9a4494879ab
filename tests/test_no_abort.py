"""No documented option aborts the process: property tests over the option space of every entry point.

Hypothesis draws option mixes (model loading, context, sampling, generation, server, speculative),
hostile values included (0, negative, 2**31 and 2**32, NaN, infinities, wrong types, token ids out of
range), and calls the one-call API, ``Context.create`` + generate, ``lc.embed``, a Server and a
SpeculativeSession, and loads models, in a child process (tests/abort_worker.py). Every example must either run or raise
an :class:`lc.LlamaError`: a child that dies (a llama.cpp assert, a segfault), hangs, or raises anything
else is a failure naming the case.

Bounded: ``LLAMA_CTYPES_FUZZ_EXAMPLES`` examples per entry point (default 25: about two minutes in all on
2 cores), from ``LLAMA_CTYPES_FUZZ_SEED`` (default fixed, so CI is repeatable; set another, or
``random``, to explore further).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import llama_ctypes as lc

HERE = Path(__file__).resolve().parent
EXAMPLES = int(os.environ.get("LLAMA_CTYPES_FUZZ_EXAMPLES", "25"))
_SEED = os.environ.get("LLAMA_CTYPES_FUZZ_SEED", "20261203")
SEED = None if _SEED == "random" else int(_SEED)
CASE_TIMEOUT = 90.0  # seconds one case may take before it counts as a hang

pytestmark = pytest.mark.timeout(900)


def _seeded(fn):
    return seed(SEED)(fn) if SEED is not None else fn


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=list(HealthCheck), print_blob=True)


class Worker:
    """tests/abort_worker.py in a child process; restarted after a case kills it."""

    def __init__(self, models: dict[str, Path]):
        self.models = models
        self.proc: subprocess.Popen | None = None
        self.stderr: list[str] = []

    def _start(self) -> None:
        args = [f"{name}={path}" for name, path in self.models.items()]
        env = dict(os.environ, PYTHONFAULTHANDLER="1", GGML_NO_BACKTRACE="1")  # (no gdb attach per abort)
        # (the package this process tests, not another copy an environment may hold: a script's own folder,
        # not the checkout, heads its sys.path)
        package_root = str(Path(lc.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, str(HERE / "abort_worker.py"), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.stderr = []
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        line = self.proc.stdout.readline()
        assert line and json.loads(line).get("ready"), f"worker did not start: {''.join(self.stderr)[-2000:]}"

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-200]

    def call(self, case: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        proc.stdin.write(json.dumps(case) + "\n")
        proc.stdin.flush()
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(CASE_TIMEOUT)
        if reader.is_alive():
            proc.kill()
            proc.wait()
            self.proc = None
            return {"hang": CASE_TIMEOUT}
        if not result or not result[0]:
            rc = proc.wait()
            self.proc = None
            return {"died": rc, "stderr": "".join(self.stderr)[-3000:]}
        return json.loads(result[0])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def worker(tiny_model_path, gemma_path, tmp_path_factory, vocab_dir):
    from tiny_models import write_tiny_qwen35

    hybrid = write_tiny_qwen35(tmp_path_factory.mktemp("fuzz") / "tiny-qwen35.gguf",
                               vocab_dir / "ggml-vocab-llama-spm.gguf")
    w = Worker({"tiny": tiny_model_path, "hybrid": hybrid, "gemma": gemma_path})
    yield w
    w.close()


def _f(x: float):
    """A float as JSON can carry it (NaN and the infinities tagged)."""
    return {"$float": repr(x)} if not math.isfinite(x) else x


# ---- strategies ---------------------------------------------------------------------------------
HOSTILE_INTS = [-(2 ** 31), -(2 ** 32), -2, -1, 0, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64]
WRONG_TYPES = [None, "8", 1.5, True, [1]]


def ints(lo: int, hi: int, *special: int) -> st.SearchStrategy:
    """Mostly sensible values in [lo, hi], sometimes edge or hostile ones (and rarely a wrong type)."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi),
                     st.sampled_from(list(special) + HOSTILE_INTS), st.sampled_from(WRONG_TYPES))


def floats(lo: float, hi: float, *special: float) -> st.SearchStrategy:
    hostile = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, -1e30]
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi),
                     st.sampled_from(list(special) + hostile).map(_f))


def maybe(**fields: st.SearchStrategy) -> st.SearchStrategy:
    """A dict holding a random subset of ``fields`` (most calls set only a few options)."""
    return st.fixed_dictionaries({}, optional=fields)


CONTEXT = maybe(
    n_ctx=ints(0, 4096, 1, 2, 8, 16, 64, 128),
    n_batch=ints(1, 2048, 1, 2, 3, 4),
    n_ubatch=ints(1, 512, 1, 2, 3),
    n_seq_max=ints(1, 8, 2, 3, 64, 256, 257),
    n_threads=ints(1, 4),
    n_threads_batch=ints(1, 4),
    type_k=st.sampled_from(["f16", "f32", "q8_0", "q4_0", "bf16", "iq4_nl", "q5_1", "bogus"]),
    type_v=st.sampled_from(["f16", "f32", "q8_0", "q4_0", "bf16", "bogus"]),
    flash_attn=st.sampled_from(["auto", "enabled", "disabled", "on"]),
    rope_scaling=st.sampled_from(["unspecified", "none", "linear", "yarn", "longrope"]),
    rope_freq_base=floats(0.0, 1e6, 10000.0),
    rope_freq_scale=floats(0.0, 4.0, 0.5, 1.0),
    yarn_ext_factor=floats(-1.0, 2.0),
    yarn_attn_factor=floats(-1.0, 2.0),
    yarn_beta_fast=floats(-1.0, 64.0),
    yarn_beta_slow=floats(-1.0, 4.0),
    yarn_orig_ctx=ints(0, 8192),
    offload_kqv=st.booleans(),
    op_offload=st.booleans(),
    swa_full=st.booleans(),
    kv_unified=st.booleans(),
    embeddings=st.booleans(),
    pooling=st.sampled_from(["unspecified", "none", "mean", "cls", "last", "rank"]),
    attention=st.sampled_from(["unspecified", "causal", "non_causal"]),
    n_rs_seq=ints(0, 4),
    n_outputs_max=ints(0, 64, 1, 2),
)

SAMPLING = maybe(
    temp=floats(0.0, 2.0, 0.0, -1.0),
    top_k=ints(0, 100, 1, 300000),
    top_p=floats(0.0, 1.0),
    min_p=floats(0.0, 1.0),
    typical_p=floats(0.01, 1.0),
    top_n_sigma=floats(-1.0, 3.0),
    xtc_probability=floats(0.0, 1.0),
    xtc_threshold=floats(0.0, 1.0),
    dynatemp_range=floats(0.0, 2.0),
    dynatemp_exponent=floats(0.0, 2.0),
    mirostat=ints(0, 2, 3),
    mirostat_tau=floats(0.01, 10.0),
    mirostat_eta=floats(0.01, 1.0),
    penalty_last_n=ints(-1, 128, 2 ** 31 - 1),
    penalty_repeat=floats(0.5, 2.0),
    penalty_freq=floats(-1.0, 1.0),
    penalty_present=floats(-1.0, 1.0),
    dry_multiplier=floats(0.0, 2.0),
    dry_base=floats(1.0, 3.0),
    dry_allowed_length=ints(0, 8),
    dry_penalty_last_n=ints(-1, 128, 2 ** 31 - 1),
    dry_sequence_breakers=st.lists(st.sampled_from(["\n", ":", "", "x" * 300, "\x00", "\ud800"]), max_size=4),
    adaptive_target=floats(-1.0, 1.0),
    adaptive_decay=floats(0.0, 0.99),
    logit_bias=st.dictionaries(st.sampled_from([0, 1, 2, 31999, 32000, 262143, 262144, 10 ** 9, -1]),
                               st.sampled_from([1.0, -5.0, _f(-math.inf), _f(math.inf), _f(math.nan)]), max_size=3)
    .map(lambda d: {str(k): v for k, v in d.items()}),
    seed=ints(0, 2 ** 32 - 2),
    min_keep=ints(0, 10, 300000),
    grammar=st.sampled_from(['root ::= "a"+', 'root ::= [a-z]{1,3}', "root ::= x", "root ::= ", "", 'root ::= "a"*',
                             'root ::= ("a" | "b")? root?', 'root ::= [\\x00-\\x{10FFFF}]{0,100000}']),
    json_schema=st.sampled_from([{"type": "integer"}, {"type": "string", "maxLength": 3},
                                 {"type": "array", "minItems": 100000}, {"type": "bogus"},
                                 {"type": "string", "pattern": "(a+)+$"}]),
    grammar_lazy_triggers=st.lists(st.sampled_from(["x", "(a+)+", "[", "", ".", "e", "[a-z]"]), max_size=2),
    backend_sampling=st.booleans(),
)

GENERATION = maybe(
    max_tokens=ints(1, 8, 0, -1),
    stop=st.lists(st.sampled_from(["\n", "a", "the", "", "\ud800", "x" * 5000]), max_size=3),
    ignore_eos=st.booleans(),
    add_special=st.booleans(),
    parse_special=st.booleans(),
    special=st.booleans(),
    cache_prompt=st.booleans(),
    logprobs=ints(0, 5, 20, 21),
    post_sampling=st.booleans(),
)

PROMPTS = st.one_of(
    st.sampled_from(["Hi", "", "Hi there friend how are you", "<start_of_turn>user\nHello<end_of_turn>",
                     "\x00", "word " * 300]),
    st.text(max_size=40),
    st.lists(st.sampled_from([0, 1, 2, 100, 31999, 32000, 262143, 262144, -1, 2 ** 31 - 1]), max_size=6),
)

MODELS = st.sampled_from(["tiny", "tiny", "hybrid", "gemma"])


def _fix(case: dict) -> dict:
    """Keep each case bounded in time: no unbounded generation on a big context, and no 256 tokens by default
    either (the cases are about options, not length: Gemma's answer to "Hi" under a loaded machine once took
    more than CASE_TIMEOUT)."""
    generating = [case["opts"].get("gen", {})] + ([case["opts"]] if case["api"] in ("generate", "stream") else [])
    for group in (case["opts"], case["opts"].get("gen", {})):
        if group.get("max_tokens") == -1:
            group["max_tokens"] = 8  # -1 means "until the context is full": correct, but minutes on Gemma
    for group in generating:
        group.setdefault("max_tokens", 16)
    return case


def check(worker: Worker, case: dict) -> None:
    result = worker.call(_fix(case))
    if "ok" in result or "error" in result:
        return
    if "died" in result:
        pytest.fail(f"the process died (exit {result['died']}) on {case!r}\n{result['stderr']}")
    if "hang" in result:
        pytest.fail(f"no answer in {CASE_TIMEOUT:.0f} s on {case!r}")
    pytest.fail(f"{result['unexpected']} (not an LlamaError) on {case!r}: {result['message']}\n"
                f"{result.get('traceback', '')}")


# ---- the properties -------------------------------------------------------------------------------
@_seeded
@FUZZ
@given(model=MODELS, prompt=PROMPTS, ctx=CONTEXT, sampling=SAMPLING, gen=GENERATION, api=st.sampled_from(["generate", "stream"]))
def test_one_call_api_never_aborts(worker, model, prompt, ctx, sampling, gen, api):
    check(worker, {"api": api, "model": model, "prompt": prompt, "opts": {**ctx, **sampling, **gen}})


@_seeded
@FUZZ
@given(model=MODELS, prompt=PROMPTS, ctx=CONTEXT, sampling=SAMPLING, gen=GENERATION)
def test_context_and_sampler_never_abort(worker, model, prompt, ctx, sampling, gen):
    check(worker, {"api": "context", "model": model, "prompt": prompt,
                   "opts": {"ctx": ctx, "sampling": sampling, "gen": gen}})


EMBED_CONTEXT = maybe(n_threads=ints(1, 4), type_k=st.sampled_from(["f16", "f32", "q8_0", "bogus"]),
                      flash_attn=st.sampled_from(["auto", "enabled", "disabled"]),
                      attention=st.sampled_from(["unspecified", "causal", "non_causal"]),
                      rope_freq_base=floats(0.0, 1e6), swa_full=st.booleans(), n_rs_seq=ints(0, 4),
                      n_batch=ints(1, 4096, 1, 2, 3), n_seq_max=ints(1, 4), embeddings=st.booleans())


@_seeded
@FUZZ
@given(model=MODELS, texts=st.one_of(PROMPTS, st.lists(st.sampled_from(["a", "", "word " * 600, "\x00"]), max_size=5)),
       opts=EMBED_CONTEXT, pooling=st.sampled_from([None, "none", "mean", "cls", "last", "rank", "max"]),
       normalize=st.sampled_from([True, False, None]), truncate=st.booleans())
def test_embed_never_aborts(worker, model, texts, opts, pooling, normalize, truncate):
    check(worker, {"api": "embed", "model": model, "prompt": texts,
                   "opts": {**opts, "pooling": pooling, "normalize": normalize, "truncate": truncate}})


SERVER = maybe(n_parallel=ints(1, 4, 64, 257), n_ctx=ints(0, 4096, 1, 16, 64), n_batch=ints(1, 1024, 1, 2),
               max_queue=ints(0, 8), cache_prompt=st.booleans(), prompt_cache_ram_mb=floats(0.0, 64.0),
               kv_unified=st.booleans(), share_kv=st.booleans(), n_ubatch=ints(1, 512, 1, 2),
               type_k=st.sampled_from(["f16", "q8_0", "q4_0"]), swa_full=st.booleans(),
               n_outputs_max=ints(0, 16, 1), n_seq_max=ints(1, 8), embeddings=st.booleans(),
               attention=st.sampled_from(["unspecified", "non_causal"]), rope_freq_scale=floats(0.0, 4.0))


@_seeded
@FUZZ
@given(model=MODELS, prompt=PROMPTS, server=SERVER, sampling=SAMPLING, gen=GENERATION)
def test_server_never_aborts(worker, model, prompt, server, sampling, gen):
    check(worker, {"api": "server", "model": model, "prompt": prompt,
                   "opts": {"server": server, "gen": {**sampling, **gen}}})


SESSION = maybe(n_draft=ints(1, 8, 0, 64, 65), n_ctx=ints(0, 4096, 1, 16, 64), n_batch=ints(1, 1024, 1, 2),
                n_ubatch=ints(1, 512, 1, 2), n_seq_max=ints(1, 4), kv_unified=st.booleans(), swa_full=st.booleans(),
                n_outputs_max=ints(0, 16, 1), n_rs_seq=ints(0, 8), embeddings=st.booleans())


@_seeded
@FUZZ
@given(model=MODELS, prompt=PROMPTS, session=SESSION, sampling=SAMPLING, gen=GENERATION)
def test_speculative_session_never_aborts(worker, model, prompt, session, sampling, gen):
    check(worker, {"api": "speculative", "model": model, "prompt": prompt,
                   "opts": {"session": session, "gen": {**sampling, **gen}}})


MODEL = maybe(
    n_gpu_layers=ints(-1, 100),
    split_mode=st.sampled_from(["none", "layer", "row", "tensor", "bogus"]),
    main_gpu=ints(0, 2),
    tensor_split=st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0, _f(math.nan), _f(math.inf)]), max_size=3),
    use_mmap=st.sampled_from([None, True, False]),
    use_direct_io=st.booleans(),
    vocab_only=st.booleans(),
    check_tensors=st.booleans(),
    use_extra_bufts=st.booleans(),
    no_host=st.booleans(),
    load_mtp=st.booleans(),
    kv_overrides=st.dictionaries(
        st.sampled_from(["llama.context_length", "llama.block_count", "llama.embedding_length",
                         "llama.attention.head_count", "llama.attention.head_count_kv", "llama.vocab_size",
                         "gemma3.attention.sliding_window", "gemma3.context_length", "gemma3.block_count",
                         "qwen35.block_count", "qwen35.nextn_predict_layers", "general.architecture",
                         "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "x" * 127]),
        st.sampled_from([0, 1, -1, 7, 2 ** 31 - 1, 2 ** 40, 1.5, True, False, "llama", ""]), max_size=2),
)


@_seeded
@FUZZ
@given(model=MODELS, prompt=PROMPTS, load=MODEL, gen=GENERATION)
def test_model_load_options_never_abort(worker, model, prompt, load, gen):
    check(worker, {"api": "load", "model": model, "prompt": prompt, "opts": {"model": load, "gen": gen}})


# ---- the reproductions from the hostile run, one by one (Gemma 3 270M) ----------------------------------
REPRODUCTIONS = [  # (api, prompt, options, what must happen: "ok" runs, else the LlamaError class refusing it)
    ("generate", "Hi", {"max_tokens": 3, "n_seq_max": 2}, "ok"),
    ("generate", "Hi", {"max_tokens": 3, "n_seq_max": 2, "kv_unified": True}, "ok"),
    ("generate", "Hi", {"max_tokens": 3, "n_seq_max": 2, "swa_full": True}, "ok"),
    ("stream", "Hi", {"max_tokens": 3, "n_seq_max": 2, "logprobs": 2}, "ok"),
    ("generate", "Hi", {"max_tokens": 3, "embeddings": True}, "InvalidArgumentError"),
    ("generate", "Hi there friend how are you",
     {"max_tokens": 3, "attention": "non_causal", "n_batch": 4, "n_ubatch": 2}, "InvalidArgumentError"),
    ("generate", "Hi", {"max_tokens": 3, "penalty_last_n": 2 ** 31 - 1, "penalty_repeat": 1.1}, "ok"),
    ("context", "Hi there friend how are you", {"ctx": {"embeddings": True, "n_outputs_max": 2}},
     "InvalidArgumentError"),
]


@pytest.mark.gemma
@pytest.mark.parametrize("api,prompt,opts,expected", REPRODUCTIONS, ids=lambda x: str(x)[:40])
def test_hostile_run_reproductions_do_not_abort(worker, api, prompt, opts, expected):
    result = worker.call({"api": api, "model": "gemma", "prompt": prompt, "opts": opts})
    assert "died" not in result, result.get("stderr")
    assert ("ok" if "ok" in result else result.get("error")) == expected, result


@pytest.mark.parametrize("name,value", [("rope_freq_base", math.nan), ("rope_freq_scale", -1.0),
                                        ("yarn_ext_factor", math.inf), ("yarn_attn_factor", -math.inf),
                                        ("n_ctx", 2 ** 32), ("n_batch", 2 ** 32 + 8), ("n_seq_max", 257),
                                        ("n_ctx", None)])  # (hypothesis found None reaching ctypes)
def test_context_options_out_of_range_are_refused(tiny_model, name, value):
    with pytest.raises(lc.InvalidArgumentError, match=name):
        lc.generate(tiny_model, "Hi", max_tokens=2, **{name: value})


def test_partial_seq_cp_across_kv_streams_is_refused(tiny_model):
    """Without kv_unified each sequence has its own KV stream, which llama.cpp copies only whole
    (an assert otherwise); a whole copy still works, and so does a partial one in a unified cache."""
    ids = lc.Tokenizer.encode(tiny_model, "hello world how are you")
    for unified in (False, True):
        with lc.Context.create(tiny_model, n_ctx=256, n_seq_max=2, kv_unified=unified) as ctx, \
                lc.Sampler.create(tiny_model, temp=0) as smp:
            ctx.generate(smp, ids, max_tokens=2)
            if unified:
                ctx.seq_cp(0, 1, 2, 5)
                assert ctx.seq_pos_max(1) == 4
            else:
                with pytest.raises(lc.InvalidArgumentError, match="kv_unified"):
                    ctx.seq_cp(0, 1, 2, 5)
                ctx.seq_cp(0, 1)
                assert ctx.seq_pos_max(1) == ctx.seq_pos_max(0)
            for bad in (2 ** 31, -2, 1.5, True):
                with pytest.raises(lc.InvalidArgumentError, match="p0"):
                    ctx.seq_rm(0, bad, -1)
