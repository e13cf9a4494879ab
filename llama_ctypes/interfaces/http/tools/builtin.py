"""llama-server's built-in server tools (``--tools all|name,...``), with its names, definitions and results.

Each tool validates its params the way llama-server's JSON layer does: a missing or mistyped required param is
a :class:`ToolParamError` (400, with nlohmann's message), a mistyped optional one falls back to its default.
Where the I/O runs (host, container, ssh) comes from ``params["runtime"]``, see ``runtime.py``.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ....core.json_schema.normalize import json_type
from ....core.regex_worker import RegexSyntaxError, RegexTimeout, RegexWorker, RegexWorkerError
from ....errors import CancelledError
from .base import StopFn, StreamFn, Tool, ToolParamError
from .edits import EditError, apply_edits
from .files import ListKind, path_glob_match, printable
from .runtime import FileTooLarge, make_tools_io

log = logging.getLogger(__name__)

READ_FILE_MAX_SIZE = 16 * 1024  # bytes of text read_file returns
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024  # bytes of a file read_file returns as base64
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_FILE_SIZE = 16 * 1024 * 1024  # bytes; a larger file is skipped (it is read whole)
#: Seconds one search may spend matching: its pattern runs in a child process (core/regex_worker.py), killed then.
GREP_SEARCH_TIMEOUT = 10.0
#: Most context lines before and after a match (llama-server takes any int: 2**31-1 printed whole files per match).
GREP_SEARCH_MAX_CONTEXT_LINES = 50
#: Bytes of output (UTF-8) at most; llama-server has no cap, and 100 matches with context gave 63 MB from 40 KB.
GREP_SEARCH_MAX_OUTPUT = 256 * 1024
EDIT_FILE_MAX_SIZE = 64 * 1024 * 1024  # bytes; edit_file holds a few copies of the file
EXEC_MAX_OUTPUT_SIZE = 16 * 1024  # bytes
EXEC_MAX_TIMEOUT = 60  # seconds
EXEC_DEFAULT_TIMEOUT = 10  # seconds
GET_INFO_MAX_OUTPUT = 4096  # bytes
GET_INFO_TIMEOUT = 5  # seconds
_INT_MIN, _INT_MAX = -(2 ** 31), 2 ** 31 - 1


# --- params, as llama-server's json layer reads them ---------------------------------------------------------

def _at(obj: Any, key: str) -> Any:
    if not isinstance(obj, dict):
        raise ToolParamError(f"[json.exception.type_error.304] cannot use at() with {json_type(obj)}")
    if key not in obj:
        raise ToolParamError(f"[json.exception.out_of_range.403] key '{key}' not found")
    return obj[key]


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: llama-server's JSON parser refuses the request
        raise ToolParamError("invalid string: a surrogate must be part of a pair") from None


def _require_str(obj: Any, key: str) -> str:
    value = _at(obj, key)
    if not isinstance(value, str):
        raise ToolParamError(f"[json.exception.type_error.302] type must be string, but is {json_type(value)}")
    _utf8(value)
    return value


def _optional(key: str, default: Any, ok: bool, value: Any) -> Any:
    if not ok:
        log.warning("Wrong type supplied for parameter '%s', using default value", key)
        return default
    return value


def _opt_str(params: dict[str, Any], key: str, default: str) -> str:
    value = params.get(key)
    if value is None:
        return default
    return _optional(key, default, isinstance(value, str), value)


def _opt_bool(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key)
    if value is None:
        return default
    return _optional(key, default, isinstance(value, bool), value)


def _opt_int(params: dict[str, Any], key: str, default: int) -> int:
    """An int as nlohmann reads one: a float is truncated, a boolean is 0/1, anything else is the default."""
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return _optional(key, default, False, value)
    return max(_INT_MIN, min(_INT_MAX, int(value)))


def _check_params(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise ToolParamError(f"[json.exception.type_error.304] cannot use at() with {json_type(params)}")
    return params


def _getlines(content: bytes) -> list[bytes]:
    """Lines as ``std::getline`` gives them: split on '\\n', no empty last line for a final '\\n'."""
    lines = content.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def _function(name: str, description: str, properties: dict[str, Any],
              required: Sequence[str] | None = None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = list(required)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _prop(kind: str, description: str) -> dict[str, str]:
    return {"type": kind, "description": description}


_Invoke = TypeVar("_Invoke", bound=Callable[..., dict[str, Any]])


def _memory_safe(invoke: _Invoke) -> _Invoke:
    """A tool that runs out of memory answers ``{"error": ...}`` (HTTP 200), not a 500 with a traceback."""
    @functools.wraps(invoke)
    def wrapper(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return invoke(*args, **kwargs)
        except MemoryError:
            log.warning("tool %s ran out of memory", getattr(args[0], "name", "?"))
            return {"error": "out of memory"}
    return wrapper  # type: ignore[return-value]


# --- the tools -------------------------------------------------------------------------------------------------

class ReadFileTool(Tool):
    """Text of a file (a line range, optionally numbered), capped at 16 KiB; base64 when ``resp_type`` says."""

    name = "read_file"
    display_name = "Read file"
    uses_cwd = True

    def definition(self) -> dict[str, Any]:
        return _function(self.name, (
            "Read the contents of a file. Optionally specify a 1-based line range. "
            "If append_loc is true, each line is prefixed with its line number (e.g. \"1\u2192...\")."), {
            "path": _prop("string", "Path to the file"),
            "start_line": _prop("integer", "First line to read, 1-based (default: 1)"),
            "end_line": _prop("integer", "Last line to read, 1-based inclusive (default: end of file)"),
            "append_loc": _prop("boolean", "Prefix each line with its line number"),
        }, ["path"])

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        path = _require_str(params, "path")
        start_line = _opt_int(params, "start_line", 1)
        end_line = _opt_int(params, "end_line", -1)  # -1: to the end
        append_loc = _opt_bool(params, "append_loc", False)
        # comes from the x-resp-type header, the model cannot ask for it
        as_base64 = _opt_str(params, "resp_type", "") == "base64"
        io = make_tools_io(params)

        size = io.file_size(path)
        if size is None:
            return {"error": f"cannot stat file: {path}"}
        if as_base64:
            if size > READ_FILE_MAX_SIZE_BASE64:
                return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE_BASE64})"}
            try:
                content = io.read_file(path, READ_FILE_MAX_SIZE_BASE64)
            except FileTooLarge as e:
                return {"error": str(e)}
            if content is None:
                return {"error": f"failed to open file: {path}"}
            return {"base64": base64.b64encode(content).decode("ascii"), "size_bytes": len(content)}

        if size > READ_FILE_MAX_SIZE and end_line == -1:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE}). "
                             "Use start_line/end_line to read a portion."}
        # only the range is read, and of it no more than one byte past the cap: enough to tell that the output
        # is truncated (every line costs at least its bytes), so the result is as if the whole file were read
        first = max(1, start_line)
        try:
            content = io.read_lines(path, first, end_line, READ_FILE_MAX_SIZE + 1)
        except FileTooLarge as e:
            return {"error": f"line {first} not found within the first {e.limit} bytes of {path}"}
        if content is None:
            return {"error": f"failed to open file: {path}"}
        out = bytearray()
        for lineno, line in enumerate(_getlines(content), start=first):
            piece = (f"{lineno}\u2192".encode() if append_loc else b"") + line + b"\n"
            if len(out) + len(piece) > READ_FILE_MAX_SIZE:
                out += b"[output truncated]"
                break
            out += piece
        return {"plain_text_response": out.decode("utf-8", "replace")}


_LIST_KINDS = {"file": ListKind.FILES, "dir": ListKind.DIRS, "all": ListKind.ALL}


class FileGlobSearchTool(Tool):
    """Entries under a directory that match a glob: text for the model, ``entries`` and ``base`` for a UI."""

    name = "file_glob_search"
    display_name = "File search"
    uses_cwd = True

    def definition(self) -> dict[str, Any]:
        n = FILE_SEARCH_MAX_RESULTS
        return _function(self.name, (
            "Recursively search for files matching a glob pattern under a directory. "
            "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
            "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
            "A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth. "
            "A pattern containing '/' matches the full relative path; unless already anchored with "
            "\"**/\" or a leading '/', it is automatically prefixed with \"**/\". "
            "Use type=\"dir\" or \"all\" to also list directories; directory entries are suffixed with '/' in "
            "the output. Note: directory listings do not apply .gitignore filtering."), {
            "path": _prop("string", "Base directory to search in"),
            "include": _prop("string", "Glob pattern for files to include (e.g. \"*.cpp\" or \"src/**/*.cpp\"). "
                                       "Default: **"),
            "exclude": _prop("string", "Glob pattern for files to exclude"),
            "type": _prop("string", "Entry type to return: \"file\" (default), \"dir\" or \"all\""),
            "max_depth": _prop("integer", "Maximum depth to descend into subdirectories "
                                          "(default: 0 = unlimited; 1 = direct children only)"),
            "limit": _prop("integer", f"Maximum number of results to return, capped at {n} (default {n})"),
        }, ["path"])

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        io = make_tools_io(params)
        path = _require_str(params, "path")
        base = io.resolve(path)
        include = _opt_str(params, "include", "**")
        exclude = _opt_str(params, "exclude", "")
        type_ = _opt_str(params, "type", "file")
        max_depth = max(0, _opt_int(params, "max_depth", 0))
        limit_req = _opt_int(params, "limit", FILE_SEARCH_MAX_RESULTS)
        if limit_req < 1:
            return {"error": f"invalid limit: {limit_req} (expected 1 or more)"}
        limit = min(limit_req, FILE_SEARCH_MAX_RESULTS)
        kind = _LIST_KINDS.get(type_)
        if kind is None:
            return {"error": f"invalid type: {type_} (expected \"file\", \"dir\" or \"all\")"}

        listing = io.list_entries(base, max_depth, kind)
        if listing.err:
            return {"error": f"{listing.err}: {path}"}
        matches = [e for e in listing.entries
                   if path_glob_match(include, e.rel) and not (exclude and path_glob_match(exclude, e.rel))]
        total, shown = len(matches), min(len(matches), limit)
        text = "".join(f"{printable(e.rel)}{'/' if e.is_dir else ''}\n" for e in matches[:shown])
        text += f"\n---\nTotal matches: {total}\n"
        if total > shown:
            text += (f"[{shown} results limit reached ({total} total matches). "
                     "Refine the glob pattern to narrow the search.]\n")
        if listing.truncated:
            text += "[results truncated: time budget or unreadable directory]\n"
        entries = [{"path": printable(e.rel), "type": "dir" if e.is_dir else "file"} for e in matches[:shown]]
        # `base` is absolute on the host, so a client (the web UI's picker) can join the relative entries to it
        return {"plain_text_response": text, "entries": entries, "base": printable(base)}


class _CappedText:
    """Text built piece by piece, at most ``cap`` bytes of UTF-8: the piece that crosses it is cut (at a
    character boundary) and ``truncated`` is set; later pieces are dropped."""

    def __init__(self, cap: int) -> None:
        self.cap, self.size, self.truncated = cap, 0, False
        self._parts: list[str] = []

    def add(self, piece: str) -> None:
        if self.truncated:
            return
        data = piece.encode("utf-8", "surrogatepass")
        if self.size + len(data) > self.cap:
            piece = data[:self.cap - self.size].decode("utf-8", "ignore")
            self.truncated = True
        self._parts.append(piece)
        self.size += len(data)

    def text(self) -> str:
        return "".join(self._parts)


_REGEX_SPECIALS = frozenset("\\^$.|?*+()[]{}")


class GrepSearchTool(Tool):
    """Lines matching a regular expression under a file or directory, at most 100 matches."""

    name = "grep_search"
    display_name = "Grep search"
    uses_cwd = True

    def definition(self) -> dict[str, Any]:
        return _function(self.name, (
            "Search for a pattern in files under a path. Returns matching lines with file paths "
            "(and, unless searching a single file, paths relative to the given directory). "
            "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
            "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
            "include/exclude: a pattern with no '/' matches the basename at any depth; a pattern "
            "containing '/' matches the full relative path (auto-anchored with \"**/\" unless already anchored)."), {
            "path": _prop("string", "File or directory to search in"),
            "pattern": _prop("string", "Pattern to search for (regular expression unless literal is true)"),
            "include": _prop("string", "Glob pattern to filter files (default: **)"),
            "exclude": _prop("string", "Glob pattern to exclude files"),
            "return_line_numbers": _prop("boolean", "If true, include line numbers in results"),
            "literal": _prop("boolean", "Treat pattern as a literal string instead of a regular expression "
                                        "(default: false)"),
            "ignore_case": _prop("boolean", "Case-insensitive search (default: false)"),
            "context_lines": _prop("integer", "Number of lines of context to show before and after each match "
                                              "(default: 0)"),
        }, ["path", "pattern"])

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        path = _require_str(params, "path")
        pattern_text = _require_str(params, "pattern")
        include = _opt_str(params, "include", "**")
        exclude = _opt_str(params, "exclude", "")
        show_lineno = _opt_bool(params, "return_line_numbers", False)
        literal = _opt_bool(params, "literal", False)
        ignore_case = _opt_bool(params, "ignore_case", False)
        ctx = min(GREP_SEARCH_MAX_CONTEXT_LINES, max(0, _opt_int(params, "context_lines", 0)))

        if literal:
            pattern_text = "".join("\\" + c if c in _REGEX_SPECIALS else c for c in pattern_text)
        flags = re.IGNORECASE if ignore_case else 0
        deadline = time.monotonic() + GREP_SEARCH_TIMEOUT
        with RegexWorker(should_stop) as worker:
            try:
                worker.search(pattern_text, (), flags=flags, deadline=deadline)  # (compiles it: errors come first)
                return self._search(worker, params, path, pattern_text, flags, include, exclude,
                                    show_lineno or ctx > 0, ctx, deadline, should_stop)
            except RegexSyntaxError as e:
                return {"error": f"invalid regex: {e}"}
            except RegexTimeout:
                return {"error": "grep_search stopped: matching the pattern took longer than "
                                 f"{GREP_SEARCH_TIMEOUT:g} s (a pattern that backtracks catastrophically, such as (a+)+$, can take forever); "
                                 "simplify the pattern or pass literal: true"}
            except CancelledError:
                return {"error": "grep_search stopped: the client has gone"}
            except RegexWorkerError as e:
                return {"error": f"grep_search failed: {e}"}

    @staticmethod
    def _search(worker: RegexWorker, params: dict[str, Any], path: str, pattern: str, flags: int, include: str,
                exclude: str, show_num: bool, ctx: int, deadline: float, should_stop: StopFn) -> dict[str, Any]:
        io = make_tools_io(params)
        files: list[tuple[str, str]] = []  # (path to read, path to show)
        abs_path = io.resolve(path)
        if io.is_regular_file(abs_path):
            files.append((abs_path, path))
        elif io.is_directory(abs_path):
            listing = io.list_entries(abs_path, 0, ListKind.FILES)
            if listing.err:
                return {"error": f"{listing.err}: {path}"}
            prefix = abs_path.rstrip("/")
            files += [(f"{prefix}/{e.rel}", printable(e.rel)) for e in listing.entries
                      if path_glob_match(include, e.rel) and not (exclude and path_glob_match(exclude, e.rel))]
        else:
            return {"error": f"path does not exist: {path}"}

        out = _CappedText(GREP_SEARCH_MAX_OUTPUT)
        total = skipped = 0
        limit_reached = False
        for fpath, shown in files:
            if limit_reached or out.truncated or should_stop():
                break
            try:
                content = io.read_file(fpath, GREP_SEARCH_MAX_FILE_SIZE)
            except FileTooLarge:  # it is searched in memory: a huge (or sparse) file would exhaust it
                skipped += 1
                continue
            if content is None:
                continue
            lines = content.decode("utf-8", "replace").split("\n")
            if lines[-1] == "":
                lines.pop()
            if total >= GREP_SEARCH_MAX_RESULTS:  # (llama-server: reached when one more line was to be searched)
                limit_reached = bool(lines)
                continue
            hits = worker.search(pattern, lines, flags=flags, limit=GREP_SEARCH_MAX_RESULTS - total,
                                 deadline=deadline)
            for i in hits:
                for j in range(max(0, i - ctx), min(len(lines) - 1, i + ctx) + 1):
                    sep = ":" if j == i else "-"
                    out.add(f"{shown}{sep}{f'{j + 1}{sep}' if show_num else ''}{lines[j]}\n")
                if ctx > 0:
                    out.add("--\n")
                total += 1
                if out.truncated:
                    break
            if total >= GREP_SEARCH_MAX_RESULTS and hits and hits[-1] < len(lines) - 1:
                limit_reached = True
        tail = [f"\n---\nTotal matches: {total}\n"]
        if limit_reached:
            tail.append(f"[{GREP_SEARCH_MAX_RESULTS} matches limit reached. "
                        "Narrow the path/pattern/include to see more.]\n")
        if out.truncated:
            tail.append(f"[output truncated at {GREP_SEARCH_MAX_OUTPUT} bytes. "
                        "Narrow the path/pattern/include or lower context_lines to see more.]\n")
        if skipped:
            tail.append(f"[{skipped} file(s) over {GREP_SEARCH_MAX_FILE_SIZE} bytes not searched]\n")
        return {"plain_text_response": out.text() + "".join(tail)}


class ExecShellCommandTool(Tool):
    """``sh -c command`` (``cmd /c`` on a Windows host), output capped at 16 KiB, killed after its timeout."""

    name = "exec_shell_command"
    display_name = "Execute shell command"
    uses_cwd = True
    permission_write = True
    support_stream = True

    def definition(self) -> dict[str, Any]:
        return _function(self.name, "Execute a shell command and return its output (stdout and stderr combined).", {
            "command": _prop("string", "Shell command to execute"),
            "timeout": _prop("integer", f"Timeout in seconds (default 10, max {EXEC_MAX_TIMEOUT})"),
            "max_output_size": _prop("integer", f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT_SIZE})"),
        }, ["command"])

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        command = _require_str(params, "command")
        timeout = min(_opt_int(params, "timeout", EXEC_DEFAULT_TIMEOUT), EXEC_MAX_TIMEOUT)
        max_output = _opt_int(params, "max_output_size", EXEC_MAX_OUTPUT_SIZE)
        # llama-server casts to size_t: a negative size is huge, hence the cap
        max_output = EXEC_MAX_OUTPUT_SIZE if max_output < 0 else min(max_output, EXEC_MAX_OUTPUT_SIZE)
        # an isolate is POSIX whatever the host is
        on_windows_host = os.name == "nt" and not _opt_str(params, "runtime", "")
        argv = ["cmd", "/c", command] if on_windows_host else ["sh", "-c", command]
        io = make_tools_io(params)

        if stream is not None:
            def on_chunk(chunk: str) -> bool:
                stream(chunk)
                return not should_stop()

            res = io.run(argv, max_output, timeout, on_chunk, should_stop)
            if should_stop():
                return {}
            stream(f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else ""))
            return {}

        res = io.run(argv, max_output, timeout, should_stop=should_stop)
        text = res.text + f"\n[exit code: {res.exit_code}]"
        if res.timed_out:
            text += " [exit due to timed out]"
        return {"plain_text_response": text}


class WriteFileTool(Tool):
    """Create or overwrite a file, parent directories included."""

    name = "write_file"
    display_name = "Write file"
    uses_cwd = True
    permission_write = True

    def definition(self) -> dict[str, Any]:
        return _function(self.name, (
            "Write content to a file, creating it (including parent directories) if it does not exist. "
            "May use with edit_file for more complex edits."), {
            "path": _prop("string", "Path of the file to write"),
            "content": _prop("string", "Content to write"),
        }, ["path", "content"])

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        path = _require_str(params, "path")
        content = _utf8(_require_str(params, "content"))
        io = make_tools_io(params)
        if not io.write_file(path, content):
            return {"error": f"failed to write file: {path}"}
        return {"result": "file written successfully", "path": path, "bytes": len(content)}


class EditFileTool(Tool):
    """Exact (else whitespace/typography-tolerant) text replacements, each unique and disjoint."""

    name = "edit_file"
    display_name = "Edit file"
    uses_cwd = True
    permission_write = True

    def definition(self) -> dict[str, Any]:
        return _function(self.name, (
            "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file "
            "and is matched against the original content, not incrementally. Merge nearby changes into "
            "one edit instead of overlapping edits. Use write_file to replace the whole file."), {
            "path": _prop("string", "Path to the file to edit"),
            "edits": {
                "type": "array",
                "description": "One or more exact text replacements to apply",
                "items": {
                    "type": "object",
                    "properties": {
                        "old_text": _prop("string", "Exact text to find; must be unique in the file and must not "
                                                    "overlap with other edits"),
                        "new_text": _prop("string", "Text to replace old_text with"),
                    },
                    "required": ["old_text", "new_text"],
                },
            },
        }, ["path", "edits"])

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        path = _require_str(params, "path")
        edits_json = _at(params, "edits")
        if not isinstance(edits_json, list) or not edits_json:
            return {"error": "\"edits\" must be a non-empty array"}
        edits: list[tuple[bytes, bytes]] = []
        for item in edits_json:
            old = _utf8(_require_str(item, "old_text"))
            new = _utf8(_require_str(item, "new_text"))
            if not old:
                return {"error": f"edits[{len(edits)}].old_text must not be empty"}
            edits.append((old, new))

        io = make_tools_io(params)
        # checked before opening: reading a FIFO blocks, /dev/zero never ends
        size = io.file_size(path)
        if size is None:
            reason = " (not a regular file)" if io.exists(path) else ""
            return {"error": f"failed to open file: {path}{reason}"}
        if size > EDIT_FILE_MAX_SIZE:
            return {"error": f"file too large ({size} bytes, max {EDIT_FILE_MAX_SIZE})"}
        try:
            original = io.read_file(path, EDIT_FILE_MAX_SIZE)
        except FileTooLarge as e:  # it grew since
            return {"error": str(e)}
        if original is None:
            return {"error": f"failed to open file: {path}"}
        try:
            new_content, applied = apply_edits(original, edits, path)
        except EditError as e:
            return {"error": str(e)}
        if not io.write_file(path, new_content):
            return {"error": f"failed to write file: {path}"}
        return {"result": "file edited successfully", "path": path, "edits_applied": applied}


class GetInfoTool(Tool):
    """The runtime's OS (``uname -a``, ``ver`` on a Windows host) and working directory."""

    name = "get_info"
    display_name = "Get Runtime Info"
    uses_cwd = True

    def definition(self) -> dict[str, Any]:
        return _function(self.name, "Returns runtime info: the OS name/version and the current working directory",
                         {})

    @_memory_safe
    def invoke(self, params: dict[str, Any], stream: StreamFn | None = None,
               should_stop: StopFn = lambda: False) -> dict[str, Any]:
        params = _check_params(params)
        io = make_tools_io(params)
        runtime = _opt_str(params, "runtime", "")
        argv = ["cmd", "/c", "ver"] if os.name == "nt" and not runtime else ["uname", "-a"]
        res = io.run(argv, GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT)
        # a failed spawn or a timeout leaves a diagnostic in the output, which is no OS name
        os_info = res.text.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
        cwd = _opt_str(params, "cwd", "")
        if not cwd:
            if not runtime:
                try:
                    cwd = os.getcwd()
                except OSError:
                    cwd = ""
            else:
                pwd = io.run(["pwd"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT)
                cwd = pwd.text.strip() if pwd.exit_code == 0 and not pwd.timed_out else "unknown"
        return {"os": os_info, "cwd": printable(cwd)}


# keep this list minimal, as llama-server does: I/O and shell only; anything higher level belongs to MCP
_TOOL_CLASSES: tuple[type[Tool], ...] = (
    ReadFileTool, FileGlobSearchTool, GrepSearchTool, ExecShellCommandTool, WriteFileTool, EditFileTool, GetInfoTool,
)
BUILTIN_TOOL_NAMES: tuple[str, ...] = tuple(cls.name for cls in _TOOL_CLASSES)


def build_tools(enabled: Sequence[str]) -> list[Tool]:
    """The tools ``--tools`` enables, in llama-server's order: ``["all"]`` is every one, ``[]`` none. Raises
    ValueError with llama-server's message for an unknown name."""
    for name in enabled:
        if name != "all" and name not in BUILTIN_TOOL_NAMES:
            raise ValueError(f'unknown tool "{name}". available tools: {", ".join(BUILTIN_TOOL_NAMES)}')
    wanted = set(enabled)
    return [cls() for cls in _TOOL_CLASSES if "all" in wanted or cls.name in wanted]
