"""Where the built-in tools' I/O runs: the host, or an isolate (a container, an ssh host), as llama-server.

A tool call names its runtime in ``params["runtime"]`` (the ``x-tool-runtime`` header, else the
``--tools-runtime`` spec): empty is the host; ``docker-container:<id>`` / ``podman-container:<id>`` attach to a
running container; ``ssh:<target>`` runs on a remote account. ``--tools-runtime docker:<image>`` (or podman)
spawns a container owned by :class:`ToolsRuntime` and removed by its ``close()``. An isolate is driven through
its exec'd shell only (``sh``, ``cat``, ``wc``, ``find``, ``timeout``), and user strings never reach a shell
other than as ``"$1"``-style arguments, except the command of ``exec_shell_command`` itself.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from .base import ToolCallError
from .files import (
    GIT_LS_FILES_MAX_OUTPUT,
    LIST_ENTRIES_TIMEOUT,
    ListEntry,
    ListKind,
    ListResult,
    entry_depth,
    find_command,
    split_lines,
    walk_entries,
)
from .process import ChunkFn, ExecResult, run_subprocess

log = logging.getLogger(__name__)

#: Timeout of an isolate's auxiliary calls (stat, mkdir, ls helpers), seconds.
ISOLATE_EXEC_TIMEOUT = 15
#: Largest file an isolate's ``cat`` may return, bytes.
ISOLATE_READ_FILE_MAX_SIZE = 64 * 1024 * 1024
#: How far a line-range read may scan for its first line before giving up, bytes (a sparse file can be 1 TB).
READ_LINES_MAX_SCAN = 1024 * 1024 * 1024
_READ_CHUNK = 1 << 16
_ENGINES = ("docker", "podman")  # they take the same verbs, so one code path drives both


class FileTooLarge(Exception):
    """A read refused because the file is over the caller's cap; ``size`` is -1 where it is unknown."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"file too large ({size} bytes, max {limit})" if size >= 0 else
                         f"file too large (max {limit} bytes)")
        self.size, self.limit = size, limit


# --- tool I/O --------------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _home() -> str:
    # read once, as llama-server does
    return os.environ.get("HOME") or os.environ.get("USERPROFILE") or ""


def expand_home(path: str) -> str:
    """A leading ``~`` or ``~/`` made the home directory; ``~user`` is left alone."""
    if not path.startswith("~") or (len(path) > 1 and path[1] not in "/\\"):
        return path
    home = _home()
    return home + path[1:] if home else path


class ToolsIO(abc.ABC):
    """Where one tool call does its I/O. Paths are resolved against ``cwd`` (the ``x-tool-cwd`` header)."""

    def __init__(self, cwd: str = "") -> None:
        self.cwd = cwd

    @abc.abstractmethod
    def resolve(self, path: str) -> str:
        """``path`` against the working directory; an absolute path is returned as is."""

    @abc.abstractmethod
    def is_directory(self, path: str) -> bool:
        """Whether ``path`` is a directory."""

    @abc.abstractmethod
    def is_regular_file(self, path: str) -> bool:
        """Whether ``path`` is a regular file (links followed)."""

    @abc.abstractmethod
    def file_size(self, path: str) -> int | None:
        """Size in bytes of a regular file, or None."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` names anything (links followed)."""

    @abc.abstractmethod
    def read_file(self, path: str, max_size: int | None = None) -> bytes | None:
        """The bytes of a regular file, or None (no such file, not a regular file, unreadable). Raises
        :class:`FileTooLarge` when the file is over ``max_size`` bytes, read no further than that."""

    @abc.abstractmethod
    def read_lines(self, path: str, start_line: int, end_line: int, max_bytes: int) -> bytes | None:
        """Lines ``start_line``..``end_line`` (1-based, inclusive; ``end_line`` -1: to the end) of a regular
        file as they are in it, at most ``max_bytes`` of them; the file is read no further than needed.
        None as :meth:`read_file`; :class:`FileTooLarge` when the first line lies too far in."""

    @abc.abstractmethod
    def write_file(self, path: str, content: bytes) -> bool:
        """Create or overwrite the file (parent directories too); False on failure, or when ``path`` exists and
        is not a regular file (writing to a FIFO blocks, to a device makes no file)."""

    @abc.abstractmethod
    def list_entries(self, base: str, max_depth: int, kind: ListKind) -> ListResult:
        """Entries under ``base`` (already resolved): ``git ls-files`` for files (honours .gitignore), else a
        walk that skips junk directories. ``max_depth`` 0 is unlimited, 1 direct children only."""

    @abc.abstractmethod
    def run(self, argv: Sequence[str], max_output: int, timeout_s: int, on_chunk: ChunkFn | None = None,
            should_stop: Callable[[], bool] | None = None) -> ExecResult:
        """Run ``argv`` in the working directory, stdout and stderr combined."""


