"""Input that Python reads too kindly: ``int()`` takes ``'١'``, ``'1_0'``, ``'+0'`` and ``' 0'``, and
``'²'.isdigit()`` is true while ``int('²')`` raises; ``json.loads`` lets in lone surrogates (which no
UTF-8 text holds: a file name, a tokenizer or the JSON answer then fails to encode them), ``NaN`` and
nestings deep enough to raise ``RecursionError``. Each is a 400 in llama-server's shape, never a 500."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("starlette")
from starlette.requests import Request  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

import llama_ctypes as lc  # noqa: E402
from llama_ctypes.interfaces.http.app import create_app  # noqa: E402
from llama_ctypes.interfaces.http.common import read_body  # noqa: E402
from llama_ctypes.interfaces.http.errors import BadRequest, Unavailable  # noqa: E402
from llama_ctypes.interfaces.http.serve import vertex_ai_routes  # noqa: E402
from llama_ctypes.interfaces.http.tools.box import ToolBox  # noqa: E402

LONE = '"\\ud800"'  # (a JSON escape of a lone surrogate)


@pytest.fixture
def http(tiny_model, tmp_path):
    (tmp_path / "slots").mkdir()
    with lc.ModelManager() as manager:
        manager.load("tiny", tiny_model, mode="server", n_parallel=2, n_ctx=256)
        app = create_app(manager, slot_save_path=tmp_path / "slots", tools=ToolBox(["read_file"]),
                         predict_route="/predict")
        with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
            yield client


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_slot_ids_are_ascii_digits_only(http):
    assert http.post("/slots/1?action=erase").json() == {"id_slot": 1, "n_erased": 0}
    for slot in ("١", "1_0", "+0", " 0", "0 ", "²", "-1", "0x1", "1" * 10):
        error = _error(http.post(f"/slots/{slot}?action=erase"))
        assert error["message"] == "Invalid slot ID" and error["type"] == "invalid_request_error", slot
        assert error["param"] == "id_slot"


def test_lone_surrogates_and_other_json_that_python_lets_in_are_400(http, tmp_path):
    bodies = {
        ("/slots/0?action=save", "/slots/0?action=restore"): [
            '{"filename": %s}' % LONE, '{"filename": "x\\udcff.bin"}', b'{"filename": "\xed\xa0\x80"}'],
        ("/tools",): ['{"tool": %s, "params": {}}' % LONE, '{"tool": "read_file", "params": {"path": NaN}}',
                      "[" * 40_000],
        ("/lora-adapters",): ['[{"id": %s, "scale": 1}]' % LONE],
        ("/predict",): ['{"instances": [{"@requestFormat": %s}]}' % LONE],
    }
    for paths, cases in bodies.items():
        for path in paths:
            for body in cases:
                raw = body if isinstance(body, bytes) else body.encode()
                r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
                error = _error(r)
                assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error", (path, body)
    assert not any((tmp_path / "slots").iterdir())
    # (the ordinary names still work)
    r = http.post("/slots/0?action=save", json={"filename": "café.bin"})
    assert r.status_code == 200 and r.json()["filename"] == "café.bin"


def test_an_error_message_that_quotes_undecodable_bytes_is_still_json():
    """File names come from the file system with surrogate escapes (bytes that are not UTF-8): an error
    that quotes one (a model id taken from a file name, while it loads) must still encode as JSON."""
    r = Unavailable("loading model(s): m\udcff", code="loading").response()
    assert r.status_code == 503
    assert json.loads(r.body)["error"] == {"message": "loading model(s): m\\udcff", "type": "unavailable_error",
                                           "param": None, "code": "loading"}
    assert BadRequest("x", param="p\ud800").body()["error"]["param"] == "p\\ud800"


async def _read_with_length(value: bytes) -> bytes:
    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", value)]}
    return await read_body(Request(scope, receive), 1 << 20)


@pytest.mark.parametrize("value", ["²".encode("latin-1"), "¹²³".encode("latin-1")])
def test_a_content_length_that_isdigit_but_is_no_number_is_not_a_crash(value):
    import asyncio

    assert asyncio.run(_read_with_length(value)) == b"{}"


def test_a_vertex_port_that_isdigit_but_is_no_number_is_refused():
    args = argparse.Namespace(port=8080)
    for port in ("²", "٨٠٨٠", "8_080", " 8080"):
        with pytest.raises(lc.ArgumentTypeError, match="AIP_HTTP_PORT"):
            vertex_ai_routes(args, {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": port})
    assert args.port == 8080


def test_a_logit_bias_key_of_thousands_of_digits_is_400(http):
    """int() refuses strings of more than 4300 digits with a ValueError: it was a 500 on /completion."""
    huge = "9" * 5000
    for path, body in (("/completion", {"prompt": "Hi", "n_predict": 1, "logit_bias": {huge: 1}}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {huge: 1}}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                 "logit_bias": {huge: 1}})):
        error = _error(http.post(path, json=body))
        assert "token id" in error["message"] and len(error["message"]) < 300, (path, error)
    # an ordinary key still works
    assert http.post("/completion", json={"prompt": "Hi", "n_predict": 1, "logit_bias": {"5": 1}}).status_code == 200


def test_a_grammar_too_broad_for_the_vocabulary_is_a_400_at_once(http):
    """10,000 alternatives cost seconds per token in llama.cpp's grammar check on the scheduler thread (every
    other client's stream waited 31 s for 12 tokens): refused before it is sampled."""
    grammar = "root ::= (" + " | ".join(f'"w{i} "' for i in range(10_000)) + ")+"
    for path, body in (("/completion", {"prompt": "a", "n_predict": 12, "grammar": grammar}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 12,
                                                 "grammar": grammar})):
        error = _error(http.post(path, json=body))
        assert "too broad" in error["message"], error


