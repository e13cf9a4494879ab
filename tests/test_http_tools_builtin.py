"""The built-in server tools (llama-server's ``/tools``), called directly: real files, real subprocesses.

Containers and ssh are exercised through fake ``docker`` / ``ssh`` executables put first on PATH, which run
the command they are handed on this machine: the isolate code path (file I/O through the exec'd shell, the
in-isolate ``timeout``, the quoting for ssh) runs for real without a container engine.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llama_ctypes.interfaces.http.tools import builtin
from llama_ctypes.interfaces.http.tools import runtime as rt
from llama_ctypes.interfaces.http.tools.base import ToolCallError, ToolParamError
from llama_ctypes.interfaces.http.tools.builtin import (
    BUILTIN_TOOL_NAMES,
    EDIT_FILE_MAX_SIZE,
    GREP_SEARCH_MAX_FILE_SIZE,
    build_tools,
)
from llama_ctypes.interfaces.http.tools.files import glob_match, path_glob_match
from llama_ctypes.interfaces.http.tools.process import kill_running, run_subprocess

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX shell commands")

UPSTREAM_UNIT = Path(__file__).resolve().parent.parent / "vendor/llama.cpp/tools/server/tests/unit"
GREP_MARKER = "llama_cpp_test_tools_builtin_marker_" + "grep_search"  # split: not to match this file
TOOLS = {t.name: t for t in build_tools(["all"])}


def call(name: str, params: dict, **kw) -> dict:
    """A call that must succeed: a JSON-serializable result without "error" (what the route would send)."""
    res = TOOLS[name].invoke(dict(params), **kw)
    json.dumps(res, ensure_ascii=False).encode("utf-8")
    assert "error" not in res, res
    return res


def call_error(name: str, params: dict) -> str:
    res = TOOLS[name].invoke(dict(params))
    assert set(res) == {"error"}, res
    return res["error"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def wait_dead(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


# --- setup and definitions -------------------------------------------------------------------------------------

def test_build_tools_names_order_and_errors():
    assert BUILTIN_TOOL_NAMES == ("read_file", "file_glob_search", "grep_search", "exec_shell_command",
                                  "write_file", "edit_file", "get_info")
    assert [t.name for t in build_tools(["all"])] == list(BUILTIN_TOOL_NAMES)
    assert [t.name for t in build_tools(["get_info", "read_file"])] == ["read_file", "get_info"]
    assert build_tools([]) == []
    with pytest.raises(ValueError) as e:
        build_tools(["read_file", "web_search"])
    assert str(e.value) == ('unknown tool "web_search". available tools: read_file, file_glob_search, grep_search, '
                            'exec_shell_command, write_file, edit_file, get_info')


def test_definitions_match_llama_server():
    listed = {t.name: t.to_json() for t in build_tools(["all"])}
    for name, item in listed.items():
        assert item["tool"] == name and item["type"] == "server" and item["uses_cwd"] is True
        fn = item["definition"]["function"]
        assert item["definition"]["type"] == "function" and fn["name"] == name
        assert fn["parameters"]["type"] == "object"
    write = {n for n, item in listed.items() if item["permissions"]["write"]}
    assert write == {"exec_shell_command", "write_file", "edit_file"}
    assert [t.name for t in build_tools(["all"]) if t.support_stream] == ["exec_shell_command"]
    assert listed["get_info"]["display_name"] == "Get Runtime Info"
    assert listed["exec_shell_command"]["display_name"] == "Execute shell command"
    fn = {n: item["definition"]["function"] for n, item in listed.items()}
    assert fn["read_file"]["parameters"]["required"] == ["path"]
    assert "(e.g. \"1\u2192...\")" in fn["read_file"]["description"]
    assert fn["grep_search"]["parameters"]["required"] == ["path", "pattern"]
    assert fn["edit_file"]["parameters"]["properties"]["edits"]["items"]["required"] == ["old_text", "new_text"]
    assert fn["get_info"]["parameters"] == {"type": "object", "properties": {}}
    props = fn["exec_shell_command"]["parameters"]["properties"]
    assert props["timeout"]["description"] == "Timeout in seconds (default 10, max 60)"
    assert props["max_output_size"]["description"] == "Maximum output size in bytes (default 16384)"
    limit = fn["file_glob_search"]["parameters"]["properties"]["limit"]["description"]
    assert limit == "Maximum number of results to return, capped at 100 (default 100)"


# --- read_file / write_file ------------------------------------------------------------------------------------

@pytest.mark.skipif(not UPSTREAM_UNIT.is_dir(), reason="no llama.cpp tree")
def test_upstream_read_file_and_grep_search(tmp_path):
    # a copy: the vendored tree sits in a git-ignored folder, where `git ls-files` rightly lists nothing
    unit = tmp_path / "tools" / "server" / "tests" / "unit"
    unit.mkdir(parents=True)
    this_file = unit / "test_tools_builtin.py"
    this_file.write_bytes((UPSTREAM_UNIT / "test_tools_builtin.py").read_bytes())
    text = call("read_file", {"path": str(this_file)})["plain_text_response"]
    assert GREP_MARKER in text and "def test_tools_builtin_read_file" in text
    res = call("grep_search", {"path": str(tmp_path), "pattern": GREP_MARKER, "include": "test_tools_builtin.py"})
    text = res["plain_text_response"]
    assert "test_tools_builtin.py" in text and GREP_MARKER in text and "Total matches: 1" in text


def test_write_then_edit_file(tmp_path):
    log_path = str(tmp_path / "test.log")
    res = call("write_file", {"path": log_path, "content": "line1\nline2\nline3\n"})
    assert res == {"result": "file written successfully", "path": log_path, "bytes": 18}
    assert call("read_file", {"path": log_path})["plain_text_response"] == "line1\nline2\nline3\n"
    res = call("edit_file", {"path": log_path, "edits": [{"old_text": "line2", "new_text": "line2-edited"},
                                                          {"old_text": "line3\n", "new_text": "line3\nline4\n"}]})
    assert res == {"result": "file edited successfully", "path": log_path, "edits_applied": 2}
    assert call("read_file", {"path": log_path})["plain_text_response"] == "line1\nline2-edited\nline3\nline4\n"


def test_read_file_ranges_numbers_and_caps(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("a\nb\nc\nd")
    assert call("read_file", {"path": str(f), "start_line": 2, "end_line": 3})["plain_text_response"] == "b\nc\n"
    assert call("read_file", {"path": str(f), "start_line": 3, "append_loc": True})["plain_text_response"] == \
        "3\u2192c\n4\u2192d\n"
    # mistyped optional params fall back to their defaults, as llama-server's json_value does
    assert call("read_file", {"path": str(f), "start_line": "x", "append_loc": 1})["plain_text_response"] == \
        "a\nb\nc\nd\n"
    big = tmp_path / "big.txt"
    big.write_text("".join(f"line {i:06d}\n" for i in range(3000)))  # 36 kB
    assert call_error("read_file", {"path": str(big)}) == (
        f"file too large ({big.stat().st_size} bytes, max 16384). Use start_line/end_line to read a portion.")
    text = call("read_file", {"path": str(big), "start_line": 2, "end_line": 2})["plain_text_response"]
    assert text == "line 000001\n"
    text = call("read_file", {"path": str(big), "end_line": 100000})["plain_text_response"]
    assert text.endswith("\n[output truncated]") and len(text.encode()) <= 16384 + len("[output truncated]")


def test_read_file_errors_and_hostile_paths(tmp_path):
    missing = str(tmp_path / "nope.txt")
    assert call_error("read_file", {"path": missing}) == f"cannot stat file: {missing}"
    assert call_error("read_file", {"path": str(tmp_path)}) == f"cannot stat file: {tmp_path}"
    # a device has no size and no end: refused before any read
    assert call_error("read_file", {"path": "/dev/zero", "end_line": 1}) == "cannot stat file: /dev/zero"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert call_error("read_file", {"path": str(fifo)}).startswith("cannot stat file")
    with pytest.raises(ToolParamError, match="key 'path' not found"):
        TOOLS["read_file"].invoke({})
    with pytest.raises(ToolParamError, match="type must be string, but is number"):
        TOOLS["read_file"].invoke({"path": 3})
    with pytest.raises(ToolParamError):
        TOOLS["read_file"].invoke(["not", "an", "object"])  # type: ignore[arg-type]


def test_read_file_binary_and_base64(tmp_path):
    blob = bytes(range(256)) * 4
    f = tmp_path / "blob.bin"
    f.write_bytes(blob)
    text = call("read_file", {"path": str(f)})["plain_text_response"]
    assert "\ufffd" in text and "\x00" in text
    res = call("read_file", {"path": str(f), "resp_type": "base64"})
    assert res == {"base64": base64.b64encode(blob).decode(), "size_bytes": len(blob)}


def test_relative_and_absolute_paths_against_cwd(tmp_path):
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "rel.txt").write_text("relative-content")
    cwd = {"cwd": str(workdir)}
    assert "relative-content" in call("read_file", {"path": "rel.txt", **cwd})["plain_text_response"]
    assert "relative-content" in call("read_file", {"path": "./x/../rel.txt", **cwd})["plain_text_response"]
    call("write_file", {"path": "sub/out.txt", "content": "written", **cwd})
    assert (workdir / "sub" / "out.txt").read_text() == "written"
    res = call("file_glob_search", {"path": ".", "include": "*.txt", **cwd})
    assert "rel.txt" in res["plain_text_response"] and res["base"] == str(workdir)
    assert call("file_glob_search", {"path": "sub/..", **cwd})["base"] == str(workdir)
    other = tmp_path / "other"
    other.mkdir()
    (other / "abs.txt").write_text("absolute-content")
    assert "absolute-content" in call("read_file", {"path": str(other / "abs.txt"), **cwd})["plain_text_response"]
    call("exec_shell_command", {"command": "echo hello > marker.txt", **cwd})
    assert (workdir / "marker.txt").read_text() == "hello\n"
    assert call("get_info", cwd)["cwd"] == str(workdir)


def test_write_file_bytes_errors_and_params(tmp_path):
    target = tmp_path / "a" / "b" / "u.txt"
    assert call("write_file", {"path": str(target), "content": "h\u00e9\u2192"})["bytes"] == 6
    assert target.read_bytes() == "h\u00e9\u2192".encode()
    assert call_error("write_file", {"path": str(tmp_path), "content": "x"}) == f"failed to write file: {tmp_path}"
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = str(blocker / "below.txt")
    assert call_error("write_file", {"path": path, "content": "x"}) == f"failed to write file: {path}"
    with pytest.raises(ToolParamError, match="key 'content' not found"):
        TOOLS["write_file"].invoke({"path": str(target)})
    with pytest.raises(ToolParamError):
        TOOLS["write_file"].invoke({"path": str(target), "content": "\ud800"})


# --- edit_file ----------------------------------------------------------------------------------------------------

def test_edit_file_refusals(tmp_path):
    f = tmp_path / "t.log"
    f.write_text("dup\ndup\n")
    p = str(f)
    err = call_error("edit_file", {"path": p, "edits": [{"old_text": "dup", "new_text": "x"}]})
    assert err == f"found 2 occurrences of edits[0].old_text in {p}, it must be unique"
    f.write_text("line1\nline2\n")
    err = call_error("edit_file", {"path": p, "edits": [{"old_text": "line1\nline2", "new_text": "a"},
                                                         {"old_text": "line2", "new_text": "b"}]})
    assert err == (f"edits[0] and edits[1] overlap in {p}; merge them into one edit or target disjoint regions")
    err = call_error("edit_file", {"path": p, "edits": [{"old_text": "nope", "new_text": "b"}]})
    assert err == f"could not find edits[0].old_text in {p}, it must match the file's current content exactly"
    err = call_error("edit_file", {"path": p, "edits": [{"old_text": "line1", "new_text": "line1"}]})
    assert err == "no changes made: the replacement(s) produced identical content"
    err = call_error("edit_file", {"path": p, "edits": [{"old_text": "line1", "new_text": "x"},
                                                         {"old_text": "", "new_text": "y"}]})
    assert err == "edits[1].old_text must not be empty"
    assert call_error("edit_file", {"path": p, "edits": []}) == '"edits" must be a non-empty array'
    assert call_error("edit_file", {"path": p, "edits": "x"}) == '"edits" must be a non-empty array'
    missing = str(tmp_path / "missing")
    err = call_error("edit_file", {"path": missing, "edits": [{"old_text": "a", "new_text": "b"}]})
    assert err == f"failed to open file: {missing}"
    with pytest.raises(ToolParamError, match="key 'new_text' not found"):
        TOOLS["edit_file"].invoke({"path": p, "edits": [{"old_text": "line1"}]})
    with pytest.raises(ToolParamError, match="cannot use at"):
        TOOLS["edit_file"].invoke({"path": p, "edits": ["line1"]})
    assert f.read_text() == "line1\nline2\n"  # nothing was written by any refusal


def test_edit_file_fuzzy_match_keeps_untouched_lines(tmp_path):
    f = tmp_path / "q.py"
    f.write_bytes("keep   \nprint(\u201chi\u201d)  \nalso keep\t\n".encode())
    res = call("edit_file", {"path": str(f), "edits": [{"old_text": 'print("hi")', "new_text": 'print("bye")'}]})
    assert res["edits_applied"] == 1
    # the edited line is normalized; the others keep their trailing blanks
    assert f.read_bytes() == b'keep   \nprint("bye")\nalso keep\t\n'
    # a whitespace-only variant still counts as a duplicate
    f.write_text("x = 1  \nx = 1\n")
    err = call_error("edit_file", {"path": str(f), "edits": [{"old_text": "x = 1\n", "new_text": "y\n"}]})
    assert "2 occurrences" in err


def test_edit_file_binary_bytes_preserved(tmp_path):
    f = tmp_path / "b.bin"
    f.write_bytes(b"\xff\xfe head \x00 MARK tail \x80")
    call("edit_file", {"path": str(f), "edits": [{"old_text": "MARK", "new_text": "\u00e9"}]})
    assert f.read_bytes() == b"\xff\xfe head \x00 \xc3\xa9 tail \x80"


def test_edit_and_write_refuse_fifos_and_devices(tmp_path):
    # a FIFO with no writer would block the read (and a worker thread) forever; /dev/zero never ends
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    edits = [{"old_text": "a", "new_text": "b"}]
    for path in (str(fifo), "/dev/zero"):
        worker_result: list[dict] = []
        worker = threading.Thread(target=lambda p=path: worker_result.append(
            TOOLS["edit_file"].invoke({"path": p, "edits": edits})), daemon=True)
        worker.start()
        worker.join(5)
        assert not worker.is_alive(), f"edit_file blocked on {path}"
        assert worker_result == [{"error": f"failed to open file: {path} (not a regular file)"}]
        # a FIFO with no reader would block the write; /dev/zero swallows the bytes and makes no file
        worker_result.clear()
        worker = threading.Thread(target=lambda p=path: worker_result.append(
            TOOLS["write_file"].invoke({"path": p, "content": "x"})), daemon=True)
        worker.start()
        worker.join(5)
        assert not worker.is_alive(), f"write_file blocked on {path}"
        assert worker_result == [{"error": f"failed to write file: {path}"}]
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_edit_file_size_cap(tmp_path):
    f = tmp_path / "huge.txt"
    with open(f, "wb") as fh:
        fh.truncate(EDIT_FILE_MAX_SIZE + 1)  # sparse: no disk used
    err = call_error("edit_file", {"path": str(f), "edits": [{"old_text": "a", "new_text": "b"}]})
    assert err == f"file too large ({EDIT_FILE_MAX_SIZE + 1} bytes, max {EDIT_FILE_MAX_SIZE})"


def _sparse(path: Path, size: int) -> Path:
    try:
        with open(path, "wb") as fh:
            fh.write(b"first line\nsecond\nthird")
            fh.truncate(size)
    except OSError as e:
        pytest.skip(f"the filesystem refuses a sparse file: {e}")
    return path


def test_huge_sparse_file_is_never_read_whole(tmp_path, monkeypatch):
    big = _sparse(tmp_path / "big.log", 2 ** 40)  # 1 TB, holding three lines and then NUL bytes
    text = call("read_file", {"path": str(big), "start_line": 1, "end_line": 2})["plain_text_response"]
    assert text == "first line\nsecond\n"
    text = call("read_file", {"path": str(big), "start_line": 2, "end_line": 9, "append_loc": True})
    # line 3 runs on for a terabyte: over the cap, so it is left out, as any over-long line
    assert text["plain_text_response"] == "2\u2192second\n[output truncated]"
    text = call("read_file", {"path": str(big), "start_line": 3, "end_line": 3})["plain_text_response"]
    assert text == "[output truncated]"
    # grep searches in memory: the huge file is skipped (and said so), a small one beside it is searched
    (tmp_path / "small.txt").write_text("second\n")
    text = call("grep_search", {"path": str(tmp_path), "pattern": "second"})["plain_text_response"]
    assert "small.txt:second" in text and "big.log" not in text.split("---")[0]
    assert f"[1 file(s) over {GREP_SEARCH_MAX_FILE_SIZE} bytes not searched]" in text
    text = call("grep_search", {"path": str(big), "pattern": "second"})["plain_text_response"]
    assert text.startswith("\n---\nTotal matches: 0\n")
    # the line-range read gives up on a first line too far in rather than scanning a terabyte
    monkeypatch.setattr(rt, "READ_LINES_MAX_SCAN", 4 * 1024 * 1024)
    err = call_error("read_file", {"path": str(big), "start_line": 4, "end_line": 5})
    assert err == f"line 4 not found within the first {rt.READ_LINES_MAX_SCAN} bytes of {big}"


def test_memory_error_is_a_tool_error(tmp_path, monkeypatch):
    f = tmp_path / "f.txt"
    f.write_text("x\n")

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(rt.HostIO, "read_lines", no_memory)
    monkeypatch.setattr(rt.HostIO, "read_file", no_memory)
    assert call_error("read_file", {"path": str(f), "end_line": 1}) == "out of memory"
    assert call_error("grep_search", {"path": str(f), "pattern": "x"}) == "out of memory"


# --- file_glob_search --------------------------------------------------------------------------------------------

def test_glob_type_dir_and_all(tmp_path):
    (tmp_path / "project-alpha" / "src").mkdir(parents=True)
    (tmp_path / "project-alpha" / "README.md").write_text("alpha")
    (tmp_path / "project-alpha" / "src" / "main.cpp").write_text("int main() {}")
    (tmp_path / "project-beta").mkdir()
    (tmp_path / "project-beta" / "notes.txt").write_text("beta")
    res = call("file_glob_search", {"path": str(tmp_path), "type": "dir"})
    text = res["plain_text_response"]
    assert "project-alpha/\n" in text and "project-beta/\n" in text and "project-alpha/src/\n" in text
    assert "README.md" not in text
    types = {e["path"]: e["type"] for e in res["entries"]}
    assert types == {"project-alpha": "dir", "project-alpha/src": "dir", "project-beta": "dir"}
    paths = [e["path"] for e in call("file_glob_search", {"path": str(tmp_path), "type": "all",
                                                          "include": "*proj*"})["entries"]]
    assert sorted(paths) == ["project-alpha", "project-beta"]
    res = call("file_glob_search", {"path": str(tmp_path), "include": "src/*.cpp"})
    assert [e["path"] for e in res["entries"]] == ["project-alpha/src/main.cpp"]
    res = call("file_glob_search", {"path": str(tmp_path), "type": "all", "exclude": "**/src/*"})
    assert "project-alpha/src/main.cpp" not in [e["path"] for e in res["entries"]]
    assert "project-alpha/src" in [e["path"] for e in res["entries"]]
    # llama-server's auto "**/" prefix wants a '/' before the pattern: a top-level folder is not matched
    res = call("file_glob_search", {"path": str(tmp_path), "exclude": "project-alpha/**"})
    assert "project-alpha/README.md" in [e["path"] for e in res["entries"]]


def test_glob_max_depth_and_limit(tmp_path):
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "top.txt").write_text("top")
    (tmp_path / "a" / "mid.txt").write_text("mid")
    (tmp_path / "a" / "b" / "deep.txt").write_text("deep")
    text = call("file_glob_search", {"path": str(tmp_path), "max_depth": 1})["plain_text_response"]
    assert "top.txt" in text and "mid.txt" not in text
    text = call("file_glob_search", {"path": str(tmp_path), "max_depth": 2})["plain_text_response"]
    assert "mid.txt" in text and "deep.txt" not in text
    assert "deep.txt" in call("file_glob_search", {"path": str(tmp_path), "max_depth": -3})["plain_text_response"]
    res = call("file_glob_search", {"path": str(tmp_path), "limit": 1})
    assert len(res["entries"]) == 1
    assert "Total matches: 3" in res["plain_text_response"]
    assert "[1 results limit reached (3 total matches)." in res["plain_text_response"]
    for i in range(120):
        (tmp_path / f"n{i:03d}.dat").write_text("")
    res = call("file_glob_search", {"path": str(tmp_path), "include": "*.dat", "limit": 1000})
    assert len(res["entries"]) == 100 and "Total matches: 120" in res["plain_text_response"]


def test_glob_junk_dirs_links_and_errors(tmp_path):
    (tmp_path / "build" / "nested").mkdir(parents=True)
    (tmp_path / "build" / "artifact.txt").write_text("built")
    (tmp_path / "node_modules" / "x").mkdir(parents=True)
    (tmp_path / "node_modules" / "x" / "index.js").write_text("")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.cpp").write_text("int main() {}")
    (tmp_path / "src" / "loop").symlink_to(tmp_path)  # would walk forever if followed
    res = call("file_glob_search", {"path": str(tmp_path), "type": "dir", "max_depth": 1})
    assert {"build", "node_modules", "src"} <= {e["path"] for e in res["entries"]}
    paths = [e["path"] for e in call("file_glob_search", {"path": str(tmp_path), "type": "all"})["entries"]]
    assert "src/main.cpp" in paths and "src/loop" in paths
    assert not [p for p in paths if p.startswith(("build/", "node_modules/", "src/loop/"))]
    err = call_error("file_glob_search", {"path": str(tmp_path), "type": "bogus"})
    assert err == 'invalid type: bogus (expected "file", "dir" or "all")'
    assert call_error("file_glob_search", {"path": str(tmp_path), "limit": 0}) == \
        "invalid limit: 0 (expected 1 or more)"
    assert call_error("file_glob_search", {"path": "/no/such/dir"}) == \
        "path does not exist or is not a directory: /no/such/dir"


def test_glob_honours_gitignore_in_a_repo(tmp_path):
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("secret.txt\n")
    (tmp_path / "secret.txt").write_text("")
    (tmp_path / "kept.txt").write_text("")
    paths = {e["path"] for e in call("file_glob_search", {"path": str(tmp_path)})["entries"]}
    assert paths == {".gitignore", "kept.txt"}


def test_glob_non_utf8_names_are_reported_safely(tmp_path):
    name = os.path.join(os.fsencode(tmp_path), b"bad\xff.txt")
    with open(name, "wb") as f:
        f.write(b"needle\n")
    res = call("file_glob_search", {"path": str(tmp_path)})
    assert [e["path"] for e in res["entries"]] == ["bad\ufffd.txt"]
    assert "bad\ufffd.txt:needle" in call("grep_search", {"path": str(tmp_path), "pattern": "needle"})[
        "plain_text_response"]


def test_glob_match_rules():
    assert glob_match("*.cpp", "a.cpp") and not glob_match("*.cpp", "d/a.cpp")
    assert glob_match("**/*.cpp", "d/e/a.cpp") and glob_match("**", "x/y")
    assert glob_match("?.c", "a.c") and not glob_match("?", "/")
    assert glob_match("[a-c]x", "bx") and not glob_match("[!a-c]x", "bx") and glob_match("[]]", "]")
    assert glob_match("a[b", "a[b") and not glob_match("a[b", "ab")
    assert path_glob_match("*.py", "deep/dir/x.py")
    assert path_glob_match("src/*.cpp", "p/src/a.cpp")
    # as llama-server: the auto "**/" prefix needs a '/' before the pattern, so a top-level src/ does not match
    assert not path_glob_match("src/*.cpp", "src/a.cpp")
    assert path_glob_match("**/src/*.cpp", "x/src/a.cpp") and not path_glob_match("/src/a.cpp", "src/a.cpp")
    # neither a long path nor a pattern full of stars blows the stack or the clock
    start = time.monotonic()
    assert glob_match("**", "a/" * 20000)
    assert not glob_match("*a*a*a*a*a*a*a*a*a*a*a*b", "a" * 3000)
    assert time.monotonic() - start < 5


# --- grep_search -------------------------------------------------------------------------------------------------

def test_grep_search_options(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("one\nTwo\nthree\nfour\n")
    (tmp_path / "b.md").write_text("a.b\naxb\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "junk.txt").write_text("Two\n")
    text = call("grep_search", {"path": str(tmp_path), "pattern": "two", "ignore_case": True,
                                "return_line_numbers": True})["plain_text_response"]
    assert text == "src/a.txt:2:Two\n\n---\nTotal matches: 1\n"
    text = call("grep_search", {"path": str(tmp_path), "pattern": "Two", "context_lines": 1})["plain_text_response"]
    assert text.startswith("src/a.txt-1-one\nsrc/a.txt:2:Two\nsrc/a.txt-3-three\n--\n")
    text = call("grep_search", {"path": str(tmp_path), "pattern": "a.b", "literal": True})["plain_text_response"]
    assert "b.md:a.b\n" in text and "axb" not in text
    assert "Total matches: 2" in call("grep_search", {"path": str(tmp_path), "pattern": "a.b"})["plain_text_response"]
    text = call("grep_search", {"path": str(tmp_path), "pattern": "o", "include": "*.txt", "exclude": "a.*"})[
        "plain_text_response"]
    assert "Total matches: 0" in text
    # a single file is shown under the path as given
    text = call("grep_search", {"path": "src/a.txt", "pattern": "four", "cwd": str(tmp_path)})["plain_text_response"]
    assert text.startswith("src/a.txt:four\n")
    assert call_error("grep_search", {"path": str(tmp_path), "pattern": "("}).startswith("invalid regex: ")
    assert call_error("grep_search", {"path": "/no/such", "pattern": "x"}) == "path does not exist: /no/such"
    with pytest.raises(ToolParamError, match="key 'pattern' not found"):
        TOOLS["grep_search"].invoke({"path": str(tmp_path)})


def test_grep_search_limit(tmp_path):
    (tmp_path / "many.txt").write_text("hit\n" * 150)
    text = call("grep_search", {"path": str(tmp_path), "pattern": "hit"})["plain_text_response"]
    assert text.count("many.txt:hit\n") == 100
    assert text.endswith("Total matches: 100\n[100 matches limit reached. Narrow the path/pattern/include to see "
                         "more.]\n")



def _regex_children() -> list[int]:
    """Pids of this process's regex workers (core/regex_worker.py) still alive."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z" and b"-I" in cmdline and b"-S" in cmdline:
            pids.append(int(entry.name))
    return pids


