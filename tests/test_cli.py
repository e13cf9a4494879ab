"""The llama-ctypes command, run as a subprocess like a user would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_ctypes", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_streams_to_stdout(tiny_model_path):
    out = run("generate", "Hello", "--model", str(tiny_model_path), "--max-tokens", "8", "--temp", "0", "-v")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "tok/s" in out.stderr and "llama_model_loader" not in out.stderr  # quiet by default


def test_info_and_devices(tiny_model_path):
    info = run("info", str(tiny_model_path))
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["architecture"] == "llama" and data["n_layer"] == 2
    devices = run("devices", "--json")
    assert devices.returncode == 0
    assert any(d["type"] == "cpu" for d in json.loads(devices.stdout))


def test_errors_are_one_line_not_tracebacks(tmp_path):
    out = run("generate", "Hi", "--model", str(tmp_path / "missing.gguf"))
    assert out.returncode == 1
    assert "model file not found" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.gemma
def test_generate_uses_the_demo_model_by_default():
    out = run("generate", "The capital of France is", "--max-tokens", "8", "--temp", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_chat_is_multi_turn_over_stdin(tiny_model_path):
    proc = subprocess.run(
        [sys.executable, "-m", "llama_ctypes", "chat", "--model", str(tiny_model_path), "--chat-template", "chatml",
         "--system", "Be brief.", "--no-think", "-n", "6", "--temp", "0"],
        input="Hello\nAnd again\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip("\n").split("\n")) >= 2  # one reply per turn


def test_bench_prints_speeds(tiny_model_path):
    out = run("bench", str(tiny_model_path), "-p", "32", "-n", "8", "-r", "1")
    assert out.returncode == 0, out.stderr
    assert "pp32" in out.stdout and "tg8" in out.stdout and "tok/s" in out.stdout


@pytest.mark.parametrize("flags, expect", [
    ([], {}),  # the 4 default slots share one KV buffer (cross-slot prefix reuse)
    (["-np", "8"], {"kv_unified": False}),  # as llama-server: -np without --kv-unified, a stream per slot
    (["-np", "8", "--kv-unified"], {"share_kv": True}),  # as llama-server: every slot may fill the whole -c
    (["--no-kv-unified"], {"kv_unified": False}),
])
def test_serve_kv_flags_mean_what_llama_servers_mean(tiny_model_path, flags, expect):
    from llama_ctypes.interfaces.cli import build_parser
    from llama_ctypes.interfaces.http.serve import model_specs

    args = build_parser().parse_args(["serve", str(tiny_model_path), *flags])
    _, (spec,) = model_specs(args)
    assert {k: spec[k] for k in ("kv_unified", "share_kv") if k in spec} == expect


def test_serve_media_flags(tiny_model_path, tmp_path):
    from llama_ctypes.errors import ArgumentTypeError, InvalidArgumentError
    from llama_ctypes.interfaces.cli import build_parser
    from llama_ctypes.interfaces.http.serve import limits_from_args, model_specs, models_from_config

    parse = build_parser().parse_args
    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"GGUF")
    _, (spec,) = model_specs(parse(["serve", str(tiny_model_path), "--mmproj", str(mmproj), "--no-mmproj-offload",
                                    "--image-max-tokens", "256"]))
    assert spec["mmproj"] == str(mmproj) and spec["mmproj_params"] == {"use_gpu": False, "image_max_tokens": 256}
    _, (spec,) = model_specs(parse(["serve", "--hub", "acme/vlm-GGUF", "vlm.gguf"]))
    assert spec["mmproj"] == "auto"  # (as llama-server's -hf: the repository's projector when it has one)
    _, (spec,) = model_specs(parse(["serve", "--hub", "acme/vlm-GGUF", "vlm.gguf", "--no-mmproj"]))
    assert "mmproj" not in spec
    for bad in (["--mmproj", str(tmp_path / "missing.gguf")], ["--image-min-tokens", "4"],
                ["--mmproj", str(mmproj), "--no-mmproj"]):
        with pytest.raises(ArgumentTypeError):
            model_specs(parse(["serve", str(tiny_model_path), *bad]))
    requests, _ = limits_from_args(parse(["serve", str(tiny_model_path), "--media-max-mb", "2",
                                          "--media-max-items", "3"]))
    assert requests.media.max_bytes == 2 * 2**20 and requests.media.max_items == 3
    with pytest.raises(InvalidArgumentError, match="--media-max-items"):
        limits_from_args(parse(["serve", str(tiny_model_path), "--media-max-items", "0"]))
    config = tmp_path / "models.toml"
    config.write_text(f'[[models]]\nid = "v"\npath = "{tiny_model_path}"\nmmproj = "mmproj.gguf"\n')
    _, (entry,) = models_from_config(config)
    assert entry["mmproj"] == str(tmp_path / "mmproj.gguf")
