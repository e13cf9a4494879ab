"""llama-server's own API on ``llama-ctypes serve``: its command line, /props, /slots and the ChatML
fallback for a model without a chat template (issue: speak llama-server's whole API).

The server is started with llama-server's flag names, as llama.cpp's server tests start llama-server.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from http_helpers import ServeProcess, api_error, wait_for

import llama_ctypes as lc


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    folder = tmp_path_factory.mktemp("llama-server-api")
    proc = ServeProcess(["--model", str(tiny_model_path), "--alias", "tinyllama-2,fim,code", "--tags", "chat,small",
                         "--parallel", "2", "--ctx-size", "2048", "--batch-size", "64", "--ubatch-size", "32",
                         "--temp", "0.8", "--seed", "42", "--n-predict", "16", "--no-jinja", "--cont-batching",
                         "--metrics", "-fa", "off", "-ctk", "f16", "--kv-unified"], folder / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_models_list_every_alias_and_tag_and_take_the_first_alias_as_id(server):
    (model,) = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert model["id"] == "code"  # the first in sorted order, as llama-server
    assert set(model["aliases"]) == {"tinyllama-2", "fim", "code"}
    assert set(model["tags"]) == {"chat", "small"}
    for name in ("tinyllama-2", "fim", "code"):  # every alias routes to it
        r = httpx.post(f"{server.base_url}/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "code"  # responses name the model id


def test_props_report_the_command_line(server, tiny_model_path):
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["model_path"] == str(tiny_model_path)
    assert props["build_info"] == lc.version_info().build_info and props["build_info"].startswith("b")
    assert props["total_slots"] == 2
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 2048  # per slot: with --kv-unified a slot may fill the whole -c, as llama-server
    assert settings["params"]["seed"] == 42 and settings["params"]["temperature"] == pytest.approx(0.8)
    assert settings["params"]["n_predict"] == 16
    assert props["endpoint_slots"] is True and props["modalities"] == {"vision": False, "video": False,
                                                                         "audio": False}
    assert "<|im_start|>" in props["chat_template"]  # the ChatML fallback of a model without a template
    r = httpx.post(f"{server.base_url}/props", json={})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_n_predict_is_the_default_max_tokens(server):
    body = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Once upon a time",
                                                                  "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_a_model_without_a_template_chats_in_chatml_and_says_so(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n is more tokens than "hi" alone
    assert usage["prompt_tokens"] > 8
    assert server.log().count("has no chat template: using ChatML") == 1


def test_slots_show_a_running_request_and_fail_on_no_slot(server):
    slots = httpx.get(f"{server.base_url}/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    assert all(s["n_ctx"] == 2048 and not s["is_processing"] and "params" not in s for s in slots)  # (--kv-unified)
    # two long requests fill both slots: /slots shows them, and ?fail_on_no_slot answers 503
    started = threading.Barrier(3)

    def long_request():
        started.wait()
        httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True})

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    try:
        for _ in range(200):
            slots = httpx.get(f"{server.base_url}/slots").json()
            if all(s["is_processing"] for s in slots):
                break
        assert all(s["is_processing"] for s in slots)
        busy = slots[0]
        assert busy["n_prompt_tokens"] > 0 and busy["next_token"][0]["n_remain"] <= 400
        r = httpx.get(f"{server.base_url}/slots?fail_on_no_slot=1")
        assert r.status_code == 503
    finally:
        for t in threads:
            t.join()
    # (on a loaded machine a client may give up first: the server finishes its request, then the slot is free)
    for _ in range(600):
        if not any(s["is_processing"] for s in httpx.get(f"{server.base_url}/slots").json()):
            break
        time.sleep(0.2)
    assert httpx.get(f"{server.base_url}/slots?fail_on_no_slot=1").status_code == 200


def test_no_slots_answers_501_in_llama_servers_shape(tmp_path, tiny_model_path):
    proc = ServeProcess([str(tiny_model_path), "--no-slots", "-c", "1024"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        r = httpx.get(f"{proc.base_url}/slots")
        assert api_error(r, 501)["type"] == "not_supported_error"
    finally:
        proc.stop()


def test_a_flag_serve_lacks_is_refused_not_swallowed(tmp_path, tiny_model_path):
    proc = ServeProcess([str(tiny_model_path), "--grp-attn-n", "4"], tmp_path / "serve.log")
    assert proc.proc.wait(timeout=60) == 2  # argparse's usage error, before anything loads
    proc.stop()
    assert "unrecognized arguments: --grp-attn-n 4" in proc.log()


def test_apply_template_renders_without_generating(server):
    r = httpx.post(f"{server.base_url}/apply-template",
                   json={"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                  "<|im_start|>assistant\n")


def test_reasoning_switch_sets_thinking_as_llama_server(tmp_path, tiny_model_path, vocab_dir):
    """--reasoning auto (the default) and on ask a thinking template to think, off asks it not to; a
    request's own chat_template_kwargs.enable_thinking wins."""
    template = vocab_dir / "templates" / "Qwen-QwQ-32B.jinja"  # (llama.cpp's models/templates)
    ask = {"messages": [{"role": "user", "content": "What is today?"}]}
    ends = {}
    for mode in ("auto", "off"):
        proc = ServeProcess([str(tiny_model_path), "-c", "1024", "--jinja", "--chat-template-file", str(template),
                             "--reasoning", mode], tmp_path / f"serve-{mode}.log")
        try:
            proc.wait_ready()
            ends[mode] = httpx.post(f"{proc.base_url}/apply-template", json=ask).json()["prompt"]
            thinking = httpx.post(f"{proc.base_url}/apply-template", json={
                **ask, "chat_template_kwargs": {"enable_thinking": True}}).json()["prompt"]
        finally:
            proc.stop()
        assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    assert ends["auto"].endswith("<|im_start|>assistant\n<think>\n")
    assert ends["off"].endswith("<|im_start|>assistant\n<think>\n</think>")
    bad = ServeProcess([str(tiny_model_path), "--reasoning", "maybe"], tmp_path / "serve-bad.log")
    assert bad.proc.wait(timeout=60) == 2
    bad.stop()


