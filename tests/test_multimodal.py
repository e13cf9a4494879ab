"""Images and audio through libmtmd: the projector, media prompts, the one-call API and chat.

The models are tiny and random (tests/tiny_models.py: a llava-style MLP projector, a Gemma-3-style
one whose images are decoded with non-causal attention, and an Ultravox-style audio projector), so
the tests assert invariants and agreement with llama.cpp's own ``llama-mtmd-cli`` on the same files.
"""

from __future__ import annotations

import base64
import dataclasses
import struct
import subprocess
import threading

import numpy as np
import pytest
from llama_server import NOT_BUILT, find_tool
from margins import NEAR_TIE, assert_greedy_equivalent
from media_files import png, wav
from PIL import Image
from tiny_models import (
    write_tiny_audio_mmproj,
    write_tiny_gemma3_mmproj,
    write_tiny_mmproj,
    write_tiny_qwen2vl,
    write_tiny_qwen2vl_mmproj,
)

import llama_ctypes as lc
from llama_ctypes.errors import (
    ArgumentTypeError,
    ClosedError,
    InvalidArgumentError,
    MediaError,
    MediaTooLargeError,
    ModelLoadError,
)

GREEDY = dict(temp=0.0, n_ctx=512)


RNG = np.random.default_rng(7)
IMG_A = RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8)
IMG_B = RNG.integers(0, 256, (48, 32, 3), dtype=np.uint8)
TONE = (0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_path):
    d = tmp_path_factory.mktemp("mm")
    out = {
        "model": tiny_model_path,
        "vision": write_tiny_mmproj(d / "mmproj-mlp.gguf"),
        "gemma3": write_tiny_gemma3_mmproj(d / "mmproj-gemma3.gguf"),
        "audio": write_tiny_audio_mmproj(d / "mmproj-audio.gguf"),
        "wrong_width": write_tiny_mmproj(d / "mmproj-n32.gguf", n_embd_text=32),
        "a.png": d / "a.png", "b.png": d / "b.png", "a.jpg": d / "a.jpg", "tone.wav": d / "tone.wav",
    }
    out["a.png"].write_bytes(png(IMG_A))
    out["b.png"].write_bytes(png(IMG_B))
    out["a.jpg"].write_bytes(png(IMG_A, "JPEG"))
    out["tone.wav"].write_bytes(wav(TONE))
    return out


@pytest.fixture(scope="module")
def vlm(files):
    model = lc.load_model(files["model"], mmproj=files["vision"])
    yield model
    model.close()


@pytest.fixture(scope="module")
def alm(files):
    model = lc.load_model(files["model"], mmproj=files["audio"])
    yield model
    model.close()


@pytest.fixture(scope="module")
def gemma3ish(files):
    model = lc.load_model(files["model"], mmproj=files["gemma3"])
    yield model
    model.close()


PROMPT = "Look at this: " + lc.MEDIA_MARKER + " What is it?"


def test_projector_describes_itself(vlm, alm, gemma3ish, tiny_model):
    assert vlm.modalities == {"vision"} and alm.modalities == {"audio"} and gemma3ish.modalities == {"vision"}
    assert tiny_model.modalities == frozenset() and tiny_model.projector is None
    assert vlm.projector.audio_sample_rate is None and alm.projector.audio_sample_rate == 16000
    assert not vlm.projector.uses_mrope
    assert "vision" in repr(vlm.projector)
    # the marker a projector looks for is random: text from a user never places media
    assert vlm.projector.marker != alm.projector.marker and lc.MEDIA_MARKER not in vlm.projector.marker
    with pytest.raises(InvalidArgumentError, match="has a projector already"):
        vlm.attach_projector(vlm.projector.path)


