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
        {"Origin": "http://evil.example:8080", "Host": "evil.example:8080"},  # (DNS rebinding)
        {"x-llama-ctypes-proxied": "1", "Content-Type": "text/plain"},  # (a /cors-proxy target's redirect: no Origin)
        {"Host": "evil.example:8080", "Referer": "http://evil.example:8080/",
         "Content-Type": "text/plain"}]  # (DNS rebinding: a same-origin GET, without Origin nor Sec-Fetch-*)


@pytest.fixture
def manager(tiny_model):
    with lc.ModelManager() as mm:
        mm.load("tiny", tiny_model, mode="server", n_parallel=2, n_ctx=256)
        yield mm


def _completes(http) -> bool:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_server_of_one_model_has_no_load_or_unload(manager):
    with TestClient(create_app(manager), raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
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
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
        assert http.post("/models/unload", json={"model": "tiny"},
                         headers={"Origin": "https://other.example"}).status_code == 403
        assert http.post("/models/unload", json={"model": "tiny"},
                         headers={"Origin": "https://admin.example"}).json() == {"success": True}


def test_pages_of_other_sites_cannot_act_on_slots_or_adapter_scales(manager, tmp_path):
    (tmp_path / "slots").mkdir()
    app = create_app(manager, slot_save_path=tmp_path / "slots")
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
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


def test_a_catalog_of_several_models_is_a_router_and_reload_is_refused_to_other_sites(manager, tiny_model_path):
    from llama_ctypes.interfaces.http.catalog import Catalog, CatalogEntry

    catalog = Catalog(manager)
    catalog.add(CatalogEntry("tiny", {"source": str(tiny_model_path)}))
    catalog.add(CatalogEntry("other", {"source": str(tiny_model_path), "n_ctx": 256}, autoload=False))
    with TestClient(create_app(manager, catalog=catalog), raise_server_exceptions=False,
                    base_url="http://127.0.0.1") as http:
        assert http.get("/models?reload=1", headers=EVIL[0]).status_code == 403
        assert http.get("/models", headers=EVIL[0]).status_code == 200  # (listing is not acting)
        assert http.post("/models/unload", json={"model": "tiny"}).json() == {"success": True}


def test_tools_refuse_other_sites_even_with_cors_origins_star(manager, tmp_path):
    from llama_ctypes.interfaces.http.tools.box import ToolBox

    marker = tmp_path / "ran"
    call = {"tool": "exec_shell_command", "params": {"command": f"touch {marker}"}}
    app = create_app(manager, tools=ToolBox(["exec_shell_command"]), cors_origins="*")
    with TestClient(app, base_url="http://127.0.0.1:8080", raise_server_exceptions=False) as http:
        for headers in EVIL + [{"Origin": "null"}]:
            r = http.post("/tools", content=json.dumps(call), headers=headers)
            assert r.status_code == 403, headers
        assert not marker.exists()
        assert http.post("/tools", json=call).status_code == 200 and marker.exists()


def test_a_model_that_failed_to_load_is_tried_again_by_a_request_outside_router_mode(tmp_path, tiny_model_path):
    """A server of one model has no /models/load: a failed wake-up from --sleep-idle-seconds (the file
    briefly gone) must not leave it answering 503 until a restart."""
    import asyncio
    import time

    from llama_ctypes.interfaces.http.catalog import Catalog, CatalogEntry
    from llama_ctypes.interfaces.http.errors import Unavailable

    path = tmp_path / "model.gguf"
    with lc.ModelManager() as mm:
        catalog = Catalog(mm, retry_failed_after=0.5)
        catalog.add(CatalogEntry("m", {"source": str(path), "mode": "server", "n_ctx": 256}))
        with pytest.raises(Unavailable, match="failed to load"):
            asyncio.run(catalog.ensure("m"))
        path.symlink_to(tiny_model_path)
        with pytest.raises(Unavailable, match="tries again in"):  # (not at once: no retry loop per request)
            asyncio.run(catalog.ensure("m"))
        time.sleep(0.6)
        asyncio.run(catalog.ensure("m"))
        assert catalog.status("m") == "loaded"
