"""The chat page at ``/``: its files and headers, then the page itself in a real headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, driven with Selenium) against a real ``serve``.

Two models from a config: ``gemma`` (Gemma 3 270M, ``ignore_eos`` so an answer runs until stopped)
and ``echo`` (the tiny model under a grammar that makes it write HTML and Markdown, to check that
model output is shown as text).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from http_helpers import ServeProcess, busy, wait_for
from starlette.testclient import TestClient

from llama_ctypes.engines.manager import ModelManager
from llama_ctypes.interfaces.http import create_app
from llama_ctypes.interfaces.http.webui import CSP, PACKAGE_DIR

ECHO = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2> **bold** `code`"
THOUGHT, ANSWER = "pondering the question", "The answer is 42."
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


# ---- the files, without a browser -------------------------------------------------------------

@pytest.fixture
def client():
    manager = ModelManager()
    try:
        yield TestClient(create_app(manager))
    finally:
        manager.close()


def test_the_page_is_served_with_a_strict_policy_etags_and_gzip(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.text == (PACKAGE_DIR / "index.html").read_text()
    csp = r.headers["content-security-policy"]
    assert csp == CSP and "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    etag = r.headers["etag"]
    again = client.get("/", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    js = client.get("/app.js", headers={"Accept-Encoding": "gzip"})
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert js.headers["content-encoding"] == "gzip" and js.text == (PACKAGE_DIR / "app.js").read_text()
    plain = client.get("/app.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.text == js.text
    for refused in ("GZIP;Q=0", "*;q=0", "gzip;q=0, *"):
        assert "content-encoding" not in client.get("/app.js", headers={"Accept-Encoding": refused}).headers
    assert client.get("/app.js", headers={"Accept-Encoding": "br;q=1, *;q=0.5"}).headers["content-encoding"] == "gzip"
    assert client.get("/", headers={"If-None-Match": "*"}).status_code == 304
    head = client.head("/style.css")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    for path in ("/nothing.js", "/../pyproject.toml", "/%2e%2e/pyproject.toml", "/webui.py"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/models").json()["data"] == []  # (the API's paths come first)
    # the rest is answered as without the page: 405 for an API path's other methods, a redirect for a
    # trailing slash, 404 for anything else
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert client.post("/nope").status_code == 404 and client.put("/v1/nope").status_code == 404
    r = client.get("/v1/models/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/v1/models")
    r = client.post("/index.html")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"


def test_the_page_needs_no_key_but_the_api_does():
    manager = ModelManager()
    try:
        c = TestClient(create_app(manager, api_key="sesame"))
        assert c.get("/").status_code == 200 and c.get("/app.js").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.post("/").status_code in (401, 405)  # (only GET and HEAD reach the page's files)
        assert c.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    finally:
        manager.close()


def test_no_webui_another_folder_and_an_api_prefix(tmp_path):
    manager = ModelManager()
    try:
        off = TestClient(create_app(manager, webui=False))
        assert off.get("/").status_code == 404 and off.get("/app.js").status_code == 404
        (tmp_path / "index.html").write_text("<!doctype html><title>mine</title>")
        (tmp_path / "assets").mkdir()
        (tmp_path / "assets" / "a.js").write_text("export const a = 1;\n")
        (tmp_path / ".secret").write_text("hidden")
        (tmp_path / "metrics").write_text("a file named as an API path")
        (tmp_path / "v1").mkdir()
        (tmp_path / "v1" / "models").write_text("{}")
        keyed = TestClient(create_app(manager, webui=tmp_path, api_key="sesame"))
        assert keyed.get("/metrics").status_code == 401 and keyed.get("/v1/models").status_code == 401
        assert keyed.get("/assets/a.js").status_code == 200
        mine = TestClient(create_app(manager, webui=tmp_path))
        assert "mine" in mine.get("/").text and mine.get("/assets/a.js").text == "export const a = 1;\n"
        assert mine.get("/.secret").status_code == 404 and mine.get("/app.js").status_code == 404
        with pytest.raises(ValueError, match="index.html"):
            create_app(manager, webui=tmp_path / "assets")
        prefixed = TestClient(create_app(manager, api_prefix="/llama"))
        r = prefixed.get("/llama", follow_redirects=False)
        assert r.status_code in (307, 308) and r.headers["location"].endswith("/llama/")
        assert prefixed.get("/llama/").status_code == 200 and prefixed.get("/llama/app.js").status_code == 200
        assert prefixed.get("/app.js").status_code == 404
    finally:
        manager.close()


# ---- the page in a browser --------------------------------------------------------------------

def _browser_missing() -> str | None:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        return "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install '.[test]')"
    return None


@pytest.fixture(scope="module")
def browser_available():
    missing = _browser_missing()
    if missing:
        if os.environ.get("LLAMA_CTYPES_REQUIRE_BROWSER"):  # (.ci/run installs them: missing is a failure there)
            pytest.fail(missing)
        pytest.skip(missing)


def _chrome(profile: Path):
    """Debian's Chromium, headless, with a profile (its localStorage) of its own."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # (the network here is closed: Chromium's background connections are turned off, as the machine notes say)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1200,800", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    return driver


