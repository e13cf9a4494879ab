"""Regular expressions from strangers, matched in a child interpreter that a deadline can kill.

Python's ``re`` backtracks, and one ``search`` is one C call that holds the GIL until it returns: the
pattern ``(a+)+$`` against a line of 27 ``a`` and a ``!`` takes seconds (each extra ``a`` doubles it),
and meanwhile every thread of the process waits — an HTTP server's event loop, its models' scheduler
threads. Nothing in the process can interrupt it. So a pattern a request supplies (``grep_search``'s
``pattern``, a JSON schema's ``pattern`` checked against its ``enum`` values) is matched here: in a
separate ``python -I -S`` that imports only the standard library, one per :class:`RegexWorker`. The
caller's thread waits on a pipe (GIL released) and kills the child at its deadline or as soon as its
``should_stop()`` says the client has gone; the child also carries a ``SIGALRM`` (default action:
terminate, which no C loop can delay) so that it dies with its search even if the caller is gone, and
an address-space limit so that a search cannot exhaust the machine's memory.

Why a process and not a linear-time engine: ``google-re2`` installs as a wheel here, but RE2 refuses
backreferences and lookahead, which llama-server's ``grep_search`` accepts (``std::regex`` with
ECMAScript syntax), so it would turn valid patterns into errors; Python's ``re`` reads ECMAScript's
syntax nearly as written (lookahead, backreferences, ``\\d``, classes, lazy quantifiers). A process
keeps that, adds no compiled dependency, and can be stopped mid-match. Its cost is one interpreter
start per worker (about 40 ms) and a pipe round trip per call.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CancelledError, InvalidArgumentError, LlamaError

__all__ = ["RegexWorker", "RegexSyntaxError", "RegexTimeout", "RegexWorkerError", "RegexWorkerUnavailable",
           "DEFAULT_MEMORY_BYTES"]

log = logging.getLogger(__name__)

#: Address space the child may use: files up to 16 MiB are searched whole, their lines with them.
DEFAULT_MEMORY_BYTES = 2 * 1024 ** 3
#: How often a waiting caller checks ``should_stop()``, seconds.
_POLL_S = 0.05
_HEADER = struct.Struct("<Q")

# The child: read (pattern, flags, texts, limit, seconds) requests, answer each with JSON, until EOF.
_CHILD = r"""
import json, re, struct, sys
HEADER = struct.Struct("<Q")
limit_bytes = int(sys.argv[1])
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
except Exception:
    pass
try:
    import signal
    alarm = signal.alarm
except (ImportError, AttributeError):
    alarm = lambda seconds: 0
import pickle
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
compiled = {}

def read_exact(n):
    data = bytearray()
    while len(data) < n:
        chunk = stdin.read(n - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return bytes(data)

while True:
    pattern, flags, texts, limit, seconds = pickle.loads(read_exact(HEADER.unpack(read_exact(HEADER.size))[0]))
    alarm(seconds)
    try:
        rx = compiled.get((pattern, flags))
        if rx is None:
            rx = compiled[(pattern, flags)] = re.compile(pattern, flags)
        hits = []
        for i, text in enumerate(texts):
            if rx.search(text) is not None:
                hits.append(i)
                if len(hits) >= limit:
                    break
        reply = {"hits": hits}
    except re.error as e:
        reply = {"syntax": str(e)}
    except (RecursionError, OverflowError, ValueError) as e:
        reply = {"syntax": str(e) or type(e).__name__}
    except MemoryError:
        reply = {"error": "out of memory"}
    alarm(0)
    del texts
    data = json.dumps(reply).encode()
    stdout.write(HEADER.pack(len(data)) + data)
    stdout.flush()
"""


class RegexSyntaxError(InvalidArgumentError):
    """The pattern does not compile (the message is ``re``'s)."""


class RegexTimeout(LlamaError, TimeoutError):
    """The match ran past its deadline; the child was killed."""


class RegexWorkerError(LlamaError, OSError):
    """The child died without answering (out of memory, killed), or could not start."""


class RegexWorkerUnavailable(RegexWorkerError):
    """No child could be started (no Python executable to run)."""


def _reader(stream: Any, replies: queue.Queue[bytes | None]) -> None:
    try:
        while True:
            head = stream.read(_HEADER.size)
            if len(head) < _HEADER.size:
                break
            (n,) = _HEADER.unpack(head)
            body = stream.read(n)
            if len(body) < n:
                break
            replies.put(body)
    except (OSError, ValueError):
        pass
    finally:
        replies.put(None)


class RegexWorker:
    """A child interpreter that runs ``re`` searches for one caller, each under a deadline.

    Not thread-safe: one caller at a time. A timeout, a stop or a dead child closes the worker (the next
    call starts a fresh child). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, should_stop: Callable[[], bool] | None = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self._should_stop = should_stop
        self._memory_bytes = memory_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._replies: queue.Queue[bytes | None] | None = None

    def __enter__(self) -> "RegexWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the child (if any) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.kill()
        except OSError:
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # (SIGKILL cannot be ignored; a zombie is reaped by the OS later)
            log.warning("regex worker %d did not exit after SIGKILL", proc.pid)

    def _start(self) -> subprocess.Popen[bytes]:
        if not sys.executable:
            raise RegexWorkerUnavailable("cannot start a regex worker: no Python executable (sys.executable is empty)")
        kw: dict[str, Any] = {}
        if os.name == "nt":
            kw["creationflags"] = getattr(subprocess, "CREATE_NO_WINDOW", 0)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, str(self._memory_bytes)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    **kw)
        except (OSError, ValueError) as e:
            raise RegexWorkerUnavailable(f"cannot start a regex worker: {e}") from e
        self._replies = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, self._replies), daemon=True,
                         name="regex-worker-reader").start()
        self._proc = proc
        return proc

    def search(self, pattern: str, texts: Sequence[str], *, flags: int = 0, limit: int | None = None,
               deadline: float) -> list[int]:
        """Indices of the ``texts`` in which ``re.search(pattern, text, flags)`` finds a match, in order, at most
        ``limit`` of them. ``deadline`` is a :func:`time.monotonic` time.

        Raises :class:`RegexSyntaxError` (the pattern does not compile), :class:`RegexTimeout` (the deadline
        passed), :class:`CancelledError` (``should_stop()`` became true) or :class:`RegexWorkerError`.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RegexTimeout("the regular expression ran out of time")
        proc = self._proc or self._start()
        assert self._replies is not None
        # the child's own alarm: a whole second past the deadline, so the caller's kill comes first
        request = pickle.dumps((pattern, flags, list(texts), len(texts) if limit is None else limit,
                                math.ceil(remaining) + 1), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            assert proc.stdin is not None
            proc.stdin.write(_HEADER.pack(len(request)) + request)
            proc.stdin.flush()
        except (OSError, ValueError) as e:
            self.close()
            raise RegexWorkerError(f"the regex worker died: {e}") from e
        while True:
            if self._should_stop is not None and self._should_stop():
                self.close()
                raise CancelledError("the regular expression search was stopped")
            wait = deadline - time.monotonic()
            if wait <= 0:
                self.close()
                raise RegexTimeout("the regular expression ran out of time")
            try:
                body = self._replies.get(timeout=min(wait, _POLL_S))
            except queue.Empty:
                continue
            break
        if body is None:
            self.close()
            raise RegexWorkerError("the regex worker died without answering (out of memory?)")
        reply = json.loads(body)
        if "syntax" in reply:
            raise RegexSyntaxError(reply["syntax"])
        if "error" in reply:
            self.close()
            raise RegexWorkerError(reply["error"])
        return [int(i) for i in reply["hits"]]
