"""llama-server's own completion API on ``llama-ctypes serve``: ``/completion`` and ``/infill``, checked
against llama-server from the same build on a tiny model whose vocabulary declares FIM tokens.

What must agree exactly is deterministic: the prompt each endpoint builds (tokens and text), the
fields of the response, the token accounting. Generated text is compared only with itself (a stream's
pieces against its own tokens).
"""

from __future__ import annotations

import json

import httpx
import pytest
from http_helpers import ServeProcess
from llama_server import NOT_BUILT, LlamaServer, find_llama_server
from tiny_models import write_tiny_llama

import llama_ctypes as lc
from llama_ctypes.features.infill import InfillError, infill_prompt

pytestmark = pytest.mark.needs_tools  # (conftest.py builds llama-server first)

FIM = (31990, 31991, 31992, 31993, 31994, 31995)  # pre, suf, mid, pad, rep, sep: ids of the spm vocab
SETTINGS = ["--parallel", "1", "--ctx-size", "1024", "--batch-size", "64"]
CODE = {"input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n", "prompt": "    int n = llama_",
        "input_suffix": "}\n"}
EXTRA = [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}, {"text": "// no name\n"}]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory, vocab_dir):
    return write_tiny_llama(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf",
                            fim_tokens=FIM)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, fim_model):
    """(ours, llama-server's) base URLs, both on the FIM model with the same settings."""
    exe = find_llama_server()
    if exe is None:
        pytest.fail(NOT_BUILT)  # (the test command builds it: a missing one is a broken install)
    theirs = LlamaServer(exe, fim_model, ["-np", "1", "-c", "1024", "-b", "64", "-t", "1"]).start()
    ours = ServeProcess(["--model", str(fim_model), *SETTINGS, "--threads", "1"],
                        tmp_path_factory.mktemp("native") / "serve.log")
    try:
        theirs.wait()
        ours.wait_ready()
        yield ours.base_url, theirs.url
    finally:
        ours.stop()
        theirs.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


@pytest.mark.parametrize("body", [
    CODE,
    {**CODE, "input_extra": EXTRA},
    {**CODE, "input_prefix": "int x = 0;\n" * 60, "input_suffix": "return x;\n" * 40},  # over the batch budgets
    {"input_prefix": [1, 2, "mixed"], "input_suffix": "", "prompt": ""},
], ids=["plain", "extra", "long", "token-ids"])
def test_infill_builds_llama_servers_prompt(servers, body):
    ours, theirs = servers
    request = {**body, "n_predict": 2, "temperature": 0}
    a, b = _post(ours, "/infill", request), _post(theirs, "/infill", request)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    a, b = a.json(), b.json()
    assert a["prompt"] == b["prompt"] and a["tokens_evaluated"] == b["tokens_evaluated"]
    assert a["tokens_predicted"] == b["tokens_predicted"] == 2


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}])
def test_infill_refuses_a_bad_extra_chunk_as_llama_server(servers, extra):
    ours, theirs = servers
    body = {**CODE, "input_extra": [extra]}
    a, b = _post(ours, "/infill", body), _post(theirs, "/infill", body)
    assert a.status_code == b.status_code == 400
    assert a.json()["error"]["type"] == "invalid_request_error"


def test_infill_needs_fim_tokens(tmp_path, tiny_model_path):
    proc = ServeProcess(["--model", str(tiny_model_path), *SETTINGS], tmp_path / "serve.log")
    try:
        proc.wait_ready()
        r = _post(proc.base_url, "/infill", CODE)
        assert r.status_code == 501 and "FIM prefix, suffix, middle" in r.json()["error"]["message"]
    finally:
        proc.stop()


def test_infill_layout_without_repo_tokens_and_in_spm_order(tmp_path, vocab_dir):
    path = write_tiny_llama(tmp_path / "fim3.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", fim_tokens=FIM[:3])
    with lc.load_model(path) as model:
        vocab = model.vocab
        psm = infill_prompt(vocab, "a", "b", [{"text": "x"}], n_batch=64, n_ctx=1024)
        spm = infill_prompt(vocab, "a", "b", [{"text": "x"}], n_batch=64, n_ctx=1024, spm=True)
        separator = vocab.tokenize("\n\n--- snippet ---\n\n", add_special=False)
        assert psm[:len(separator)] == separator  # (no FIM_SEP: llama-server's text separator)
        a, b = vocab.tokenize("a", add_special=False), vocab.tokenize("b", add_special=False)
        body = psm[psm.index(vocab.bos):]
        assert body == [vocab.bos, FIM[0], *a, FIM[1], *b, FIM[2]]
        assert spm[spm.index(vocab.bos):] == [vocab.bos, FIM[1], *b, FIM[0], *a, FIM[2]]
        with pytest.raises(InfillError, match="filename"):
            infill_prompt(vocab, "a", "b", [{"text": "x", "filename": 1}])


