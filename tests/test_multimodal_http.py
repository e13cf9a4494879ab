"""Images and audio over HTTP: ``llama-ctypes serve --mmproj`` with the official ``openai`` client, its
limits and errors, and llama-server with the same files as the reference."""

from __future__ import annotations

import base64
import os

import anthropic
import httpx
import numpy as np
import openai
import pytest
from http_helpers import ServeProcess, api_error
from llama_server import NOT_BUILT, LlamaServer, find_llama_server
from margins import NEAR_TIE
from media_files import data_url, png, wav
from tiny_models import write_tiny_audio_mmproj, write_tiny_mmproj, write_tiny_qwen2vl, write_tiny_qwen2vl_mmproj

RNG = np.random.default_rng(11)
IMG_A = RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8)
IMG_B = RNG.integers(0, 256, (24, 24, 3), dtype=np.uint8)


def wav_b64(seconds: float = 1.0) -> str:
    return base64.b64encode(wav(0.4 * np.sin(2 * np.pi * 330 * np.arange(int(16000 * seconds)) / 16000))).decode()


def image_message(url: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def mm_files(tmp_path_factory, tiny_model_path):
    d = tmp_path_factory.mktemp("mmhttp")
    return {"model": tiny_model_path, "vision": write_tiny_mmproj(d / "mmproj-v.gguf"),
            "audio": write_tiny_audio_mmproj(d / "mmproj-a.gguf"), "dir": d}


@pytest.fixture(scope="module")
def served(mm_files):
    server = ServeProcess([str(mm_files["model"]), "--mmproj", str(mm_files["vision"]), "--chat-template", "chatml",
                           "-np", "2", "-c", "1024", "--media-max-items", "3", "--media-max-mb", "1"],
                          mm_files["dir"] / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_openai_client_with_an_image(served):
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="none")
    url = data_url(png(IMG_A))
    reply = client.chat.completions.create(model="tiny-llama", messages=image_message(url), max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2)
    assert reply.choices[0].finish_reason == "length" and reply.usage.prompt_tokens > 16
    # streamed equals non-streamed: both cold (no cached prefix), per-slot KV: the same computation
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-llama", messages=image_message(url), max_tokens=8, temperature=0, stream=True,
        extra_body={"cache_prompt": False}) if c.choices]
    assert "".join(pieces) == reply.choices[0].message.content
    # plain base64 (no data: prefix) is taken too, as llama-server takes it
    raw = client.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                         messages=image_message(base64.b64encode(png(IMG_A)).decode()))
    assert raw.usage.prompt_tokens == reply.usage.prompt_tokens
    # the second turn reuses the image from the slot's cache
    turn2 = image_message(url) + [{"role": "assistant", "content": reply.choices[0].message.content},
                                  {"role": "user", "content": "And?"}]
    again = client.chat.completions.create(model="tiny-llama", messages=turn2, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 + 3


def test_native_completion_with_multimodal_data(served):
    b64 = base64.b64encode(png(IMG_A)).decode()
    post = lambda prompt: httpx.post(served.base_url + "/completion", json={  # noqa: E731
        "prompt": prompt, "n_predict": 4, "temperature": 0}, timeout=60)
    marker = httpx.get(served.base_url + "/props").json()["media_marker"]
    r = post({"prompt_string": f"What is this: {marker}\n", "multimodal_data": [b64]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens_evaluated"] > 16 and body["tokens_predicted"] == 4 and marker in body["prompt"]
    # several prompts, one with media and one without
    r = post([{"prompt_string": f"A {marker} B", "multimodal_data": [b64]}, {"prompt_string": "A B"}])
    assert r.status_code == 200 and len(r.json()) == 2
    api_error(post({"prompt_string": f"What is this: {marker}\n", "multimodal_data": ["malformed"]}), 400,
              "prompt.multimodal_data[0]")
    api_error(post({"prompt_string": "What is this:\n", "multimodal_data": [""]}), 400)
    api_error(post({"prompt_string": "No marker here", "multimodal_data": [b64]}), 400)
    api_error(post({"prompt_string": f"{marker} x", "multimodal_data": "nope"}), 400, "prompt.multimodal_data")
    # the media of all a request's prompts count together (--media-max-items 3 here)
    two = {"prompt_string": f"{marker}{marker} x", "multimodal_data": [b64, b64]}
    api_error(post([two, two]), 413, "prompt[1].multimodal_data")


def test_props_and_models_report_modalities(served):
    props = httpx.get(served.base_url + "/props").json()
    assert props["modalities"] == {"vision": True, "video": False, "audio": False}
    listed = httpx.get(served.base_url + "/v1/models").json()
    (model,) = listed["data"]
    assert "multimodal" in model["capabilities"]
    # llama-server's Ollama-style list beside OpenAI's, with its capability names
    (entry,) = listed["models"]
    assert entry["name"] == model["id"] and entry["capabilities"] == ["completion", "multimodal"]
    assert httpx.get(served.base_url + "/models").json() == listed


def test_media_errors_over_http(served):
    post = lambda messages: httpx.post(served.base_url + "/v1/chat/completions",  # noqa: E731
                                       json={"messages": messages, "max_tokens": 2}, timeout=60)
    truncated = png(IMG_A)[:60]
    api_error(post(image_message(data_url(truncated))), 400, "messages[0].content[1]")
    api_error(post(image_message("data:image/png;base64,!!notbase64")), 400, "messages[0].content[1]")
    api_error(post(image_message("data:text/html;base64,aGVsbG8=")), 400)
    api_error(post(image_message("https://127.0.0.1:1/cat.png")), 400)  # not fetched without --media-urls
    api_error(post(image_message("/etc/passwd")), 400)  # never a file of the server
    bomb = bytearray(png(IMG_A))
    bomb[16:24] = (20000).to_bytes(4, "big") * 2  # the header claims 20000×20000
    api_error(post(image_message(data_url(bytes(bomb)))), 413)
    api_error(post(image_message(data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * (1 << 20)))), 413)  # --media-max-mb 1
    four = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(IMG_B))}}] * 4
             + [{"type": "text", "text": "x"}]}]
    api_error(post(four), 413)  # --media-max-items 3
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav_b64(), "format": "wav"}},
                                          {"type": "text", "text": "x"}]}]
    e = api_error(post(audio), 400)
    assert "audio" in e["message"]
    api_error(post([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": 5}}]}]), 400)
    ogg = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav_b64(), "format": "ogg"}}]}]
    assert "not supported" in api_error(post(ogg), 400, "messages[0].content[0]")["message"]
    # still serving
    ok = post(image_message(data_url(png(IMG_B))))
    assert ok.status_code == 200, ok.text


