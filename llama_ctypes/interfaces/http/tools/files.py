"""Listing and matching helpers of the built-in tools: llama-server's glob, junk-directory rules and walker.

Pure functions over paths and text; where the I/O happens (host, container, ssh) is ``runtime.py``'s concern.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field

#: Directories a listing reports but never descends into: they can be enormous (llama-server's list).
JUNK_DIR_NAMES: tuple[str, ...] = (
    ".git", ".svn", ".hg", "node_modules", "__pycache__",
    ".venv", "venv", "dist", "build", "target", ".cache", ".idea", ".vscode",
)
_JUNK_SET = frozenset(JUNK_DIR_NAMES)

#: Time budget of one listing call (git and the walker share it), seconds.
LIST_ENTRIES_TIMEOUT = 15
#: Output cap of ``git ls-files`` and of the isolate's ``find``, bytes.
GIT_LS_FILES_MAX_OUTPUT = 8 * 1024 * 1024


class ListKind(enum.Enum):
    """Entry kinds a directory listing may return."""

    FILES = "file"
    DIRS = "dir"
    ALL = "all"


@dataclass
class ListEntry:
    """One listed entry: ``rel`` is '/'-separated and relative to the listed base."""

    rel: str
    is_dir: bool = False


@dataclass
class ListResult:
    """A listing: ``err`` is set when the base is not a directory; ``truncated`` when the walk saw less."""

    entries: list[ListEntry] = field(default_factory=list)
    err: str = ""
    truncated: bool = False


def printable(text: str) -> str:
    """``text`` with any undecodable filename bytes (surrogate escapes) turned into U+FFFD, so it can be
    sent as JSON; llama-server's JSON writer replaces invalid UTF-8 the same way."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def entry_depth(rel: str) -> int:
    """Depth of a '/'-separated relative path: ``"a/b/c"`` is 3."""
    return 1 + rel.count("/")


def split_lines(text: str, strip_dot_slash: bool) -> list[str]:
    """Non-empty lines of a command's output, '\\r' dropped, '\\' made '/', optionally without "./"."""
    out = []
    for line in text.split("\n"):
        line = line.removesuffix("\r")
        if not line:
            continue
        if strip_dot_slash and line.startswith("./"):
            line = line[2:]
        out.append(line.replace("\\", "/"))
    return out


# --- glob ---------------------------------------------------------------------------------------------------
# llama-server's glob: '*' is any run of non-'/' characters, '**' any run at all, '?' one non-'/' character,
# '[...]' a class ('!' negates, a leading ']' or '-' is literal, 'a-z' ranges) that may match '/', and a '['
# without its ']' is literal. Its C version recurses; this compiles the pattern once and runs it as an NFA, so
# neither a long path nor a pattern full of stars can blow the stack or take exponential time.

_DSTAR, _STAR, _QMARK, _CLASS, _LIT = range(5)


def _class_match(c: str, body: str) -> bool:
    negated = body.startswith("!")
    if negated:
        body = body[1:]
    if body[:1] in ("]", "-"):
        if body[0] == c:
            return not negated
        body = body[1:]
    i = 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-" and body[i + 2] != "]":
            if body[i] <= c <= body[i + 2]:
                return not negated
            i += 3
        else:
            if body[i] == c:
                return not negated
            i += 1
    return negated


def _compile_glob(pattern: str) -> list[tuple[int, str]]:
    tokens: list[tuple[int, str]] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            tokens.append((_DSTAR, ""))
            i += 2
        elif ch == "*":
            tokens.append((_STAR, ""))
            i += 1
        elif ch == "?":
            tokens.append((_QMARK, ""))
            i += 1
        elif ch == "[":
            end = i + 1
            if end < len(pattern) and pattern[end] in "]-":
                end += 1
            end = pattern.find("]", end)
            if end < 0:
                tokens.append((_LIT, "["))
                i += 1
            else:
                tokens.append((_CLASS, pattern[i + 1:end]))
                i = end + 1
        else:
            tokens.append((_LIT, ch))
            i += 1
    return tokens