def test_vertex_ai_prediction_route_as_llama_server(tmp_path, tiny_model_path):
    """AIP_MODE=PREDICTION: POST /predict runs each instance through the endpoint its @requestFormat
    names, in order, each failure in its own place; AIP_HTTP_PORT overrides --port."""
    from http_helpers import free_port

    port = free_port()
    proc = ServeProcess([str(tiny_model_path), "-c", "1024", "-np", "2", "--chat-template", "chatml"],
                        tmp_path / "serve.log", env={"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port),
                                                     "AIP_PREDICT_ROUTE": "predict", "AIP_HEALTH_ROUTE": "/ping"})
    proc.base_url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_ready(path="/ping")
        chat = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{proc.base_url}/predict", timeout=120, json={"instances": [
            {"@requestFormat": "chatCompletions", **chat, "stream": True},
            {"@requestFormat": "/v1/chat/completions", **chat},
            {"@requestFormat": "tokenize", "content": "Hello world"},
            {"@requestFormat": "noSuchThing"},
            {"@requestFormat": "chatCompletions", "messages": "not a list"},
            "not an object"]})
        assert r.status_code == 200, r.text
        first, second, tokens, unknown, bad, not_object = r.json()["predictions"]
        assert first["choices"][0]["message"]["role"] == "assistant" and first["usage"]["completion_tokens"] == 4
        assert second["object"] == "chat.completion" and second["usage"]["completion_tokens"] == 4
        plain = httpx.post(f"{proc.base_url}/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert tokens["tokens"] == plain
        assert "noSuchThing" in unknown["error"]["message"] and "messages" in bad["error"]["message"]
        assert "JSON object" in not_object["error"]["message"]
        assert httpx.post(f"{proc.base_url}/predict", json={"instances": [{}] * 129}).status_code == 400
        assert httpx.post(f"{proc.base_url}/predict", json={"nothing": 1}).status_code == 400
    finally:
        proc.stop()


def test_pooling_none_is_refused_in_openais_shape_only(tmp_path, tiny_model_path):
    """Per-token embeddings have no OpenAI shape: /v1/embeddings answers 400 as llama-server; /embeddings
    gives each input's matrix (a row per token)."""
    proc = ServeProcess([str(tiny_model_path), "--embedding", "--pooling", "none"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        refused = httpx.post(f"{proc.base_url}/v1/embeddings", json={"input": "hello hello hello"})
        assert "not OAI compatible" in api_error(refused, 400)["message"]
        r = httpx.post(f"{proc.base_url}/embeddings", json={"input": ["hello hello hello", "hi"]})
        assert r.status_code == 200, r.text
        rows = [d["embedding"] for d in r.json()["data"]]
        n = [len(httpx.post(f"{proc.base_url}/tokenize", json={"content": t, "add_special": True}).json()["tokens"])
             for t in ("hello hello hello", "hi")]
        assert [len(m) for m in rows] == n and len({len(row) for m in rows for row in m}) == 1
    finally:
        proc.stop()


def test_embedding_inputs_count_as_prompts_in_the_metrics(tmp_path, tiny_model_path):
    """An embedding request samples nothing, but its inputs are prompt tokens and cost decodes:
    llamacpp:prompt_tokens_total and n_decode_total count them, as llama-server's test_metrics asks."""
    proc = ServeProcess([str(tiny_model_path), "--embedding"], tmp_path / "serve.log")

    def sample(text: str, name: str) -> float:
        return float(re.search(rf"^llamacpp:{name} (\S+)$", text, re.M).group(1))

    try:
        proc.wait_ready()
        before = httpx.get(f"{proc.base_url}/metrics").text
        assert sample(before, "prompt_tokens_total") == sample(before, "n_decode_total") == 0
        r = httpx.post(f"{proc.base_url}/v1/embeddings", json={"input": ["hello world", "goodbye world"]})
        assert r.status_code == 200, r.text
        after = httpx.get(f"{proc.base_url}/metrics").text
        assert sample(after, "prompt_tokens_total") == r.json()["usage"]["prompt_tokens"] > 0
        assert sample(after, "n_decode_total") == 1  # (two short texts share one decode)
        assert sample(after, "tokens_predicted_total") == 0
    finally:
        proc.stop()


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^llamacpp:{name} (\S+)$", text, re.M).group(1))


def test_sleep_idle_seconds_frees_the_model_and_the_next_request_loads_it(tmp_path, tiny_model_path):
    """``--sleep-idle-seconds``, as llama-server: after that long without work the model is freed; /health,
    /props, /models and /metrics answer without waking it (the counters as they were, the throughput
    gauges over the window since the last scrape); the next generation or token count loads it again,
    and the counters go on from where they were."""
    proc = ServeProcess([str(tiny_model_path), "--sleep-idle-seconds", "1", "--alias", "tiny"],
                        tmp_path / "serve.log")

    def sleeping() -> bool:
        return httpx.get(f"{proc.base_url}/props").json()["is_sleeping"]

    def wait_asleep() -> None:
        deadline = time.monotonic() + 15
        while not sleeping():
            assert time.monotonic() < deadline, "the server did not go to sleep"
            time.sleep(0.1)

    try:
        proc.wait_ready()
        assert not sleeping()
        request = {"prompt": "Hello", "n_predict": 8, "ignore_eos": True, "return_tokens": True, "temperature": 0}
        first = httpx.post(f"{proc.base_url}/completion", json=request, timeout=60).json()
        wait_asleep()
        # (/props says so as the model starts being freed; the log line comes once it is)
        assert wait_for(lambda: "entering sleeping state" in proc.log(), 15)
        props = httpx.get(f"{proc.base_url}/props").json()
        assert props["model_alias"] == "tiny" and props["total_slots"] >= 1
        assert httpx.get(f"{proc.base_url}/health").status_code == 200
        listed = httpx.get(f"{proc.base_url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["tiny"]
        scrape = httpx.get(f"{proc.base_url}/metrics").text
        assert _metric(scrape, "tokens_predicted_total") == 8 and _metric(scrape, "predicted_tokens_seconds") > 0
        again = httpx.get(f"{proc.base_url}/metrics").text  # (a new window: nothing ran)
        assert _metric(again, "predicted_tokens_seconds") == 0 and _metric(again, "tokens_predicted_total") == 8
        assert httpx.get(f"{proc.base_url}/favicon.ico").status_code == 404  # (not an API path: not work)
        assert sleeping()  # none of these woke it
        # a token count is work: it wakes the model
        r = httpx.post(f"{proc.base_url}/v1/messages/count_tokens",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}]})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        assert not sleeping() and "exiting sleeping state" in proc.log()
        wait_asleep()
        # so is a generation; the model loaded again gives what it gave before the sleep (greedy)
        second = httpx.post(f"{proc.base_url}/completion", json=request, timeout=60).json()
        assert not sleeping()
        # (both ran cold on the same machine, in the same batch shapes: the same tokens)
        assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 8
        after = httpx.get(f"{proc.base_url}/metrics").text
        assert _metric(after, "tokens_predicted_total") == 16  # (the 8 from before the sleep carried over)
        assert _metric(after, "n_decode_total") >= 16
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()


def test_sleep_in_router_mode_loads_what_requests_name(tmp_path, tiny_model_path):
    """With several models (``--models-dir``), a sleep frees every loaded one; a request then loads only the
    model it names, ``/models/load`` works while asleep (and ends the sleep), and a model that cannot be
    loaded again fails alone."""
    import shutil

    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("a", "b"):
        shutil.copy(tiny_model_path, folder / f"{name}.gguf")
    proc = ServeProcess(["--models-dir", str(folder), "--sleep-idle-seconds", "1"], tmp_path / "serve.log")

    def status() -> dict[str, str]:
        return {m["id"]: m["status"]["value"] for m in httpx.get(f"{proc.base_url}/models").json()["data"]}

    def complete(model: str) -> httpx.Response:
        return httpx.post(f"{proc.base_url}/completion", timeout=60,
                          json={"model": model, "prompt": "Hi", "n_predict": 2, "temperature": 0})

    try:
        proc.wait_ready()
        assert complete("a").status_code == 200 and complete("b").status_code == 200
        assert wait_for(lambda: status() == {"a": "unloaded", "b": "unloaded"}, 15)
        assert wait_for(lambda: "entering sleeping state" in proc.log(), 15)
        assert complete("b").status_code == 200
        assert status() == {"a": "unloaded", "b": "loaded"}  # (only what the request named)
        assert wait_for(lambda: status()["b"] == "unloaded", 15)  # asleep again
        r = httpx.post(f"{proc.base_url}/models/load", json={"model": "a"}, timeout=60)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: status()["a"] == "loaded", 30)
        assert wait_for(lambda: status()["a"] == "unloaded", 15)  # (awake again: the timer ran, asleep again)
        (folder / "a.gguf").write_bytes(b"GGUF broken")  # a cannot be loaded any more; b still can
        assert complete("a").status_code == 503
        assert complete("b").status_code == 200
    finally:
        proc.stop()


