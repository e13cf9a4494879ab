"""Running one command for a tool: output capped, deadline kept, the whole process group killed at the end.

llama-server's ``run_subprocess``, in Python: stdout and stderr combined (unless told otherwise), raw reads so that
output streams as soon as it is ready, the pipe drained past the cap so the child never blocks on it. Running
commands are registered, so that :func:`kill_running` can end them all when the server stops.
"""

from __future__ import annotations

import codecs
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ChunkFn = Callable[[str], bool]
"""Receives each chunk of output as it is read; returning False kills the process (the client has gone)."""

#: How often a running command checks its deadline and its ``should_stop``, seconds.
_POLL_S = 0.1
#: How long to keep draining a killed command's pipe: a process that left the group may hold it, seconds.
_DRAIN_AFTER_KILL_S = 2.0
_TRUNCATED = b"\n[output truncated]"
#: Longest pause between two checks whether a command whose pipe closed has exited, seconds.
_REAP_POLL_MAX_S = 0.05


@dataclass
class ExecResult:
    """A finished command: raw output (stdout+stderr unless told otherwise), its exit code (-1 when it could
    not start, 1 when a signal ended it, as llama-server reports), and whether the timeout killed it."""

    output: bytes = b""
    exit_code: int = -1
    timed_out: bool = False

    @property
    def text(self) -> str:
        """The output as text, invalid UTF-8 replaced."""
        return self.output.decode("utf-8", "replace")


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the command and everything it started (its own process group), as far as it is still there."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass


class _Live:
    """A command :func:`run_subprocess` has started and not yet reaped."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.aborted = threading.Event()  # set by kill_running: stop waiting for the pipe


# Live commands by pid. A command is reaped only under this lock (see _poll), and kill_running signals only
# under it, so a group is never signalled after its leader's pid was freed for reuse.
_live_lock = threading.Lock()
_live: dict[int, _Live] = {}


def kill_running() -> int:
    """SIGKILL the process group of every command :func:`run_subprocess` is running (the server is stopping);
    their calls return soon after, as killed ones. Returns how many groups were signalled."""
    with _live_lock:
        live = [entry for entry in _live.values() if entry.proc.returncode is None]
        for entry in live:
            entry.aborted.set()
            _kill_tree(entry.proc)
    if live:
        log.info("killed %d running tool command(s)", len(live))
    return len(live)


def _poll(entry: _Live) -> int | None:
    """Reap the command if it has exited (dropping it from the registry); its exit code, else None."""
    with _live_lock:
        code = entry.proc.poll()
        if code is not None:
            _live.pop(entry.proc.pid, None)
        return code


def _reader(stream: Any, chunks: queue.Queue[bytes | None]) -> None:
    # raw reads, not lines: output may hold NUL and must arrive as soon as it is ready. The pipe is closed here,
    # never by the caller, which may stop waiting while a process that left the group still holds the pipe
    try:
        while data := os.read(stream.fileno(), 4096):
            chunks.put(data)
    except OSError:
        pass
    finally:
        stream.close()
        chunks.put(None)


def _feed(stream: Any, data: bytes) -> None:
    try:
        if data:
            stream.write(data)
        stream.close()
    except OSError:  # a short write is no error by itself, the exit code decides
        pass


def run_subprocess(argv: Sequence[str], max_output: int, timeout_s: float, on_chunk: ChunkFn | None = None, *,
                   combine_stderr: bool = True, cwd: str = "", stdin_data: bytes | None = None,
                   should_stop: Callable[[], bool] | None = None) -> ExecResult:
    """Run ``argv`` (no shell), capturing at most ``max_output`` bytes; past the cap the pipe is still drained
    (else the child blocks) and ``"\\n[output truncated]"`` is appended. ``timeout_s`` (seconds), a true
    ``should_stop()`` or :func:`kill_running` kills its whole process group; ``on_chunk`` sees the kept output
    as it arrives (decoded UTF-8). ``stdin_data`` is written to the child's stdin, then closed (empty when None)."""
    popen_kw: dict[str, Any] = {}
    if os.name == "posix":
        popen_kw["start_new_session"] = True  # its own process group, so a kill reaches what it spawned
    else:
        popen_kw["creationflags"] = getattr(subprocess, "CREATE_NO_WINDOW", 0)
    try:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if combine_stderr else subprocess.DEVNULL,
            stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE,
            cwd=cwd or None, **popen_kw)
    except (OSError, ValueError) as e:
        log.debug("cannot spawn %s: %s", argv[:1], e)
        return ExecResult(b"failed to spawn process", -1)

    entry = _Live(proc)
    with _live_lock:
        _live[proc.pid] = entry
    chunks: queue.Queue[bytes | None] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, chunks), daemon=True).start()
    if stdin_data is not None:
        threading.Thread(target=_feed, args=(proc.stdin, stdin_data), daemon=True).start()

    deadline = time.monotonic() + timeout_s
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    output = bytearray()
    truncated = timed_out = killed = False
    drain_until = float("inf")

    def kill() -> None:
        nonlocal killed, drain_until
        # only this thread reaps, so an unset returncode means the group id is still the command's
        if not killed and proc.returncode is None:
            killed = True
            _kill_tree(proc)
            drain_until = time.monotonic() + _DRAIN_AFTER_KILL_S

    def push(data: bytes) -> bool:
        text = decoder.decode(data, final=not data)
        return on_chunk is None or not text or on_chunk(text)

    def stop_asked() -> bool:
        return entry.aborted.is_set() or (should_stop is not None and should_stop())

    def reap() -> int:
        # Popen.wait() would reap outside _live_lock; poll under it instead, backing off as wait() does
        nonlocal timed_out
        delay = 0.0005
        while (code := _poll(entry)) is None:
            if not killed and time.monotonic() >= deadline:
                timed_out = True
                kill()
            elif not killed and stop_asked():
                kill()
            time.sleep(delay)
            delay = min(delay * 2, _REAP_POLL_MAX_S)
        return code

    try:
        while True:
            now = time.monotonic()
            if not killed and now >= deadline:
                timed_out = True
                kill()
            if not killed and stop_asked():
                kill()
                break
            if now >= drain_until:
                break
            try:
                data = chunks.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if data is None:
                break
            if truncated:
                continue
            if len(output) + len(data) <= max_output:
                output += data
                if not push(data):
                    kill()
                    break
            else:
                data = data[:max(0, max_output - len(output))]
                output += data
                if data:
                    push(data)
                truncated = True

        # the pipe is closed, yet the command may still run (it closed its stdout): keep the deadline
        code = reap()
    except BaseException:
        # a failing callback (or an interrupt) must not leave the command running
        kill()
        while _poll(entry) is None:
            time.sleep(0.01)
        raise
    if on_chunk is not None and not killed:
        push(b"")  # flush a truncated UTF-8 sequence at the very end
    result = bytes(output) + (_TRUNCATED if truncated else b"")
    # llama-server's process library reports EXIT_FAILURE for a command a signal ended
    return ExecResult(result, 1 if code < 0 else code, timed_out)