def glob_match(pattern: str, text: str) -> bool:
    """Whether ``text`` matches ``pattern`` as llama-server's ``glob_match`` decides."""
    tokens = _compile_glob(pattern)
    n = len(tokens)

    def closure(states: set[int]) -> set[int]:
        # a star may match nothing: every star is also a way to the next token
        todo = list(states)
        while todo:
            t = todo.pop()
            if t < n and tokens[t][0] in (_DSTAR, _STAR) and t + 1 not in states:
                states.add(t + 1)
                todo.append(t + 1)
        return states

    states = closure({0})
    for c in text:
        nxt: set[int] = set()
        for t in states:
            if t == n:
                continue
            kind, arg = tokens[t]
            if kind == _DSTAR or (kind == _STAR and c != "/"):
                nxt.add(t)
            elif (kind == _QMARK and c != "/") or (kind == _LIT and c == arg) or \
                    (kind == _CLASS and _class_match(c, arg)):
                nxt.add(t + 1)
        if not nxt:
            return False
        states = closure(nxt)
    return n in states


def path_glob_match(pattern: str, rel_path: str) -> bool:
    """llama-server's include/exclude rule: a pattern without '/' matches the basename at any depth; one with
    '/' matches the whole relative path, prefixed with ``**/`` unless it starts with ``**``/``**/`` or '/'."""
    if "/" not in pattern:
        return glob_match(pattern, rel_path.rsplit("/", 1)[-1])
    if pattern == "**" or pattern.startswith("**/") or pattern.startswith("/"):
        return glob_match(pattern, rel_path)
    return glob_match("**/" + pattern, rel_path)


# --- the host walker ------------------------------------------------------------------------------------------

def _is_junk(name: str) -> bool:
    # NTFS is case insensitive, so Build and build are the same directory there
    return (name.lower() if os.name == "nt" else name) in _JUNK_SET


def walk_entries(base: str, max_depth: int, kind: ListKind, deadline: float) -> tuple[list[ListEntry], bool]:
    """Walk ``base`` (absolute) depth first as llama-server's fallback walker does: junk directories and
    links to directories are listed but not entered; ``max_depth`` 0 is unlimited, 1 direct children only.
    ``deadline`` is a ``time.monotonic()`` instant. Returns the entries and whether the walk was cut short."""
    result: list[ListEntry] = []
    truncated = False
    stack: list[tuple[str, str, int]] = [(base, "", 0)]
    while stack:
        if time.monotonic() >= deadline:
            return result, True
        directory, rel_dir, depth = stack.pop()
        try:
            it = os.scandir(directory)
        except PermissionError:
            continue  # llama-server skips unreadable directories silently (skip_permission_denied)
        except OSError:
            truncated = True
            continue
        with it:
            while True:
                try:
                    entry = next(it)
                except StopIteration:
                    break
                except OSError:
                    truncated = True
                    break
                if time.monotonic() >= deadline:
                    return result, True
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    continue
                if is_dir:
                    if kind in (ListKind.DIRS, ListKind.ALL):
                        result.append(ListEntry(rel, True))
                    if _is_junk(entry.name):
                        continue
                    try:
                        is_link = entry.is_symlink()
                    except OSError:
                        is_link = True
                    # a link can point back to an ancestor and loop forever, so it is never walked
                    if not is_link and (max_depth == 0 or depth + 1 < max_depth):
                        stack.append((entry.path, rel, depth + 1))
                else:
                    try:
                        is_file = entry.is_file()
                    except OSError:
                        continue
                    if is_file and kind in (ListKind.FILES, ListKind.ALL):
                        result.append(ListEntry(rel, False))
    return result, truncated


def find_command(max_depth: int, dirs: bool) -> str:
    """The ``sh -c`` script an isolate lists with (``$1`` is the base): one ``find`` pass that prints junk
    directories without entering them; ``-mindepth``/``-maxdepth`` keep busybox working like GNU find."""
    prune = " -o ".join(f"-name {n}" for n in JUNK_DIR_NAMES)
    cmd = 'cd "$1" && find . -mindepth 1'
    if max_depth > 0:
        cmd += f" -maxdepth {max_depth}"
    cmd += f" \\( {prune} \\) -prune"
    cmd += " -print -o -type d -print" if dirs else " -o -type f -print"
    return cmd
