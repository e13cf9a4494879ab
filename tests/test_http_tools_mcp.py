"""The MCP client behind ``/tools`` (llama-server's ``--mcp-servers-json``), against real child processes
running tests/mcp_fixtures/fake_server.py. Plain functions around ``asyncio.run``; no async plugin."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llama_ctypes.interfaces.http.tools import mcp
from llama_ctypes.interfaces.http.tools.mcp import (
    McpManager,
    McpServerConfig,
    McpTool,
    parse_mcp_config,
    read_mcp_config_file,
)

pytestmark = pytest.mark.timeout(60)

FAKE = str(Path(__file__).resolve().parent / "mcp_fixtures" / "fake_server.py")


def server(name: str, *flags: str, **kw) -> McpServerConfig:
    return McpServerConfig(name, sys.executable, (FAKE, *flags), **kw)


def run(coro_fn, *configs: McpServerConfig, **kw):
    """Start a manager on ``configs``, run ``coro_fn(manager)``, always close it."""
    async def main():
        mgr = McpManager(list(configs), **kw)
        try:
            await mgr.start()
            return await coro_fn(mgr)
        finally:
            await mgr.close()
    return asyncio.run(main())


def gone(pid: int) -> bool:
    """No such process, or a zombie (the container's init may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in "ZX"
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if gone(pid):
            return True
        time.sleep(0.02)
    return False


# --- configuration -------------------------------------------------------------------------------

def test_parse_full_entry_and_defaults():
    cfgs = parse_mcp_config(json.dumps({"mcpServers": {
        "fs": {"command": "npx", "args": ["-y", "srv"], "env": {"K": "v"}, "cwd": "/tmp", "timeout_ms": 1500,
               "type": "stdio", "disabled": False},
        "bare": {"command": "x"},
    }}))
    assert cfgs == [McpServerConfig("fs", "npx", ("-y", "srv"), {"K": "v"}, "/tmp", 1500),
                    McpServerConfig("bare", "x")]
    assert cfgs[0].timeout == 1.5 and cfgs[1].timeout_ms == 30000


def test_parse_lenient_cases_as_llama_server():
    assert parse_mcp_config("{}") == []
    assert parse_mcp_config("[]") == []
    assert parse_mcp_config('{"mcpServers": []}') == []
    # no command (or an empty one, or a URL server) is skipped, not an error
    assert parse_mcp_config('{"mcpServers": {"a": {"args": ["x"]}, "b": {"command": ""}, '
                            '"c": {"url": "http://x"}, "d": {"command": "ok"}}}') == [McpServerConfig("d", "ok")]
    # args that is not an array / env that is not an object is ignored
    assert parse_mcp_config('{"mcpServers": {"a": {"command": "c", "args": "x", "env": 3}}}') == [
        McpServerConfig("a", "c")]
    assert parse_mcp_config('{"mcpServers": {"a": {"command": "c", "timeout_ms": 2.9}}}')[0].timeout_ms == 2


@pytest.mark.parametrize("text", [
    "not valid json", "", '{"mcpServers": {"a": 1}}', '{"mcpServers": {"a": {"command": 5}}}',
    '{"mcpServers": {"a": {"command": "c", "args": [1]}}}', '{"mcpServers": {"a": {"command": "c", "env": {"K": 1}}}}',
    '{"mcpServers": {"a": {"command": "c", "cwd": 1}}}', '{"mcpServers": {"a": {"command": "c", "timeout_ms": "5"}}}',
    '{"mcpServers": {"a": {"command": "c", "timeout_ms": 0}}}',
])
def test_parse_errors(text):
    with pytest.raises(ValueError, match="failed to parse MCP config JSON"):
        parse_mcp_config(text)


def test_config_file(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"echo": {"command": "python3", "args": ["s.py"]}}}))
    assert read_mcp_config_file(path) == [McpServerConfig("echo", "python3", ("s.py",))]
    with pytest.raises(ValueError, match="failed to open MCP config file"):
        read_mcp_config_file(tmp_path / "nonexistent.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="failed to parse"):
        read_mcp_config_file(path)


# --- listing -------------------------------------------------------------------------------------

def test_tools_listed_named_and_shaped():
    async def check(mgr):
        tools = {t.name: t for t in mgr.tools()}
        assert {"echo_echo", "echo_add", "echo2_echo", "echo2_add"} <= set(tools)
        entry = tools["echo_echo"].to_json()
        assert entry["type"] == "mcp" and entry["tool"] == entry["display_name"] == "echo_echo"
        assert entry["permissions"] == {"write": False} and entry["uses_cwd"] is False
        assert entry["definition"] == {"type": "function", "function": {
            "name": "echo_echo", "description": "Echo back the input message",
            "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}}
        assert tools["echo_pid"].definition()["function"]["parameters"] == {}
        assert all(isinstance(t, McpTool) and t.kind == "mcp" for t in tools.values())
        # warm-up shuts its processes down again: nothing runs until a call
        assert mgr._sessions == {}
    run(check, server("echo"), server("echo2"))


def test_paged_listing_and_empty_list_and_duplicate_names():
    async def check(mgr):
        names = [t.name for t in mgr.tools()]
        assert names[:3] == ["paged_echo", "paged_add", "paged_fail_once"] and "paged_params" in names
        assert not [n for n in names if n.startswith("empty_")]
        assert names.count("paged_echo") == 1  # the second "paged" server was skipped
    run(check, server("paged", "--paged"), server("empty", "--empty"), server("paged", "--empty"))


def test_name_collision_between_servers_is_skipped():
    async def check(mgr):
        tools = [t for t in mgr.tools() if t.name == "e_fail_once"]
        assert len(tools) == 1 and tools[0].server == "e" and tools[0].tool == "fail_once"
        assert "e_fail_echo" in [t.name for t in mgr.tools()]
    # server "e" tool "fail_once" and server "e_fail" tool "once" are both "e_fail_once": first wins
    run(check, server("e"), server("e_fail"))


def test_bad_command_and_crash_at_start_leave_others_working():
    async def check(mgr):
        names = [t.name for t in mgr.tools()]
        assert "good_echo" in names
        assert not [n for n in names if n.startswith(("nonexistent_", "dies_", "badcwd_"))]
        assert await mgr.call_tool("nonexistent", "x", {}) == {"error": "MCP server unavailable: nonexistent"}
        assert "error" in await mgr.call_tool("dies", "echo", {})
        assert await mgr.call_tool("good", "echo", {"message": "x"}) == {"plain_text_response": "echo: x"}
    run(check, server("good"), McpServerConfig("nonexistent", "this_executable_does_not_exist_12345"),
        server("dies", "--crash-at-start"), server("badcwd", cwd="/nonexistent/dir"))


def test_silent_server_does_not_hang_start():
    t0 = time.monotonic()
    tools = run(lambda mgr: _tools(mgr), server("silent", "--silent", timeout_ms=400), server("ok"))
    assert time.monotonic() - t0 < 10
    assert "ok_echo" in tools and not [n for n in tools if n.startswith("silent_")]
    # the warm-up cap holds even with the default 30 s request timeout
    t0 = time.monotonic()
    assert run(lambda mgr: _tools(mgr), server("silent", "--silent"), warmup_timeout_s=0.5) == []
    assert time.monotonic() - t0 < 10


def test_warmup_timeout_is_logged_as_a_timeout(caplog):
    caplog.set_level(logging.WARNING, logger="llama_ctypes.interfaces.http.tools.mcp")
    assert run(lambda mgr: _tools(mgr), server("silent", "--silent"), warmup_timeout_s=0.3) == []
    assert "MCP warmup: 'silent': initialize failed: request timed out" in caplog.text
    assert "cancelled" not in caplog.text


async def _tools(mgr):
    return [t.name for t in mgr.tools()]


def test_startup_noise_is_skipped():
    async def check(mgr):
        assert "noisy_echo" in [t.name for t in mgr.tools()]
        assert await mgr.call_tool("noisy", "echo", {"message": "m"}) == {"plain_text_response": "echo: m"}
    run(check, server("noisy", "--startup-noise"))


# --- calls ---------------------------------------------------------------------------------------

def test_invocation_results_and_errors(tmp_path):
    async def check(mgr):
        hello = await mgr.call_tool("e", "echo", {"message": "hello world"})
        assert hello == {"plain_text_response": "echo: hello world"}
        assert await mgr.call_tool("e", "add", {"a": 3, "b": 5}) == {"plain_text_response": "8"}
        assert await mgr.call_tool("e", "is_error", {}) == {"error": "bad input\nsecond"}
        assert await mgr.call_tool("e", "rpc_error", {}) == {"error": "no good"}
        assert await mgr.call_tool("e", "nope", {}) == {"error": "Unknown tool: nope"}
        assert await mgr.call_tool("e", "env", {"name": "MCP_TEST_VAR"}) == {"plain_text_response": "from config"}
        assert await mgr.call_tool("e", "env", {"name": "PATH"}) == {"plain_text_response": os.environ["PATH"]}
        assert await mgr.call_tool("e", "cwd", {}) == {"plain_text_response": str(tmp_path)}
        argv = json.loads((await mgr.call_tool("e", "argv", {}))["plain_text_response"])
        assert argv == ["--extra", "arg"]
        big = await mgr.call_tool("e", "big", {})
        assert len(big["plain_text_response"]) == 1024 * 1024
        assert await mgr.call_tool("missing", "echo", {}) == {"error": "MCP server unavailable: missing"}
    run(check, server("e", "--extra", "arg", env={"MCP_TEST_VAR": "from config"}, cwd=str(tmp_path)))


def test_tool_objects_invoke():
    async def check(mgr):
        tools = {t.name: t for t in mgr.tools()}
        params = {"a": 1, "runtime": "docker-container:x", "resp_type": "text", "cwd": "/w"}
        out = await tools["e_params"].ainvoke(params)
        assert json.loads(out["plain_text_response"]) == {"a": 1, "cwd": "/w"}
        # invoke() from a worker thread bridges to the manager's loop
        res = await asyncio.to_thread(tools["e_echo"].invoke, {"message": "thread"})
        assert res == {"plain_text_response": "echo: thread"}
    run(check, server("e"))


def test_timeout_is_an_error_and_the_server_keeps_running():
    async def check(mgr):
        pid = (await mgr.call_tool("slow", "pid", {}))["plain_text_response"]
        t0 = time.monotonic()
        assert await mgr.call_tool("slow", "sleep", {"seconds": 3}) == {"error": "request timed out"}
        assert time.monotonic() - t0 < 2.5
        assert await mgr.call_tool("slow", "echo", {"message": "still"}) == {"plain_text_response": "echo: still"}
        assert (await mgr.call_tool("slow", "pid", {}))["plain_text_response"] == pid
    run(check, server("slow", timeout_ms=500))


def test_respawn_after_crash_and_exit_mid_call(caplog):
    caplog.set_level(logging.INFO, logger="llama_ctypes.interfaces.http.tools.mcp")

    async def check(mgr):
        pid1 = (await mgr.call_tool("c", "pid", {}))["plain_text_response"]
        assert await mgr.call_tool("c", "crash", {}) == {"plain_text_response": "crashing"}
        # (a call racing the exit itself gets "transport closed", as in llama-server: it was sent)
        await asyncio.sleep(0.3)
        assert await mgr.call_tool("c", "echo", {"message": "hi2"}) == {"plain_text_response": "echo: hi2"}
        pid2 = (await mgr.call_tool("c", "pid", {}))["plain_text_response"]
        assert pid2 != pid1 and wait_gone(int(pid1))
        # a server that died unnoticed (the loop is blocked here): the write fails, a fresh spawn answers
        os.kill(int(pid2), signal.SIGKILL)
        assert wait_gone(int(pid2))
        assert await mgr.call_tool("c", "echo", {"message": "hi3"}) == {"plain_text_response": "echo: hi3"}
        assert "had exited before the call reached it" in caplog.text
        pid2 = (await mgr.call_tool("c", "pid", {}))["plain_text_response"]
        t0 = time.monotonic()
        assert await mgr.call_tool("c", "die", {}) == {"error": "transport closed"}
        assert time.monotonic() - t0 < 5
        assert await mgr.call_tool("c", "echo", {"message": "back"}) == {"plain_text_response": "echo: back"}
        assert (await mgr.call_tool("c", "pid", {}))["plain_text_response"] not in (pid1, pid2)
    run(check, server("c"))


def test_fails_first_call_then_succeeds():
    async def check(mgr):
        assert await mgr.call_tool("e", "fail_once", {}) == {"error": "transient error"}
        assert await mgr.call_tool("e", "fail_once", {}) == {"plain_text_response": "ok"}
    run(check, server("e"))


def test_notifications_server_requests_and_stale_replies_are_not_answers():
    async def check(mgr):
        assert await mgr.call_tool("n", "notify", {"message": "hi"}) == {"plain_text_response": "echo: hi"}
        assert await mgr.call_tool("n", "burst", {}) == {"plain_text_response": "burst ok"}
        assert await mgr.call_tool("n", "pings", {}) == {"plain_text_response": "1"}  # we answered its ping
    run(check, server("n"))


def test_garbage_and_huge_lines_mid_session():
    async def check(mgr):
        assert await mgr.call_tool("g", "noise", {}) == {"plain_text_response": "after noise"}
        assert await mgr.call_tool("g", "echo", {"message": "ok"}) == {"plain_text_response": "echo: ok"}
    run(check, server("g"))


def test_concurrent_and_rapid_calls():
    async def check(mgr):
        results = await asyncio.gather(*(mgr.call_tool("e", "echo", {"message": f"m{i}"}) for i in range(30)))
        assert results == [{"plain_text_response": f"echo: m{i}"} for i in range(30)]
        # a slow call does not hold up the others on the same server
        slow = asyncio.ensure_future(mgr.call_tool("e", "sleep", {"seconds": 1}))
        for i in range(50):
            assert await mgr.call_tool("e", "echo", {"message": f"r{i}"}) == {"plain_text_response": f"echo: r{i}"}
        assert not slow.done()
        assert await slow == {"plain_text_response": "slept"}
        # first calls racing on a server that is not yet spawned start one process, not several
        pids = await asyncio.gather(*(mgr.call_tool("f", "pid", {}) for _ in range(10)))
        assert len({p["plain_text_response"] for p in pids}) == 1
    run(check, server("e"), server("f"))


async def _max_tick_gap(coro, period: float = 0.01):
    """Run ``coro`` beside a ticker; its result and the longest the event loop kept the ticker waiting."""
    gaps: list[float] = []
    done = False

    async def ticker():
        last = time.monotonic()
        while not done:
            await asyncio.sleep(period)
            now = time.monotonic()
            gaps.append(now - last - period)
            last = now

    tick = asyncio.ensure_future(ticker())
    try:
        return await coro, max(gaps, default=0.0)
    finally:
        done = True
        await tick


def test_stderr_flood_does_not_stall_the_loop():
    async def check(mgr):
        t0 = time.monotonic()
        # 50 MiB as 26 M two-byte lines: the loop must not spend itself on every one of them
        res, gap = await _max_tick_gap(mgr.call_tool("s", "flood", {"mb": 50, "line": 2}))
        assert res == {"plain_text_response": "flooded"}
        assert gap < 0.5 and time.monotonic() - t0 < 20
        assert mgr._sessions["s"].diagnostics().endswith("e\nflood done")  # the tail is kept
    run(check, server("s", timeout_ms=20_000))


def test_stderr_is_logged_sparingly_when_debugging(caplog):
    caplog.set_level(logging.DEBUG, logger="llama_ctypes.interfaces.http.tools.mcp")

    async def check(mgr):
        assert await mgr.call_tool("s", "flood", {"mb": 2, "line": 20}) == {"plain_text_response": "flooded"}
    run(check, server("s"))
    lines = [r for r in caplog.records if "stderr" in r.getMessage()]
    assert 1 <= len(lines) < 20  # 100 k lines of stderr: a few summarized records, not one per line


def test_notification_flood_does_not_stall_the_loop():
    async def check(mgr):
        res, gap = await _max_tick_gap(mgr.call_tool("n", "notify_flood", {"count": 200_000}))
        assert res == {"plain_text_response": "notified"} and gap < 0.5
    run(check, server("n"))


# --- shutdown ------------------------------------------------------------------------------------

def test_close_during_call_then_call_after_close(tmp_path):
    gc_file = tmp_path / "gc.pid"

    async def main():
        mgr = McpManager([server("s", "--grandchild", str(gc_file))])
        await mgr.start()
        assert "s_sleep" in [t.name for t in mgr.tools()]
        warm_gc = int(gc_file.read_text())
        pid = int((await mgr.call_tool("s", "pid", {}))["plain_text_response"])
        gc_pid = int(gc_file.read_text())
        assert gc_pid != warm_gc
        call = asyncio.ensure_future(mgr.call_tool("s", "sleep", {"seconds": 30}))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await mgr.close()
        assert time.monotonic() - t0 < 3
        assert await asyncio.wait_for(call, 2) == {"error": "cancelled"}
        await mgr.close()  # idempotent
        t0 = time.monotonic()
        assert await mgr.call_tool("s", "echo", {"message": "x"}) == {"error": "MCP server unavailable: s"}
        assert time.monotonic() - t0 < 1
        return pid, gc_pid, warm_gc
    pid, gc_pid, warm_gc = asyncio.run(main())
    assert wait_gone(pid) and wait_gone(gc_pid) and wait_gone(warm_gc)


def test_exit_while_a_grandchild_holds_stdout(tmp_path):
    gc_file = tmp_path / "gc.pid"

    async def check(mgr):
        t0 = time.monotonic()
        assert await mgr.call_tool("g", "die", {}) == {"error": "transport closed"}
        assert time.monotonic() - t0 < 5  # not the 30 s request timeout: no EOF comes, the exit is seen
        gc_pid = int(gc_file.read_text())
        assert await mgr.call_tool("g", "echo", {"message": "again"}) == {"plain_text_response": "echo: again"}
        assert wait_gone(gc_pid)  # the respawn killed the dead server's process group
    run(check, server("g", "--grandchild", str(gc_file)))


def test_kill_tree_spares_a_group_that_reused_a_reaped_pid():
    # a server reaped long ago whose pid now leads someone else's process group: that group is not ours
    victim = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        stale = SimpleNamespace(pid=victim.pid, returncode=0)
        asyncio.run(mcp._kill_tree(stale))  # type: ignore[arg-type]
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_close_during_start_kills_warmup():
    async def main():
        mgr = McpManager([server("silent", "--silent")])
        start = asyncio.ensure_future(mgr.start())
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await mgr.close()
        await asyncio.wait_for(start, 3)
        assert time.monotonic() - t0 < 3
        assert mgr.tools() == []
    asyncio.run(main())


def test_invoke_from_thread_after_loop_stopped():
    holder = {}

    async def check(mgr):
        holder["tool"] = next(t for t in mgr.tools() if t.name == "e_echo")
    run(check, server("e"))
    with pytest.raises(RuntimeError, match="not running"):
        holder["tool"].invoke({"message": "x"})


def test_empty_manager():
    async def check(mgr):
        assert mgr.empty and mgr.tools() == []
        return await mgr.call_tool("x", "y", {})
    assert run(check) == {"error": "MCP server unavailable: x"}
