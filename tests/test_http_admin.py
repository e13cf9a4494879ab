"""Endpoints that change what a server serves (``/models/load``, ``/models/unload``, slot actions, adapter
scales) against pages of other sites: a "simple" cross-site POST (``text/plain``, no preflight) runs in
any browser, so CORS headers do not stop a web page the user visits from unloading the model under
everyone's streams. They refuse such pages, ``--cors-origins *`` (the default) notwithstanding; and a
server of one model does not serve ``/models/load``/``/models/unload`` at all, as llama-server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

import llama_ctypes as lc  # noqa: E402
from llama_ctypes.interfaces.http.app import create_app  # noqa: E402

EVIL = [{"Origin": "https://evil.example", "Content-Type": "text/plain"},
        {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},  # (a link or a no-cors fetch: no Origin)
        {"Origin": "http://evil.example:8080", "Host": "evil.example:8080"}]  # (DNS rebinding)


@pytest.fixture
def manager(tiny_model):
    with lc.ModelManager() as mm:
        mm.load("tiny", tiny_model, mode="server", n_parallel=2, n_ctx=256)
        yield mm


def _completes(http) -> bool:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_server_of_one_model_has_no_load_or_unload(manager):
    with TestClient(create_app(manager), raise_server_exceptions=False) as http:
        for headers in [{}, *EVIL]:
            r = http.post("/models/unload", content=json.dumps({"model": "tiny"}), headers=headers)
            assert r.status_code == 404 and "router mode" in r.json()["error"]["message"], headers
            assert http.post("/models/load", json={"model": "tiny"}).status_code == 404
        assert manager.loaded("tiny") and _completes(http)


def test_pages_of_other_sites_cannot_unload_a_routers_model(manager):
    with TestClient(create_app(manager, router_mode=True), base_url="http://127.0.0.1:8080",
                    raise_server_exceptions=False) as http:
        for headers in EVIL:
            r = http.post("/models/unload", content=json.dumps({"model": "tiny"}), headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", headers
            assert manager.loaded("tiny")
        assert _completes(http)
        # the server's own page (reached by its address or localhost) and clients that are no browser
        assert http.post("/models/unload", json={"model": "tiny"},
                         headers={"Origin": "http://127.0.0.1:8080"}).json() == {"success": True}
        assert not manager.loaded("tiny")


def test_a_named_origin_may_unload(manager):
    app = create_app(manager, router_mode=True, cors_origins="https://admin.example")
    with TestClient(app, raise_server_exceptions=False) as http:
        assert http.post("/models/unload", json={"model": "tiny"},
                         headers={"Origin": "https://other.example"}).status_code == 403
        assert http.post("/models/unload", json={"model": "tiny"},
                         headers={"Origin": "https://admin.example"}).json() == {"success": True}


def test_pages_of_other_sites_cannot_act_on_slots_or_adapter_scales(manager, tmp_path):
    (tmp_path / "slots").mkdir()
    app = create_app(manager, slot_save_path=tmp_path / "slots")
    with TestClient(app, raise_server_exceptions=False) as http:
        for headers in EVIL:
            for path, body in (("/slots/0?action=save", {"filename": "x.bin"}), ("/slots/0?action=erase", {}),
                               ("/lora-adapters", [])):
                r = http.post(path, content=json.dumps(body), headers=headers)
                assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", (path, headers)
        assert not list((tmp_path / "slots").iterdir())
        assert http.post("/slots/0?action=erase").status_code == 200
        assert http.get("/lora-adapters", headers=EVIL[0]).status_code == 200  # (reading is not acting)
        # one scale per adapter, as a request's own "lora" list
        r = http.post("/lora-adapters", json=[{"id": 0, "scale": 1}, {"id": 0, "scale": 2}])
        assert r.status_code == 400 and "twice" in r.json()["error"]["message"]