def test_refused_projectors(files):
    with lc.load_model(files["model"]) as model:
        with pytest.raises(ModelLoadError, match="mismatch between text model"):
            model.attach_projector(files["wrong_width"])
        with pytest.raises(ModelLoadError, match="projector"):
            model.attach_projector(files["model"])  # a text model is no projector
        with pytest.raises(FileNotFoundError):
            model.attach_projector(files["model"].parent / "missing.gguf")
        assert model.projector is None  # nothing half-attached
        model.attach_projector(files["vision"])
        assert model.modalities == {"vision"}


def test_prompt_places_media(vlm):
    prompt = vlm.projector.tokenize("a " + vlm.projector.marker + " b", [vlm.projector.read(IMG_A)])
    (span,) = prompt.spans
    assert span.kind == "image" and span.n_tokens == span.n_pos == 16 and span.end < len(prompt)
    assert all(t < 0 for t in prompt[span.start:span.end]) and all(t >= 0 for t in prompt.text_tokens)
    assert prompt.cut_point(span.start + 3) == span.start and prompt.cut_point(span.end) == span.end
    other = vlm.projector.tokenize("a " + vlm.projector.marker + " b", [vlm.projector.read(IMG_B)])
    assert other.spans[0].id != span.id and other[span.start] != prompt[span.start]


def test_same_image_in_every_form_gives_the_same_tokens(vlm, files):
    data = files["a.png"].read_bytes()
    forms = [str(files["a.png"]), files["a.png"], data, "data:image/png;base64," + base64.b64encode(data).decode(),
             IMG_A, Image.fromarray(IMG_A)]
    outs = [lc.generate(vlm, PROMPT, media=[m], max_tokens=8, **GREEDY).tokens for m in forms]
    assert all(o == outs[0] for o in outs), outs  # one decoded picture: the same computation each time
    other = lc.generate(vlm, PROMPT, media=[IMG_B], max_tokens=8, **GREEDY).tokens
    assert other != outs[0]  # the image reaches the model


def test_cached_image_prefix_equals_cold(vlm):
    cold = lc.generate(vlm, PROMPT, media=[IMG_A], max_tokens=12, logprobs=2, cache_prompt=False, **GREEDY)
    assert cold.timings.cached_tokens == 0
    warm = lc.generate(vlm, PROMPT, media=[IMG_A], max_tokens=12, cache_prompt=True, **GREEDY)
    assert warm.timings.cached_tokens == cold.prompt_tokens - 1  # the image came from the cache
    assert_greedy_equivalent(warm, cold, what="cached image")
    # another image at the same place: only the text before it is reused
    other = lc.generate(vlm, PROMPT, media=[IMG_B], max_tokens=4, cache_prompt=True, **GREEDY)
    assert 0 < other.timings.cached_tokens < 8


def test_second_chat_turn_reuses_the_image(vlm):
    turn1 = [{"role": "user", "content": [{"type": "image", "image": IMG_A}, {"type": "text", "text": "What?"}]}]
    first = lc.chat(vlm, turn1, chat_template="chatml", max_tokens=6, cache_prompt=True, **GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": str(first)}, {"role": "user", "content": "And?"}]
    second = lc.chat(vlm, turn2, chat_template="chatml", max_tokens=6, cache_prompt=True, **GREEDY)
    assert second.timings.cached_tokens > 16 + 5  # BOS, the turn's opening and the 16 image embeddings


def test_audio_clip(alm, files):
    from_file = lc.generate(alm, "Hear " + lc.MEDIA_MARKER + " ok", media=[files["tone.wav"]], max_tokens=6, **GREEDY)
    assert from_file.prompt_tokens > 50  # 1 s of audio: 50 embeddings, and the text
    as_array = lc.generate(alm, "Hear " + lc.MEDIA_MARKER + " ok", media=[TONE], max_tokens=6, **GREEDY)
    assert as_array.prompt_tokens == from_file.prompt_tokens
    reply = lc.chat(alm, [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(TONE)).decode(), "format": "wav"}},
        {"type": "text", "text": "What is this sound?"}]}], chat_template="chatml", max_tokens=4, **GREEDY)
    assert len(reply.tokens) == 4