@pytest.mark.parametrize("prompt", [
    "I believe the meaning of life is",
    [1, 306, 4658, 278],
    [1, 2, 3, "and text", 7, "more"],
    {"prompt_string": "I believe"},
], ids=["text", "ids", "mixed", "object"])
def test_completion_reads_a_prompt_as_llama_server(servers, prompt):
    ours, theirs = servers
    body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "return_tokens": True}
    a, b = _post(ours, "/completion", body), _post(theirs, "/completion", body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    a, b = a.json(), b.json()
    assert a["prompt"] == b["prompt"] and a["tokens_evaluated"] == b["tokens_evaluated"]
    # every field llama-server sends is here, but the model name (ours: the alias) and its extra settings
    assert set(b) - set(a) == set()
    assert {k for k in b["generation_settings"]} >= {k for k in a["generation_settings"]} - {"cache_prompt", "typ_p"}
    assert a["stop_type"] == "limit" and a["tokens_predicted"] == 3 and len(a["tokens"]) == 3
    assert set(a["timings"]) == set(b["timings"])
    for t in (a["timings"], b["timings"]):  # (each side reuses its own cache)
        assert t["prompt_n"] + t["cache_n"] == a["tokens_evaluated"]


def test_several_prompts_give_a_list_in_order(servers):
    ours, _ = servers
    r = _post(ours, "/completion", {"prompt": ["Once upon", [1, 306, 4658], {"prompt_string": "x"}], "n_predict": 2,
                                    "temperature": 0})
    assert r.status_code == 200
    results = r.json()
    assert [x["index"] for x in results] == [0, 1, 2] and [x["tokens_evaluated"] for x in results][1] == 3


def test_a_stream_gives_the_tokens_behind_each_piece(servers):
    ours, _ = servers
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 0, "stream": True, "return_tokens": True,
            "n_probs": 2}
    chunks = []
    with httpx.stream("POST", ours + "/completion", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    *pieces, last = chunks
    assert last["stop"] is True and all(c["stop"] is False for c in pieces)
    assert all(c["tokens"] for c in pieces)  # (every piece names the tokens that made it)
    assert [t for c in pieces for t in c["tokens"]] == last["tokens"]
    assert sum(len(c["completion_probabilities"]) for c in pieces) == len(last["tokens"])
    prompt = _post(ours, "/tokenize", {"content": body["prompt"], "add_special": True}).json()["tokens"]
    whole = _post(ours, "/detokenize", {"tokens": prompt + last["tokens"]}).json()["content"]
    alone = _post(ours, "/detokenize", {"tokens": prompt}).json()["content"]
    assert alone + "".join(c["content"] for c in pieces) == whole


def test_logit_bias_in_every_form_bans_its_tokens(servers):
    ours, _ = servers
    base = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "return_tokens": True}
    first = _post(ours, "/completion", base).json()["tokens"]
    banned = sorted(set(first))
    for bias in ([[t, False] for t in banned], {str(t): -100 for t in banned}):
        tokens = _post(ours, "/completion", {**base, "logit_bias": bias}).json()["tokens"]
        assert not set(tokens) & set(banned), bias
    text = _post(ours, "/detokenize", {"tokens": [first[0]]}).json()["content"]
    tokens = _post(ours, "/completion", {**base, "logit_bias": [[text, False]]}).json()["tokens"]
    assert first[0] not in tokens
    # the biases are reported as llama-server reports them: ignore_eos's -inf (null) on every EOG token
    plain = _post(ours, "/completion", base).json()["generation_settings"]["logit_bias"]
    assert plain == []
    shown = _post(ours, "/completion", {**base, "ignore_eos": True, "logit_bias": {str(first[0]): -2.5}}).json()
    listed = {e["token"]: e["bias"] for e in shown["generation_settings"]["logit_bias"]}
    eos = _post(ours, "/tokenize", {"content": "</s>", "parse_special": True}).json()["tokens"]
    assert listed[first[0]] == -2.5 and eos and all(listed[t] is None for t in eos)
    assert sum(b is None for b in listed.values()) >= 1


def test_response_fields_and_probabilities(servers):
    ours, _ = servers
    r = _post(ours, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0, "n_probs": 3,
                                    "response_fields": ["content", "generation_settings/n_predict", "prompt"]})
    assert set(r.json()) == {"content", "generation_settings/n_predict", "prompt"}
    assert r.json()["generation_settings/n_predict"] == 4
    probs = _post(ours, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0, "n_probs": 3}).json()
    entries = probs["completion_probabilities"]
    assert len(entries) == 4 and all(len(e["top_logprobs"]) == 3 for e in entries)
    assert all(e["id"] == e["top_logprobs"][0]["id"] for e in entries)  # greedy: the best is chosen
    r = _post(ours, "/completion", {"prompt": {"prompt_string": "x <__media__>", "multimodal_data": "iVBO"}})
    assert r.status_code == 400


def test_post_sampling_probs_as_llama_server(servers):
    body = {"prompt": "Hello", "n_predict": 1, "temperature": 1.0, "top_k": 5, "top_p": 1.0, "min_p": 0.0,
            "n_probs": 5, "post_sampling_probs": True, "seed": 3}
    got = [_post(url, "/completion", body).json()["completion_probabilities"][0] for url in servers]
    for entry in got:
        assert "prob" in entry and "logprob" not in entry and 0 < entry["prob"] <= 1
        assert len(entry["top_probs"]) == 5
        assert sum(p["prob"] for p in entry["top_probs"]) == pytest.approx(1, abs=1e-4)
    # The same candidates at the same probabilities, compared by rank: two near-tied candidates may
    # swap places on another CPU, their probabilities do not move.
    ours, theirs = ([p["prob"] for p in e["top_probs"]] for e in got)
    assert all(abs(a - b) < 1e-3 for a, b in zip(ours, theirs))
    for i, (a, b) in enumerate(zip(got[0]["top_probs"], got[1]["top_probs"])):
        tied = any(abs(ours[i] - ours[j]) < 1e-3 for j in (i - 1, i + 1) if 0 <= j < len(ours))
        assert tied or a["id"] == b["id"]  # (ids may differ only where two candidates are near tied)
    greedy = _post(servers[0], "/completion", {**body, "temperature": 0}).json()["completion_probabilities"][0]
    assert greedy["prob"] == 1.0 and [p["id"] for p in greedy["top_probs"]] == [greedy["id"]]
