"""Admission limits of the Python API: a request's work is bounded before any of it is done.

Schema sizes before compiling, tool counts and sizes, template variables that collide with the
renderer's own, the Server's bounded queue and its groups (queued whole or not at all, abortable
while being built), and the tokenizer's special-token split in linear time.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_helpers import slow_decode, wait_idle

import llama_ctypes as lc
from llama_ctypes.core.json_schema.limits import SchemaLimits, check_schema_size, measure_schema
from llama_ctypes.features.tool_calls import MAX_TOOLS, plan_chat

ROOT = Path(__file__).resolve().parent.parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "user", "content": "hi"}]


def _props(n: int, required: bool = False) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# ---- schema sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, bound", [
    (_props(1001, required=True), "max_properties"),
    (_props(251), "max_optional_properties"),
    ({"enum": [f"v{i}" for i in range(1001)]}, "max_enum_values"),
    ({"type": "string", "pattern": "a" * 100_001}, "max_text_chars"),
    (_deep(40), "max_depth"),  # (200 levels overflowed jsonschema's own recursion: a RecursionError escaped)
    ({"anyOf": [{"type": "array", "items": []} for _ in range(6000)]}, "max_nodes"),
])
def test_oversized_schemas_are_refused_before_any_compilation(schema, bound):
    with pytest.raises(lc.SchemaTooLargeError, match=rf"SchemaLimits\.{bound}=") as info:
        lc.grammar.from_json_schema(schema)
    assert isinstance(info.value, lc.SchemaError) and "limits=" in str(info.value)  # says how to raise it
    # the same bounds on every path that compiles a schema
    with pytest.raises(lc.SchemaTooLargeError):
        lc.SamplingParams(json_schema=schema)


def test_refusal_reads_each_value_once():
    """A 20,000-property schema took 11 s in the meta-schema check alone (and minutes in llama.cpp's
    converter); measuring it stops at the first bound."""
    size = measure_schema([_props(20_000)])
    assert size.properties == 20_000  # (one properties object: counted whole, then the bound stops the walk)
    assert size.nodes <= 2


def test_schemas_within_the_limits_compile_and_larger_limits_allow_more():
    assert lc.grammar.from_json_schema(_props(1000, required=True))
    assert lc.grammar.from_json_schema({"enum": [f"v{i}" for i in range(1000)]})
    assert lc.grammar.from_json_schema(_deep(25))
    big = _props(1200, required=True)
    with pytest.raises(lc.SchemaTooLargeError):
        lc.grammar.from_json_schema(big)
    gbnf = lc.grammar.from_json_schema(big, limits=SchemaLimits(max_properties=2000))
    assert "p1199" in gbnf
    with pytest.raises(lc.InvalidArgumentError):
        SchemaLimits(max_depth=0)
    with pytest.raises(lc.InvalidArgumentError):
        check_schema_size([{}], limits="big")


_SMALL_STACK_CONVERSION = """
import threading, llama_ctypes as lc
from llama_ctypes.core.json_schema.limits import SchemaLimits
schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(800)}}
threading.stack_size(128 * 1024)
out = []
t = threading.Thread(target=lambda: out.append(lc.grammar.from_json_schema(
    schema, limits=SchemaLimits(max_optional_properties=800))))