def test_non_causal_projector_needs_a_ubatch_for_its_image(gemma3ish):
    out = lc.generate(gemma3ish, PROMPT, media=[IMG_A], max_tokens=6, **GREEDY)
    assert len(out.tokens) == 6
    with pytest.raises(InvalidArgumentError, match="non-causal"):
        lc.generate(gemma3ish, PROMPT, media=[IMG_A], max_tokens=2, n_ubatch=2, n_batch=2, **GREEDY)


def test_chat_parts_and_literal_markers(vlm):
    url = "data:image/png;base64," + base64.b64encode(png(IMG_A)).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "this?"}]}]
    reply = lc.chat(vlm, msgs, chat_template="chatml", max_tokens=4, **GREEDY)
    assert len(reply.tokens) == 4 and reply.prompt_tokens > 16
    # the public marker typed by a user is only text in chat: no media is expected for it
    text_only = lc.chat(vlm, [{"role": "user", "content": "say " + lc.MEDIA_MARKER}], chat_template="chatml",
                        max_tokens=2, **GREEDY)
    assert len(text_only.tokens) == 2


def run_mtmd_cli(cmd: list[str]) -> tuple[str, bool]:
    """llama-mtmd-cli's printed text and whether all of it arrived.

    Its text goes through llama.cpp's asynchronous log, which can lose the last lines at exit on a loaded
    machine (measured: 6 of 30 runs lost one or more trailing tokens with both cores busy). The log is a
    queue, so only the tail is lost, and a whole run ends with the closing blank line: run it again until
    one is whole (up to 4 times), else keep the longest, marked cut."""
    best = ""
    for _ in range(4):
        run = subprocess.run(cmd, capture_output=True, timeout=120)
        assert run.returncode == 0, run.stderr.decode(errors="replace")[-2000:]
        out = run.stdout.decode("utf-8", errors="replace")
        if out.endswith("\n\n"):
            return out.strip("\n"), True
        best = max(best, out, key=len)
    return best.strip("\n"), False


def assert_matches_text(ours, theirs: str, what: str = "", whole: bool = True) -> None:
    """``ours`` (with logprobs) printed ``theirs`` (llama-mtmd-cli's output), up to a point where our top two
    tokens nearly tied (another CPU's rounding may pick either there). Where ``theirs`` was cut (not
    ``whole``), it is only held to be a prefix of ours."""
    pieces = [e.text for e in ours.logprobs]
    n, text = 0, ""
    while n < len(pieces) and theirs.startswith(text + pieces[n]):
        text += pieces[n]
        n += 1
    if n < len(pieces) and (whole or text != theirs):
        top = ours.logprobs[n].top
        assert len(top) >= 2 and top[0].logprob - top[1].logprob < NEAR_TIE, (what, theirs, str(ours))


@pytest.mark.needs_tools
def test_against_llama_mtmd_cli(vlm, alm, gemma3ish, files, tmp_path):
    exe = find_tool("llama-mtmd-cli")
    if exe is None:
        pytest.fail(NOT_BUILT.replace("llama-server", "llama-mtmd-cli"))
    cases = [(vlm, files["vision"], "--image", files["a.png"], IMG_A),
             (gemma3ish, files["gemma3"], "--image", files["b.png"], IMG_B),
             (alm, files["audio"], "--audio", files["tone.wav"], files["tone.wav"])]
    for model, mmproj, flag, path, media in cases:
        cmd = [str(exe), "-m", str(files["model"]), "--mmproj", str(mmproj), flag, str(path), "-p", "What is this?",
               "-n", "10", "--temp", "0", "--chat-template", "chatml", "-c", "512", "-t", "2"]
        theirs, whole = run_mtmd_cli(cmd)
        kind = "image" if flag == "--image" else "audio"
        ours = lc.chat(model, [{"role": "user", "content": [{"type": kind, kind: media},
                                                            {"type": "text", "text": "What is this?"}]}],
                       chat_template="chatml", max_tokens=10, logprobs=2, **GREEDY)
        assert_matches_text(ours, theirs, what=mmproj.name, whole=whole)