def test_sleep_idle_seconds_is_checked(tmp_path, tiny_model_path):
    proc = ServeProcess([str(tiny_model_path), "--sleep-idle-seconds", "0"], tmp_path / "serve.log")
    assert proc.proc.wait(60) != 0
    assert "--sleep-idle-seconds 0" in proc.log()
    proc.stop()


def test_a_prompt_over_the_slot_is_refused_in_both_shapes(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "What is the best book? " * 400}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "exceed_context_size_error"
    assert error["code"] == "context_length_exceeded"  # (what OpenAI clients look for)
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] > 2048  # (--kv-unified: the whole -c)


BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def _chat(server, **body):
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": BOOK, "max_tokens": 4, **body},
                      timeout=60)


def test_timings_come_with_every_reply_and_with_every_chunk_when_asked(server):
    reply = _chat(server).json()
    t = reply["timings"]
    assert t["predicted_n"] == reply["usage"]["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == reply["usage"]["prompt_tokens"]
    assert t["predicted_per_second"] > 0 and t["prompt_ms"] > 0
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"messages": BOOK, "max_tokens": 4, "stream": True, "timings_per_token": True,
                            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    first, *rest = chunks
    assert "timings" not in first and first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all("timings" in c for c in rest)
    assert rest[-1]["choices"] == [] and rest[-1]["timings"]["predicted_n"] == rest[-1]["usage"]["completion_tokens"]


def test_verbose_shows_the_rendered_prompt(server):
    prompt = httpx.post(f"{server.base_url}/apply-template", json={"messages": BOOK}).json()["prompt"]
    reply = _chat(server, verbose=True).json()
    verbose = reply["__verbose"]
    assert verbose["prompt"] == prompt and verbose["tokens_predicted"] == reply["usage"]["completion_tokens"]
    assert verbose["content"] == reply["choices"][0]["message"]["content"]
    assert "__verbose" not in _chat(server).json()


def test_a_final_assistant_message_is_continued(server):
    base = httpx.post(f"{server.base_url}/apply-template", json={"messages": BOOK}).json()["prompt"]
    prefill = BOOK + [{"role": "assistant", "content": "Whill"}]
    verbose = _chat(server, messages=prefill, verbose=True).json()["__verbose"]
    assert verbose["prompt"] == base + "Whill"  # no end of turn: the model goes on with the same word
    explicit = _chat(server, messages=prefill, verbose=True, add_generation_prompt=False,
                     continue_final_message=True).json()["__verbose"]
    assert explicit["prompt"] == verbose["prompt"]
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]  # joined as llama-server joins them
    joined = _chat(server, messages=BOOK + [{"role": "assistant", "content": parts}], verbose=True)
    assert joined.json()["__verbose"]["prompt"] == base + "Wh\n\nill", joined.text
    r = _chat(server, messages=prefill, add_generation_prompt=True, continue_final_message=True)
    assert api_error(r, 400, "continue_final_message")
    r = _chat(server, messages=prefill + [{"role": "assistant", "content": "again"}])
    assert "2 or more assistant messages" in api_error(r, 400, "messages")["message"]
    finished = _chat(server, messages=prefill, verbose=True, continue_final_message=False).json()["__verbose"]
    assert finished["prompt"].startswith(base + "Whill<|im_end|>")  # (explicitly false: a finished turn)