class HostIO(ToolsIO):
    """The tools run on the server's own machine, as the server's user."""

    def resolve(self, path: str) -> str:
        """``~`` expanded, joined to ``cwd`` (else the process's working directory), normalized lexically."""
        p = expand_home(path)
        if not os.path.isabs(p):
            try:
                p = os.path.join(self.cwd or os.getcwd(), p)
            except OSError:  # the server's own working directory is gone
                return p
        p = os.path.normpath(p)
        return p.replace("\\", "/") if os.name == "nt" else p

    def is_directory(self, path: str) -> bool:
        return os.path.isdir(self.resolve(path))

    def is_regular_file(self, path: str) -> bool:
        return os.path.isfile(self.resolve(path))

    def file_size(self, path: str) -> int | None:
        try:
            st = os.stat(self.resolve(path))
        except (OSError, ValueError):
            return None
        # like std::filesystem::file_size: a directory, a FIFO or a device has no size (and /dev/zero no end)
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def exists(self, path: str) -> bool:
        return os.path.exists(self.resolve(path))

    def _open_regular(self, path: str) -> Any:
        """A binary reader on a regular file, or None. Checked before opening (opening a FIFO blocks, a device
        may act), and again on the open file, which O_NONBLOCK keeps from blocking if the path was swapped."""
        target = self.resolve(path)
        try:
            if not stat.S_ISREG(os.stat(target).st_mode):
                return None
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        except (OSError, ValueError):
            return None
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            return None
        return f

    def read_file(self, path: str, max_size: int | None = None) -> bytes | None:
        f = self._open_regular(path)
        if f is None:
            return None
        with f:
            try:
                if max_size is None:
                    return f.read()
                size = os.fstat(f.fileno()).st_size
                data = f.read(max_size + 1) if size <= max_size else b""
                if size > max_size or len(data) > max_size:  # grown since the stat
                    raise FileTooLarge(max(size, len(data)), max_size)
                return data
            except OSError:
                return None

    def read_lines(self, path: str, start_line: int, end_line: int, max_bytes: int) -> bytes | None:
        f = self._open_regular(path)
        if f is None:
            return None
        start_line = max(1, start_line)
        out = bytearray()
        lineno, scanned = 1, 0
        with f:
            try:
                while len(out) < max_bytes and (end_line == -1 or lineno <= end_line):
                    chunk = f.read(_READ_CHUNK)
                    if not chunk:
                        break
                    newlines = chunk.count(b"\n")
                    if lineno + newlines < start_line:  # the whole chunk lies before the range
                        lineno += newlines
                        scanned += len(chunk)
                        if scanned > READ_LINES_MAX_SCAN:
                            raise FileTooLarge(-1, READ_LINES_MAX_SCAN)
                        continue
                    pos = 0
                    while pos < len(chunk) and len(out) < max_bytes and (end_line == -1 or lineno <= end_line):
                        nl = chunk.find(b"\n", pos)
                        stop = len(chunk) if nl < 0 else nl + 1
                        if lineno >= start_line:
                            out += chunk[pos:min(stop, pos + max_bytes - len(out))]
                        if nl < 0:
                            break
                        lineno, pos = lineno + 1, stop
            except OSError:
                return None
        return bytes(out)

    def write_file(self, path: str, content: bytes) -> bool:
        target = self.resolve(path)
        try:
            if os.path.exists(target) and not os.path.isfile(target):
                return False
            parent = os.path.dirname(target)
            if parent:
                os.makedirs(parent, exist_ok=True)
            # O_NONBLOCK: a FIFO swapped in after the check fails to open (no reader) instead of blocking
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NONBLOCK", 0)
                         | getattr(os, "O_BINARY", 0), 0o666)
            with os.fdopen(fd, "wb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return False
                f.write(content)
            return True
        except (OSError, ValueError):
            return False

    def list_entries(self, base: str, max_depth: int, kind: ListKind) -> ListResult:
        if not os.path.isdir(base):
            return ListResult(err="path does not exist or is not a directory")
        deadline = time.monotonic() + LIST_ENTRIES_TIMEOUT
        # git ls-files cannot list directories; the walker does when they are asked for
        if kind is ListKind.FILES:
            res = self.run(["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"],
                           GIT_LS_FILES_MAX_OUTPUT, LIST_ENTRIES_TIMEOUT)
            if res.exit_code == 0 and not res.timed_out:
                text = res.output.decode("utf-8", "surrogateescape")
                out = ListResult()
                for rel in split_lines(text, strip_dot_slash=False):
                    if max_depth > 0 and entry_depth(rel) > max_depth:
                        continue
                    if os.path.isfile(os.path.join(base, rel)):
                        out.entries.append(ListEntry(rel, False))
                return out
        entries, truncated = walk_entries(base, max_depth, kind, deadline)
        return ListResult(entries, truncated=truncated)

    def run(self, argv: Sequence[str], max_output: int, timeout_s: int, on_chunk: ChunkFn | None = None,
            should_stop: Callable[[], bool] | None = None) -> ExecResult:
        return run_subprocess(argv, max_output, timeout_s, on_chunk, cwd=self.cwd, should_stop=should_stop)


def shell_quote_join(argv: Sequence[str]) -> str:
    """``argv`` quoted into one string a POSIX shell re-parses into exactly ``argv``."""
    return " ".join("'" + arg.replace("'", "'\\''") + "'" for arg in argv)


class IsolateIO(ToolsIO):
    """Every operation as a command in an isolate, which must offer sh, cat, wc, mkdir, dirname, find, timeout.
    Isolate paths are POSIX; relative ones are joined to ``cwd`` when set, else left to the isolate."""

    @abc.abstractmethod
    def build_argv(self, inner: Sequence[str], needs_stdin: bool) -> list[str]:
        """The host-side argv that runs ``inner`` (a complete POSIX argv) in the isolate."""

    def resolve(self, path: str) -> str:
        if not self.cwd or path.startswith("/"):
            return path
        return f"{self.cwd}/{path}"

    def _exec(self, inner: Sequence[str], max_output: int, combine_stderr: bool = True) -> ExecResult:
        return run_subprocess(self.build_argv(inner, False), max_output, ISOLATE_EXEC_TIMEOUT,
                              combine_stderr=combine_stderr)

    def _test(self, flag: str, path: str) -> bool:
        res = self._exec(["sh", "-c", f'[ {flag} "$1" ]', "_", path], 4096)
        return res.exit_code == 0 and not res.timed_out

    def is_directory(self, path: str) -> bool:
        return self._test("-d", self.resolve(path))

    def is_regular_file(self, path: str) -> bool:
        return self._test("-f", self.resolve(path))

    def exists(self, path: str) -> bool:
        return self._test("-e", self.resolve(path))

    def file_size(self, path: str) -> int | None:
        # `-f` first: wc on a FIFO would block until the timeout, on /dev/zero read until it
        res = self._exec(["sh", "-c", '[ -f "$1" ] && wc -c < "$1"', "_", self.resolve(path)], 64)
        if res.exit_code != 0 or res.timed_out:
            return None
        m = re.match(rb"\s*(\d+)", res.output)
        return int(m.group(1)) if m else None

    def read_file(self, path: str, max_size: int | None = None) -> bytes | None:
        # one byte past the cap tells a file over it; head stops there, so a huge file is not streamed whole.
        # stderr must not be spliced into the file's bytes
        limit = min(max_size, ISOLATE_READ_FILE_MAX_SIZE) if max_size is not None else ISOLATE_READ_FILE_MAX_SIZE
        res = self._exec(["sh", "-c", '[ -f "$1" ] && exec head -c "$2" -- "$1"', "_", self.resolve(path),
                          str(limit + 1)], limit + 1, combine_stderr=False)
        if res.exit_code != 0 or res.timed_out:
            return None
        if len(res.output) > limit:
            if max_size is None:  # no cap asked for, but a partial file must not pass for the whole
                return None
            raise FileTooLarge(-1, limit)
        return res.output

    def read_lines(self, path: str, start_line: int, end_line: int, max_bytes: int) -> bytes | None:
        start_line = max(1, start_line)
        if end_line != -1 and end_line < start_line:
            return b"" if self.is_regular_file(path) else None
        # sed quits after the range, head after max_bytes; the timeout bounds a scan for a far first line
        script = f"{start_line},{end_line}p;{end_line}q" if end_line != -1 else f"{start_line},$p"
        res = self._exec(["sh", "-c", '[ -f "$1" ] && sed -n "$2" -- "$1" | head -c "$3"', "_",
                          self.resolve(path), script, str(max_bytes)], max_bytes, combine_stderr=False)
        return None if res.exit_code != 0 or res.timed_out else res.output

    def write_file(self, path: str, content: bytes) -> bool:
        # the content travels on stdin: no argv for the far side to re-parse, no temp file on the host
        inner = ["sh", "-c", 'mkdir -p "$(dirname "$1")" && { [ ! -e "$1" ] || [ -f "$1" ]; } && cat > "$1"', "_",
                 self.resolve(path)]
        res = run_subprocess(self.build_argv(inner, True), 4096, ISOLATE_EXEC_TIMEOUT, stdin_data=content)
        return res.exit_code == 0 and not res.timed_out

    def list_entries(self, base: str, max_depth: int, kind: ListKind) -> ListResult:
        abs_base = self.resolve(base)
        if not self.is_directory(base):
            return ListResult(err="path does not exist or is not a directory")
        out = ListResult()
        if kind is ListKind.FILES:
            res = self._exec(["sh", "-c", 'cd "$1" && git ls-files --cached --others --exclude-standard',
                              "_", abs_base], GIT_LS_FILES_MAX_OUTPUT)
            if res.exit_code == 0 and not res.timed_out:
                out.entries = [ListEntry(rel, False) for rel in split_lines(res.text, strip_dot_slash=False)
                               if max_depth <= 0 or entry_depth(rel) <= max_depth]
                return out
        for dirs in (True, False):
            if (kind is ListKind.FILES and dirs) or (kind is ListKind.DIRS and not dirs):
                continue
            res = self._exec(["sh", "-c", find_command(max_depth, dirs), "_", abs_base], GIT_LS_FILES_MAX_OUTPUT)
            out.truncated = out.truncated or res.timed_out
            out.entries += [ListEntry(rel, dirs) for rel in split_lines(res.text, strip_dot_slash=True)]
        return out

    def _with_cwd(self, inner: list[str]) -> list[str]:
        # not every transport has a `-w`; the command changes directory itself (127: could not run)
        if not self.cwd:
            return inner
        return ["sh", "-c", 'cd "$1" || exit 127; shift; exec "$@"', "_", self.cwd, *inner]

    def run(self, argv: Sequence[str], max_output: int, timeout_s: int, on_chunk: ChunkFn | None = None,
            should_stop: Callable[[], bool] | None = None) -> ExecResult:
        # killing the host-side client does not kill the tree in the isolate: `timeout` runs in there, and the
        # host waits 5 s more so that the in-isolate one can end it cleanly first
        inner = ["timeout", f"{timeout_s}s", *argv]
        return run_subprocess(self.build_argv(self._with_cwd(inner), True), max_output, timeout_s + 5, on_chunk,
                              should_stop=should_stop)


class ContainerIO(IsolateIO):
    """A running container driven through ``<engine> exec`` (docker and podman take the same verbs)."""

    def __init__(self, engine: str, container_id: str, cwd: str = "") -> None:
        super().__init__(cwd)
        self.engine = engine
        self.container_id = container_id

    def build_argv(self, inner: Sequence[str], needs_stdin: bool) -> list[str]:
        return [self.engine, "exec", *(["-i"] if needs_stdin else []), self.container_id, *inner]


#: ssh options that never prompt (there is no console): key-based auth, host key trusted beforehand.
SSH_OPTIONS: tuple[str, ...] = (
    "-o", "BatchMode=yes",
    "-o", "PasswordAuthentication=no",
    "-o", "KbdInteractiveAuthentication=no",
    "-o", "StrictHostKeyChecking=yes",
)


class SshIO(IsolateIO):
    """A remote account over ssh. This is remoting, not isolation: the tools can do what that account can."""

    def __init__(self, target: str, cwd: str = "") -> None:
        super().__init__(cwd)
        self.target = target

    def build_argv(self, inner: Sequence[str], needs_stdin: bool) -> list[str]:
        # the remote shell re-parses the command line, so `inner` travels as one quoted word
        return ["ssh", *SSH_OPTIONS, *([] if needs_stdin else ["-n"]), self.target, shell_quote_join(inner)]


# --- runtime specs ---------------------------------------------------------------------------------------------

def _ascii_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def is_valid_container_id(cid: str) -> bool:
    """An id or name that cannot pass for an engine option (``--privileged``): ASCII alnum first, then
    alnum, '.', '-' or '_'."""
    return bool(cid) and _ascii_alnum(cid[0]) and all(_ascii_alnum(c) or c in ".-_" for c in cid)


def is_valid_ssh_target(target: str) -> bool:
    """A ``[user@]host`` that cannot pass for an ssh option (``-oProxyCommand=...`` runs on the host)."""
    return bool(target) and not target.startswith("-") and all(_ascii_alnum(c) or c in ".-_@" for c in target)


def parse_container_spec(spec: str) -> tuple[str, str, bool] | None:
    """``(engine, image_or_id, attach)`` for ``<engine>-container:<id>`` (attach) or ``<engine>:<image>``
    (spawn), else None."""
    for engine in _ENGINES:
        if spec.startswith(f"{engine}-container:"):
            return engine, spec[len(engine) + len("-container:"):], True
        if spec.startswith(f"{engine}:"):
            return engine, spec[len(engine) + 1:], False
    return None


def make_tools_io(params: dict[str, Any]) -> ToolsIO:
    """The I/O of one tool call, from its ``cwd`` and ``runtime`` params. Raises :class:`ToolCallError` with
    llama-server's message for a runtime it refuses; a named runtime never falls back to the host."""
    cwd = params.get("cwd") if isinstance(params.get("cwd"), str) else ""
    runtime = params.get("runtime") if isinstance(params.get("runtime"), str) else ""
    if not runtime:
        return HostIO(cwd)
    container = parse_container_spec(runtime)
    if container is not None:
        engine, arg, attach = container
        if not attach:  # spawning belongs to the runtime that owns the container, a tool call only attaches
            raise ToolCallError(f"tool runtime must name a running container: {runtime}")
        if not is_valid_container_id(arg):
            raise ToolCallError(f"invalid container id: {arg}")
        return ContainerIO(engine, arg, cwd)
    if runtime.startswith("ssh:"):
        target = runtime[len("ssh:"):]
        if not is_valid_ssh_target(target):
            raise ToolCallError(f"invalid ssh target: {target}")
        return SshIO(target, cwd)
    raise ToolCallError(f"unknown tool runtime: {runtime}")


class ToolsRuntime:
    """``--tools-runtime``: an existing target (validated once), passed through to every tool call."""

    def __init__(self, spec: str) -> None:
        self._spec = spec

    @property
    def spec(self) -> str:
        """The runtime string a tool call gets in ``params["runtime"]``."""
        return self._spec

    def close(self) -> None:
        """Release what the runtime owns (nothing here); idempotent."""


#: How long a spawned container may take to write its id, seconds.
CONTAINER_START_TIMEOUT = 10.0
#: How long ``close()`` waits for the container's shell to end before forcing it, seconds.
CONTAINER_STOP_TIMEOUT = 30.0


class ContainerToolsRuntime(ToolsRuntime):
    """``--tools-runtime <engine>:<image>``: runs ``<engine> run --rm -i <image> sh`` and keeps its stdin open,
    so the shell (the container's pid 1) blocks reading it; closing stdin ends it and ``--rm`` removes it.
    A container that died on its own is respawned when the spec is next asked for."""

    def __init__(self, engine: str, image: str) -> None:
        super().__init__("")
        self.engine, self.image = engine, image
        self.container_id = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._spawn()

    def _spawn(self) -> None:
        self._reap()
        # a private directory: the cid file must not exist beforehand, and nobody else may plant it
        with tempfile.TemporaryDirectory(prefix="llama-tools-runtime-") as tmp:
            cidfile = os.path.join(tmp, "cid")
            argv = [self.engine, "run", "--rm", "-i", "--cidfile", cidfile, self.image, "sh"]
            try:
                self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)
            except OSError as e:
                raise ValueError(f"failed to spawn {self.engine} container for tools runtime "
                                 f"(image: {self.image})") from e
            cid = ""
            deadline = time.monotonic() + CONTAINER_START_TIMEOUT
            while not cid and time.monotonic() < deadline:
                try:
                    with open(cidfile, encoding="utf-8") as f:
                        cid = f.readline().strip()
                except OSError:
                    pass
                if not cid:
                    time.sleep(0.1)
        if not cid:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            raise ValueError(f"timed out waiting for {self.engine} container to start (image: {self.image})")
        self.container_id = cid
        log.info("%s tools runtime container %s started (image: %s)", self.engine, cid, self.image)

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=CONTAINER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("%s tools runtime container %s did not stop, removing it", self.engine, self.container_id)
            proc.kill()
            proc.wait()
            if self.container_id and shutil.which(self.engine):
                subprocess.run([self.engine, "rm", "-f", self.container_id], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=CONTAINER_STOP_TIMEOUT, check=False)

    @property
    def spec(self) -> str:
        """``<engine>-container:<id>`` of a running container (respawned if it died; ValueError if it cannot)."""
        with self._lock:
            if self._closed:
                raise ToolCallError("tools runtime is closed")
            if self._proc is None or self._proc.poll() is not None:
                log.warning("%s tools runtime container \"%s\" died, respawning", self.engine, self.container_id)
                try:
                    self._spawn()
                except ValueError as e:
                    raise ToolCallError(str(e)) from None
            return f"{self.engine}-container:{self.container_id}"

    def close(self) -> None:
        """Stop the container (closing its shell's stdin; ``--rm`` removes it); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reap()


def make_tools_runtime(spec: str) -> ToolsRuntime:
    """The ``--tools-runtime`` object: ``<engine>:<image>`` spawns and owns a container; anything else names an
    existing target whose spec is only validated here. Raises ValueError with llama-server's message."""
    parsed = parse_container_spec(spec)
    if parsed is not None and not parsed[2]:
        engine, image, _ = parsed
        if not image:
            raise ValueError(f"--tools-runtime {engine}:<image> requires an image name")
        if image.startswith("-"):  # it lands on `<engine> run`'s command line, where it would be an option
            raise ValueError(f"invalid container image: {image}")
        return ContainerToolsRuntime(engine, image)
    try:
        make_tools_io({"runtime": spec})
    except ToolCallError as e:
        raise ValueError(str(e)) from None
    return ToolsRuntime(spec)