def test_media_path_serves_the_files_of_its_folder_only(served, mm_files, tmp_path):
    """``--media-path DIR``: ``file://PATH`` media from DIR, as llama-server's test_local_media_file; nothing
    outside it (``..``, a link out), and none at all without the flag."""
    folder = tmp_path / "media"
    (folder / "mtmd").mkdir(parents=True)
    (folder / "mtmd" / "a.png").write_bytes(png(IMG_A))
    (tmp_path / "secret.png").write_bytes(png(IMG_B))
    (folder / "link.png").symlink_to(tmp_path / "secret.png")
    (folder / "big.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * (1 << 20))
    os.mkfifo(folder / "fifo.png")  # (opened, it would wait for a writer forever)
    off = api_error(httpx.post(served.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": image_message("file://mtmd/a.png"), "max_tokens": 1}), 400)
    assert "--media-path" in off["message"]
    server = ServeProcess([str(mm_files["model"]), "--mmproj", str(mm_files["vision"]), "--chat-template", "chatml",
                           "-c", "1024", "--media-max-mb", "1", "--media-path", str(folder)], tmp_path / "serve.log")
    try:
        server.wait_ready()
        post = lambda url: httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={  # noqa: E731
            "messages": image_message(url), "max_tokens": 1, "temperature": 0})
        inline = post(data_url(png(IMG_A)))
        assert inline.status_code == 200, inline.text
        for url in ("file://mtmd/a.png", "file:////mtmd//a.png", "FILE://mtmd/a.png"):
            r = post(url)
            assert r.status_code == 200, (url, r.text)
            assert r.json()["usage"]["prompt_tokens"] == inline.json()["usage"]["prompt_tokens"]
        for url in ("file://mtmd/missing.png", "file://../secret.png", "file://mtmd/../../secret.png",
                    "file://link.png", "file://mtmd/a.png:x", "file://", "file://fifo.png", "file://mtmd",
                    "file://" + "日" * 100):  # (255 bytes at most, as llama-server: this is 300)
            api_error(post(url), 400, "messages[0].content[1]")
        api_error(post("file://big.png"), 413)
    finally:
        server.stop()
    assert "Traceback" not in server.log()


def test_audio_over_http(mm_files):
    server = ServeProcess([str(mm_files["model"]), "--mmproj", str(mm_files["audio"]), "--chat-template", "chatml",
                           "-c", "1024"], mm_files["dir"] / "serve-audio.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny-llama", max_tokens=5, temperature=0, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav_b64(), "format": "wav"}},
                                         {"type": "text", "text": "What is this sound?"}]}])
        assert reply.usage.prompt_tokens > 50 and reply.usage.completion_tokens == 5
        assert httpx.get(server.base_url + "/props").json()["modalities"]["audio"] is True
    finally:
        server.stop()