t.start(); t.join()
print(len(out[0]))
"""


def test_the_converter_runs_on_a_deep_stack_whatever_the_callers(tmp_path):
    """llama.cpp's converter recurses once per optional property: 20,000 of them overflowed an 8 MiB stack
    (a 20,000-property response_format killed the HTTP server with SIGSEGV after 29 s), 500 a 128 KiB one.
    It runs on core/deep_stack.py's threads, so a caller with a small stack and raised limits is safe.
    (800: 1,000 optional properties nest past grammar_check.MAX_DEPTH, a SchemaError.)"""
    proc = subprocess.run([sys.executable, "-c", _SMALL_STACK_CONVERSION], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert int(proc.stdout.strip().splitlines()[-1]) > 800


def test_tools_are_bounded_in_number_and_size(tiny_model):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(lc.InvalidArgumentError, match=f"at most {MAX_TOOLS}"):
        plan_chat(tiny_model, MSGS, tools=[tool] * (MAX_TOOLS + 1), chat_template=CHATML)
    enum = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"enum": [f"value{i}" for i in range(600)]}}}}}
    # two tools of 600 enum values each: over the bound together, though each one is within it
    with pytest.raises(lc.SchemaTooLargeError, match="tools' parameter schemas together"):
        plan_chat(tiny_model, MSGS, tools=[enum, {**enum, "function": {**enum["function"], "name": "h"}}],
                  chat_template=CHATML)
    plan_chat(tiny_model, MSGS, tools=[enum], chat_template=CHATML)  # one is fine


# ---- template variables -----------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["tools", "add_generation_prompt", "messages", "bos_token", "timeout"])
def test_template_kwargs_naming_the_renderers_own_variables_are_refused(tiny_model, key):
    """Before, 'tools' or 'add_generation_prompt' raised a bare TypeError ("multiple values for keyword
    argument"), and 'messages' silently replaced the validated conversation."""
    with pytest.raises(lc.InvalidArgumentError, match=repr(key)):
        lc.chat(tiny_model, MSGS, chat_template=CHATML, template_kwargs={key: "x"}, max_tokens=1)
    with pytest.raises(lc.InvalidArgumentError, match=repr(key)):
        plan_chat(tiny_model, MSGS, chat_template=CHATML, template_kwargs={key: "x"})
    with pytest.raises(lc.InvalidArgumentError, match="bos_token"):
        lc.ChatTemplate(CHATML).render(MSGS, bos_token="x")  # (the others are the method's own parameters)
    with pytest.raises(lc.ArgumentTypeError):
        lc.chat(tiny_model, MSGS, chat_template=CHATML, template_kwargs=["tools"], max_tokens=1)
    # other variables still reach the template
    text = lc.ChatTemplate("{{ greeting }}").render(MSGS, greeting="hello")
    assert text == "hello"


# ---- the server's queue and groups ---------------------------------------------------------------

def test_the_default_queue_is_bounded(tiny_model, monkeypatch):
    from llama_ctypes.engines.server.server import DEFAULT_MAX_QUEUE

    assert 0 < DEFAULT_MAX_QUEUE < 10_000
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=256) as srv:
        assert srv._engine.scheduler.max_queue == DEFAULT_MAX_QUEUE
        slow_decode(monkeypatch, srv, 0.05)
        hold = srv.stream("hold the slot", max_tokens=200, temp=0, ignore_eos=True)
        next(iter(hold))
        waiting = [srv.stream(f"w{i}", max_tokens=1) for i in range(DEFAULT_MAX_QUEUE)]
        with pytest.raises(lc.QueueFullError, match="max_queue"):
            srv.stream("one too many", max_tokens=1)
        for s in waiting:
            s.cancel()
        hold.cancel()
        wait_idle(srv)
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=256, max_queue=0) as srv:
        assert srv._engine.scheduler.max_queue == 0  # 0: unbounded, on request