def test_bad_media(vlm, alm, tiny_model, files, tmp_path):
    good = png(IMG_A)
    text_file = tmp_path / "notes.png"
    text_file.write_text("not a picture at all\n" * 20)
    cases = [
        (good[: len(good) // 2], MediaError, "decoded"),  # truncated: the header is fine, the pixels are not
        (good[:33] + b"\x00" * 200, MediaError, "decoded"),  # corrupt
        (text_file, MediaError, "not an image"),
        ("data:image/png;base64,!!!", MediaError, "base64"),
        (np.zeros((2, 2), np.uint8), MediaError, "neither"),
        (b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk", MediaError, "corrupt WAV"),
        (wav(TONE), MediaError, "takes no audio"),  # audio for a vision projector
        (42, ArgumentTypeError, "media must be"),
    ]
    for item, error, match in cases:
        with pytest.raises(error, match=match):
            lc.generate(vlm, PROMPT, media=[item], max_tokens=2, **GREEDY)
    with pytest.raises(MediaError, match="takes no audio"):
        lc.generate(vlm, PROMPT, media=[TONE], max_tokens=2, **GREEDY)
    with pytest.raises(MediaError, match="corrupt WAV"):  # a WAV header with nothing after it
        lc.generate(alm, PROMPT, media=[b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk"], max_tokens=2, **GREEDY)
    with pytest.raises(MediaError, match="takes no images or audio"):
        lc.generate(tiny_model, PROMPT, media=[IMG_A], max_tokens=2, **GREEDY)
    with pytest.raises(MediaError, match="1 media marker"):
        lc.generate(vlm, PROMPT, media=[IMG_A, IMG_B], max_tokens=2, **GREEDY)
    with pytest.raises(MediaTooLargeError, match="3 media"):
        vlm.projector.tokenize(vlm.projector.marker * 3 + " x", [vlm.projector.read(IMG_A)] * 3,
                               limits=lc.MediaLimits(max_items=2))
    with pytest.raises(InvalidArgumentError, match="end with text"):
        lc.generate(vlm, "x " + lc.MEDIA_MARKER, media=[IMG_A], max_tokens=2, **GREEDY)
    with pytest.raises(ArgumentTypeError, match="must be text"):
        lc.generate(vlm, [1, 2, 3], media=[IMG_A], max_tokens=2, **GREEDY)
    # the model is still fine after all of that
    assert len(lc.generate(vlm, PROMPT, media=[IMG_A], max_tokens=3, **GREEDY).tokens) == 3


def test_lifetimes(files):
    model = lc.load_model(files["model"], mmproj=files["vision"])
    projector = model.projector
    prompt = projector.tokenize("a " + projector.marker + " b", [projector.read(IMG_A)])
    stream = lc.stream(model, prompt, max_tokens=4, **GREEDY)
    model.close()  # the prompt's chunks and the open stream keep what they need alive
    assert not projector.freed and len(list(stream)) >= 0
    stream.close()
    with pytest.raises(ClosedError):
        lc.generate(model, PROMPT, media=[IMG_A], max_tokens=2, **GREEDY)
    with pytest.raises(ClosedError):
        projector.tokenize(projector.marker + " x", [projector.read(IMG_A)])
    del prompt, stream
    assert projector.freed


def test_threads_share_one_projector(vlm):
    solo = {i: lc.generate(vlm, PROMPT, media=[img], max_tokens=6, **GREEDY).tokens
            for i, img in enumerate((IMG_A, IMG_B))}
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int, img: np.ndarray) -> None:
        try:
            for _ in range(3):
                results[i] = lc.generate(vlm, PROMPT, media=[img], max_tokens=6, **GREEDY).tokens
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, img)) for i, img in enumerate((IMG_A, IMG_B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == solo  # each its own pooled context: the same computation as alone


def test_server_batched_equals_solo(vlm, gemma3ish):
    """4 slots: image requests (two projectors' kinds) and a text request at once, each as it is alone."""
    for model in (vlm, gemma3ish):
        pj = model.projector
        prompt = PROMPT.replace(lc.MEDIA_MARKER, pj.marker)
        images = [IMG_A, IMG_B, IMG_A[::-1].copy()]
        solo = [lc.generate(model, PROMPT, media=[im], max_tokens=10, logprobs=2, **GREEDY) for im in images]
        text_solo = lc.generate(model, "Hello there, how are", max_tokens=10, logprobs=2, **GREEDY)
        with lc.Server(model=model, n_parallel=4, n_ctx=512) as server:
            streams = [server.stream_tokens(pj.tokenize(prompt, [pj.read(im)]), max_tokens=10, temp=0.0)
                       for im in images]
            streams.append(server.stream("Hello there, how are", max_tokens=10, temp=0.0))
            outs = [s.completion() for s in streams]
            for out, ref in zip(outs, solo + [text_solo]):
                assert_greedy_equivalent(out, ref, what=f"{pj.path.name}: batched vs solo")
            assert outs[0].prompt_tokens == solo[0].prompt_tokens
            # the same image again: its KV comes from the slot's cache (the prompt decode skips it)
            again = server.generate_tokens(pj.tokenize(prompt, [pj.read(IMG_A)]), max_tokens=10, temp=0.0,
                                           cache_prompt=True)
            assert again.timings.cached_tokens == again.prompt_tokens - 1
            assert_greedy_equivalent(again, solo[0], what="cached image in a slot")


def test_server_takes_media_option(vlm):
    with lc.Server(model=vlm, n_parallel=2, n_ctx=512) as server:
        solo = lc.generate(vlm, PROMPT, media=[IMG_A], max_tokens=6, logprobs=2, **GREEDY)
        out = server.generate(PROMPT, media=[IMG_A], max_tokens=6, temp=0.0)
        assert_greedy_equivalent(out, solo, what="Server.generate(media=)")
        outs = server.generate_many([PROMPT], n=2, media=[IMG_A], max_tokens=6, temp=0.0)
        for o in outs:
            assert_greedy_equivalent(o, solo, what="two choices, one encode")
        assert lc.generate(server, PROMPT, media=[IMG_B], max_tokens=2, temp=0.0).prompt_tokens == solo.prompt_tokens
        with pytest.raises(MediaError, match="1 media marker"):
            server.generate(PROMPT, media=[IMG_A, IMG_B], max_tokens=2)


def test_server_chat_with_images(vlm):
    with lc.Server(model=vlm, n_parallel=2, n_ctx=512) as server:
        msgs = [{"role": "user", "content": [{"type": "image", "image": IMG_A},
                                             {"type": "text", "text": "What is this?"}]}]
        reply = lc.chat(server, msgs, chat_template="chatml", max_tokens=6, temp=0.0)
        solo = lc.chat(vlm, msgs, chat_template="chatml", max_tokens=6, logprobs=2, **GREEDY)
        assert reply.prompt_tokens == solo.prompt_tokens and len(reply.tokens) == 6
        # a cancelled request waiting for its image frees its slot
        stream = server.stream_tokens(vlm.projector.tokenize(vlm.projector.marker + " x", [vlm.projector.read(IMG_B)]),
                                      max_tokens=50, temp=0.0)
        stream.cancel()
        with pytest.raises(lc.CancelledError):
            stream.completion()
        assert len(server.generate("Hi", max_tokens=3, temp=0.0).tokens) == 3


def test_server_refusals(vlm, files, tmp_path):
    prompt = vlm.projector.tokenize("a " + vlm.projector.marker + " b", [vlm.projector.read(IMG_A)])
    with lc.Server(model=vlm, n_parallel=1, n_ctx=256, speculative="ngram") as server:
        with pytest.raises(MediaError, match="speculative"):
            server.generate_tokens(prompt, max_tokens=2)
    # a single-sequence session too (it read the media spans' placeholder ids as tokens before)
    from llama_ctypes.engines.speculative.drafters import NgramDraft
    from llama_ctypes.engines.speculative.session import SpeculativeSession

    with SpeculativeSession(vlm, NgramDraft(), n_ctx=256) as session:
        with pytest.raises(MediaError, match="SpeculativeSession does not take images"):
            session.stream_tokens(prompt, max_tokens=2)
        assert len(session.generate("Hi", max_tokens=3, temp=0.0).tokens) == 3
    with lc.load_model(files["model"], mmproj=files["vision"]) as other:
        with lc.Server(model=other, n_parallel=1, n_ctx=256) as server:
            with pytest.raises(InvalidArgumentError, match="another model"):
                server.generate_tokens(prompt, max_tokens=2)
            ends_with_media = other.projector.tokenize("a " + other.projector.marker, [other.projector.read(IMG_A)])
            with pytest.raises(InvalidArgumentError, match="end with text"):
                server.generate_tokens(ends_with_media, max_tokens=2)


def float_wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """A WAV of IEEE float samples (format 3), which Python's wave module does not write."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_non_finite_media_never_reach_the_kv_cache(alm):
    """A float WAV of NaN decodes to NaN samples, and would spoil every batch-mate's attention (flash
    attention off): the encode refuses it, and the Server's other requests keep their output."""
    nan_clip = float_wav(np.full(16000, np.nan, np.float32))
    with pytest.raises(MediaError, match="non-finite"):
        lc.generate(alm, "Hear " + lc.MEDIA_MARKER + " ok", media=[nan_clip], max_tokens=2, **GREEDY)
    ref = lc.generate(alm, "Hello there, how are", max_tokens=8, logprobs=2, **GREEDY)
    with lc.Server(model=alm, n_parallel=2, n_ctx=512, flash_attn="disabled") as server:
        bad = server.stream("Hear " + lc.MEDIA_MARKER + " ok", media=[nan_clip], max_tokens=4, temp=0.0)
        text = server.stream("Hello there, how are", max_tokens=8, temp=0.0)
        with pytest.raises(MediaError, match="non-finite"):
            bad.completion()
        assert_greedy_equivalent(text.completion(), ref, what="a batch-mate of a NaN clip")
        after = server.generate("Hello there, how are", max_tokens=8, temp=0.0)
        assert_greedy_equivalent(after, ref, what="after a NaN clip")


def test_a_changed_or_closed_media_prompt_fails_alone(vlm, tmp_path):
    pj = vlm.projector
    ref = lc.generate(vlm, "Hello there, how are", max_tokens=6, logprobs=2, **GREEDY)

    def fresh():
        return pj.tokenize("a " + pj.marker + " b", [pj.read(IMG_A)])

    changed = fresh()
    changed.insert(0, changed[0])  # (a list: it can be changed, and its spans no longer fit)
    shifted = fresh()
    shifted.spans = (dataclasses.replace(shifted.spans[0], index=0),)  # a text chunk named as media
    closed = fresh()
    closed.chunks.close()
    with lc.Server(model=vlm, n_parallel=2, n_ctx=512) as server:
        text = server.stream("Hello there, how are", max_tokens=6, temp=0.0)
        for prompt, error in ((changed, InvalidArgumentError), (shifted, InvalidArgumentError),
                              (closed, ClosedError)):
            with pytest.raises(error):
                server.generate_tokens(prompt, max_tokens=2)
            with pytest.raises(error):
                lc.generate(vlm, prompt, max_tokens=2, **GREEDY)
        assert_greedy_equivalent(text.completion(), ref, what="the Server goes on")
        # a slot that holds an image cannot be saved to a file (token ids only), and nothing is written
        server.generate_tokens(fresh(), max_tokens=2, temp=0.0, id_slot=1, cache_prompt=True)
        with pytest.raises(InvalidArgumentError, match="images or audio"):
            server.save_slot(1, tmp_path / "slot.bin")
        assert not (tmp_path / "slot.bin").exists()


def test_closing_a_server_while_encoding_leaves_prompts_usable(vlm):
    pj = vlm.projector
    prompts = [pj.tokenize("x " + pj.marker + " y", [pj.read(np.full((30, 40, 3), i, np.uint8))]) for i in range(6)]
    server = lc.Server(model=vlm, n_parallel=4, n_ctx=512)
    streams = [server.stream_tokens(p, max_tokens=2, temp=0.0) for p in prompts]
    server.close()
    for s in streams:
        try:
            s.completion()  # (one may have finished before the close)
        except (lc.CancelledError, lc.ClosedError):
            pass
    assert all(not p.encoding for p in prompts)
    with lc.Server(model=vlm, n_parallel=2, n_ctx=512) as again:  # each can still be served elsewhere
        assert all(len(again.generate_tokens(p, max_tokens=2, temp=0.0).tokens) == 2 for p in prompts)


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory, vocab_dir):
    """A tiny M-RoPE text model and its Qwen2-VL-style projector (tests/tiny_models.py)."""
    d = tmp_path_factory.mktemp("qwen2vl")
    text = write_tiny_qwen2vl(d / "qwen2vl.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf")
    mmproj = write_tiny_qwen2vl_mmproj(d / "mmproj-qwen2vl.gguf")
    (d / "grid.png").write_bytes(png(IMG_GRID))
    model = lc.load_model(text, mmproj=mmproj)
    yield model
    model.close()


IMG_GRID = np.random.default_rng(11).integers(0, 256, (48, 64, 3), dtype=np.uint8)  # 4 x 3 merged patches


def test_mrope_image_takes_its_grid_positions(qwen2vl):
    """M-RoPE (the Qwen2-VL family): an image of nx x ny embeddings advances the position by max(nx, ny)
    only. The tokens after it sit there, as the KV cache llama.cpp keeps says, through cuts and reuse."""
    pj = qwen2vl.projector
    assert pj.uses_mrope and qwen2vl.rope_type == "mrope"
    prompt = pj.tokenize("a " + pj.marker + " b c", [pj.read(IMG_GRID)])
    (span,) = prompt.spans
    assert (span.n_tokens, span.n_pos) == (12, 4)
    shift = span.n_pos - span.n_tokens
    with lc.Context.create(qwen2vl, n_ctx=256) as ctx, ctx.lease() as lease:
        lease.prefill(prompt, reuse=False)
        cold = lease.logits(-1).copy()
        assert lease.seq_pos_max(0) == len(prompt) + shift - 1
        lease.append_fn()(int(np.argmax(cold)))
        assert lease.seq_pos_max(0) == len(prompt) + shift and len(ctx.tokens) == len(prompt) + 1
        with pytest.raises(InvalidArgumentError, match="split an image"):
            lease.truncate(span.start + 2)
        assert len(ctx.tokens) == len(prompt) + 1  # nothing changed
        assert lease.truncate(span.end) and lease.seq_pos_max(0) == span.start  # (the grid's cells: t = its start)
        assert lease.prefill(prompt, reuse=True) == span.end  # the image came from the cache
        assert lease.seq_pos_max(0) == len(prompt) + shift - 1
        np.testing.assert_allclose(lease.logits(-1), cold, atol=1e-3)  # the same positions as cold (wrong ones: ~1)
        assert lease.truncate(span.start) and lease.seq_pos_max(0) == span.start - 1
        assert lease.prefill(prompt, reuse=True) == span.start
        np.testing.assert_allclose(lease.logits(-1), cold, atol=1e-3)
        # removing positions p.. keeps the tokens before p (the grid's cells all sit at its first position)
        assert lease.seq_rm(0, len(prompt) + shift + 3, -1) and len(ctx.tokens) == len(prompt)  # none there
        assert lease.seq_rm(0, span.start + 2, -1) and len(ctx.tokens) == span.end
        assert lease.seq_pos_max(0) == span.start
        assert lease.prefill(prompt, reuse=True) == span.end
        np.testing.assert_allclose(lease.logits(-1), cold, atol=1e-3)
        assert lease.seq_rm(0, span.start, -1) and len(ctx.tokens) == span.start


@pytest.mark.needs_tools
def test_mrope_against_llama_mtmd_cli_and_cache(qwen2vl, tmp_path):
    """lc.chat equals llama-mtmd-cli on an M-RoPE model (margin-checked), and a second turn that keeps the
    image reuses it and equals a cold run."""
    exe = find_tool("llama-mtmd-cli")
    if exe is None:
        pytest.fail(NOT_BUILT.replace("llama-server", "llama-mtmd-cli"))
    image = tmp_path / "grid.png"
    image.write_bytes(png(IMG_GRID))
    cmd = [str(exe), "-m", str(qwen2vl.path), "--mmproj", str(qwen2vl.projector.path), "--image", str(image),
           "-p", "What is this?", "-n", "10", "--temp", "0", "--chat-template", "chatml", "-c", "512", "-t", "2"]
    theirs, whole = run_mtmd_cli(cmd)
    turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]}]
    ours = lc.chat(qwen2vl, turn, chat_template="chatml", max_tokens=10, logprobs=2, **GREEDY)
    assert_matches_text(ours, theirs, whole=whole)
    turn2 = turn + [{"role": "assistant", "content": "A grid."}, {"role": "user", "content": "And then?"}]
    cold = lc.chat(qwen2vl, turn2, chat_template="chatml", max_tokens=8, logprobs=2, **GREEDY)
    lc.chat(qwen2vl, turn, chat_template="chatml", max_tokens=1, cache_prompt=True, **GREEDY)
    warm = lc.chat(qwen2vl, turn2, chat_template="chatml", max_tokens=8, cache_prompt=True, **GREEDY)
    assert warm.timings.cached_tokens > 12 + 5  # the opening and the 12 image embeddings
    assert_greedy_equivalent(warm, cold, what="M-RoPE image from the cache")


