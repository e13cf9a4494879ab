"""Fetching http(s) media URLs of chat requests, only when the server was started with ``--media-urls``.

Off by default: a server that fetches what a client names can be made to reach hosts the client
cannot (llama-server fetches them always). When on, a fetch is bounded: a deadline, the media byte
limit (checked while reading, not after), no redirect to anything but http(s), and a 2xx answer.
Runs in the worker thread that plans the request, never on the event loop.
"""

from __future__ import annotations

import time
from typing import Callable

import requests

from ...core.media import MediaLimits
from ...errors import MediaError, MediaTooLargeError

__all__ = ["url_fetcher"]

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
                if declared.isdigit() and int(declared) > limits.max_bytes:
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