@pytest.fixture
def browser(browser_available, tmp_path):
    driver = _chrome(tmp_path / "profile")
    try:
        yield driver
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "favicon" not in e["message"]
                  and "401" not in e["message"] and "400" not in e["message"]]
        assert not errors, errors  # (no script error, no blocked resource, no CSP violation)
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def served(browser_available, tmp_path_factory, tiny_model_path, gemma_path, vocab_dir):
    folder = tmp_path_factory.mktemp("webui")
    grammar = 'root ::= "' + ECHO.replace("\\", "\\\\").replace('"', '\\"') + '"'
    qwen3 = vocab_dir / "templates" / "Qwen-Qwen3-0.6B.jinja"  # (a template whose replies think first)
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
id = "echo"
path = "{tiny_model_path}"
n_parallel = 1
n_ctx = 512
grammar = '''{grammar}'''

[[models]]
id = "think"
path = "{tiny_model_path}"
n_parallel = 1
n_ctx = 512
chat_template = "{qwen3}"
grammar = '''root ::= "<think>{THOUGHT}</think>{ANSWER}"'''

[[models]]
id = "gemma"
path = "{gemma_path}"
n_parallel = 1
n_ctx = 4096
ignore_eos = true
""")
    server = ServeProcess(["--config", str(config), "--threads", "2"], folder / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _by(css: str):
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def _open(driver, url: str) -> None:
    driver.get(url)
    assert wait_for(lambda: len(driver.find_elements(*_by("#model option"))) > 0, 20), "no model listed"


def _choose(driver, model: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(*_by("#model"))).select_by_value(model)


def _say(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(*_by("#input"))
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _reply(driver, url: str, model: str, text: str) -> None:
    """Open the page, pick ``model``, send ``text`` and wait for the whole answer."""
    _open(driver, url)
    _choose(driver, model)
    _say(driver, text)
    assert wait_for(lambda: _idle(driver) and _answer(driver), 30)


def _answer(driver) -> str:
    nodes = driver.find_elements(*_by("#messages .msg.assistant .content"))
    return nodes[-1].text if nodes else ""


def _idle(driver) -> bool:
    return not driver.find_elements(*_by("#messages .msg.streaming")) and \
        driver.find_element(*_by("#stop")).get_attribute("hidden") is not None


def test_a_streamed_answer_grows_stops_frees_its_slot_and_survives_a_reload(served, browser, tmp_path):
    _open(browser, served.base_url + "/")
    assert sorted(o.get_attribute("value") for o in browser.find_elements(*_by("#model option"))) == [
        "echo", "gemma", "think"]
    _choose(browser, "gemma")
    _say(browser, "Tell me a long story about a lighthouse.")
    seen = []
    deadline = time.monotonic() + 60
    while len(set(seen)) < 4 and time.monotonic() < deadline:
        seen.append(len(_answer(browser)))
        time.sleep(0.2)
    assert len(set(seen)) >= 4 and seen == sorted(seen), seen  # the text grew piece by piece
    assert browser.find_element(*_by("#stop")).is_displayed()
    assert wait_for(lambda: busy(served, "gemma")[0] == 1, 10)
    browser.save_screenshot(str(tmp_path / "mid-answer.png"))
    assert (tmp_path / "mid-answer.png").stat().st_size > 1000
    browser.find_element(*_by("#stop")).click()
    assert wait_for(lambda: _idle(browser), 10)
    assert "stopped" in browser.find_elements(*_by("#messages .msg.assistant .meta"))[-1].text
    assert wait_for(lambda: busy(served, "gemma") == (0, 0), 10), "the stopped request still holds its slot"
    stopped_at = _answer(browser)
    assert stopped_at
    browser.refresh()
    assert wait_for(lambda: browser.find_elements(*_by("#conversations li")), 10)
    titles = [li.text for li in browser.find_elements(*_by("#conversations li .conv-title"))]
    assert titles == ["Tell me a long story about a lighthouse."]
    assert wait_for(lambda: _answer(browser) == stopped_at, 10)  # (kept in the browser as it was stopped)
    assert browser.find_element(*_by("#model")).get_attribute("value") == "gemma"


def test_model_output_is_shown_as_text_never_run(served, browser):
    _reply(browser, served.base_url + "/", "echo", "Say it")
    content = browser.find_elements(*_by("#messages .msg.assistant .content"))[-1]
    assert "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>" in content.text
    assert not content.find_elements(*_by("script")) and not content.find_elements(*_by("img"))
    assert content.find_element(*_by("strong")).text == "bold" and content.find_element(*_by("code")).text == "code"
    assert browser.execute_script("return window.pwned === undefined")


def test_reasoning_is_shown_apart_and_the_speed_below(served, browser):
    _reply(browser, served.base_url + "/", "think", "Think first")
    message = browser.find_elements(*_by("#messages .msg.assistant"))[-1]
    details = message.find_element(*_by("details.reasoning"))
    assert details.is_displayed() and details.get_attribute("open") is None  # collapsed
    assert _answer(browser) == ANSWER and THOUGHT not in _answer(browser)
    details.find_element(*_by("summary")).click()
    assert message.find_element(*_by(".reasoning-text")).text == THOUGHT
    assert "tokens/s" in message.find_element(*_by(".meta")).text and "tokens/s" in browser.find_element(
        *_by("#speed")).text


def test_export_then_import_in_another_browser(served, browser, tmp_path):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    _reply(browser, served.base_url + "/", "echo", "Keep this")
    browser.find_element(*_by("#export")).click()
    exported = downloads / "conversations.json"
    assert wait_for(exported.exists, 10)
    data = json.loads(exported.read_text())
    assert data["format"] == "llama_ctypes.conversations" and data["conversations"][0]["title"] == "Keep this"
    assert data["conversations"][0]["messages"][1]["content"] == ECHO  # (the Markdown source, not its rendering)
    other = _chrome(tmp_path / "other-profile")  # a second browser: an empty list of its own
    try:
        _open(other, served.base_url + "/")
        assert not other.find_elements(*_by(".conv-title"))
        other.find_element(*_by("#import-file")).send_keys(str(exported))
        assert wait_for(lambda: [e.text for e in other.find_elements(*_by(".conv-title"))] == ["Keep this"], 10)
        other.find_element(*_by(".conv-title")).click()
        assert wait_for(lambda: _answer(other) == _answer(browser), 5)
    finally:
        other.quit()


def test_settings_rename_delete_import_and_keyboard(served, browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    _open(browser, served.base_url + "/")
    _choose(browser, "echo")
    box = browser.find_element(*_by("#input"))
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.NULL, "second line")
    assert box.get_attribute("value") == "first line\nsecond line" and not _answer(browser)  # not sent
    box.clear()
    browser.find_element(*_by("#settings-button")).click()
    browser.find_element(*_by("#set-system")).send_keys("Be brief.")
    temperature = browser.find_element(*_by("#set-temperature"))
    temperature.clear()
    temperature.send_keys("0")
    browser.find_element(*_by("#set-max-tokens")).send_keys("3")
    browser.find_element(*_by("#settings-save")).click()
    _say(browser, "Short one")
    assert wait_for(lambda: _idle(browser) and _answer(browser), 30)
    assert len(_answer(browser)) < len(ECHO) // 2  # three tokens of the grammar's text
    # rename, then reload: the title and the settings are kept with the conversation
    browser.find_element(*_by("#conversations li .conv-rename")).click()
    title = browser.find_element(*_by(".conv-rename-input"))
    title.send_keys(Keys.CONTROL, "a")
    title.send_keys("Renamed chat", Keys.ENTER)
    browser.refresh()
    assert wait_for(lambda: [e.text for e in browser.find_elements(*_by(".conv-title"))] == ["Renamed chat"], 10)
    browser.find_element(*_by("#settings-button")).click()
    assert browser.find_element(*_by("#set-system")).get_attribute("value") == "Be brief."
    assert browser.find_element(*_by("#set-max-tokens")).get_attribute("value") == "3"
    browser.find_element(*_by("#settings button[value=cancel]")).click()
    # import an export file: two conversations join the list
    export = {"format": "llama_ctypes.conversations", "version": 1, "conversations": [
        {"id": "a", "title": "Imported one", "model": "echo", "updated": 1, "settings": {},
         "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<b>x</b>"}]},
        {"id": "b", "title": "Imported two", "messages": [{"role": "user", "content": "yo"}]},
        {"id": "bad", "messages": [{"role": "system<script>", "content": 1}]}]}
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(export))
    browser.find_element(*_by("#import-file")).send_keys(str(path))
    assert wait_for(lambda: len(browser.find_elements(*_by(".conv-title"))) == 3, 10)
    one = next(e for e in browser.find_elements(*_by(".conv-title")) if e.text == "Imported one")
    one.click()
    assert wait_for(lambda: _answer(browser) == "<b>x</b>", 5)
    # delete (confirmed): gone, also after a reload
    item = next(li for li in browser.find_elements(*_by("#conversations li")) if "Imported two" in li.text)
    item.find_element(*_by(".conv-delete")).click()
    browser.switch_to.alert.accept()
    browser.refresh()
    assert wait_for(lambda: sorted(e.text for e in browser.find_elements(*_by(".conv-title")))
                    == ["Imported one", "Renamed chat"], 10)


def test_errors_from_the_server_are_shown(served, browser):
    _open(browser, served.base_url + "/")
    _choose(browser, "echo")
    browser.execute_script("document.getElementById('input').value = 'word '.repeat(2000)")
    browser.find_element(*_by("#send")).click()
    assert wait_for(lambda: browser.find_element(*_by("#error")).is_displayed(), 20)
    assert "context" in browser.find_element(*_by("#error-text")).text.lower()
    assert wait_for(lambda: _idle(browser), 5)
    # the failed turn is taken out (the next request must not carry it) and the text is back in the box
    assert not browser.find_elements(*_by("#messages .msg"))
    assert browser.find_element(*_by("#input")).get_attribute("value").startswith("word word")


def test_hostile_markdown_renders_quickly(served, browser, tmp_path):
    nasty = [">" * 5000, "# a" + " " * 5000 + "x", " **a" * 12000, "[a](" * 10000, " __a" * 12000,
             "`" * 3000, "- " * 5000 + "\n" + "  x\n" * 2000]
    export = {"format": "llama_ctypes.conversations", "version": 1, "conversations": [
        {"id": f"n{i}", "title": f"nasty {i}", "updated": 10 - i,
         "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": text}]}
        for i, text in enumerate(nasty)]}
    path = tmp_path / "nasty.json"
    path.write_text(json.dumps(export))
    _open(browser, served.base_url + "/")
    browser.find_element(*_by("#import-file")).send_keys(str(path))
    assert wait_for(lambda: len(browser.find_elements(*_by(".conv-title"))) == len(nasty), 10)
    for i in range(len(nasty)):
        t0 = time.monotonic()
        next(e for e in browser.find_elements(*_by(".conv-title")) if e.text == f"nasty {i}").click()
        assert wait_for(lambda: browser.find_elements(*_by("#messages .msg.assistant")), 10)
        assert time.monotonic() - t0 < 3, f"nasty {i} took {time.monotonic() - t0:.1f} s"
    t0 = time.monotonic()
    browser.refresh()  # (the page opens the newest conversation, the deepest quotes, at start)
    assert wait_for(lambda: browser.find_elements(*_by("#messages .msg.assistant")), 10)
    assert time.monotonic() - t0 < 5


def test_two_tabs_keep_each_others_conversations(served, browser):
    _open(browser, served.base_url + "/")
    first = browser.current_window_handle
    _choose(browser, "gemma")
    _say(browser, "A long answer in the first tab")
    assert wait_for(lambda: len(_answer(browser)) > 10, 60)
    browser.switch_to.new_window("tab")
    _open(browser, served.base_url + "/")
    browser.find_element(*_by("#new-chat")).click()
    _choose(browser, "echo")
    _say(browser, "Second tab")
    assert wait_for(lambda: _idle(browser) and _answer(browser), 30)
    browser.switch_to.window(first)
    assert wait_for(lambda: len(browser.find_elements(*_by(".conv-title"))) == 2, 10)  # (its list took it)
    browser.find_element(*_by("#stop")).click()
    assert wait_for(lambda: _idle(browser), 10)
    browser.refresh()
    assert wait_for(lambda: sorted(e.text for e in browser.find_elements(*_by(".conv-title")))
                    == ["A long answer in the first tab", "Second tab"], 10)
    assert wait_for(lambda: busy(served, "gemma") == (0, 0), 10)


def test_a_phone_sized_window_slides_the_list_over(served, browser):
    browser.set_window_size(390, 844)
    _open(browser, served.base_url + "/")
    sidebar = browser.find_element(*_by("#sidebar"))
    menu = browser.find_element(*_by("#menu"))
    assert menu.is_displayed() and sidebar.rect["x"] + sidebar.rect["width"] <= 0
    menu.click()
    assert wait_for(lambda: sidebar.rect["x"] >= 0, 5)
    browser.find_element(*_by("#new-chat")).click()
    assert wait_for(lambda: sidebar.rect["x"] + sidebar.rect["width"] <= 0, 5)
    composer = browser.find_element(*_by("#input"))
    assert composer.is_displayed() and composer.rect["width"] > 200


def test_with_an_api_key_the_page_asks_for_it(browser_available, browser, tmp_path, tiny_model_path):
    server = ServeProcess(["--model", str(tiny_model_path), "--threads", "1", "--n-predict", "8"],
                          tmp_path / "serve.log", api_key="sesame")
    try:
        server.wait_ready()
        _ = httpx.get(server.base_url + "/", timeout=10).raise_for_status()
        browser.get(server.base_url + "/")
        assert wait_for(lambda: browser.find_element(*_by("#apikey")).is_displayed(), 10)
        browser.find_element(*_by("#apikey-input")).send_keys("sesame")
        browser.find_element(*_by("#apikey-save")).click()
        assert wait_for(lambda: len(browser.find_elements(*_by("#model option"))) == 1, 10)
        _say(browser, "Hello")
        assert wait_for(lambda: _idle(browser) and _answer(browser), 30)
        assert browser.execute_script("return localStorage.getItem('llama_ctypes.apiKey')") == "sesame"
    finally:
        server.stop()
