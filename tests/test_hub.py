"""The Hub client against a local fake Hub: search, list, download, resume, checksums, offline, auth."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import llama_ctypes as lc
from fake_hub import TOKEN, FakeHub, Repo


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_path):
    model_bytes = tiny_model_path.read_bytes()
    with FakeHub() as fake:
        fake.state.repos["acme/tiny-GGUF"] = Repo(files={
            "tiny-Q8_0.gguf": model_bytes,
            "big-00001-of-00003.gguf": b"part one " * 100,
            "big-00002-of-00003.gguf": b"part two " * 100,
            "big-00003-of-00003.gguf": b"part three " * 100,
            "README.md": b"# tiny",
        }, downloads=50)
        fake.state.repos["acme/other-gguf"] = Repo(files={"x.gguf": b"GGUF"}, downloads=5)
        fake.state.repos["acme/private-GGUF"] = Repo(files={"p.gguf": b"secret model"}, private=True)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("LLAMA_CTYPES_MODELS_DIR", str(tmp_path / "cache"))
        for var in ("HF_TOKEN", "LLAMA_OFFLINE", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        fake.model_bytes = model_bytes
        yield fake


def test_search_and_list(hub):
    found = lc.hub.search("acme", limit=5)
    assert [m.id for m in found] == ["acme/tiny-GGUF", "acme/other-gguf"]
    assert found[0].downloads == 50 and "gguf" in found[0].tags
    files = lc.hub.list_gguf_files("acme/tiny-GGUF")
    by_name = {f.name: f for f in files}
    assert set(by_name) == {"tiny-Q8_0.gguf", "big-00001-of-00003.gguf"}
    split = by_name["big-00001-of-00003.gguf"]
    assert split.is_split and len(split.parts) == 3 and split.size == 900 + 900 + 1100
    assert by_name["tiny-Q8_0.gguf"].sha256 == hashlib.sha256(hub.model_bytes).hexdigest()


def test_download_load_and_cache_layout(hub, tmp_path):
    path = lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf")
    assert path == (tmp_path / "cache" / "acme--tiny-GGUF" / "main" / "tiny-Q8_0.gguf").resolve()
    assert path.read_bytes() == hub.model_bytes
    with lc.load_model_from_hub("acme/tiny-GGUF", "tiny-Q8_0.gguf") as model:
        assert model.architecture == "llama"
        assert lc.generate(model, "hi", max_tokens=2, temp=0).tokens
    # the second download only asks whether the file is current (one HEAD), no body
    before = len(hub.state.requests)
    assert lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf") == path
    new = hub.state.requests[before:]
    assert [r[0] for r in new] == ["HEAD"]
    # same file name in another repo: another path
    other = lc.hub.download("acme/other-gguf", "x.gguf")
    assert other.parent != path.parent


def test_split_model_downloads_every_part(hub):
    first = lc.hub.download("acme/tiny-GGUF", "big-00001-of-00003.gguf")
    for i, body in ((1, b"part one " * 100), (2, b"part two " * 100), (3, b"part three " * 100)):
        assert (first.parent / f"big-0000{i}-of-00003.gguf").read_bytes() == body


def test_interrupted_download_resumes_with_range(hub):
    hub.state.truncate["tiny-Q8_0.gguf"] = len(hub.model_bytes) // 3
    seen = []
    path = lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf", progress=lambda done, total: seen.append(done))
    assert path.read_bytes() == hub.model_bytes
    cdn = [r for r in hub.requests_to("/cdn/") if r[0] == "GET"]
    assert len(cdn) == 2 and "Range" not in cdn[0][2]
    resumed_at = int(cdn[1][2]["Range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(hub.model_bytes) // 3  # from what reached the disk, not from zero
    assert seen[-1] == len(hub.model_bytes)


def test_corrupt_body_is_rejected_and_not_cached(hub):
    hub.state.corrupt.add("tiny-Q8_0.gguf")
    with pytest.raises(lc.HubIntegrityError, match="sha256"):
        lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf")
    folder = Path(lc.hub.default_cache_dir()) / "acme--tiny-GGUF" / "main"
    assert not (folder / "tiny-Q8_0.gguf").exists()
    assert not (folder / "tiny-Q8_0.gguf.incomplete").exists()
    hub.state.corrupt.clear()
    assert lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf").read_bytes() == hub.model_bytes


def test_offline_mode_makes_no_requests(hub, monkeypatch):
    path = lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf")
    monkeypatch.setenv("LLAMA_OFFLINE", "1")
    before = len(hub.state.requests)
    assert lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf") == path
    with pytest.raises(lc.HubOfflineError, match="not in the cache"):
        lc.hub.download("acme/tiny-GGUF", "README.md")
    with pytest.raises(lc.HubOfflineError):
        lc.hub.search("acme")
    monkeypatch.delenv("LLAMA_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(lc.HubOfflineError):
        lc.hub.list_gguf_files("acme/tiny-GGUF")
    assert len(hub.state.requests) == before


@pytest.mark.parametrize("bad", ["../escape.gguf", "/etc/passwd", "a/../../b.gguf", "dir\\..\\x.gguf", "", "./x",
                                 "C:/x.gguf"])
def test_path_traversal_is_refused(hub, bad):
    with pytest.raises(ValueError):
        lc.hub.download("acme/tiny-GGUF", bad)
    assert hub.state.requests == []


def test_bad_repo_and_revision_are_refused(hub):
    for repo in ("../x", "noslash", "a/b/c", "a/.."):
        with pytest.raises(ValueError):
            lc.hub.download(repo, "x.gguf")
    with pytest.raises(ValueError):
        lc.hub.download("acme/tiny-GGUF", "x.gguf", revision="../main")


def test_not_found_and_unauthorized(hub, caplog):
    with pytest.raises(lc.HubNotFoundError, match="nope.gguf.*acme/tiny-GGUF.*main"):
        lc.hub.download("acme/tiny-GGUF", "nope.gguf")
    with pytest.raises(lc.HubNotFoundError):
        lc.hub.list_gguf_files("acme/missing")
    with pytest.raises(lc.HubUnauthorizedError, match="HF_TOKEN"):
        lc.hub.download("acme/private-GGUF", "p.gguf")
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(lc.HubUnauthorizedError) as err:
            lc.hub.download("acme/private-GGUF", "p.gguf", token="hf_wrong_token_value")
    assert "hf_wrong_token_value" not in str(err.value) and "hf_wrong_token_value" not in caplog.text
    path = lc.hub.download("acme/private-GGUF", "p.gguf", token=TOKEN)
    assert path.read_bytes() == b"secret model"


def test_hf_token_environment_variable(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert lc.hub.download("acme/private-GGUF", "p.gguf").read_bytes() == b"secret model"
    auth = [r[2].get("Authorization") for r in hub.requests_to("/resolve/")]
    assert auth and all(a == f"Bearer {TOKEN}" for a in auth)


def test_concurrent_downloads_give_one_correct_file(hub):
    paths, errors = [], []

    def work():
        try:
            paths.append(lc.hub.download("acme/tiny-GGUF", "tiny-Q8_0.gguf"))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert paths[0].read_bytes() == hub.model_bytes
    bodies = [r for r in hub.requests_to("/cdn/") if r[0] == "GET"]
    assert len(bodies) == 1  # the lock made the others wait and reuse the file


def test_concurrent_processes(hub, tmp_path):
    code = ("import llama_ctypes as lc, sys; "
            "print(lc.hub.download('acme/tiny-GGUF', 'tiny-Q8_0.gguf'))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and Path(outs[0]).read_bytes() == hub.model_bytes


def test_cli_hub_commands(hub):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "llama_ctypes", *args], capture_output=True, text=True,
                              timeout=120)

    assert "acme/tiny-GGUF" in run("hub", "search", "acme").stdout
    listing = run("hub", "list", "acme/tiny-GGUF").stdout
    assert "tiny-Q8_0.gguf" in listing and "(3 parts)" in listing
    path = run("hub", "download", "acme/tiny-GGUF", "tiny-Q8_0.gguf").stdout.strip()
    assert Path(path).read_bytes() == hub.model_bytes
    out = run("generate", "Hi", "--hub", "acme/tiny-GGUF", "tiny-Q8_0.gguf", "-n", "3", "--temp", "0")
    assert out.returncode == 0, out.stderr
    missing = run("hub", "download", "acme/tiny-GGUF", "missing.gguf")
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_the_repository_projector_is_found_as_llama_server_finds_it(hub, tmp_path):
    from tiny_models import write_tiny_mmproj

    mmproj = write_tiny_mmproj(tmp_path / "p.gguf").read_bytes()
    hub.state.repos["acme/vlm-GGUF"] = Repo(files={
        "vlm-Q4_K_M.gguf": hub.model_bytes, "mmproj-vlm-f16.gguf": mmproj, "mmproj-vlm-Q8_0.gguf": mmproj,
        "other/mmproj-x-Q4_0.gguf": b"not for this model"})
    # the closest quantization to the model's, from its own folder (not a sibling folder's)
    assert lc.hub.find_mmproj("acme/vlm-GGUF", "vlm-Q4_K_M.gguf") == "mmproj-vlm-Q8_0.gguf"
    assert lc.hub.find_mmproj("acme/tiny-GGUF", "tiny-Q8_0.gguf", required=False) is None
    with pytest.raises(lc.HubNotFoundError):
        lc.hub.find_mmproj("acme/tiny-GGUF", "tiny-Q8_0.gguf")
    with lc.load_model_from_hub("acme/vlm-GGUF", "vlm-Q4_K_M.gguf", mmproj="auto") as model:
        assert model.modalities == {"vision"}
        assert model.projector.path.name == "mmproj-vlm-Q8_0.gguf"
    with lc.load_model_from_hub("acme/tiny-GGUF", "tiny-Q8_0.gguf", mmproj="auto") as model:
        assert model.modalities == frozenset()  # (none in the repository: text only)
    with lc.ModelManager() as manager:
        manager.load("plain", ("hub", "acme/vlm-GGUF", "vlm-Q4_K_M.gguf"), n_ctx=256)
        text_only = manager.used()
        info = manager.load("vlm", ("hub", "acme/vlm-GGUF", "vlm-Q4_K_M.gguf"), mmproj="auto", n_ctx=256)
        assert "multimodal" in info.capabilities
        # the projector's weights count in the budget (on this CPU machine: in RAM), besides the model's
        assert manager.used()["ram"] == 2 * text_only["ram"] + len(mmproj)


def test_find_model_chooses_as_llama_servers_hf(hub, monkeypatch):
    """``-hf owner/name[:quant]``'s choice of file: the tag (any case), else Q4_K_M, then Q8_0, then the first
    model file; never a projector, an imatrix or a later part of a split model. Offline: among the cached
    files only, with no request."""
    hub.state.repos["acme/quants-GGUF"] = Repo(files={
        "mmproj-m-Q4_K_M.gguf": b"p", "m-Q2_K.gguf": b"a", "m-Q8_0.gguf": b"b", "m-Q4_K_M.gguf": b"c",
        "sub/n-F16-00002-of-00002.gguf": b"e", "sub/n-F16-00001-of-00002.gguf": b"d"})
    find = lc.hub.find_model
    assert find("acme/quants-GGUF") == ("acme/quants-GGUF", "m-Q4_K_M.gguf")
    assert find("acme/quants-GGUF:q8_0") == ("acme/quants-GGUF", "m-Q8_0.gguf")
    assert find("acme/quants-GGUF:F16") == ("acme/quants-GGUF", "sub/n-F16-00001-of-00002.gguf")
    assert find("acme/other-gguf") == ("acme/other-gguf", "x.gguf")  # (no usual tag: the first model file)
    with pytest.raises(lc.HubNotFoundError, match="'Q5_K'"):
        find("acme/quants-GGUF:Q5_K")
    with pytest.raises(ValueError):
        find("acme/quants-GGUF:bad tag")
    lc.hub.download("acme/quants-GGUF", "m-Q2_K.gguf")
    monkeypatch.setenv("LLAMA_OFFLINE", "1")
    before = len(hub.state.requests)
    assert find("acme/quants-GGUF") == ("acme/quants-GGUF", "m-Q2_K.gguf")  # (the one cached)
    with pytest.raises(lc.HubNotFoundError, match="offline"):
        find("acme/quants-GGUF:Q8_0")
    assert lc.hub.find_mmproj("acme/quants-GGUF", "m-Q2_K.gguf", required=False) is None  # (not cached)
    assert len(hub.state.requests) == before
