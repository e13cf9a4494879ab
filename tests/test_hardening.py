"""Regression tests for the core defects of the hardening review (issue 17).

Each test names the defect it covers. They misuse the API as a hostile user
would; every failure must be a clear exception, never a crash.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import llama_ctypes as lc
from margins import assert_greedy_equivalent
from llama_ctypes.core.context_pool import ContextPool

PROMPT = "The quick brown fox"


def ids(model, text=PROMPT):
    return lc.Tokenizer.encode(model, text)


# ---- 1 / 12: a running stream holds its Sampler; one Sampler serves one generation ----------------------

def test_stream_keeps_a_closed_sampler_alive(tiny_model):
    with lc.Context.create(tiny_model, n_ctx=256) as ctx:
        with lc.Sampler.create(tiny_model, temp=0.8, seed=1) as smp:
            st = ctx.stream(smp, ids(tiny_model), max_tokens=20, ignore_eos=True)
        assert smp.closed
        out = st.completion()  # the stream still holds the sampler: no freed pointer reaches C
        assert len(out.tokens) == 20
        with pytest.raises(lc.ClosedError):
            smp.sample(ctx)
        with pytest.raises(lc.ClosedError):
            ctx.stream(smp, ids(tiny_model), max_tokens=2)


def test_stream_keeps_a_closed_context_alive(tiny_model):
    smp = lc.Sampler.create(tiny_model, temp=0)
    ctx = lc.Context.create(tiny_model, n_ctx=256)
    st = ctx.stream(smp, ids(tiny_model), max_tokens=8, ignore_eos=True)
    ctx.close()
    assert len(st.completion().tokens) == 8
    with pytest.raises(lc.ClosedError):
        ctx.seq_pos_max(0)
    smp.close()


def test_one_sampler_shared_by_two_threads_raises_busy(tiny_model):
    smp = lc.Sampler.create(tiny_model, temp=0.8, seed=3)
    ctxs = [lc.Context.create(tiny_model, n_ctx=512) for _ in range(2)]
    errors: list[BaseException] = []
    done: list[int] = []
    start = threading.Barrier(2)

    def work(ctx):
        start.wait()
        for _ in range(20):
            try:
                done.append(len(ctx.generate(smp, ids(tiny_model), max_tokens=30, ignore_eos=True).tokens))
            except lc.BusyError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in ctxs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done and all(n == 30 for n in done)
    assert errors, "two threads generating with one Sampler must meet BusyError"
    # and a stream holding the sampler refuses a second user at once
    st = ctxs[0].stream(smp, ids(tiny_model), max_tokens=5)
    next(st)
    with pytest.raises(lc.BusyError):
        ctxs[1].generate(smp, ids(tiny_model), max_tokens=2)
    st.close()
    for c in ctxs:
        c.close()
    smp.close()


# ---- 2: -1 penalty windows mean the whole context ---------------------------------------------------

def test_minus_one_penalty_windows_build_active_samplers(tiny_model):
    with lc.Sampler.create(tiny_model, dry_multiplier=0.8) as smp:
        assert "dry" in smp.names and "?dry" not in smp.names
    with lc.Sampler.create(tiny_model, penalty_repeat=1.3, penalty_last_n=-1) as smp:
        assert "penalties" in smp.names and "?penalties" not in smp.names


def test_whole_context_presence_penalty_forbids_every_repeat(tiny_model):
    # Greedy on random weights loops quickly; a huge presence penalty over the whole context
    # (-1) makes every generated token new. With the window turned off, tokens repeat.
    opts = dict(temp=0, max_tokens=60, ignore_eos=True)
    plain = lc.generate(tiny_model, PROMPT, **opts)
    assert len(set(plain.tokens)) < len(plain.tokens), "the test needs a model that repeats itself"
    penalised = lc.generate(tiny_model, PROMPT, penalty_present=1e4, penalty_last_n=-1, **opts)
    assert len(set(penalised.tokens)) == len(penalised.tokens) == 60


# ---- 9: Model.close racing a finishing stream --------------------------------------------------------

def test_model_close_racing_stream_end_frees_everything(tiny_model_path):
    for i in range(12):
        model = lc.load_model(tiny_model_path)
        st = lc.stream(model, PROMPT, max_tokens=4, temp=0)
        next(st)
        finisher = threading.Thread(target=st.completion)
        finisher.start()
        if i % 2:
            time.sleep(0.001)
        model.close()
        finisher.join()
        assert model.freed, "an idle context put back after close keeps the weights alive"
        with pytest.raises(lc.ClosedError):
            ContextPool.of(model)


# ---- 10: cancel from another thread, during a long prefill -----------------------------------------------

@pytest.mark.gemma
def test_cancel_from_another_thread_aborts_a_long_prefill(gemma):
    prompt = ids(gemma, "word " * 6000)[:6000]
    with lc.Context.create(gemma, n_ctx=8192, n_batch=8192, n_ubatch=512) as ctx, \
            lc.Sampler.create(gemma, temp=0) as smp:
        st = ctx.stream(smp, prompt, max_tokens=4)
        result: dict = {}

        def consume():
            t0 = time.perf_counter()
            try:
                st.completion()
            except BaseException as exc:
                result["error"] = exc
            result["s"] = time.perf_counter() - t0
            result["end"] = time.perf_counter()

        t = threading.Thread(target=consume)
        t.start()
        time.sleep(0.5)
        cancelled_at = time.perf_counter()
        st.cancel()
        t.join(60)
        assert isinstance(result.get("error"), lc.CancelledError), result
        assert result["end"] - cancelled_at < 1.5, "the decode in flight was not aborted"
        assert st.cancelled
        # the context is usable again, and consistent: a fresh generation works
        assert len(ctx.generate(smp, ids(gemma, "Hello"), max_tokens=3, ignore_eos=True).tokens) == 3


def _consume_in_thread(st):
    out: dict = {"pieces": [], "error": None}

    def consume():
        try:
            for piece in st:
                out["pieces"].append(piece)
                time.sleep(0.001)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=consume)
    t.start()
    return t, out


def test_cancel_and_close_from_another_thread(tiny_model):
    pool = ContextPool.of(tiny_model)
    opts = dict(max_tokens=-1, ignore_eos=True, temp=0, n_ctx=2048)
    st = lc.stream(tiny_model, PROMPT, **opts)
    t, out = _consume_in_thread(st)
    time.sleep(0.1)
    st.cancel()
    t.join(10)
    assert not t.is_alive() and isinstance(out["error"], lc.CancelledError) and out["pieces"]
    assert st.cancelled and st.finish_reason is None
    for _ in range(5):  # close() from another thread: the consumer ends, never "generator already executing"
        st = lc.stream(tiny_model, PROMPT, **opts)
        t, out = _consume_in_thread(st)
        time.sleep(0.05)
        st.close()
        t.join(10)
        assert not t.is_alive()
        assert out["error"] is None or isinstance(out["error"], lc.CancelledError), out["error"]
        assert pool.n_idle >= 1  # the context went back
    # cancelling an unstarted stream: its first next() raises, and it releases everything
    st2 = lc.stream(tiny_model, PROMPT, max_tokens=5)
    st2.cancel()
    with pytest.raises(lc.CancelledError):
        next(st2)
    # cancel after a normal end changes nothing
    done = lc.stream(tiny_model, PROMPT, max_tokens=3, ignore_eos=True)
    assert len(done.completion().tokens) == 3
    done.cancel()
    assert not done.cancelled and done.finish_reason == "length"


# ---- 11: dropping a chat stream without the cycle collector ------------------------------------------------

def test_dropped_chat_stream_releases_its_context_without_gc(tiny_model):
    pool = ContextPool.of(tiny_model)
    messages = [{"role": "user", "content": "Hello"}]
    gc.disable()
    try:
        for _ in range(3):
            for piece in lc.stream_chat(tiny_model, messages, max_tokens=200, ignore_eos=True, temp=0,
                                        chat_template="chatml"):
                break
            assert pool.n_idle >= 1
            st = lc.stream_chat(tiny_model, messages, max_tokens=200, ignore_eos=True, temp=0,
                                chat_template="chatml")
            next(iter(st))
            n = pool.n_idle
            del st
            assert pool.n_idle == n + 1
    finally:
        gc.enable()


# ---- 12: plain calls that used to crash the process ----------------------------------------------------

def test_out_of_range_token_ids_raise(tiny_model):
    n = tiny_model.n_vocab
    for bad in (n, -1, 2**31):
        with pytest.raises(lc.TokenizationError):
            lc.Tokenizer.token_to_piece(tiny_model, bad)
        with pytest.raises(lc.TokenizationError):
            lc.Tokenizer.decode(tiny_model, [bad])
        with pytest.raises(lc.TokenizationError):
            lc.Tokenizer.is_eog(tiny_model, bad)
        with pytest.raises(lc.LlamaError):
            lc.generate(tiny_model, [1, bad], max_tokens=1)
    assert lc.Tokenizer.token_to_piece(tiny_model, n - 1) is not None


def test_deeply_nested_grammar_is_refused_before_c(tiny_model):
    deep = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
    with pytest.raises(lc.GrammarError, match="deep"):
        lc.generate(tiny_model, PROMPT, grammar=deep, max_tokens=2)
    ok = "root ::= " + "(" * 50 + '"a"' + ")" * 50
    assert lc.generate(tiny_model, PROMPT, grammar=ok, max_tokens=4, temp=0) == "a"
    with pytest.raises(lc.GrammarError, match="empty"):
        lc.generate(tiny_model, PROMPT, grammar="", max_tokens=2)
    with pytest.raises(lc.GrammarError, match="empty"):
        lc.generate(tiny_model, PROMPT, grammar="  # only a comment\n", max_tokens=2)
    # a string holding parentheses is not nesting
    assert lc.generate(tiny_model, PROMPT, grammar='root ::= "(((" [)(]', max_tokens=6, temp=0).startswith("(((")


EMPTY_COPIES = {  # each took seconds to minutes per 20 tokens in llama.cpp's sampler, which nothing interrupts
    "a nullable rule repeated": 'root ::= x{0,300}\nx ::= "a"?',
    "a nullable group repeated": 'root ::= ("a"?){0,60}',
    "nested repetitions": 'root ::= (("a"?){0,8}){0,8}',
    "written out": "root ::= " + " ".join(['"a"?'] * 60),
    # different items that all take an "a" (9.5 s per 20 tokens), however they are spelled
    "overlapping classes": "root ::= " + " ".join(['"a"? [a-b]?'] * 60),
    "escapes and groups": "root ::= " + " ".join(['"\\x61"? ("a")? [\\x60-\\x62]? .?'] * 7),
    "neighbouring rules": 'root ::= x{0,24} y{0,24} x{0,24} y{0,24}\nx ::= "a"?\ny ::= "b"?',
    "strings spelled apart": "root ::= " + " ".join(['("ab")? ("a" "b")? "ab"?'] * 9),
}


@pytest.mark.parametrize("kind", sorted(EMPTY_COPIES))
def test_repeating_what_can_match_nothing_is_refused(tiny_model, kind):
    """llama.cpp expands x{0,n} into nested optional copies: where x may be empty, every way of spreading the
    text over the copies is a parse stack of its own (x{0,100} with x ::= "a"? took 8 s for 20 tokens, x{0,200}
    minutes, and every request of a Server's model waited)."""
    with pytest.raises(lc.GrammarError, match="can match nothing"):
        lc.generate(tiny_model, PROMPT, grammar=EMPTY_COPIES[kind], max_tokens=20, ignore_eos=True)


def test_a_json_schema_pattern_of_copies_of_the_empty_is_refused(tiny_model):
    """The same shapes from a response_format's pattern (a remote client's): refused before the sampler."""
    schema = {"type": "string", "pattern": "^" + "a?[ab]?" * 40 + "c$"}
    with pytest.raises(lc.SchemaError, match="can match nothing"):
        lc.generate(tiny_model, PROMPT, json_schema=schema, max_tokens=20)


GEMMA_VOCAB = 262144


def test_a_grammar_too_broad_for_the_vocabulary_is_refused(tiny_model):
    """Where the model's pick is refused, llama.cpp tests every token against every parse stack (and each of a
    class's ranges): 10,000 alternatives took 1.5 to 2.5 s per token on the tiny model's 32k vocabulary, and a
    Server's other requests waited. The bound scales with the vocabulary; 1,000 alternatives (a JSON-schema
    enum's most) pass on Gemma's 262k."""
    from llama_ctypes.core.grammar_check import check_breadth

    words = lambda n: "root ::= (" + " | ".join(f'"w{i} "' for i in range(n)) + ")+"  # noqa: E731
    for grammar in (words(10_000), "root ::= [" + "".join(chr(0x4E00 + 2 * i) for i in range(20_000)) + "]+",
                    # spread over rules, behind something that can match nothing
                    'root ::= " "? (' + " | ".join(f"r{j}" for j in range(10)) + ")+\n"
                    + "\n".join(f"r{j} ::= " + " | ".join(f'"x{j}y{i}"' for i in range(1000)) for j in range(10))):
        t0 = time.perf_counter()
        with pytest.raises(lc.GrammarError, match="too broad for this model's vocabulary of 32000"):
            lc.generate(tiny_model, PROMPT, grammar=grammar, max_tokens=4)
        assert time.perf_counter() - t0 < 2.0
    out = lc.generate(tiny_model, PROMPT, grammar=words(1000), max_tokens=6, ignore_eos=True)
    assert out.text.startswith("w")
    check_breadth(words(1024), GEMMA_VOCAB)
    with pytest.raises(lc.GrammarError, match="at most 1024"):
        check_breadth(words(1025), GEMMA_VOCAB)
    enum = lc.grammar.from_json_schema({"enum": [f"value {i}" for i in range(1000)]})
    check_breadth(enum, GEMMA_VOCAB)


def test_grammars_whose_stacks_multiply_as_text_is_read_end_their_request(tiny_model):
    """What no look at the text sees (from a review): stacks that double with each "a" read (94 s for one token
    after a dozen), or breadth reached behind a literal ("x" g "1" | "x" g "2" | ... multiplies g's
    alternatives). llama.cpp's grammar bounds its stacks and its work per token (a patch); the request fails
    with a GrammarError in seconds, and the model serves the next one."""
    levels = 12  # (16 ways to end each "a": the stacks multiply by 16 per "a" read, past the bound at the 4th)
    doubling = "root ::= s0\n" + "\n".join(f's{i} ::= ' + " | ".join(f'"a" s{i + 1} "{c}"' for c in "bcdefghijklmnop")
                                           + f' | "a" s{i + 1} "q"' for i in range(levels)) + f'\ns{levels} ::= "z"'
    g = " | ".join(f'"w{i} "' for i in range(5000))
    behind_a_literal = "root ::= " + " | ".join(f'"x" g "{k}"' for k in range(10)) + "\ng ::= " + g
    for grammar in (doubling, behind_a_literal):
        t0 = time.perf_counter()
        with pytest.raises(lc.GrammarError, match="too broad"):
            lc.generate(tiny_model, PROMPT, grammar=grammar, max_tokens=40, ignore_eos=True)
        assert time.perf_counter() - t0 < 60
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=256) as server:
        bad = server.stream(PROMPT, grammar=doubling, max_tokens=40, ignore_eos=True)
        good = server.stream(PROMPT, max_tokens=8, ignore_eos=True)
        assert len(good.completion().tokens) == 8
        with pytest.raises(lc.GrammarError, match="too broad"):
            bad.completion()
    # a class of consecutive characters is matched element by element as written: counted so
    cls = "[" + "".join(chr(0x4E00 + i) for i in range(20_000)) + "]"
    with pytest.raises(lc.GrammarError, match="too broad"):
        lc.generate(tiny_model, PROMPT, grammar="root ::= " + " | ".join(f'c "{k}"' for k in range(50))
                    + "\nc ::= " + cls, max_tokens=4)