@pytest.mark.needs_tools
def test_same_tokens_as_llama_server(served, mm_files):
    exe = find_llama_server()
    if exe is None:
        pytest.fail(NOT_BUILT)
    messages = image_message(data_url(png(IMG_B)), "Describe:")
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    ours = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    with LlamaServer(exe, mm_files["model"], ["--mmproj", str(mm_files["vision"]), "--chat-template", "chatml",
                                               "-c", "1024", "-np", "1", "--no-mmproj-offload"]) as ref:
        r = ref.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        theirs = r.json()
    assert_same_greedy(ours, theirs)


def assert_same_greedy(ours: dict, theirs: dict) -> None:
    """The same prompt token count and the same tokens, up to a point where our top two nearly tie."""
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    ours_lp = ours["choices"][0]["logprobs"]["content"]
    their_tokens = [t["token"] for t in theirs["choices"][0]["logprobs"]["content"]]
    n = 0
    while n < min(len(ours_lp), len(their_tokens)) and ours_lp[n]["token"] == their_tokens[n]:
        n += 1
    if n < min(len(ours_lp), len(their_tokens)):  # a divergence only where our top two nearly tie
        top = ours_lp[n]["top_logprobs"]
        assert top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE, (ours, theirs)


@pytest.mark.needs_tools
def test_mrope_model_as_llama_server(tmp_path, vocab_dir):
    """An M-RoPE (Qwen2-VL-style) model over HTTP: the same tokens as llama-server, for a first turn and
    a second one that keeps the image (each server serves it from its slot's cache)."""
    exe = find_llama_server()
    if exe is None:
        pytest.fail(NOT_BUILT)
    model = write_tiny_qwen2vl(tmp_path / "qwen2vl.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf")
    mmproj = write_tiny_qwen2vl_mmproj(tmp_path / "mmproj-qwen2vl.gguf")
    image = np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    turn = image_message(data_url(png(image)), "Describe:")
    turns = [turn, turn + [{"role": "assistant", "content": "A grid."}, {"role": "user", "content": "More?"}]]
    bodies = [{"messages": m, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2} for m in turns]
    args = ["--mmproj", str(mmproj), "--chat-template", "chatml", "-c", "1024", "-np", "1"]
    server = ServeProcess([str(model), *args], tmp_path / "serve.log")
    try:
        server.wait_ready()
        ours = [httpx.post(server.base_url + "/v1/chat/completions", json=b, timeout=120).json() for b in bodies]
    finally:
        server.stop()
    with LlamaServer(exe, model, [*args, "--no-mmproj-offload"]) as ref:
        theirs = [ref.post("/v1/chat/completions", b).json() for b in bodies]
    for o, t in zip(ours, theirs):
        assert_same_greedy(o, t)
    assert ours[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 12  # the image came from the cache


def test_anthropic_and_responses_apis_take_images(served):
    b64 = base64.b64encode(png(IMG_A)).decode()
    chat = httpx.post(served.base_url + "/v1/chat/completions/input_tokens",
                      json={"messages": image_message(data_url(png(IMG_A)), "What?")}).json()["input_tokens"]
    assert chat > 16
    client = anthropic.Anthropic(base_url=served.base_url, api_key="none")
    reply = client.messages.create(model="tiny-llama", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}])
    usage = reply.usage  # (Anthropic's input_tokens leave out what the cache served)
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat and usage.output_tokens == 3
    oai = openai.OpenAI(base_url=served.base_url + "/v1", api_key="none")
    response = oai.responses.create(model="tiny-llama", max_output_tokens=3, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": data_url(png(IMG_A))}]}])
    assert response.usage.input_tokens == chat
    # /apply-template shows where the image goes with the public marker, as /props names it
    shown = httpx.post(served.base_url + "/apply-template",
                       json={"messages": image_message(data_url(png(IMG_A)), "What?")}).json()["prompt"]
    assert shown.count("<__media__>") == 1
