"""Reading media URLs of chat requests: http(s) ones only with ``--media-urls``, ``file://`` ones only
with ``--media-path DIR`` (:func:`media_reader` puts the two together).

Off by default: a server that fetches what a client names can be made to reach hosts the client
cannot (llama-server fetches them always). When on, a fetch is bounded: a deadline, the media byte
limit (checked while reading, not after), no redirect to anything but http(s), and a 2xx answer.
Runs in the worker thread that plans the request, never on the event loop.
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Callable

import requests

from ...core.media import MediaLimits
from ...errors import MediaError, MediaTooLargeError

__all__ = ["url_fetcher", "file_reader", "media_reader"]

#: Seconds to connect and between two reads of one media URL.
FETCH_TIMEOUT = 10.0
#: Seconds one media URL may take in all (a slow sender cannot hold a worker longer).
FETCH_DEADLINE = 30.0


def url_fetcher(limits: MediaLimits, timeout: float = FETCH_TIMEOUT,
                deadline: float = FETCH_DEADLINE) -> Callable[[str], bytes]:
    """``fetch(url) -> bytes`` for http(s) URLs, within ``limits.max_bytes`` and ``deadline`` seconds."""

    def fetch(url: str) -> bytes:
        end = time.monotonic() + deadline
        try:
            with requests.get(url, stream=True, timeout=timeout, allow_redirects=True,
                              headers={"Accept": "image/*, audio/*"}) as response:
                if not response.url.lower().startswith(("http://", "https://")):
                    raise MediaError(f"{url}: redirected away from http(s)")
                if response.status_code // 100 != 2:
                    raise MediaError(f"{url}: the server answered {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isascii() and declared.isdigit() and int(declared) > limits.max_bytes:
                    raise MediaTooLargeError(f"{url}: {declared} bytes, over the limit of {limits.max_bytes}")
                chunks, size = [], 0
                for chunk in response.iter_content(64 << 10):
                    if time.monotonic() > end:
                        raise MediaError(f"{url}: not fetched within {deadline:g} s")
                    size += len(chunk)
                    if size > limits.max_bytes:
                        raise MediaTooLargeError(f"{url}: over the limit of {limits.max_bytes} bytes per media")
                    chunks.append(chunk)
                return b"".join(chunks)
        except requests.RequestException as exc:
            raise MediaError(f"{url}: could not be fetched ({type(exc).__name__})") from None

    return fetch


#: What llama-server refuses in a ``file://`` path (common's ``fs_validate_filename`` with subfolders):
#: control characters, the characters Windows forbids, look-alikes of dots and slashes, ``..``.
_BAD_PATH_CHARS = re.compile("[\x00-\x1f\x7f-\x9f:*?\"<>|\uff0e\u2215\u2216\ufffd\ufeff\ud800-\udfff]")


def file_reader(folder: str | os.PathLike, limits: MediaLimits) -> Callable[[str], bytes]:
    """``read(url) -> bytes`` for ``file://PATH`` URLs, PATH relative to ``folder`` (llama-server's
    ``--media-path``): a path with ``..``, a forbidden character or over 255 bytes (UTF-8) is refused, as
    llama-server does, and so is one that resolves outside the folder through a symbolic link (llama-server
    follows those). At most ``limits.max_bytes`` are read."""
    root = Path(folder).resolve()

    def read(url: str) -> bytes:
        path = url[len("file://"):]
        if (not path or len(path.encode("utf-8", "surrogatepass")) > 255 or ".." in path or _BAD_PATH_CHARS.search(path)
                or path[0] == " " or path[-1] in " ." or path == "."):
            raise MediaError(f"file path is not allowed: {path}")
        target = (root / path.lstrip("/")).resolve()
        if not target.is_relative_to(root):
            raise MediaError(f"file path is not allowed: {path}")
        try:  # (a FIFO or a device would block the thread or never end: regular files only)
            if not stat.S_ISREG(os.stat(target).st_mode):
                raise OSError("not a regular file")
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with open(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # (swapped since the check)
                    raise OSError("not a regular file")
                data = fh.read(limits.max_bytes + 1)
        except OSError:
            raise MediaError(f"file does not exist or cannot be opened: {path}") from None
        if len(data) > limits.max_bytes:
            raise MediaTooLargeError(f"{path}: over the limit of {limits.max_bytes} bytes per media")
        return data

    return read


def media_reader(limits: MediaLimits, *, urls: bool = False,
                 folder: str | os.PathLike | None = None) -> Callable[[str], bytes] | None:
    """What a chat request's ``http(s)://`` and ``file://`` media URLs are read with: the first only when
    ``urls`` (``--media-urls``), the second only under ``folder`` (``--media-path``); None when neither."""
    fetch = url_fetcher(limits) if urls else None
    local = file_reader(folder, limits) if folder is not None else None
    if fetch is None and local is None:
        return None

    def read(url: str) -> bytes:
        if url[:7].lower() == "file://":
            if local is None:
                raise MediaError("file:// URLs are not allowed unless --media-path is specified")
            return local(url)
        if fetch is None:
            raise MediaError("http(s) media URLs are not fetched by this server: send the media as a data: "
                             "URL (or start it with --media-urls)")
        return fetch(url)

    return read