def test_what_llama_cpp_generates_is_never_refused():
    """No false refusals: every schema of llama.cpp's converter tests, every grammar they expect, its grammars/
    files, and the tool-call grammars and triggers of every chat template it ships pass the checks."""
    import glob
    import json
    import re

    from conftest import llama_cpp_dir
    from llama_ctypes.core.grammar_check import check_breadth, check_gbnf
    from llama_ctypes.core.trigger_check import check_trigger_pattern as _check_trigger_pattern
    from llama_ctypes.features.chat_native import ChatFormatter

    root = llama_cpp_dir()
    blocks = re.findall(r'R"""\((.*?)\)"""', (root / "tests" / "test-json-schema-to-grammar.cpp").read_text(), re.S)
    grammars = [b for b in blocks if "::=" in b] + [open(f).read() for f in glob.glob(str(root / "grammars/*.gbnf"))]
    assert len(grammars) > 50
    for grammar in grammars:
        check_gbnf(grammar)
        check_breadth(grammar, GEMMA_VOCAB)
    schemas = 0
    for block in blocks:
        try:
            schema = json.loads(block)
        except ValueError:
            continue
        if isinstance(schema, dict):
            schemas += 1
            try:
                check_breadth(lc.grammar.from_json_schema(schema), GEMMA_VOCAB)
            except lc.LlamaError as exc:
                assert "nothing" not in str(exc) and "deep" not in str(exc) and "broad" not in str(exc), (exc, block)
    assert schemas > 50
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    triggers = 0
    for path in sorted(glob.glob(str(root / "models/templates/*.jinja"))):
        for choice in ("auto", "required"):
            try:
                fmt = ChatFormatter(None, open(path).read(), bos_token="<s>", eos_token="</s>").apply(
                    [{"role": "user", "content": "Hi"}], tools=[tool], tool_choice=choice)
            except lc.LlamaError:
                continue  # (a template that cannot render this; the parity tests cover templates)
            if fmt.grammar:
                check_gbnf(fmt.grammar)
                check_breadth(fmt.grammar, GEMMA_VOCAB)
            for pattern in fmt.trigger_patterns:
                _check_trigger_pattern(pattern)
                triggers += 1
    assert triggers > 20


