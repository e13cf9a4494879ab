"""LoRA adapters (core/lora.py): loading and refusal, applying per context and per call, what the KV
cache may reuse under which adapters, activated LoRAs, the Server's per-request adapters, and
llama-server's ``--lora`` / ``/lora-adapters`` / ``"lora": [...]`` over HTTP.

The adapters are generated (tests/tiny_models.write_tiny_lora) for the tiny llama model: low-rank
pairs on attention, FFN and the output head, strong enough to change greedy output. Equalities
between runs compare computations that are the same in llama.cpp (a zero scale drops the adapter;
an aLoRA whose invocation is absent stays off); across different adapters only differences and
invariants are asserted.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from http_helpers import ServeProcess, api_error
from margins import assert_greedy_equivalent, assert_same_greedy, tops
from tiny_models import write_tiny_lora

import llama_ctypes as lc

PROMPT = "Hello world, this is a test of adapters"


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory):
    return write_tiny_lora(tmp_path_factory.mktemp("lora") / "tiny-lora.gguf")


@pytest.fixture(scope="module")
def other_lora_path(tmp_path_factory):
    return write_tiny_lora(tmp_path_factory.mktemp("lora") / "other-lora.gguf", seed=7, name="other")


@pytest.fixture
def model(tiny_model_path):
    m = lc.load_model(tiny_model_path)
    yield m
    m.close()


def _greedy(model, prompt=PROMPT, **opts):
    return lc.generate(model, prompt, max_tokens=12, temp=0, ignore_eos=True, **opts)


def test_an_adapter_loads_with_its_metadata_and_changes_the_output(model, lora_path):
    adapter = model.load_lora(lora_path)
    assert adapter.name == "tiny-lora-test" and adapter.alpha == 4.0 and adapter.architecture == "llama"
    assert adapter.metadata["adapter.type"] == "lora" and not adapter.is_alora
    assert model.loras == [adapter]
    base = _greedy(model).tokens
    assert _greedy(model, lora={adapter: 1.0}).tokens != base
    assert _greedy(model, lora={"tiny-lora-test": 0.0}).tokens == base  # (llama.cpp drops a zero scale)
    assert _greedy(model, lora={}).tokens == base
    assert _greedy(model).tokens == base  # (the pooled context does not keep the adapter)
    chat = [{"role": "user", "content": "hi"}]
    assert str(lc.chat(model, chat, chat_template="chatml", max_tokens=6, temp=0, ignore_eos=True,
                       lora=["tiny-lora-test"])) != \
        str(lc.chat(model, chat, chat_template="chatml", max_tokens=6, temp=0, ignore_eos=True))


@pytest.mark.parametrize("kind", ["arch", "shape", "model"])
def test_an_adapter_of_another_model_is_refused_before_anything_is_applied(model, tmp_path, kind, tiny_model_path):
    path = {"arch": lambda: write_tiny_lora(tmp_path / "a.gguf", arch="gemma3"),
            "shape": lambda: write_tiny_lora(tmp_path / "s.gguf", n_embd=32),
            "model": lambda: tiny_model_path}[kind]()
    with pytest.raises(lc.ModelLoadError, match="LoRA adapter") as info:
        model.load_lora(path)
    assert {"arch": "arch mismatch", "shape": "incorrect shape", "model": "adapter"}[kind] in str(info.value)
    assert model.loras == []
    assert _greedy(model).finish_reason == "length"  # (the model still works)
    with pytest.raises(lc.ModelNotFoundError):
        model.load_lora(tmp_path / "missing.gguf")


def test_names_scales_and_owners_are_checked(model, lora_path, tiny_model_path):
    adapter = model.load_lora(lora_path, name="mine")
    with pytest.raises(lc.InvalidArgumentError, match="no adapter named 'nope'.*mine"):
        _greedy(model, lora={"nope": 1.0})
    with pytest.raises(lc.InvalidArgumentError, match="within"):
        _greedy(model, lora={adapter: float("nan")})
    with pytest.raises(lc.ArgumentTypeError):
        _greedy(model, lora={3.5: 1.0})
    other = lc.load_model(tiny_model_path)
    try:
        with pytest.raises(lc.InvalidArgumentError, match="another model"):
            _greedy(other, lora={adapter: 1.0})
    finally:
        other.close()


def test_a_context_applies_adapters_until_told_otherwise_and_never_reuses_kv_across_sets(model, lora_path):
    adapter = model.load_lora(lora_path)
    ctx = lc.Context.create(model, n_ctx=256)
    sampler = lc.Sampler.create(model, temp=0)
    try:
        tokens = model.tokenize(PROMPT)
        with ctx.lease() as lease:
            lease.set_loras({adapter: 1.0})
        assert ctx.loras == {adapter: 1.0}
        first = ctx.generate(sampler, tokens, max_tokens=8, ignore_eos=True, cache_prompt=True)
        again = ctx.generate(sampler, tokens, max_tokens=8, ignore_eos=True, cache_prompt=True)
        assert again.timings.cached_tokens == len(tokens) - 1  # same adapters: the prefix is reused
        # another set: nothing computed under the first may be reused (the cache hit would be wrong)
        plain = ctx.generate(sampler, tokens, max_tokens=8, ignore_eos=True, cache_prompt=True, lora={})
        assert plain.timings.cached_tokens == 0 and ctx.loras == {}
        assert plain.tokens != first.tokens
        with pytest.raises(lc.BusyError):  # (not while a context applies it)
            with ctx.lease() as lease:
                lease.set_loras({adapter: 0.5})
            adapter.close()
        with ctx.lease() as lease:
            lease.set_loras(None)
        adapter.close()
        assert adapter.closed and model.loras == []
        with pytest.raises(lc.ClosedError):
            _greedy(model, lora={adapter: 1.0})
    finally:
        sampler.close()
        ctx.close()


def test_closing_the_model_first_frees_its_adapters_after_their_contexts(tiny_model_path, lora_path):
    model = lc.load_model(tiny_model_path)
    adapter = model.load_lora(lora_path)
    ctx = lc.Context.create(model, n_ctx=128)
    with ctx.lease() as lease:
        lease.set_loras({adapter: 1.0})
    model.close()
    assert not adapter.freed and not model.freed  # (the context still applies it)
    with ctx.lease() as lease:
        lease.prefill(ctx.vocab.tokenize("a b c"), reuse=False)  # still decodes with it
    ctx.close()
    assert adapter.freed and model.freed


def test_an_activated_lora_applies_from_its_invocation_tokens_on(model, tmp_path, lora_path):
    invocation = tuple(model.tokenize("assistant:", add_special=False))  # (as inside the prompt below)
    path = write_tiny_lora(tmp_path / "alora.gguf", invocation_tokens=invocation, name="alora")
    alora = model.load_lora(path)
    assert alora.is_alora and alora.invocation_tokens == invocation
    base_without = _greedy(model, "the question is what").tokens
    # no invocation in the prompt: the adapter stays off (the same computation as the base model)
    assert _greedy(model, "the question is what", lora={"alora": 1.0}).tokens == base_without
    prompt = "the question is what assistant: the"
    assert _greedy(model, prompt, lora={"alora": 1.0}).tokens != _greedy(model, prompt).tokens
    # the part before the invocation was read without the adapter: a later plain run reuses it
    ctx = lc.Context.create(model, n_ctx=256)
    sampler = lc.Sampler.create(model, temp=0)
    try:
        tokens = model.tokenize(prompt)
        start = len(tokens) - len(invocation) - 1
        ctx.generate(sampler, tokens, max_tokens=4, ignore_eos=True, cache_prompt=True, lora={alora: 1.0})
        plain = ctx.generate(sampler, tokens, max_tokens=4, ignore_eos=True, cache_prompt=True, lora={})
        assert plain.timings.cached_tokens == start
        other = model.load_lora(lora_path)
        with pytest.raises(lc.InvalidArgumentError, match="several activated"):
            alora2 = model.load_lora(path, name="alora2")
            ctx.generate(sampler, tokens, max_tokens=2, lora={alora: 1.0, alora2: 1.0})
        # an aLoRA beside a plain adapter applies throughout, as llama-server does
        both = ctx.generate(sampler, tokens, max_tokens=2, lora={alora: 1.0, other: 1.0})
        assert both.finish_reason in ("length", "eog")
    finally:
        sampler.close()
        ctx.close()


def test_the_server_runs_each_request_under_its_adapters_and_rotates_between_sets(model, lora_path,
                                                                                     other_lora_path):
    srv = lc.Server(model=model, n_parallel=4, n_ctx=256, loras=[(lora_path, "a"), (other_lora_path, "b")])
    sets = {"none": None, "A": {"a": 1.0}, "A+B": {"a": 1.0, "b": 0.5}}
    try:
        solo = {}
        for key, lora in sets.items():  # (alone: the references, with their top-2 margins)
            solo[key] = srv.generate(PROMPT, max_tokens=10, temp=0, ignore_eos=True, cache_prompt=False,
                                     logprobs=2, lora=lora)
        assert len({tuple(c.tokens) for c in solo.values()}) == 3
        results: dict[int, lc.Completion] = {}
        keys = ["none", "A", "A+B", "A", "none", "A+B", "A", "A+B"]  # (8 requests, 4 slots, 3 sets)

        def run(i: int) -> None:
            results[i] = srv.generate(PROMPT, max_tokens=10, temp=0, ignore_eos=True, cache_prompt=False,
                                      lora=sets[keys[i]])

        before = srv.stats()["lora_switches"]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(keys))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # batched with the requests of its set (a tick decodes one set), each gets what it got alone
        for i, key in enumerate(keys):
            assert_greedy_equivalent(results[i], solo[key], what=f"request {i} under {key}")
        assert srv.stats()["lora_switches"] > before
        # a request naming an unknown adapter gets a clear error, and nothing else fails
        with pytest.raises(lc.InvalidArgumentError, match="no adapter named 'c'"):
            srv.generate(PROMPT, max_tokens=2, lora={"c": 1.0})
        assert srv.generate(PROMPT, max_tokens=2, lora={"a": 1.0}).finish_reason in ("length", "eog")
    finally:
        srv.close()


def test_the_server_never_hands_a_prefix_computed_under_one_set_to_another(model, lora_path, tmp_path):
    srv = lc.Server(model=model, n_parallel=2, n_ctx=256, loras=[(lora_path, "a")], prompt_cache_ram_mb=8)
    try:
        long_prompt = PROMPT * 3
        first = srv.generate(long_prompt, max_tokens=4, temp=0, logprobs=2, lora={"a": 1.0})
        hits = srv.stats()["cached_tokens"]
        srv.generate(long_prompt, max_tokens=4, temp=0)  # base: must not reuse the adapter's KV
        assert srv.stats()["cached_tokens"] == hits
        again = srv.generate(long_prompt, max_tokens=4, temp=0, lora={"a": 1.0})
        assert srv.stats()["cached_tokens"] > hits  # same set: reused
        assert_greedy_equivalent(again, first, what="a cache hit under the same adapter")
        # a slot file cannot say which adapters computed it: a slot holding the adapter's cache is not saved
        refused = 0
        for i in range(2):
            try:
                srv.save_slot(i, tmp_path / f"slot{i}.bin")
            except lc.InvalidArgumentError as exc:
                assert "LoRA" in str(exc)
                refused += 1
        assert refused == 1
        # unloading waits for nothing here, refuses new requests, drops the prefixes computed under it
        srv.unload_lora("a")
        with pytest.raises(lc.InvalidArgumentError, match="no adapter named 'a'"):
            srv.generate(PROMPT, max_tokens=2, lora={"a": 1.0})
        assert srv.loras == {}
        assert srv.generate(PROMPT, max_tokens=2, temp=0).finish_reason in ("length", "eog")
    finally:
        srv.close()


def test_unloading_waits_for_the_requests_that_use_the_adapter(model, lora_path):
    srv = lc.Server(model=model, n_parallel=2, n_ctx=4096)
    adapter = srv.load_lora(lora_path, name="a")
    try:
        # (until the context is full: it runs as long as this test needs, whatever the machine's speed)
        stream = srv.stream(PROMPT, max_tokens=-1, temp=0, ignore_eos=True, lora={"a": 1.0})
        next(iter(stream))
        done = threading.Event()

        def unload() -> None:
            srv.unload_lora("a")
            done.set()

        t = threading.Thread(target=unload)
        t.start()
        assert not done.wait(0.3)  # the stream still uses it
        with pytest.raises(lc.InvalidArgumentError, match="unloaded"):
            srv.generate(PROMPT, max_tokens=2, lora={adapter: 1.0})
        assert srv.generate(PROMPT, max_tokens=2).finish_reason in ("length", "eog")  # (the rest goes on)
        stream.close()  # (its request ends: the unload goes through)
        t.join(30)
        assert done.is_set() and adapter.freed
    finally:
        srv.close()


def test_llama_server_lora_flags_and_endpoints(tiny_model_path, lora_path, other_lora_path, tmp_path):
    proc = ServeProcess([str(tiny_model_path), "-c", "512", "--parallel", "2", "--lora", str(lora_path),
                         "--lora-scaled", str(other_lora_path), "0.5"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        url = proc.base_url
        listed = httpx.get(f"{url}/lora-adapters").json()
        assert [(e["id"], e["name"], e["scale"]) for e in listed] == [(0, "tiny-lora", 1.0), (1, "other-lora", 0.5)]
        assert listed[0]["path"] == str(lora_path)

        def tokens(**extra):
            r = httpx.post(f"{url}/completion", timeout=60, json={
                "prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, **extra})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        by_default = tokens()  # both adapters, at their scales
        only_first = tokens(lora=[{"id": 0, "scale": 1.0}])  # the second gets 0
        assert only_first != by_default
        assert tokens(lora=[{"name": "tiny-lora", "scale": 1.0}]) == only_first
        assert httpx.post(f"{url}/lora-adapters", json=[{"id": 0, "scale": 1.0}]).json() == {"success": True}
        assert [e["scale"] for e in httpx.get(f"{url}/lora-adapters").json()] == [1.0, 0.0]
        assert tokens() == only_first  # the new default scales
        assert httpx.post(f"{url}/lora-adapters", json=[]).json() == {"success": True}
        base = tokens()
        assert base != only_first
        assert tokens(lora=[{"id": 0}]) == base  # (as llama-server: an entry without a scale is off)
        assert api_error(httpx.post(f"{url}/completion", json={"prompt": "x", "lora": [{"id": 9, "scale": 1}]}),
                         400)
        assert api_error(httpx.post(f"{url}/lora-adapters", json={"id": 0}), 400)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "lora": [{"id": 1, "scale": 2.0}]})
        assert r.status_code == 200, r.text
    finally:
        proc.stop()


# ---- control vectors ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cvec_path(tmp_path_factory):
    from tiny_models import write_tiny_control_vector

    return write_tiny_control_vector(tmp_path_factory.mktemp("cvec") / "cvec.gguf")


def test_control_vectors_load_sum_and_steer(model, cvec_path, lora_path, tmp_path):
    from tiny_models import write_tiny_control_vector

    cv = lc.load_control_vector(cvec_path)
    assert cv.n_embd == 64 and cv.data.shape == (1, 64) and cv.layers(2) == (1, 2)
    doubled = lc.load_control_vector([(cvec_path, 1.0), (cvec_path, 1.0)])
    assert (doubled.data == 2 * cv.data).all()  # (files add up, as llama.cpp's loader sums them)
    base = _greedy(model).tokens
    assert _greedy(model, control_vector=cv).tokens != base
    zero = lc.load_control_vector((cvec_path, 0.0))
    assert _greedy(model, control_vector=zero).tokens == base  # (x + 0 is x)
    assert _greedy(model).tokens == base  # (the pooled context dropped it)
    assert _greedy(model, control_vector=cv, lora={model.load_lora(lora_path): 1.0}).tokens != base
    wide = lc.load_control_vector(write_tiny_control_vector(tmp_path / "wide.gguf", n_embd=32))
    with pytest.raises(lc.InvalidArgumentError, match="n_embd=64"):
        _greedy(model, control_vector=wide)
    with pytest.raises(lc.ModelLoadError, match="direction"):
        lc.load_control_vector(lora_path)
    with pytest.raises(lc.ArgumentTypeError):
        _greedy(model, control_vector="cvec.gguf")
    with pytest.raises(lc.InvalidArgumentError, match="empty"):
        lc.load_control_vector(cvec_path, layer_range=(2, 1))


def test_a_prefix_computed_without_the_control_vector_is_not_reused_with_it(model, cvec_path):
    cv = lc.load_control_vector(cvec_path)
    ctx = lc.Context.create(model, n_ctx=256)
    sampler = lc.Sampler.create(model, temp=0)
    try:
        tokens = model.tokenize(PROMPT)
        ctx.generate(sampler, tokens, max_tokens=4, ignore_eos=True, cache_prompt=True)
        steered = ctx.generate(sampler, tokens, max_tokens=4, ignore_eos=True, cache_prompt=True, control_vector=cv)
        assert steered.timings.cached_tokens == 0 and ctx.control_vector is cv
        again = ctx.generate(sampler, tokens, max_tokens=4, ignore_eos=True, cache_prompt=True)
        assert again.timings.cached_tokens == len(tokens) - 1  # (None keeps the context's vector)
        with ctx.lease() as lease:
            lease.set_control_vector(None)
        assert ctx.generate(sampler, tokens, max_tokens=4, cache_prompt=True).timings.cached_tokens == 0
    finally:
        sampler.close()
        ctx.close()


def test_a_server_applies_its_control_vector_to_every_request(model, cvec_path, tiny_model_path, tmp_path):
    cv = lc.load_control_vector(cvec_path)
    ref = _greedy(model, control_vector=cv, logprobs=2)
    with lc.Server(model=model, n_parallel=2, n_ctx=256, control_vector=cv) as srv:
        out = srv.generate(PROMPT, max_tokens=12, temp=0, ignore_eos=True)
        assert_greedy_equivalent(out, ref, what="a Server with the control vector")
        with pytest.raises(lc.InvalidArgumentError, match="every request"):
            srv.generate(PROMPT, max_tokens=2, control_vector=cv)
    proc = ServeProcess([str(tiny_model_path), "-c", "512", "--parallel", "1", "--control-vector-scaled",
                         str(cvec_path), "1.0", "--control-vector-layer-range", "1", "2"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        r = httpx.post(f"{proc.base_url}/completion", timeout=60, json={
            "prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True})
        assert r.status_code == 200, r.text
        assert len(r.json()["tokens"]) == len(ref.tokens) == 12
        assert_same_greedy(r.json()["tokens"], ref.tokens, tops(ref.logprobs), what="serve --control-vector")
    finally:
        proc.stop()


def test_the_server_reads_an_activated_loras_prompt_in_two_parts(model, tmp_path):
    invocation = tuple(model.tokenize("assistant:", add_special=False))
    path = write_tiny_lora(tmp_path / "alora.gguf", invocation_tokens=invocation, name="alora")
    prompt = "the question is what assistant: the"
    with lc.Server(model=model, n_parallel=2, n_ctx=256, loras=[(path, "alora")]) as srv:
        ref = _greedy(model, prompt, lora={srv.loras["alora"]: 1.0}, logprobs=2)
        assert ref.tokens != _greedy(model, prompt).tokens
        out = srv.generate(prompt, max_tokens=12, temp=0, ignore_eos=True, lora={"alora": 1.0})
        assert_greedy_equivalent(out, ref, what="the Server's aLoRA")
        # the part before the invocation was computed without the adapter: a plain request reuses it
        n_before = len(model.tokenize(prompt)) - len(invocation) - 1
        hits = srv.stats()["cached_tokens"]
        srv.generate(prompt, max_tokens=2, temp=0)
        assert srv.stats()["cached_tokens"] - hits == n_before
        # without the invocation the adapter stays off: what the base model writes
        plain = srv.generate("the question is what", max_tokens=8, temp=0, ignore_eos=True, logprobs=2)
        off = srv.generate("the question is what", max_tokens=8, temp=0, ignore_eos=True, lora={"alora": 1.0})
        assert_greedy_equivalent(off, plain, what="an aLoRA without its invocation")


def test_the_manager_loads_a_models_adapters_and_counts_them_in_the_budget(tiny_model_path, lora_path, tmp_path):
    from llama_ctypes.interfaces.http.serve import models_from_config

    with lc.ModelManager() as mm:
        mm.load("plain", tiny_model_path, n_parallel=1, n_ctx=256)
        before = mm.used()
        mm.load("adapted", tiny_model_path, n_parallel=1, n_ctx=256, loras=[(str(lora_path), "a", 1.0)])
        # the adapter's bytes are counted in the pool of the weights, beside a second copy of the model
        assert (mm.used() - before) - before == {"ram": lora_path.stat().st_size}
        base = mm.generate("plain", PROMPT, max_tokens=6, temp=0, ignore_eos=True, logprobs=2)
        assert mm.generate("adapted", PROMPT, max_tokens=6, temp=0, ignore_eos=True).tokens != base.tokens
        # per request through the manager: scale 0 turns the model's default adapter off
        assert_greedy_equivalent(mm.generate("adapted", PROMPT, max_tokens=6, temp=0, ignore_eos=True,
                                             lora={"a": 0.0}), base, what="the adapter off per request")
    config = tmp_path / "models.toml"
    config.write_text(f'[[models]]\nid = "m"\npath = "{tiny_model_path}"\n'
                      f'loras = ["{lora_path}", {{path = "{lora_path}", name = "b", scale = 0.5}}]\n')
    _, specs = models_from_config(config)
    assert specs[0]["loras"] == [(str(lora_path), "tiny-lora", 0.0), (str(lora_path), "b", 0.5)]
    config.write_text(f'[[models]]\nid = "m"\npath = "{tiny_model_path}"\nloras = [{{file = "x"}}]\n')
    with pytest.raises(lc.InvalidArgumentError, match="each lora"):
        models_from_config(config)


def test_adapters_load_and_unload_over_http_behind_the_api_key(tiny_model_path, lora_path, tmp_path):
    proc = ServeProcess([str(tiny_model_path), "-c", "512", "--parallel", "1"], tmp_path / "serve.log", api_key="k")
    try:
        proc.wait_ready()
        url, key = proc.base_url, proc.headers
        assert api_error(httpx.post(f"{url}/lora-adapters/load", json={"path": str(lora_path)}), 401)
        r = httpx.post(f"{url}/lora-adapters/load", headers=key, json={"path": str(lora_path), "name": "x"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == 0 and r.json()["name"] == "x" and r.json()["scale"] == 0.0
        assert api_error(httpx.post(f"{url}/lora-adapters/load", headers=key,
                                    json={"path": str(lora_path), "name": "x"}), 400)  # (the name is taken)
        assert api_error(httpx.post(f"{url}/lora-adapters/load", headers=key,
                                    json={"path": str(tmp_path / "serve.log")}), 400, "path")
        body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "cache_prompt": False}
        plain = httpx.post(f"{url}/completion", headers=key, json=body, timeout=60).json()["tokens"]
        adapted = httpx.post(f"{url}/completion", headers=key, timeout=60,
                             json={**body, "lora": [{"name": "x", "scale": 1.0}]}).json()["tokens"]
        assert adapted != plain
        r = httpx.post(f"{url}/lora-adapters/unload", headers=key, json={"name": "x"})
        assert r.json() == {"success": True}
        assert httpx.get(f"{url}/lora-adapters", headers=key).json() == []
        assert api_error(httpx.post(f"{url}/completion", headers=key,
                                    json={**body, "lora": [{"name": "x", "scale": 1.0}]}), 400)
    finally:
        proc.stop()
    proc = ServeProcess([str(tiny_model_path), "-c", "256", "--parallel", "1"], tmp_path / "open.log")
    try:
        proc.wait_ready()
        assert api_error(httpx.post(f"{proc.base_url}/lora-adapters/load", json={"path": str(lora_path)}), 501)
    finally:
        proc.stop()


# ---- what a hostile review found ------------------------------------------------------------------

def test_a_shorter_control_vector_leaves_nothing_of_a_longer_one(tmp_path, vocab_dir):
    from tiny_models import write_tiny_control_vector, write_tiny_llama

    path = write_tiny_llama(tmp_path / "deep.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", n_layer=4)
    long = lc.load_control_vector(write_tiny_control_vector(tmp_path / "long.gguf", n_layer=4))
    short = lc.load_control_vector(write_tiny_control_vector(tmp_path / "short.gguf", layers=(1,), seed=9))
    with lc.load_model(path) as fresh:
        expected = _greedy(fresh, control_vector=short).tokens
    with lc.load_model(path) as model:
        _greedy(model, control_vector=long)
        assert _greedy(model, control_vector=short).tokens == expected  # (the pooled context's rows 2-3 cleared)


def test_a_cut_keeps_track_of_the_adapters_of_what_follows(model, lora_path):
    adapter = model.load_lora(lora_path)
    ctx = lc.Context.create(model, n_ctx=128)
    try:
        toks = model.tokenize(PROMPT * 2)[:12]
        with ctx.lease() as lease:
            lease.prefill(toks[:5], reuse=False)
            lease.set_loras({adapter: 1.0})
            lease.extend(toks[5:10])
            assert lease.truncate(3)
            lease.extend(toks[3:10])  # (recomputed under the adapter)
            lease.set_loras(None)
            assert lease.prefill(toks[:12], reuse=True) == 3
    finally:
        ctx.close()


def test_adapter_ids_stay_valid_after_an_unload(model, lora_path, other_lora_path):
    with lc.Server(model=model, n_parallel=1, n_ctx=256, loras=[(lora_path, "a"), (other_lora_path, "b")]) as srv:
        assert [(i, a.name) for i, a, _ in srv.lora_table()] == [(0, "a"), (1, "b")]
        by_b = srv.generate(PROMPT, max_tokens=6, temp=0, ignore_eos=True, lora={1: 1.0}, logprobs=2)
        srv.unload_lora("a")
        with pytest.raises(lc.InvalidArgumentError, match="no adapter with id 0"):
            srv.generate(PROMPT, max_tokens=2, lora={0: 1.0})
        assert_greedy_equivalent(srv.generate(PROMPT, max_tokens=6, temp=0, ignore_eos=True, lora={1: 1.0}), by_b,
                                 what="id 1 after id 0 was unloaded")
        srv.load_lora(lora_path, "a2")
        assert [(i, a.name) for i, a, _ in srv.lora_table()] == [(1, "b"), (2, "a2")]
        with pytest.raises(lc.InvalidArgumentError, match="within"):
            srv.generate(PROMPT, max_tokens=2, lora={"b": 1e300})


def test_a_request_resolved_before_an_unload_is_waited_for(model, lora_path, monkeypatch):
    import llama_ctypes.engines.server.adapters as adapters_module

    srv = lc.Server(model=model, n_parallel=1, n_ctx=256)
    adapter = srv.load_lora(lora_path, "a")
    resolved, go = threading.Event(), threading.Event()
    real = adapters_module.resolve_loras

    def slow(*args, **kw):
        out = real(*args, **kw)
        if out:
            resolved.set()
            go.wait(10)
        return out

    monkeypatch.setattr(adapters_module, "resolve_loras", slow)
    try:
        result: dict = {}
        submit = threading.Thread(target=lambda: result.setdefault("c", srv.generate(
            PROMPT, max_tokens=4, temp=0, ignore_eos=True, lora={"a": 1.0})))
        submit.start()
        assert resolved.wait(10)
        unload = threading.Thread(target=lambda: srv.unload_lora("a"))
        unload.start()
        unload.join(0.3)
        assert unload.is_alive()  # (it waits for the request resolved before it)
        go.set()
        submit.join(30)
        unload.join(30)
        assert result["c"].finish_reason == "length" and not unload.is_alive()
        assert adapter.freed
    finally:
        go.set()
        srv.close()


def test_an_idle_server_applies_no_adapter(model, lora_path):
    adapter = model.load_lora(lora_path)
    with lc.Server(model=model, n_parallel=1, n_ctx=256, loras=[adapter]) as srv:
        srv.generate(PROMPT, max_tokens=2, lora={adapter: 1.0})
        deadline = threading.Event()
        for _ in range(100):  # (the scheduler drops it once idle)
            try:
                adapter.close()
                break
            except lc.BusyError:
                deadline.wait(0.02)
        assert adapter.closed
        with pytest.raises(lc.ClosedError):
            srv.generate(PROMPT, max_tokens=2, lora={adapter: 1.0})


def _last_logits(model, tokens, loras=None):
    ctx = lc.Context.create(model, n_ctx=128)
    try:
        with ctx.lease() as lease:
            lease.set_loras(loras)
            lease.prefill(tokens, reuse=False)
            return np.array(lease.logits(-1), dtype=np.float64)
    finally:
        ctx.close()


def test_an_adapter_equals_its_weights_merged_into_the_model(model, tmp_path, vocab_dir, lora_path, other_lora_path):
    """llama.cpp's LoRA is W·x + s·alpha/rank·B·(A·x): the same logits (within float32 rounding) as a
    model whose weights are W + s·alpha/rank·B·A, and the same greedy tokens."""
    from tiny_models import merged_deltas, tiny_lora_pairs, write_tiny_llama

    vocab = vocab_dir / "ggml-vocab-llama-spm.gguf"
    a, b = model.load_lora(lora_path, "a"), model.load_lora(other_lora_path, "b")
    pairs_a, pairs_b = tiny_lora_pairs(seed=1), tiny_lora_pairs(seed=7)  # (what write_tiny_lora wrote)
    tokens = model.tokenize(PROMPT)
    for loras, merged in (({a: 0.7}, [(pairs_a, 4.0, 0.7)]),
                          ({a: 0.7, b: -0.3}, [(pairs_a, 4.0, 0.7), (pairs_b, 4.0, -0.3)])):
        path = write_tiny_llama(tmp_path / f"merged{len(loras)}.gguf", vocab, deltas=merged_deltas(*merged))
        with lc.load_model(path) as merged_model:
            want = _last_logits(merged_model, tokens)
            got = _last_logits(model, tokens, loras)
            # (float32 sums in another order: within 1e-4 of the largest logit)
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
            assert np.abs(got - _last_logits(model, tokens)).max() > 0.1 * np.abs(want).max()  # (it does change)
            ref = _greedy(merged_model, logprobs=2)
            assert_greedy_equivalent(_greedy(model, lora=loras), ref, what=f"{len(loras)} adapter(s) vs merged")


def test_bad_adapter_files_and_scales_are_clear_errors(model, lora_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(lora_path.read_bytes()[: lora_path.stat().st_size // 2])
    with pytest.raises(lc.ModelLoadError, match="LoRA adapter"):
        model.load_lora(truncated)
    text = tmp_path / "text.gguf"
    text.write_text("not a gguf")
    with pytest.raises(lc.ModelLoadError, match="not a GGUF"):
        model.load_lora(text)
    adapter = model.load_lora(lora_path)
    for bad in (float("nan"), float("inf"), 1e300, "1", True):
        with pytest.raises((lc.InvalidArgumentError, lc.ArgumentTypeError)):
            _greedy(model, lora={adapter: bad})
    # a negative scale subtracts the adapter (llama.cpp and llama-server accept it)
    assert _greedy(model, lora={adapter: -1.0}).tokens != _greedy(model).tokens
    assert model.loras == [adapter] and _greedy(model).finish_reason == "length"


@pytest.mark.needs_tools
def test_the_same_greedy_tokens_as_llama_server_with_the_same_adapter(tiny_model_path, lora_path):
    from llama_server import NOT_BUILT, LlamaServer, find_llama_server

    exe = find_llama_server()
    if exe is None:
        pytest.fail(NOT_BUILT)
    with lc.load_model(tiny_model_path) as model:
        adapter = model.load_lora(lora_path)
        refs = {scale: _greedy(model, lora={adapter: scale}, logprobs=2) for scale in (1.0, 0.5, 0.0)}
    with LlamaServer(exe, tiny_model_path, ["-c", "512", "--parallel", "1", "--lora", str(lora_path)]) as ls:
        for scale, ref in refs.items():
            r = httpx.post(f"{ls.url}/completion", timeout=60, json={
                "prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "cache_prompt": False, "lora": [{"id": 0, "scale": scale}]})
            assert r.status_code == 200, r.text
            assert len(r.json()["tokens"]) == len(ref.tokens) == 12
            assert_same_greedy(r.json()["tokens"], ref.tokens, tops(ref.logprobs),
                               what=f"llama-server --lora at scale {scale}")