def test_a_trailing_assistant_message_with_tools_is_a_finished_turn(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = BOOK + [{"role": "assistant", "content": "Sure"}]
    r = _chat(server, messages=messages, tools=[tool], verbose=True)
    assert r.status_code == 200, r.text
    assert not r.json()["__verbose"]["prompt"].endswith("Sure")  # (a new turn follows it)
    assert api_error(_chat(server, messages=messages, tools=[tool], add_generation_prompt=False,
                           continue_final_message=True), 400)


def test_input_tokens_count_what_a_reply_reads(server):
    count = httpx.post(f"{server.base_url}/v1/chat/completions/input_tokens", json={"messages": BOOK}).json()
    assert count == {"input_tokens": _chat(server).json()["usage"]["prompt_tokens"]}
    assert httpx.post(f"{server.base_url}/chat/completions/input_tokens",
                      json={"messages": BOOK}).json() == count


def test_grammar_and_json_schema_fields_constrain_the_reply(server):
    reply = _chat(server, grammar='root ::= "a"{5,5}', max_tokens=8).json()
    assert reply["choices"][0]["message"]["content"] == "aaaaa"
    reply = _chat(server, json_schema={"const": "42"}, max_tokens=8).json()
    assert reply["choices"][0]["message"]["content"] == '"42"'
    text = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 8,
                                                                 "grammar": 'root ::= "b"{3}'}).json()
    assert text["choices"][0]["text"] == "bbb" and "timings" in text
    assert "GBNF" in api_error(_chat(server, grammar="root ::= this is (not valid GBNF"), 400)["message"]
    r = _chat(server, grammar='root ::= "a"', json_schema={"const": 1})
    assert "cannot be combined" in api_error(r, 400)["message"]