def test_a_long_list_of_the_wrong_type_is_refused_at_its_first_element(http):
    """Pydantic reported every wrong element (and each member of a union each): a million in 1 MB took 3.6 s of
    the event loop. Every list field stops at its first wrong element; the 400 names it."""
    body = b'{"model": "tiny", "prompt": [' + b",".join([b"1"] * 400_000) + b', "x"], "max_tokens": 1}'
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert _error(r)["param"] == "prompt"
    body = b'{"model": "tiny", "prompt": "a", "stop": [' + b",".join([b"1"] * 400_000) + b"]}"
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert _error(r)["param"] == "stop"


def test_a_content_part_whose_type_is_no_string_is_400(http):
    for kind in ({}, [], 3, None):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": kind, "text": "hi"}]}]})
        assert "'type' must be a string" in _error(r)["message"]


def test_a_body_of_too_many_arrays_and_objects_is_refused_before_it_is_parsed(http):
    """Each array and object becomes a Python object with the GIL held (2.8 million in 8 MB: 1-2.6 s of every
    stream and of /health): past 50,000 a body is a 413, told in a few ms; brackets inside strings do not
    count."""
    from llama_ctypes.interfaces.http.json_cost import MAX_JSON_CONTAINERS

    heavy = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": [' \
        + b",".join([b"[1]"] * 2_000_000) + b"]}}"
    many = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * (MAX_JSON_CONTAINERS + 1)})
    for path, body in (("/v1/chat/completions", heavy), ("/v1/chat/completions", many.encode()),
                       ("/tools", b'{"tool": "read_file", "params": {"x": [' + b",".join([b"{}"] * 60_000) + b"]}}")):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        error = _error(r, 413)
        assert error["code"] == "request_too_large" and "JSON arrays and objects" in error["message"]
    from llama_ctypes.interfaces.http.json_cost import MAX_JSON_VALUES

    ids = b",".join([b"1"] * (MAX_JSON_VALUES + 2))
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": [' + ids + b"]}",
                  headers={"Content-Type": "application/json"})
    error = _error(r, 413)
    assert error["code"] == "request_too_large" and "JSON values" in error["message"]
    text = "{[" * 100_000  # (brackets in a string: an ordinary prompt)
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": text}]})
    assert r.status_code != 413, r.text