def test_mrope_server_batched_equals_solo(qwen2vl):
    """4 slots of an M-RoPE model, images of other grids and text at once, each as it is alone; a slot's
    cached image is reused at its positions."""
    pj = qwen2vl.projector
    images = [IMG_GRID, IMG_B, IMG_GRID[:, ::-1].copy()]
    solo = [lc.generate(qwen2vl, PROMPT, media=[im], max_tokens=10, logprobs=2, **GREEDY) for im in images]
    text_solo = lc.generate(qwen2vl, "Hello there, how are", max_tokens=10, logprobs=2, **GREEDY)
    prompt = PROMPT.replace(lc.MEDIA_MARKER, pj.marker)
    with lc.Server(model=qwen2vl, n_parallel=4, n_ctx=512) as server:
        streams = [server.stream_tokens(pj.tokenize(prompt, [pj.read(im)]), max_tokens=10, temp=0.0) for im in images]
        streams.append(server.stream("Hello there, how are", max_tokens=10, temp=0.0))
        for out, ref in zip([s.completion() for s in streams], solo + [text_solo]):
            assert_greedy_equivalent(out, ref, what="M-RoPE batched vs solo")
        again = server.generate(PROMPT, media=[IMG_GRID], max_tokens=10, temp=0.0, cache_prompt=True)
        assert again.timings.cached_tokens == again.prompt_tokens - 1
        assert_greedy_equivalent(again, solo[0], what="M-RoPE image in a slot's cache")
        # a longer prompt whose first part a slot holds: the cut lands at the positions after the image
        longer = server.generate(PROMPT + " More words here", media=[IMG_GRID], max_tokens=6, temp=0.0,
                                 cache_prompt=True)
        ref = lc.generate(qwen2vl, PROMPT + " More words here", media=[IMG_GRID], max_tokens=6, logprobs=2, **GREEDY)
        assert longer.timings.cached_tokens > 12
        assert_greedy_equivalent(longer, ref, what="M-RoPE prefix reuse")