def wait_for_none(pids_of, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not pids_of():
            return True
        time.sleep(0.05)
    return False


def _gil_ticker() -> tuple[list[float], threading.Event, threading.Thread]:
    """A thread that wakes every 10 ms and records how long each wait really took: a call holding the GIL
    (Python's ``re`` backtracking) shows as one long gap."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.wait(0.01):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=tick)
    thread.start()
    return gaps, done, thread


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_grep_search_backtracking_pattern_stops_at_its_deadline(tmp_path, monkeypatch):
    """(a+)+$ over 28 a's and a '!' backtracks for minutes in Python's re, holding the GIL: it used to freeze
    every thread of the server. It runs in a child process now, killed at the deadline, and the caller's
    process keeps running meanwhile."""
    monkeypatch.setattr(builtin, "GREP_SEARCH_TIMEOUT", 1.0)
    (tmp_path / "evil.txt").write_text("fine\n" + "a" * 28 + "!\n")
    gaps, done, ticker = _gil_ticker()
    start = time.monotonic()
    try:
        error = call_error("grep_search", {"path": str(tmp_path), "pattern": "(a+)+$"})
    finally:
        done.set()
        ticker.join()
    elapsed = time.monotonic() - start
    assert error.startswith("grep_search stopped: matching the pattern took longer than 1 s"), error
    assert "literal: true" in error
    assert elapsed < 3, elapsed
    assert max(gaps) < 0.5, f"another thread waited {max(gaps):.2f} s for the GIL"
    assert wait_for_none(_regex_children), "the regex worker outlived its search"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_grep_search_stops_when_its_client_leaves(tmp_path):
    (tmp_path / "evil.txt").write_text("a" * 40 + "!\n")
    gone = threading.Event()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(TOOLS["grep_search"].invoke(
        {"path": str(tmp_path), "pattern": "(a+)+$"}, should_stop=gone.is_set)))
    worker.start()
    deadline = time.monotonic() + 5
    while not _regex_children() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _regex_children(), "no regex worker started"
    time.sleep(0.3)
    gone.set()
    left = time.monotonic()
    worker.join(5)
    assert not worker.is_alive() and time.monotonic() - left < 1
    assert result == {"error": "grep_search stopped: the client has gone"}
    assert wait_for_none(_regex_children)


def test_grep_search_keeps_ecmascript_features(tmp_path):
    """Backreferences and lookahead (std::regex's ECMAScript grammar, which llama-server uses): a linear-time
    engine such as RE2 would refuse them."""
    (tmp_path / "f.txt").write_text("abab\nabba\nfoobar\nfoobaz\n")
    text = call("grep_search", {"path": str(tmp_path / "f.txt"), "pattern": r"(ab)\1"})["plain_text_response"]
    assert text.startswith("%s:abab\n\n---\nTotal matches: 1" % (tmp_path / "f.txt"))
    text = call("grep_search", {"path": str(tmp_path), "pattern": "foo(?=bar)"})["plain_text_response"]
    assert text.startswith("f.txt:foobar\n\n---\nTotal matches: 1\n")
    text = call("grep_search", {"path": str(tmp_path), "pattern": "(?!ab)b.a", "return_line_numbers": True})
    assert text["plain_text_response"].startswith("f.txt:2:abba\n")


def test_grep_search_context_lines_and_output_are_capped(tmp_path):
    """A 40 KB file with context_lines 2**31-1 gave 63 MB (each of 100 matches printed the whole file)."""
    lines = [f"line {i:05d} " + "x" * 380 for i in range(100)]
    (tmp_path / "big.txt").write_text("\n".join(lines) + "\n")
    text = call("grep_search", {"path": str(tmp_path), "pattern": "line", "context_lines": 2**31 - 1})[
        "plain_text_response"]
    assert len(text.encode()) < builtin.GREP_SEARCH_MAX_OUTPUT + 1024
    assert text.endswith(f"[output truncated at {builtin.GREP_SEARCH_MAX_OUTPUT} bytes. Narrow the path/pattern/"
                         "include or lower context_lines to see more.]\n")
    # the context is clamped: 50 lines each side of a match, no more
    (tmp_path / "one.txt").write_text("".join(f"{'hit' if i == 100 else 'l'}{i}\n" for i in range(201)))
    text = call("grep_search", {"path": str(tmp_path / "one.txt"), "pattern": "hit", "context_lines": 10**9})[
        "plain_text_response"]
    shown = [line for line in text.splitlines() if line.startswith(str(tmp_path))]
    assert len(shown) == 2 * builtin.GREP_SEARCH_MAX_CONTEXT_LINES + 1 == 101
    assert shown[0].endswith("-51-l50") and shown[-1].endswith("-151-l150")
    # a single line longer than the cap is cut at a character boundary
    (tmp_path / "wide.txt").write_text("hit " + "é" * 200_000 + "\n")
    text = call("grep_search", {"path": str(tmp_path / "wide.txt"), "pattern": "hit"})["plain_text_response"]
    assert "[output truncated at" in text and len(text.encode()) < builtin.GREP_SEARCH_MAX_OUTPUT + 1024

# --- exec_shell_command / get_info ------------------------------------------------------------------------------

def test_exec_output_exit_code_and_caps(tmp_path):
    res = call("exec_shell_command", {"command": "echo out; echo err >&2; exit 3"})
    assert res == {"plain_text_response": "out\nerr\n\n[exit code: 3]"}
    res = call("exec_shell_command", {"command": "printf 0123456789", "max_output_size": 4})
    assert res["plain_text_response"] == "0123\n[output truncated]\n[exit code: 0]"
    # far more than the cap: drained to the end, never stuck on a full pipe
    res = call("exec_shell_command", {"command": "head -c 30000000 /dev/zero | tr '\\0' x"})
    text = res["plain_text_response"]
    assert text == "x" * 16384 + "\n[output truncated]\n[exit code: 0]"
    res = call("exec_shell_command", {"command": "printf abc", "max_output_size": -5})
    assert res["plain_text_response"].startswith("abc\n")
    res = call("exec_shell_command", {"command": "pwd", "cwd": str(tmp_path / "missing")})
    assert res["plain_text_response"] == "failed to spawn process\n[exit code: -1]"
    with pytest.raises(ToolParamError, match="key 'command' not found"):
        TOOLS["exec_shell_command"].invoke({})


def test_exec_timeout_kills_the_whole_group(tmp_path):
    pidfile = tmp_path / "pid"
    start = time.monotonic()
    res = call("exec_shell_command", {"command": f"sleep 300 & echo $! > {pidfile}; cat /dev/zero", "timeout": 1})
    assert time.monotonic() - start < 10
    text = res["plain_text_response"]
    assert text.endswith("\n[output truncated]\n[exit code: 1] [exit due to timed out]")
    assert wait_dead(int(pidfile.read_text()))


def test_exec_should_stop_kills_promptly(tmp_path):
    pidfile = tmp_path / "pid"
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    start = time.monotonic()
    res = TOOLS["exec_shell_command"].invoke(
        {"command": f"sleep 300 & echo $! > {pidfile}; wait", "timeout": 60}, should_stop=stop.is_set)
    assert time.monotonic() - start < 10
    assert "[exit code:" in res["plain_text_response"]
    assert wait_dead(int(pidfile.read_text()))


def test_kill_running_ends_commands_and_their_children(tmp_path):
    # what the server does at shutdown: no command (nor what it put in the background) outlives it
    pidfile, bgfile = tmp_path / "pid", tmp_path / "bg"
    results: list[dict] = []
    cmd = f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; sleep 50 & echo $! > {bgfile}; sleep 51"
    worker = threading.Thread(target=lambda: results.append(
        TOOLS["exec_shell_command"].invoke({"command": cmd, "timeout": 60})))
    worker.start()
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and bgfile.exists() and bgfile.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid, bg = int(pidfile.read_text()), int(bgfile.read_text())
    assert kill_running() >= 1
    assert wait_dead(pid) and wait_dead(bg)
    worker.join(5)
    assert not worker.is_alive()
    assert results[0]["plain_text_response"].endswith("[exit code: 1]")
    assert kill_running() == 0  # the ended command left the registry


def test_exec_stream(tmp_path):
    chunks: list[str] = []
    res = TOOLS["exec_shell_command"].invoke({"command": "echo hello; sleep 0.2; echo world"}, stream=chunks.append)
    assert res == {}
    assert len(chunks) >= 2 and "".join(chunks) == "hello\nworld\n\n[exit code: 0]"
    # a client that goes away: the process group is killed and no exit line is sent
    pidfile = tmp_path / "pid"
    chunks.clear()
    stop = threading.Event()

    def push(chunk: str) -> None:
        chunks.append(chunk)
        stop.set()

    start = time.monotonic()
    TOOLS["exec_shell_command"].invoke({"command": f"sleep 300 & echo $! > {pidfile}; echo started; wait"},
                                       stream=push, should_stop=stop.is_set)
    assert time.monotonic() - start < 10
    assert chunks == ["started\n"]
    assert wait_dead(int(pidfile.read_text()))


def test_get_info():
    res = call("get_info", {})
    assert res["cwd"] == os.getcwd() and res["os"] and res["os"] != "unknown"


# --- runtimes ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "message"), [
    ("fake:does-not-exist", "unknown tool runtime: fake:does-not-exist"),
    ("ssh:-oProxyCommand=touch /tmp/pwned", "invalid ssh target: -oProxyCommand=touch /tmp/pwned"),
    ("ssh:", "invalid ssh target: "),
    ("ssh:host;rm -rf /", "invalid ssh target: host;rm -rf /"),
    ("docker-container:--privileged", "invalid container id: --privileged"),
    ("podman-container:--privileged", "invalid container id: --privileged"),
    ("docker-container:", "invalid container id: "),
    ("docker-container:_x", "invalid container id: _x"),
    ("docker-container:\u00e9t\u00e9", "invalid container id: \u00e9t\u00e9"),
    ("docker-container:a b", "invalid container id: a b"),
    ("docker:busybox", "tool runtime must name a running container: docker:busybox"),
    ("host", "unknown tool runtime: host"),
])
def test_runtime_refused(spec, message):
    with pytest.raises(ToolCallError) as e:
        rt.make_tools_io({"runtime": spec})
    assert str(e.value) == message
    # a tool call never falls back to the host
    with pytest.raises(ToolCallError):
        TOOLS["exec_shell_command"].invoke({"command": "echo hi", "runtime": spec})


def test_runtime_command_lines():
    assert isinstance(rt.make_tools_io({}), rt.HostIO)
    box = rt.make_tools_io({"runtime": "podman-container:abc_1.x-y", "cwd": "/w"})
    assert isinstance(box, rt.ContainerIO) and box.resolve("f") == "/w/f" and box.resolve("/abs") == "/abs"
    assert box.build_argv(["cat", "--", "/f"], False) == ["podman", "exec", "abc_1.x-y", "cat", "--", "/f"]
    assert box.build_argv(["sh"], True) == ["podman", "exec", "-i", "abc_1.x-y", "sh"]
    ssh = rt.make_tools_io({"runtime": "ssh:user@host-1.example"})
    assert isinstance(ssh, rt.SshIO) and ssh.resolve("rel") == "rel"
    assert ssh.build_argv(["echo", "it's"], False) == [
        "ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no",
        "-o", "StrictHostKeyChecking=yes", "-n", "user@host-1.example", "'echo' 'it'\\''s'"]
    assert "-n" not in ssh.build_argv(["cat"], True)
    hostile = ["a b", "it's", "$(touch x)", "`id`", "\\", "\n", ""]
    out = subprocess.run(["sh", "-c", "printf '%s|' " + rt.shell_quote_join(hostile)], capture_output=True,
                         text=True, check=True).stdout
    assert out == "|".join(hostile) + "|"


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """``docker``/``podman``/``ssh`` stand-ins that run what they are handed here, logging their argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    engine = f"""#!/bin/sh
echo "$*" >> "{log}"
case "$1" in
  exec) shift; [ "$1" = "-i" ] && shift; shift; exec "$@";;
  run) while [ $# -gt 0 ]; do [ "$1" = --cidfile ] && cidfile=$2; shift; done
       [ -n "$FAKE_NO_CID" ] && exec cat > /dev/null
       echo "cid$$" > "$cidfile"; exec cat > /dev/null;;
esac
"""
    ssh = f"""#!/bin/sh
echo "$*" >> "{log}"
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -n) shift;; *) break;; esac; done
shift
exec sh -c "$1"
"""
    for name, text in (("docker", engine), ("podman", engine), ("ssh", ssh)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


@pytest.mark.parametrize("runtime", ["docker-container:abc123", "ssh:me@box"])
def test_isolate_tools_end_to_end(fake_bin, tmp_path, runtime):
    work = tmp_path / "work"
    work.mkdir()
    p = {"runtime": runtime, "cwd": str(work)}
    assert call("write_file", {"path": "d/test.log", "content": "hello container\n", **p})["bytes"] == 16
    assert (work / "d" / "test.log").read_text() == "hello container\n"
    assert call("read_file", {"path": "d/test.log", **p})["plain_text_response"] == "hello container\n"
    assert call("read_file", {"path": "d/test.log", "resp_type": "base64", **p})["size_bytes"] == 16
    assert call_error("read_file", {"path": "nope", **p}) == "cannot stat file: nope"
    (work / "d" / "lines.txt").write_text("1\n2\n3\n4\n")
    assert call("read_file", {"path": "d/lines.txt", "start_line": 2, "end_line": 3, "append_loc": True, **p}) == {
        "plain_text_response": "2\u21922\n3\u21923\n"}
    assert call("read_file", {"path": "d/lines.txt", "start_line": 4, **p})["plain_text_response"] == "4\n"
    os.mkfifo(work / "d" / "fifo")
    assert call_error("edit_file", {"path": "d/fifo", "edits": [{"old_text": "a", "new_text": "b"}], **p}) == \
        "failed to open file: d/fifo (not a regular file)"
    assert call_error("write_file", {"path": "d/fifo", "content": "x", **p}) == "failed to write file: d/fifo"
    assert "hello container" in call("exec_shell_command", {"command": "cat d/test.log", **p})["plain_text_response"]
    call("edit_file", {"path": "d/test.log", "edits": [{"old_text": "hello", "new_text": "bye"}], **p})
    assert (work / "d" / "test.log").read_text() == "bye container\n"
    (work / "build").mkdir()
    (work / "build" / "x.o").write_text("")
    res = call("file_glob_search", {"path": ".", "type": "all", **p})
    assert sorted(e["path"] for e in res["entries"]) == ["build", "d", "d/lines.txt", "d/test.log"]
    assert res["base"] == f"{work}/."
    assert call("file_glob_search", {"path": ".", "max_depth": 1, **p})["entries"] == []
    text = call("grep_search", {"path": ".", "pattern": "bye", **p})["plain_text_response"]
    assert "d/test.log:bye container" in text
    assert call("get_info", p) == {"os": call("get_info", {})["os"], "cwd": str(work)}
    res = call("exec_shell_command", {"command": "sleep 30", "timeout": 1, **p})
    assert res["plain_text_response"] == "\n[exit code: 124]"  # the in-isolate `timeout` ended it
    calls = fake_bin.read_text()
    assert "timeout 1s sh -c" in calls or "'timeout' '1s' 'sh' '-c' 'sleep 30'" in calls
    if runtime.startswith("ssh:"):
        assert "-o BatchMode=yes" in calls and " -n me@box " in calls


def test_tools_runtime_static_specs():
    assert rt.make_tools_runtime("ssh:me@box").spec == "ssh:me@box"
    assert rt.make_tools_runtime("docker-container:abc").spec == "docker-container:abc"
    for spec, message in [("fake:x", "unknown tool runtime: fake:x"), ("ssh:-oX=y", "invalid ssh target: -oX=y"),
                          ("docker:", "--tools-runtime docker:<image> requires an image name"),
                          ("podman:--privileged", "invalid container image: --privileged")]:
        with pytest.raises(ValueError) as e:
            rt.make_tools_runtime(spec)
        assert str(e.value) == message


def test_tools_runtime_spawned_container_lifecycle(fake_bin, monkeypatch):
    runtime = rt.make_tools_runtime("docker:busybox")
    try:
        spec = runtime.spec
        assert spec.startswith("docker-container:cid")
        assert "run --rm -i --cidfile " in fake_bin.read_text() and " busybox sh" in fake_bin.read_text()
        pid = int(spec.removeprefix("docker-container:cid"))
        assert alive(pid)
        assert "hi" in call("exec_shell_command", {"command": "echo hi", "runtime": spec})["plain_text_response"]
        os.kill(pid, signal.SIGKILL)  # the container dies on its own: the next call gets a new one
        assert wait_dead(pid)
        respawned = runtime.spec
        assert respawned != spec
        new_pid = int(respawned.removeprefix("docker-container:cid"))
    finally:
        runtime.close()
    assert wait_dead(new_pid)  # its shell's stdin closed: the container ends (and --rm removes it)
    runtime.close()  # idempotent
    with pytest.raises(ToolCallError):
        _ = runtime.spec


def test_tools_runtime_spawn_failures(fake_bin, monkeypatch):
    monkeypatch.setattr(rt, "CONTAINER_START_TIMEOUT", 0.5)
    monkeypatch.setenv("FAKE_NO_CID", "1")
    with pytest.raises(ValueError, match=r"^timed out waiting for podman container to start \(image: img\)$"):
        rt.make_tools_runtime("podman:img")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match=r"^failed to spawn docker container for tools runtime \(image: img\)$"):
        rt.make_tools_runtime("docker:img")


def test_no_shell_sees_user_paths(tmp_path):
    # a path full of shell syntax is only ever an argument, on the host and in an isolate alike
    evil = tmp_path / "$(touch pwned); `touch pwned2`"
    call("write_file", {"path": str(evil), "content": "x"})
    assert evil.read_text() == "x"
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "pwned").exists()
    assert stat.S_ISREG(evil.stat().st_mode)


def test_run_subprocess_edge_cases(tmp_path):
    # the command closes its stdout yet goes on: the deadline still holds
    start = time.monotonic()
    res = run_subprocess(["sh", "-c", "exec >&- 2>&-; sleep 300"], 100, 1)
    assert res.timed_out and res.exit_code == 1 and time.monotonic() - start < 10
    # a callback that fails does not leave the command behind
    pidfile = tmp_path / "pid"

    def boom(chunk: str) -> bool:
        raise RuntimeError("client write failed")

    with pytest.raises(RuntimeError):
        run_subprocess(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; echo go; wait"], 100, 60, boom)
    assert wait_dead(int(pidfile.read_text()))
    # stdin is fed and closed; split UTF-8 sequences reach the callback whole
    seen: list[str] = []
    res = run_subprocess(["cat"], 100, 10, lambda c: seen.append(c) is None, stdin_data="\u00e9t\u00e9".encode())
    assert res.output == "\u00e9t\u00e9".encode() and "".join(seen) == "\u00e9t\u00e9"