def test_a_group_is_queued_whole_or_not_at_all(tiny_model, monkeypatch):
    with lc.Server(model=tiny_model, n_parallel=2, n_ctx=256, max_queue=8) as srv:
        # a group larger than the whole queue could never be queued: not a "retry later"
        with pytest.raises(lc.InvalidArgumentError, match="could never be queued"):
            srv.submit_many(["a", "b", "c"], n=3, max_tokens=1)
        # a group larger than the room left now is refused before anything is built
        slow_decode(monkeypatch, srv, 0.05)
        held = srv.submit_many(["hold", "hold too"], max_tokens=200, ignore_eos=True)
        for s in held:
            next(iter(s))  # both slots busy
        waiting = srv.submit_many(["w1", "w2", "w3", "w4", "w5"], max_tokens=1)
        with pytest.raises(lc.QueueFullError, match="together or not at all"):
            srv.submit_many(["a", "b"], n=2, max_tokens=1)
        assert srv.stats()["queue_length"] == 5
        for s in held + waiting:
            s.cancel()
        wait_idle(srv)
        monkeypatch.undo()
        assert srv.stats()["queue_length"] == 0 and srv.stats()["active_slots"] == 0
        # one bad prompt refuses the whole group: none of the others runs
        with pytest.raises(lc.ContextOverflowError):
            srv.submit_many(["fine", "x " * 400, "fine too"], max_tokens=1)
        assert srv.stats()["queue_length"] == 0 and srv.stats()["active_slots"] == 0
        # a group that fits: n choices per prompt, seeds seed + j, in order
        done = srv.generate_many(["Once upon a time", "The sea"], n=2, max_tokens=6, temp=1.0, seed=7,
                                 ignore_eos=True)
        assert len(done) == 4 and all(len(d.tokens) == 6 for d in done)
        alone = [srv.generate(p, max_tokens=6, temp=1.0, seed=7 + j, ignore_eos=True, cache_prompt=False)
                 for p in ("Once upon a time", "The sea") for j in range(2)]
        assert [d.tokens for d in done] == [a.tokens for a in alone]
        with pytest.raises(lc.InvalidArgumentError):
            srv.submit_many(["a"], n=0)
        with pytest.raises(lc.InvalidArgumentError):  # an invalid seed is refused with n > 1 too
            srv.submit_many(["a"], n=2, seed=-5)
        with pytest.raises(lc.ArgumentTypeError):
            srv.submit_many("a string is one prompt, not a list")
        wait_idle(srv)


def test_an_aborted_group_queues_nothing(tiny_model, monkeypatch):
    """A submission still being built stops when its abort event is set (the HTTP client left):
    nothing reaches the queue after that, whichever request was being built."""
    with lc.Server(model=tiny_model, n_parallel=1, n_ctx=256, max_queue=64) as srv:
        abort = threading.Event()
        built = []
        real = srv._build_request

        def slow_build(prompt, opts, loop):
            built.append(prompt)
            if len(built) == 5:
                abort.set()  # (another thread, in real life)
            time.sleep(0.01)
            return real(prompt, opts, loop)

        monkeypatch.setattr(srv, "_build_request", slow_build)
        with pytest.raises(lc.CancelledError):
            srv.submit_many([f"p{i}" for i in range(40)], abort=abort, max_tokens=1)
        assert len(built) == 5 and srv.stats()["queue_length"] == 0 and srv.stats()["active_slots"] == 0
        # set between the last build and the queueing: still nothing queued
        abort2 = threading.Event()

        def build_then_abort(prompt, opts, loop):
            request = real(prompt, opts, loop)
            abort2.set()
            return request

        monkeypatch.setattr(srv, "_build_request", build_then_abort)
        with pytest.raises(lc.CancelledError):
            srv.submit_many(["only one"], abort=abort2, max_tokens=1)
        assert srv.stats()["queue_length"] == 0 and srv.stats()["active_slots"] == 0


# ---- the tokenizer ------------------------------------------------------------------------------

@pytest.mark.gemma
def test_special_tokens_split_in_linear_time_into_the_same_tokens(gemma):
    """llama.cpp walked its fragment list from the head for every special token it split out: 100k special
    tokens took 25 s. The build's patch (build_scripts/patches/llama-vocab-linear-partition.patch) keeps the
    fragment before the current one instead; the tokens are the same."""
    assert "llama-vocab-linear-partition" in lc.init().build_info.get("patches", [])
    unit = "<start_of_turn>user\nhello<end_of_turn>\n  \n"
    one = gemma.vocab.tokenize(unit, add_special=False, parse_special=True)
    for parse_special in (True, False):
        ids = gemma.vocab.tokenize(unit * 2000, add_special=False, parse_special=parse_special)
        assert ids == gemma.vocab.tokenize(unit, add_special=False, parse_special=parse_special) * 2000
    assert len(one) > 5 and gemma.vocab.detokenize(one, unparse_special=True) == unit
    # (timings: bench/hostile_inputs.py; 10,000 turns took 7.3 s before, see the patch's header)