def test_the_copy_check_is_fast_and_never_fails_itself():
    """The check runs before every grammar a remote client sends: classes that match nothing are a
    GrammarError of llama.cpp's (or pass), never a crash of the check; a class's repeated ranges are one way
    to take a character, not copies; and a long grammar is checked in linear time."""
    import time

    from llama_ctypes.core.grammar_check import check_gbnf

    for grammar in ('root ::= "a" []', 'root ::= "a" [^\\x00-\\U0010FFFF]', 'root ::= ([] "b")?'):
        try:
            check_gbnf(grammar)
        except lc.GrammarError:
            pass
    check_gbnf("root ::= " + " ".join(["[aaaaaaaaaa]?"] * 20))  # 20 ways, not 200
    check_gbnf("root ::= " + " ".join(["[a-ca-cb]?"] * 20))
    start = time.perf_counter()
    check_gbnf("root ::= " + " ".join(f'"w{i}"?' for i in range(20000)))  # one run of 20,000 items
    rules = "\n".join(f'r{i} ::= "{i}"? ' + " ".join([f"r{i - 1}"] * 2 if i else ['"z"']) for i in range(1500))
    check_gbnf("root ::= r1499\n" + rules)
    assert time.perf_counter() - start < 10


def test_star_plus_and_a_few_copies_of_the_empty_still_work(tiny_model):
    """* and + on a nullable item are recursion to llama.cpp, not copies; a few copies are cheap."""
    for grammar in ('root ::= ("a"?)*', 'root ::= ("a"?)+', 'root ::= ("a"?){0,20}', 'root ::= [a]{0,300}',
                    'root ::= "[" space space "a"{0,9} "]"\nspace ::= | " "'):
        out = lc.generate(tiny_model, PROMPT, grammar=grammar, max_tokens=20, ignore_eos=True, temp=0)
        assert out.finish_reason in ("length", "stop", "eog"), grammar