def test_several_listen_addresses(tmp_path, tiny_model_path):
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    proc = ServeProcess([str(tiny_model_path), "-c", "1024"], tmp_path / "serve.log", api_key="k",
                        host="127.0.0.1,::1")
    try:
        proc.wait_ready()
        for host in ("127.0.0.1", "[::1]"):
            url = f"http://{host}:{proc.port}"
            assert httpx.get(f"{url}/health").status_code == 200
            assert httpx.post(f"{url}/v1/completions", json={}).status_code == 401
            r = httpx.post(f"{url}/v1/completions", headers=proc.headers, json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        proc.stop()


def test_cors_keys_and_prefix_as_llama_server(tmp_path, tiny_model_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nkey-one\n\nkey-two\n")
    proc = ServeProcess([str(tiny_model_path), "-c", "1024", "--api-key-file", str(keys), "--api-prefix", "/llama",
                         "--cors-origins", "localhost"], tmp_path / "serve.log")
    try:
        proc.wait_ready(path="/llama/health")
        url = f"{proc.base_url}/llama"
        for key in ("key-one", "key-two"):
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert api_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert httpx.get(f"{proc.base_url}/v1/models", headers={"x-api-key": "key-one"}).status_code == 404
        r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": "key-one"}, json={"messages": "bad"})
        assert r.status_code == 400 and r.json()["type"] == "error"  # (Anthropic's shape under the prefix too)
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
        for origin, allowed in (("http://localhost:5173", True), ("http://[::1]", True),
                                ("http://localhost.evil.com", False), ("https://example.org", False)):
            r = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": origin, **preflight})
            assert r.status_code == 200  # (a preflight needs no key)
            assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
            if allowed:
                assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
                assert r.headers["access-control-allow-headers"] == "Authorization"  # (a "*" would not cover it)
                assert r.headers["access-control-allow-credentials"] == "true"
                assert b"Access-Control-Allow-Origin" in dict(r.headers.raw)
            r = httpx.get(f"{url}/v1/models", headers={"Origin": origin, "x-api-key": "key-two"})
            assert r.status_code == 200
            assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
    finally:
        proc.stop()


def _status(url: str, model_id: str) -> str:
    return next(m["status"]["value"] for m in httpx.get(f"{url}/models").json()["data"] if m["id"] == model_id)


def test_router_loads_unloads_and_evicts_the_least_recently_used(tmp_path, tiny_model_path):
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("a", "b", "c"):
        (folder / f"{name}.gguf").symlink_to(tiny_model_path)
    (folder / "mmproj-x.gguf").symlink_to(tiny_model_path)  # (a projector is not a model)
    proc = ServeProcess(["--models-dir", str(folder), "--models-max", "2", "-c", "512", "--parallel", "1"],
                        tmp_path / "serve.log")
    try:
        proc.wait_ready()
        url = proc.base_url
        props = httpx.get(f"{url}/props").json()
        assert props["role"] == "router" and props["max_instances"] == 2 and props["models_autoload"] is True
        assert re.match(r"b\d+-\S+ \(llama_ctypes ", props["build_info"])  # (llama.cpp's build tag first)
        assert {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/models").json()["data"]} == \
            {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
        # a request naming an unloaded model loads it first (autoload)
        r = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "a" and _status(url, "a") == "loaded"
        assert httpx.post(f"{url}/models/load", json={"model": "b"}).json() == {"success": True}
        assert wait_for(lambda: _status(url, "b") == "loaded", 60)
        httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}, timeout=60)
        # a third model: the least recently used idle one (b) makes room (once its grace second is over)
        time.sleep(1.2)
        assert httpx.post(f"{url}/models/load", json={"model": "c"}).json() == {"success": True}
        assert wait_for(lambda: _status(url, "c") == "loaded", 60)
        assert _status(url, "b") == "unloaded" and _status(url, "a") == "loaded"
        assert httpx.post(f"{url}/models/unload", json={"model": "a"}).json() == {"success": True}
        assert _status(url, "a") == "unloaded"
        assert api_error(httpx.post(f"{url}/models/load", json={"model": "nope"}), 404)
        assert api_error(httpx.post(f"{url}/models/load", json={"model": "c"}), 400, "model")
        assert api_error(httpx.post(f"{url}/models/unload", json={"model": "a"}), 400, "model")
    finally:
        proc.stop()


def test_a_broken_model_file_fails_alone(tmp_path, tiny_model_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "good.gguf").symlink_to(tiny_model_path)
    (folder / "broken.gguf").write_bytes(b"GGUF but not really a model file")
    proc = ServeProcess(["--models-dir", str(folder), "-c", "512"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        url = proc.base_url
        for _ in range(2):  # (the second time it is not loaded again: the reason is told at once)
            r = httpx.post(f"{url}/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2})
            assert api_error(r, 503)["code"] == "model_failed"
        status = next(m["status"] for m in httpx.get(f"{url}/models").json()["data"] if m["id"] == "broken")
        assert status["value"] == "failed" and status["error"]
        assert httpx.get(f"{url}/health").status_code == 200  # the others serve on
        r = httpx.post(f"{url}/v1/completions", json={"model": "good", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert httpx.post(f"{url}/models/load", json={"model": "broken"}).status_code == 200  # (tried again)
        assert wait_for(lambda: _status(url, "broken") == "failed", 30)
    finally:
        proc.stop()


def test_without_autoload_an_unloaded_model_answers_503(tmp_path, tiny_model_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "only.gguf").symlink_to(tiny_model_path)
    proc = ServeProcess(["--models-dir", str(folder), "--no-models-autoload", "-c", "512"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        r = httpx.post(f"{proc.base_url}/v1/completions", json={"model": "only", "prompt": "x", "max_tokens": 2})
        assert api_error(r, 503)["code"] == "model_not_loaded"
        assert httpx.post(f"{proc.base_url}/models/load", json={"model": "only"}).status_code == 200
        assert wait_for(lambda: _status(proc.base_url, "only") == "loaded", 60)
        r = httpx.post(f"{proc.base_url}/v1/completions", json={"model": "only", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        proc.stop()


def test_slots_save_restore_and_erase_as_llama_server(tmp_path, tiny_model_path):
    saves = tmp_path / "slots"
    proc = ServeProcess([str(tiny_model_path), "-c", "2048", "--parallel", "2", "--slot-save-path", str(saves)],
                        tmp_path / "serve.log")

    def complete(prompt: str, slot: int) -> dict:
        r = httpx.post(f"{proc.base_url}/completion", timeout=60, json={
            "prompt": prompt, "id_slot": slot, "cache_prompt": True, "n_predict": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["id_slot"] == slot
        return r.json()

    def action(slot: int, what: str, **body) -> httpx.Response:
        return httpx.post(f"{proc.base_url}/slots/{slot}?action={what}", json=body or None, timeout=60)

    try:
        proc.wait_ready()
        first = complete("What is the capital of France?", 1)
        n_prompt = first["tokens_evaluated"]
        assert first["timings"]["prompt_n"] == n_prompt  # nothing cached yet
        saved = action(1, "save", filename="slot1.bin").json()
        assert saved["n_saved"] == n_prompt + 4 - 1  # (the last token was sampled, never decoded)
        assert (saves / "slot1.bin").stat().st_size == saved["n_written"]
        second = complete("What is the capital of Germany?", 1)
        assert second["timings"]["prompt_n"] < n_prompt  # the common start came from slot 1's cache
        restored = action(0, "restore", filename="slot1.bin").json()
        assert restored["n_restored"] == saved["n_saved"]
        third = complete("What is the capital of Germany?", 0)
        assert third["timings"]["prompt_n"] == second["timings"]["prompt_n"]  # slot 0 now holds slot 1's start
        assert action(0, "erase").json() == {"id_slot": 0, "n_erased": third["tokens_evaluated"] + 4 - 1}
        assert complete("What is the capital of Germany?", 0)["timings"]["prompt_n"] == third["tokens_evaluated"]
        # names that would leave the folder, files that are not states, slots that do not exist
        outside = tmp_path / "outside.bin"
        outside.write_bytes(b"x")
        (saves / "link.bin").symlink_to(outside)
        for name in ("../outside.bin", "a/b.bin", "..", "", " x", "link.bin", "nul\x00.bin"):
            assert api_error(action(0, "save", filename=name), 400, "filename")
        assert not (tmp_path / "b.bin").exists() and outside.read_bytes() == b"x"
        # a file whose token list does not match its state (one token claimed more, or fewer) is refused
        import struct

        data = (saves / "slot1.bin").read_bytes()
        n = struct.unpack_from("<I", data, 8)[0]
        for claim in (n + 5, 2):
            tokens = (list(struct.unpack_from(f"<{n}i", data, 12)) + [1] * 5)[:claim]
            forged = data[:8] + struct.pack("<I", claim) + struct.pack(f"<{claim}i", *tokens) + data[12 + 4 * n:]
            (saves / "forged.bin").write_bytes(forged)
            error = api_error(action(0, "restore", filename="forged.bin"), 400, "filename")
            assert "positions" in error["message"]
        # a token id past the vocabulary (from a review: restored, and the slot held it)
        forged = bytearray(data)
        struct.pack_into("<i", forged, 12 + 4, 0x7FFFFFFF)
        (saves / "forged.bin").write_bytes(bytes(forged))
        error = api_error(action(0, "restore", filename="forged.bin"), 400, "filename")
        assert "past this model's vocabulary" in error["message"]
        (saves / "folder").mkdir()
        assert api_error(action(0, "save", filename="folder"), 400, "filename")
        (saves / "junk.bin").write_bytes(b"not a state file at all")
        error = api_error(action(0, "restore", filename="junk.bin"), 400, "filename")
        assert error["message"].startswith("junk.bin: not a llama.cpp sequence state file")
        assert api_error(action(0, "restore", filename="missing.bin"), 400, "filename")
        assert api_error(action(7, "erase"), 400)
        assert api_error(action(0, "dance"), 400, "action")
        r = httpx.post(f"{proc.base_url}/completion", json={"prompt": "x", "id_slot": 5})
        assert "id_slot=5" in api_error(r, 400)["message"]
    finally:
        proc.stop()
    proc = ServeProcess([str(tiny_model_path), "-c", "1024"], tmp_path / "serve2.log")
    try:
        proc.wait_ready()
        r = httpx.post(f"{proc.base_url}/slots/0?action=erase")
        assert api_error(r, 501)["type"] == "not_supported_error"
    finally:
        proc.stop()


def test_requests_pinned_to_one_slot_take_turns(server):
    bodies = [{"prompt": f"Story {i}:", "id_slot": 0, "n_predict": 6, "temperature": 0} for i in range(3)]
    results = []

    def run(body):
        results.append(httpx.post(f"{server.base_url}/completion", json=body, timeout=120).json())

    threads = [threading.Thread(target=run, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["id_slot"] for r in results) == [0, 0, 0]
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "messages": BOOK, "max_tokens": 4, "n": 2, "id_slot": 1})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2  # (two choices, one slot: in turn)


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_progress_reports_the_prompt_as_it_is_read(server):
    long = [{"role": "user", "content": "This is a test. " * 40}]  # several 64-token batches
    chunks = _events(server, "/v1/chat/completions", {"messages": long, "max_tokens": 3, "stream": True,
                                                       "return_progress": True})
    reports = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(reports) >= 3 and reports[0]["processed"] == reports[0]["cache"]
    assert [r["processed"] for r in reports] == sorted({r["processed"] for r in reports})  # rising
    assert reports[-1]["processed"] == reports[-1]["total"]
    assert all(r["total"] == reports[0]["total"] and r["cache"] == reports[0]["cache"] for r in reports)
    first_text = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert max(i for i, c in enumerate(chunks) if "prompt_progress" in c) < first_text
    # again: the prompt now comes from the cache, and the first report says so
    again = [c["prompt_progress"] for c in _events(server, "/v1/chat/completions", {
        "messages": long, "max_tokens": 3, "stream": True, "return_progress": True}) if "prompt_progress" in c]
    assert again[0]["cache"] == again[0]["processed"] > 0
    native = _events(server, "/completion", {"prompt": "This is a test. " * 40, "n_predict": 2, "stream": True,
                                            "return_progress": True})
    assert [c["prompt_progress"]["processed"] for c in native if "prompt_progress" in c][-1] > 0
    responses = _events(server, "/v1/responses", {"input": "This is a test. " * 40, "max_output_tokens": 2,
                                                  "stream": True, "return_progress": True})
    assert any(e["type"] == "response.in_progress" and "prompt_progress" in e for e in responses)
    plain = _events(server, "/v1/chat/completions", {"messages": long, "max_tokens": 3, "stream": True})
    assert not any("prompt_progress" in c for c in plain)


def test_metrics_are_off_unless_asked_as_on_llama_server(tmp_path, tiny_model_path):
    proc = ServeProcess([str(tiny_model_path), "-c", "256", "--parallel", "1"], tmp_path / "serve.log",
                        metrics=False)
    try:
        proc.wait_ready()
        r = httpx.get(f"{proc.base_url}/metrics", timeout=10)
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert "--metrics" in r.json()["error"]["message"]
        assert httpx.get(f"{proc.base_url}/props", timeout=10).json()["endpoint_metrics"] is False
    finally:
        proc.stop()


def test_llama_servers_metric_names_count_what_responses_report(tmp_path, tiny_model_path):
    from prometheus_client.parser import text_string_to_metric_families

    proc = ServeProcess([str(tiny_model_path), "-c", "1024", "--parallel", "1"], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        prompt_n = cache_n = predicted_n = 0
        for i, n in enumerate((1, 16, 5)):
            t = httpx.post(f"{proc.base_url}/completion", timeout=60,
                           json={"prompt": "I believe the meaning of life is" + " really" * i, "n_predict": n,
                                 "ignore_eos": True}).json()["timings"]
            prompt_n, cache_n = prompt_n + t["prompt_n"], cache_n + t["cache_n"]
            predicted_n += t["predicted_n"]
            if n == 1:  # (the first token comes with the prompt: no decode step to rate)
                assert t["predicted_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
            else:
                assert t["predicted_per_second"] == pytest.approx(1e3 / t["predicted_ms"] * (n - 1))
        r = httpx.get(f"{proc.base_url}/metrics")
        assert int(r.headers["Process-Start-Time-Unix"]) > 0
        # names on the wire spelled as llama-server spells them (clients that keep a plain dict look them up so)
        assert {b"Process-Start-Time-Unix", b"Content-Type", b"Content-Length"} <= dict(r.headers.raw).keys()
        samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
        # types and names as llama-server writes them (n_tokens_max: a counter without "_total")
        types = dict(line.split()[2:4] for line in r.text.splitlines() if line.startswith("# TYPE llamacpp:"))
        assert types["llamacpp:n_tokens_max"] == types["llamacpp:n_decode_total"] == "counter"
        assert types["llamacpp:requests_processing"] == "gauge" and len(types) == 15
        assert all(f"# HELP {name} " in r.text for name in types)
        assert samples["llamacpp:prompt_tokens_total"] == prompt_n
        assert samples["llamacpp:prompt_tokens_cached_total"] == cache_n > 0
        assert samples["llamacpp:tokens_predicted_total"] == predicted_n == 22
        assert samples["llamacpp:n_decode_total"] >= 3 and samples["llamacpp:requests_processing"] == 0
        assert samples["llamacpp:predicted_tokens_seconds"] > 0
        # (prometheus_client's parser names a counter's sample "..._total"; the text has llama-server's name)
        assert float(re.search(r"^llamacpp:n_tokens_max (\S+)$", r.text, re.M).group(1)) > 0
    finally:
        proc.stop()


def test_backend_sampling_flag_and_field_as_llama_server(tmp_path, tiny_model_path):
    """``-bs`` makes in-graph sampling every request's default, ``backend_sampling`` in a body overrides it;
    greedy text is the CPU path's (checked against its margins), and /metrics counts both kinds."""
    from margins import assert_same_greedy
    from prometheus_client.parser import text_string_to_metric_families

    proc = ServeProcess([str(tiny_model_path), "-c", "512", "--parallel", "1", "-bs", "--temp", "0"],
                        tmp_path / "serve.log")
    try:
        proc.wait_ready()
        props = httpx.get(f"{proc.base_url}/props", timeout=10).json()
        assert props["default_generation_settings"]["params"]["backend_sampling"] is True
        body = {"prompt": "Once upon a time", "n_predict": 24, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True}
        ref = httpx.post(f"{proc.base_url}/completion", json={**body, "n_probs": 2}, timeout=60).json()
        top = [[(alt["id"], alt["logprob"]) for alt in p["top_logprobs"]] for p in ref["completion_probabilities"]]
        out = httpx.post(f"{proc.base_url}/completion", json=body, timeout=60).json()
        assert_same_greedy(out["tokens"], ref["tokens"], top, what="in-graph vs CPU over HTTP")
        off = httpx.post(f"{proc.base_url}/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 4, "backend_sampling": False}).json()
        assert off["choices"][0]["text"]
        samples = [(s.name, s.labels.get("reason"), s.value)
                   for f in text_string_to_metric_families(httpx.get(f"{proc.base_url}/metrics").text)
                   for s in f.samples if s.name.startswith("llama_ctypes_in_graph")]
        assert sorted(samples, key=str) == [("llama_ctypes_in_graph_fallbacks_total", "logprobs", 1.0),
                                            ("llama_ctypes_in_graph_requests_total", None, 1.0)]
    finally:
        proc.stop()
