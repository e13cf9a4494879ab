"""llama-server's command lines on ``serve`` as its own tests write them (issue 42, part 7): ``--offline``,
``--hf-repo``/``--hf-file``, INI model presets (``--models-preset``) and ``GET /models?reload=1``, options
spelled with ``_``, ``--cache-ram``.

The router tests start the server with llama.cpp's ``ServerPreset.router()`` command line
(tools/server/tests/utils.py), unchanged but for the model files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from fake_hub import FakeHub, Repo
from http_helpers import ServeProcess, wait_for

import llama_ctypes as lc
from llama_ctypes.errors import ArgumentTypeError
from llama_ctypes.interfaces.cli import _dashed_options, build_parser
from llama_ctypes.interfaces.http.presets import read_ini, section_argv
from llama_ctypes.interfaces.http.serve import model_specs

#: llama.cpp's ServerPreset.router() command line (utils.py), before --host/--port (ServeProcess adds them).
ROUTER = ["--temp", "0.8", "--seed", "42", "--offline"]
ROUTER_TAIL = ["--batch-size", "16", "--ctx-size", "1024", "--parallel", "1", "--n-predict", "16"]


def serve_args(argv: list[str]):
    parser = build_parser()
    return parser.parse_args(_dashed_options(parser, ["serve", *argv]))


def ids(url: str, reload: bool = False) -> set[str]:
    r = httpx.get(f"{url}/models" + ("?reload=1" if reload else ""), timeout=60)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def status(url: str, model: str) -> str:
    data = httpx.get(f"{url}/models", timeout=30).json()["data"]
    return next(m["status"]["value"] for m in data if m["id"] == model)


# ---- the file and its keys ---------------------------------------------------------------------------------------

def test_preset_file_grammar_as_llama_cpp_reads_it(tmp_path):
    path = tmp_path / "p.ini"
    path.write_text("version = 1\n; a comment\n# another\n\n[*]\nctx-size = 2048 ; inline comment\n"
                    "[ model-a ]\nmodel = /m/a.gguf\n  temp=0.5\n[owner/name:q4_k_m]\nhf-repo = owner/name:Q4_K_M\n"
                    "[model-a]\nLLAMA_ARG_CTX_SIZE = 512\n")
    sections = read_ini(path)
    # (a section named twice starts over; the tag of owner/name:tag is in capitals; version = 1 is no section)
    assert sections == {"*": {"ctx-size": "2048"}, "model-a": {"LLAMA_ARG_CTX_SIZE": "512"},
                        "owner/name:Q4_K_M": {"hf-repo": "owner/name:Q4_K_M"}}
    path.write_text("[a]\nmodel = x.gguf\nthis is not ini\n")
    with pytest.raises(ArgumentTypeError, match="line 3"):
        read_ini(path)
    with pytest.raises(ArgumentTypeError, match="nope.ini"):
        read_ini(tmp_path / "nope.ini")


def test_preset_keys_are_serves_options(tmp_path):
    serve = serve_args([]).serve_parser
    argv = section_argv(serve, {"c": "256", "LLAMA_ARG_N_PARALLEL": "2", "temp": "0.1", "metrics": "true",
                                "swa-full": "false", "no-mmproj": "1", "load-on-startup": "true",
                                "stop-timeout": "5", "dedup-cache-models": "1", "lora-scaled": "a.gguf 0.5"},
                        "[x]")
    assert argv == ["-c", "256", "--n-parallel", "2", "--temp", "0.1", "--metrics", "--no-mmproj",
                    "--lora-scaled", "a.gguf", "0.5"]
    with pytest.raises(ArgumentTypeError, match="'grp-attn-n' is not an option"):
        section_argv(serve, {"grp-attn-n": "4"}, "[x]")
    with pytest.raises(ArgumentTypeError, match="expected true or false"):
        section_argv(serve, {"metrics": "maybe"}, "[x]")


def test_preset_sections_become_models_with_the_command_line_on_top(tmp_path, tiny_model_path):
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model_path, folder / "local.gguf")
    ini = tmp_path / "presets.ini"
    ini.write_text(f"[*]\nctx-size = 256\ntop-k = 7\n\n[chat]\nmodel = {tiny_model_path}\nalias = gpt-4o-mini,chat\n"
                   "load-on-startup = true\n\n[local]\ntemp = 0.3\n\n[hubbed]\nhf-repo = acme/tiny-GGUF:Q8_0\n")
    args = serve_args(["--models-preset", str(ini), "--models-dir", str(folder), "--ctx-size", "1024",
                       "--parallel", "1"])
    _, specs = model_specs(args)
    by_id = {s["id"]: s for s in specs}
    assert list(by_id) == ["local", "chat", "hubbed"]  # (the folder's models first, as llama-server lists)
    chat = by_id["chat"]
    assert chat["source"] == str(tiny_model_path) and chat["aliases"] == ["gpt-4o-mini"] and chat["load"] is True
    assert chat["n_ctx"] == 1024 and chat["top_k"] == 7  # the command line wins over [*]; [*] fills the rest
    local = by_id["local"]
    assert local["source"] == str(folder / "local.gguf") and local["temp"] == 0.3 and local["load"] is False
    assert by_id["hubbed"]["source"] == ("hub", "acme/tiny-GGUF:Q8_0", None)
    ini.write_text("[bad]\nmodel = x.gguf\nmodels-dir = /tmp\nctx-size = many\n")
    with pytest.raises(ArgumentTypeError, match=r"\[bad\]"):
        model_specs(serve_args(["--models-preset", str(ini)]))
    ini.write_text("[empty]\ntemp = 0.1\n")
    with pytest.raises(ArgumentTypeError, match="no model"):
        model_specs(serve_args(["--models-preset", str(ini)]))


def test_llama_servers_spellings_of_options(tiny_model_path):
    """``--backend_sampling`` (llama.cpp reads ``_`` as ``-`` in option names), ``-hf``/``-hff`` and
    ``--cache-ram`` (the prompt cache's MiB; -1: the machine's RAM)."""
    args = serve_args([str(tiny_model_path), "--backend_sampling", "--cache_ram", "64", "--chat-template", "a_b"])
    _, (spec,) = model_specs(args)
    assert spec["backend_sampling"] is True and spec["prompt_cache_ram_mb"] == 64
    _, (spec,) = model_specs(serve_args([str(tiny_model_path), "--cache-ram", "-1"]))
    assert spec["prompt_cache_ram_mb"] > 64
    _, (spec,) = model_specs(serve_args(["-hf", "acme/tiny-GGUF:Q8_0", "-hff", "tiny-Q8_0.gguf"]))
    assert spec["source"] == ("hub", "acme/tiny-GGUF", "tiny-Q8_0.gguf") and spec["id"] == "tiny-Q8_0"
    _, (spec,) = model_specs(serve_args(["--hf-repo", "acme/tiny-GGUF"]))
    assert spec["source"] == ("hub", "acme/tiny-GGUF", None) and spec["mmproj"] == "auto"
    with pytest.raises(ArgumentTypeError, match="--hf-file needs --hf-repo"):
        model_specs(serve_args(["--hf-file", "x.gguf"]))
    with pytest.raises(ArgumentTypeError, match="once"):
        model_specs(serve_args([str(tiny_model_path), "--hf-repo", "acme/tiny-GGUF"]))


# ---- --offline ----------------------------------------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_path):
    with FakeHub() as fake:
        fake.state.repos["acme/tiny-GGUF"] = Repo(files={"tiny-Q8_0.gguf": tiny_model_path.read_bytes(),
                                                         "tiny-Q2_K.gguf": b"GGUF never fetched"})
        for var in ("HF_TOKEN", "LLAMA_OFFLINE", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("LLAMA_CTYPES_MODELS_DIR", str(tmp_path / "cache"))
        yield fake


def test_offline_serves_hub_models_from_the_cache_without_a_request(tmp_path, hub):
    """``serve --offline`` (llama-server's flag; refused before: "unrecognized arguments") serves a Hub model
    from the cache and asks the Hub nothing (without it, the same command line asks); a model not cached
    stops the server with the reason."""
    lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf")  # (in the cache, as a previous run would leave it)
    settings = ["--temp", "0.8", "--seed", "42", "--ctx-size", "512", "--parallel", "1", "--n-predict", "4"]
    before = len(hub.state.requests)
    proc = ServeProcess(["--offline", "--hf-repo", "acme/tiny-GGUF:Q8_0", *settings], tmp_path / "offline.log")
    try:
        proc.wait_ready(120)
        r = httpx.post(f"{proc.base_url}/completion", json={"prompt": "Hi"}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4, r.text
    finally:
        proc.stop()
    assert len(hub.state.requests) == before, hub.state.requests[before:]  # (not even for the projector)

    online = ServeProcess(["--hf-repo", "acme/tiny-GGUF:Q8_0", *settings], tmp_path / "online.log")
    try:
        online.wait_ready(120)
    finally:
        online.stop()
    assert len(hub.state.requests) > before  # (the same command line without --offline asks the Hub)

    missing = ServeProcess(["--offline", "--hf-repo", "acme/tiny-GGUF:Q2_K", *settings], tmp_path / "missing.log")
    try:
        assert missing.proc.wait(120) == 1
    finally:
        missing.stop()
    assert "offline" in missing.log() and "Q2_K" in missing.log()


# ---- presets and GET /models?reload=1 -----------------------------------------------------------------------------

def test_router_reload_models_as_llama_servers_test(tmp_path):
    """llama.cpp's test_router_reload_models, on its command line (``--offline``, ``--models-preset``): it
    exited at start with a usage error. The entries name Hub repositories that are not in the cache: listed,
    never loaded."""
    preset = tmp_path / "test_reload.ini"
    preset.write_text("[model-reload-a]\nhf-repo = ggml-org/test-model-stories260K\n\n"
                      "[model-reload-b]\nhf-repo = ggml-org/test-model-stories260K-infill\n")
    proc = ServeProcess([*ROUTER, "--models-preset", str(preset), *ROUTER_TAIL], tmp_path / "serve.log",
                        env={"LLAMA_CTYPES_MODELS_DIR": str(tmp_path / "empty-cache")}, metrics=False)
    try:
        proc.wait_ready(120)
        assert {"model-reload-a", "model-reload-b"} <= ids(proc.base_url)
        preset.write_text("[model-reload-b]\nhf-repo = ggml-org/test-model-stories260K-infill\n\n"
                          "[model-reload-c]\nhf-repo = ggml-org/test-model-stories260K\n")
        listed = ids(proc.base_url, reload=True)
        assert "model-reload-a" not in listed and {"model-reload-b", "model-reload-c"} <= listed
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()


def test_reload_unloads_changed_and_removed_models_and_clears_failures(tmp_path, tiny_model_path):
    """What a reload does to models in use, as llama-server: unchanged ones stay loaded, changed ones are
    unloaded (and load with the new options when next used), removed ones are unloaded and gone (404), a
    failed one may load again; aliases follow the file; a broken file leaves the list as it was."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not a model")

    def write(top_k: int, alias: str, last: str) -> None:
        preset.write_text(f"[*]\nctx-size = 256\n\n[keep]\nmodel = {tiny_model_path}\n\n"
                          f"[change]\nmodel = {tiny_model_path}\ntop-k = {top_k}\nalias = {alias}\n\n"
                          f"[broken]\nmodel = {broken}\n\n[{last}]\nmodel = {tiny_model_path}\n")

    preset = tmp_path / "presets.ini"
    write(5, "old", "gone")
    proc = ServeProcess([*ROUTER, "--models-preset", str(preset), *ROUTER_TAIL], tmp_path / "serve.log")
    url = proc.base_url

    def complete(model: str) -> httpx.Response:
        return httpx.post(f"{url}/completion", json={"model": model, "prompt": "Hi", "n_predict": 2}, timeout=60)

    try:
        proc.wait_ready(120)
        for model in ("keep", "old", "gone"):
            assert complete(model).status_code == 200
        assert complete("broken").status_code == 503 and status(url, "broken") == "failed"
        props = httpx.get(f"{url}/props", params={"model": "change"}).json()["default_generation_settings"]
        assert props["n_ctx"] == 1024 and props["params"]["top_k"] == 5  # (the command line's -c wins over [*])
        write(9, "new", "added")
        assert ids(url, reload=True) == {"keep", "change", "broken", "added"}
        assert {m: status(url, m) for m in ("keep", "change", "broken", "added")} == \
            {"keep": "loaded", "change": "unloaded", "broken": "unloaded", "added": "unloaded"}
        assert complete("gone").status_code == 404
        assert complete("old").status_code == 404 and complete("new").status_code == 200
        props = httpx.get(f"{url}/props", params={"model": "change"}).json()["default_generation_settings"]
        assert props["params"]["top_k"] == 9
        assert complete("added").status_code == 200
        preset.write_text("[broken\n")
        r = httpx.get(f"{url}/models?reload=1")
        assert r.status_code == 500 and "unchanged" in r.json()["error"]["message"]
        assert ids(url) == {"keep", "change", "broken", "added"}
        assert wait_for(lambda: status(url, "keep") == "loaded", 5)
    finally:
        proc.stop()
    assert "Traceback" not in proc.log()