def test_backtracking_lazy_grammar_triggers_are_refused(tiny_model):
    """llama.cpp matches triggers with std::regex over the text so far at every token, where nothing interrupts
    it: (.*.*)*x ran for minutes."""
    for pattern in ("(.*.*)*x", "(a+)+$", "(a|aa)*b", "a*b*c*d*e*f", "x" * 2000, ".{1,25}" * 4, "x?" * 9,
                    "[^](.*.*)*\\x01]", "[](.*.*)*]", ".*.*.*X", "(a)\\1*x", "(?<n>a)\\k<n>", ".*a.*X", ".*(x)?.*X",
                    "(?:ab)+(?:ab)+(?:ab)+(?:ab)+X", "[ab]*(?:ab)+X", "a*(?:ab)a*X", "\\x61*\\x61*X", "^a|.*a.*X"):
        with pytest.raises(lc.InvalidArgumentError, match="grammar_lazy_triggers"):
            lc.generate(tiny_model, PROMPT, max_tokens=10, grammar='root ::= "a"', grammar_lazy_triggers=[pattern])
    # llama.cpp's own kinds of trigger still work, and repetitions that split a text one way only (a group
    # that starts or ends with a character nothing else in it matches; a required character between two
    # unbounded ones)
    for pattern in (r"<\|start\|>assistant(<\|channel\|>(?:commentary|analysis)\s+to)", r"^\s+to$",
                    r"^[\s\S]*?(<tool_call>)[\s\S]*$", r"(?:\r?\n)+<tool_call>", r"\d{1,3}(\.\d{1,3}){3}",
                    r"(?:[a-z]+_)+call", r'\s*\{\s*"name"', r"a+b+X"):
        out = lc.generate(tiny_model, PROMPT, max_tokens=4, grammar='root ::= "a"', grammar_lazy_triggers=[pattern])
        assert out.finish_reason in ("length", "stop", "eog"), pattern


_SMALL_STACK_RUN = """
import sys, threading
import llama_ctypes as lc
model = lc.Model(sys.argv[1])
result = {}

def run():
    try:
        if sys.argv[2] == "trigger":  # std::regex recursed once per character of the text searched
            out = lc.generate(model, "Once upon a time", max_tokens=1500, ignore_eos=True, temp=0,
                              grammar='root ::= "a"', grammar_lazy_triggers=[r"[\\s\\S]*#@#@#"])
            result["chars"] = len(out.text)
        elif sys.argv[2] == "bytes":  # a run of UTF-8 continuation bytes (<0x80> byte tokens) widened the window
            out = lc.generate(model, "Once upon a time", max_tokens=1500, ignore_eos=True, temp=0,
                              logit_bias={131: 100.0}, special=True,
                              grammar='root ::= "a"', grammar_lazy_triggers=[r"[\\s\\S]*#@#@#"])
            result["chars"] = len(out.tokens)
        else:  # llama.cpp's GBNF parser recurses once per ( ) level
            grammar = "root ::= " + "(" * 1900 + '"a"' + ")" * 1900
            out = lc.generate(model, "Once upon a time", max_tokens=2, grammar=grammar, temp=0)
            result["chars"] = len(out.text)
    except BaseException as e:
        result["error"] = repr(e)

threading.stack_size(256 * 1024)
t = threading.Thread(target=run)
t.start()
t.join()
print(result)
sys.exit(0 if "chars" in result else 3)
"""


@pytest.mark.parametrize("case", ["trigger", "bytes", "grammar"])
def test_long_outputs_and_deep_grammars_on_a_small_thread_stack(tiny_model, case):
    """On a thread with a 256 KiB stack (an app's choice; musl's default is 128 KiB): a lazy trigger over
    ~1500 tokens of output (llama.cpp searched all of it with a recursive std::regex: a segfault at ~50 KB
    even on 8 MiB; build_scripts/patches/llama-grammar-trigger-window.patch), and a grammar nested 1900 deep
    (its parse now runs on a large-stack thread)."""
    proc = subprocess.run([sys.executable, "-c", _SMALL_STACK_RUN, tiny_model.path, case], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    if case in ("trigger", "bytes"):
        assert int(proc.stdout.split("'chars': ")[1].split("}")[0]) >= 1500


def test_a_trigger_late_in_a_long_output_still_fires(tiny_model):
    r"""Triggers are searched in the last 256 bytes of the output: one that first appears after that many
    bytes still fires (the grammar then refuses its text: a GrammarError proves it fired), ^ does not
    take the window's start for the text's, and ^[\s\S]*?(X)[\s\S]*$ is a search for X."""
    plain = lc.generate(tiny_model, PROMPT, max_tokens=400, ignore_eos=True, temp=0)
    text = plain.text
    late = next((text[k:k + 6] for k in range(len(text) - 6, 300, -1)
                 if text.find(text[k:k + 6]) == k and text[k:k + 6].isalnum()), None)
    assert late is not None and len(text.encode()) > 400, text[-200:]
    with pytest.raises(lc.GrammarError, match="does not fit"):
        lc.generate(tiny_model, PROMPT, max_tokens=400, ignore_eos=True, temp=0, grammar='root ::= "@@@"',
                    grammar_lazy_triggers=[late])
    out = lc.generate(tiny_model, PROMPT, max_tokens=400, ignore_eos=True, temp=0, grammar='root ::= "@@@"',
                      grammar_lazy_triggers=["^" + late])
    assert out.finish_reason == "length"
    # llama.cpp's whole-output form is a search for its group, whatever the output's length
    with pytest.raises(lc.GrammarError, match="does not fit"):
        lc.generate(tiny_model, PROMPT, max_tokens=400, ignore_eos=True, temp=0, grammar='root ::= "@@@"',
                    grammar_lazy_triggers=[r"^[\s\S]*?(" + late + r")[\s\S]*$"])


def test_a_batch_whose_fields_disagree_with_its_arrays_is_refused(tiny_model):
    """n_tokens beyond the arrays, or a token in 0 (or more than n_seq_max) sequences, made llama.cpp read past them."""
    with lc.Context.create(tiny_model, n_ctx=256) as ctx, ctx.lease() as lease:
        for field, value in (("n_tokens", 2000), ("n_tokens", -1), ("n_seq_id", 0), ("n_seq_id", -5),
                             ("n_seq_id", 2)):
            batch = lc.Batch(4)
            batch.add(1, 0, 0, True)
            if field == "n_tokens":
                batch.n_tokens = value
            else:
                batch.n_seq_id[0] = value
            with pytest.raises(lc.InvalidArgumentError, match=field):
                lease.decode(batch)
        batch = lc.Batch(4)
        with pytest.raises(AttributeError):
            batch.token = np.zeros(4, dtype=np.int32)  # (llama.cpp would read the old buffer)
        with pytest.raises(lc.InvalidArgumentError):
            lc.Batch(0)
        batch.add(1, 0, 0, True)
        lease.decode(batch)
        assert np.isfinite(lease.logits(0)).all()


def test_backend_top_k_beyond_the_vocabulary_keeps_it_all(tiny_model):
    """llama.cpp's backend top-k asserts k <= n_vocab (an abort from a documented option, over HTTP too)."""
    n_vocab = tiny_model.vocab.n_tokens
    for top_k in (n_vocab, n_vocab + 1, 2**31 - 1):
        out = lc.generate(tiny_model, PROMPT, max_tokens=3, temp=0.8, seed=1, backend_sampling=True, top_k=top_k,
                          ignore_eos=True)
        assert len(out.tokens) == 3


# ---- smaller ones ------------------------------------------------------------------------------------------

def test_lone_surrogates_and_odd_options(tiny_model):
    with pytest.raises(lc.TokenizationError, match="surrogate"):
        lc.generate(tiny_model, "bad \ud800 text", max_tokens=2)
    with pytest.raises(lc.TokenizationError):
        lc.Tokenizer.encode(tiny_model, "\udfff")
    with pytest.raises(ValueError):
        lc.generate(tiny_model, PROMPT, stop=["x\ud800"], max_tokens=2)
    with pytest.raises(ValueError):
        lc.generate(tiny_model, PROMPT, max_tokens=True)


def test_huge_prompt_is_refused_before_tokenizing(tiny_model):
    text = "lorem ipsum dolor sit amet " * 400_000  # 10.8 MB
    t0 = time.perf_counter()
    with pytest.raises(lc.ContextOverflowError):
        lc.generate(tiny_model, text, max_tokens=2, n_ctx=512)
    assert time.perf_counter() - t0 < 5
    # a prompt under the byte bound still tokenizes and is checked exactly
    with pytest.raises(lc.ContextOverflowError):
        lc.generate(tiny_model, "word " * 600, max_tokens=2, n_ctx=512)


def test_sampling_params_hash_agrees_with_equality():
    a = lc.SamplingParams(temp=0.5, json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = lc.SamplingParams(temp=0.5, json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert a == b and hash(a) == hash(b)
    assert len({a, b, lc.SamplingParams(temp=0.6)}) == 2
    c = lc.SamplingParams(logit_bias={5: 1.0, 7: -2.0})
    d = lc.SamplingParams(logit_bias={7: -2.0, 5: 1.0})
    assert c == d and hash(c) == hash(d)


def test_closed_handles_raise_and_never_crash(tiny_model_path):
    model = lc.load_model(tiny_model_path)
    ctx = lc.Context.create(model, n_ctx=128)
    smp = lc.Sampler.create(model, temp=0)
    model.close()  # deferred: the context and sampler hold it
    assert not model.freed
    out = ctx.generate(smp, [1, 450, 4996], max_tokens=3, ignore_eos=True)  # token ids: the model is closed
    assert len(out.tokens) == 3
    ctx.close()
    smp.close()
    assert model.freed
    for call in (lambda: lc.generate(model, PROMPT), lambda: model.n_params, lambda: lc.Tokenizer.encode(model, "x"),
                 lambda: ctx.logits(), lambda: smp.names, lambda: lc.Context.create(model)):
        with pytest.raises(lc.ClosedError):
            call()


# ---- 8: sliding-window caches that dropped cells are not reused ------------------------------------------

@pytest.mark.gemma
def test_swa_cache_reuse_falls_back_when_the_window_is_gone(gemma):
    assert gemma.n_swa > 0
    # The window cache holds n_swa + n_ubatch = 1024 cells: a 1300-token prompt overwrites the oldest.
    with lc.Context.create(gemma, n_ctx=2048, swa_full=False) as ctx, lc.Sampler.create(gemma, temp=0) as smp:
        prompt = ids(gemma, "word " * 1300)[:1300]
        ctx.generate(smp, prompt, max_tokens=4, ignore_eos=True, cache_prompt=True)
        held = ctx.tokens
        # Cut back into the part whose window cells the cache has dropped: reuse must not happen...
        early = held[:300] + gemma.tokenize(" and then", add_special=False)
        out = ctx.generate(smp, early, max_tokens=8, cache_prompt=True, ignore_eos=True)
        assert out.timings.cached_tokens == 0
        # a cut where the window part holds no cell at all below it (pos_min of an empty window is -1)
        ctx.generate(smp, prompt, max_tokens=4, ignore_eos=True, cache_prompt=True)
        very_early = ctx.tokens[:200] + gemma.tokenize(" and so", add_special=False)
        assert ctx.generate(smp, very_early, max_tokens=2, cache_prompt=True).timings.cached_tokens == 0
        with lc.Context.create(gemma, n_ctx=2048, swa_full=False) as cold_ctx:
            cold = cold_ctx.generate(smp, early, max_tokens=8, ignore_eos=True, logprobs=2)
        assert_greedy_equivalent(out, cold, what="recomputed vs cold")  # ...so the result is the cold run's
        # ...while continuing the whole history reuses it.
        cont = ctx.tokens + gemma.tokenize(" more", add_special=False)
        assert ctx.generate(smp, cont, max_tokens=2, cache_prompt=True).timings.cached_tokens == len(cont) - 1


# ---- issue 18.6: defaults follow llama.cpp's common defaults, every sampler is reachable --------------------

def test_sampling_defaults_match_llama_cpp_common():
    p = lc.SamplingParams()
    common = dict(top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, temp=0.8, xtc_probability=0.0,
                  xtc_threshold=0.1, dynatemp_range=0.0, dynatemp_exponent=1.0, penalty_last_n=64,
                  penalty_repeat=1.0, penalty_freq=0.0, penalty_present=0.0, dry_multiplier=0.0, dry_base=1.75,
                  dry_allowed_length=2, dry_penalty_last_n=64, mirostat=0, top_n_sigma=-1.0, mirostat_tau=5.0,
                  mirostat_eta=0.1, min_keep=0, adaptive_target=-1.0, adaptive_decay=0.9)
    assert {k: getattr(p, k) for k in common} == common
    assert tuple(p.dry_sequence_breakers) == ("\n", ":", '"', "*")


def test_adaptive_p_ends_the_chain_and_generates(tiny_model):
    with lc.Sampler.create(tiny_model, adaptive_target=0.3, seed=7, min_p=0.05) as smp:
        assert "adaptive-p" in smp.names[-1] and "dist" not in smp.names
    a = lc.generate(tiny_model, PROMPT, adaptive_target=0.3, seed=7, max_tokens=12, ignore_eos=True)
    b = lc.generate(tiny_model, PROMPT, adaptive_target=0.3, seed=7, max_tokens=12, ignore_eos=True)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    with pytest.raises(ValueError):
        lc.SamplingParams(adaptive_decay=1.5)


@pytest.mark.gemma
def test_server_swa_prefix_reuse_falls_back_when_the_window_is_gone(gemma):
    prompt = ids(gemma, "word " * 1300)[:1300]  # longer than the window cache (n_swa + n_ubatch cells)
    with lc.Server(model=gemma, n_parallel=1, n_ctx=2048, swa_full=False, temp=0) as srv:
        first = srv.generate_tokens(prompt, max_tokens=4, ignore_eos=True)
        cont = prompt + first.tokens + gemma.tokenize(" more", add_special=False)
        second = srv.generate_tokens(cont, max_tokens=2, ignore_eos=True)
        assert second.timings.cached_tokens >= len(prompt)  # continuing the whole history reuses it
        early = prompt[:300] + gemma.tokenize(" and then", add_special=False)
        out = srv.generate_tokens(early, max_tokens=8, ignore_eos=True)
        assert out.timings.cached_tokens == 0  # the window before token 300 is gone: recomputed
    with lc.Server(model=gemma, n_parallel=1, n_ctx=2048, swa_full=False, temp=0) as cold:
        assert_greedy_equivalent(out, cold.generate_tokens(early, max_tokens=8, ignore_eos=True, logprobs=2),
                                 what="recomputed vs cold")


# ---- found by a hostile review of the re-cut ---------------------------------------------------------------

def test_released_leases_and_bindings_raise_instead_of_crashing(tiny_model):
    ctx = lc.Context.create(tiny_model, n_ctx=128)
    smp = lc.Sampler.create(tiny_model, temp=0.8)
    with ctx.lease() as lease:
        append, view = lease.append_fn(), lease.logits_view_fn()
        binding = smp.bind(lease)
        sample = binding.sample
        binding.release()
    ctx.close()
    smp.close()
    for call in (lease.clear, lambda: lease.seq_pos_max(0), lambda: append(1), lambda: view(-1),
                 lambda: sample(-1), lambda: lease.logits(-1)):
        with pytest.raises(lc.ClosedError):
            call()


def test_grammar_bounds_cannot_be_bypassed(tiny_model):
    hidden = "root ::= \"a\" # note\r" + "(" * 100000 + '"a"' + ")" * 100000
    with pytest.raises(lc.GrammarError):
        lc.Sampler.create(tiny_model, grammar=hidden)
    chained = "root ::= r0\n" + "".join(
        f"r{i} ::= " + "(" * 1000 + (f"r{i + 1}" if i < 99 else '"a"') + ")" * 1000 + "\n" for i in range(100))
    with pytest.raises(lc.GrammarError):
        lc.Sampler.create(tiny_model, grammar=chained)
    with pytest.raises(lc.GrammarError, match="grammar_lazy_triggers"):
        lc.Sampler.create(tiny_model, grammar='root ::= "a"', grammar_lazy_triggers=["("])
    with pytest.raises(lc.GrammarError):
        lc.Sampler.create(tiny_model, grammar='root ::= "a"', grammar_lazy_triggers=["(?P<name>x)"])


def test_batches_and_rows_beyond_what_the_context_reserved_are_refused(tiny_model):
    with pytest.raises(ValueError, match="n_outputs_max"):
        lc.Server(model=tiny_model, n_parallel=2, n_outputs_max=1)
    with pytest.raises(TypeError, match="n_outputs_max"):
        lc.embed(tiny_model, ["a", "b"], n_outputs_max=1)
    with lc.Context.create(tiny_model, n_ctx=256, n_batch=32, n_ubatch=32, n_outputs_max=2) as ctx:
        big = lc.Batch(64)
        big.add_sequence(list(range(1, 41)), 0)
        with pytest.raises(lc.InvalidArgumentError, match="n_batch"):
            ctx.decode(big)
        rows = lc.Batch(32)
        rows.add_sequence(list(range(1, 11)), 0)
        rows.logits[:10] = 1
        with pytest.raises(lc.InvalidArgumentError, match="n_outputs_max"):
            ctx.decode(rows)


def test_sampler_misuse_raises(tiny_model, tiny_model_path):
    other = lc.load_model(tiny_model_path)
    with lc.Context.create(tiny_model, n_ctx=128) as ctx:
        with lc.Sampler.create(tiny_model, temp=0.8) as smp:
            with pytest.raises(lc.IndexOutOfRangeError):
                smp.sample(ctx, -1)  # nothing decoded yet
        with lc.Sampler.create(other, temp=0.8, grammar="root ::= [a-z]+") as foreign:
            with pytest.raises(ValueError, match="another Model"):
                ctx.generate(foreign, [1, 450], max_tokens=2)
        with lc.Sampler.create(tiny_model, grammar='root ::= "a"') as smp:
            with pytest.raises(lc.TokenizationError):
                smp.accept(tiny_model.n_vocab + 5)
            eos = lc.Tokenizer.eos(tiny_model)
            with pytest.raises(lc.GrammarError):
                smp.accept(eos)  # the grammar is not complete yet
            with pytest.raises(lc.GrammarError):
                smp.accept(tiny_model.tokenize("zzz", add_special=False)[0])
        for bad in (lambda: ctx.seq_rm(-7), lambda: ctx.seq_rm(300), lambda: ctx.seq_cp(0, 300),
                    lambda: ctx.seq_pos_max(-5)):
            with pytest.raises(ValueError):
                bad()
        for bad_ids in ([1.5, 2.0], [True, 3]):
            with pytest.raises(TypeError):
                ctx.generate(lc.Sampler.create(tiny_model), bad_ids, max_tokens=1)
    other.close()


def test_tokens_agree_with_the_cache_after_manual_kv_edits(tiny_model):
    with lc.Context.create(tiny_model, n_ctx=256, n_seq_max=2) as ctx, lc.Sampler.create(tiny_model, temp=0) as smp:
        prompt = ids(tiny_model, "one two three four five six seven")
        cold = ctx.generate(smp, prompt, max_tokens=4, ignore_eos=True)
        for edit in (lambda: ctx.seq_rm(0, 2, 4), lambda: ctx.seq_rm(0, 0, 3), lambda: ctx.seq_cp(1, 0)):
            ctx.generate(smp, prompt, max_tokens=4, ignore_eos=True, cache_prompt=True)
            edit()
            again = ctx.generate(smp, prompt, max_tokens=4, ignore_eos=True, cache_prompt=True)
            assert again.tokens == cold.tokens


def test_streams_of_a_closed_model_and_closes_during_completion(tiny_model_path):
    model = lc.load_model(tiny_model_path)
    with lc.Server(model=model, n_parallel=2, n_ctx=512, temp=0) as srv:
        model.close()  # the server holds it: requests keep working, with text
        out = srv.generate("after the model was closed", max_tokens=6, ignore_eos=True)
        assert len(out.tokens) == 6 and isinstance(out.text, str)
    assert model.freed
    model = lc.load_model(tiny_model_path)
    st = lc.stream(model, PROMPT, max_tokens=-1, ignore_eos=True, temp=0, n_ctx=4096)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _safe(st.completion)))
    t.start()
    time.sleep(0.2)
    st.close()
    t.join(10)
    assert not t.is_alive() and isinstance(box["r"], lc.CancelledError)
    model.close()


def _safe(fn):
    try:
        return fn()
    except BaseException as exc:
        return exc


def test_server_callbacks_and_odd_request_options(tiny_model):
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=256, max_queue=1, temp=0) as srv:
        seen = []
        lc.telemetry.attach("review-queue-full", ["server.queue_full"], lambda e, m, md: seen.append(srv.kv_positions()))
        try:
            running = srv.stream("one", max_tokens=200, ignore_eos=True)
            next(running)
            waiting = srv.stream("two", max_tokens=2)
            with pytest.raises(lc.QueueFullError):
                srv.stream("three", max_tokens=2)
            assert seen and len(seen[0]) == 1  # the handler could call back into the server
            running.close()
            waiting.close()
        finally:
            lc.telemetry.detach("review-queue-full")
        errors = []

        def submit_from_handler(e, m, md):
            try:
                srv.generate("nested", max_tokens=1)
            except lc.LlamaError as exc:
                errors.append(exc)

        lc.telemetry.attach("review-nested", ["server.request.start"], submit_from_handler)
        try:
            assert srv.generate("outer", max_tokens=2, ignore_eos=True).tokens
        finally:
            lc.telemetry.detach("review-nested")
        assert errors and isinstance(errors[0], ValueError)
        import numpy as np

        with pytest.raises(TypeError):
            srv.generate("x", session=np.array([1, 2]))
        with pytest.raises(TypeError):
            srv.generate("x", cache_prompt=1)
        assert srv.generate("still serving", max_tokens=2, ignore_eos=True).tokens


def test_sampler_repr_while_streaming(tiny_model):
    with lc.Context.create(tiny_model, n_ctx=128) as ctx, lc.Sampler.create(tiny_model, temp=0.5) as smp:
        st = ctx.stream(smp, ids(tiny_model), max_tokens=5)
        next(st)
        assert "dist" in repr(smp)
        st.close()


def test_completion_after_a_close_between_two_steps_raises_cancelled(tiny_model):
    """close() from another thread between two next() calls closes the generator at once; the
    iterating thread's completion() used to return it as a finished run ('length')."""
    st = lc.stream(tiny_model, PROMPT, max_tokens=-1, ignore_eos=True, temp=0)
    assert next(st)
    t = threading.Thread(target=st.close)
    t.start()
    t.join(10)
    with pytest.raises(lc.CancelledError):
        st.completion()
    done = lc.stream(tiny_model, PROMPT, max_tokens=4, ignore_eos=True, temp=0)
    assert done.completion().finish_reason == "length"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, True])
def test_a_server_refuses_a_ram_tier_that_is_no_size(tiny_model, value):
    with pytest.raises(lc.InvalidArgumentError, match="prompt_cache_ram_mb"):
        lc.Server(model=tiny_model, prompt_cache_ram_mb=value)
