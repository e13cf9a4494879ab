"""Images and audio in chat messages: OpenAI content parts → media markers in the text, plus the media.

A message's content list may hold, besides ``{"type": "text", "text": ...}``:

* ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (OpenAI; a path, or for
  the Python API anything :func:`~llama_ctypes.core.media.read_media` takes, in ``url``);
* ``{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav" | "mp3"}}`` (OpenAI);
* ``{"type": "image", "image": ...}`` and ``{"type": "audio", "audio": ...}`` (the Python API: a path,
  bytes, an array or a PIL image).

Each becomes the projector's marker, and the parts are joined as llama.cpp joins them (a new line
between text parts, none around a marker), so the template sees a plain string, as llama-server's does.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

from ..core.media import MediaData, MediaLimits
from ..core.projector import Projector
from ..errors import MediaError, MediaTooLargeError

__all__ = ["has_media", "split_media", "MEDIA_PART_TYPES"]

MEDIA_PART_TYPES = ("image_url", "input_audio", "image", "audio")


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message's content holds an image or audio part."""
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, (list, tuple)):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in MEDIA_PART_TYPES:
                    return True
    return False


def split_media(messages: Sequence[Mapping[str, Any]], projector: Projector | None, limits: MediaLimits | None = None,
                *, allow_paths: bool = True, fetch: Callable[[str], bytes] | None = None,
                ) -> tuple[list[Mapping[str, Any]], list[MediaData]]:
    """The messages with each media part replaced by ``projector.marker`` (content joined into text),
    and the media read, in order. MediaError (naming the message and part) for media the model cannot
    take or that cannot be read.

    ``allow_paths=False`` (an HTTP request): a URL is a ``data:`` URL or plain base64 (as llama-server
    takes), never a file of this machine. ``fetch``: reads an http(s) URL, and a ``file://`` one when
    ``allow_paths`` is False (the server's ``--media-path``); None: such URLs are refused.
    """
    limits = limits or MediaLimits()
    out: list[Mapping[str, Any]] = []
    media: list[MediaData] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, (list, tuple)) or not any(
                isinstance(p, Mapping) and p.get("type") in MEDIA_PART_TYPES for p in content):
            out.append(message)
            continue
        if projector is None or projector.closed:
            kind = next(p.get("type") for p in content if isinstance(p, Mapping) and p.get("type") in MEDIA_PART_TYPES)
            what = "audio" if kind in ("input_audio", "audio") else "image"
            raise _at(MediaError(f"messages[{i}]: {what} input is not supported by this model (it has no "
                                 "multimodal projector: load one with mmproj=)"), f"messages[{i}].content")
        pieces: list[tuple[str, str]] = []  # (type, text): "text" or "marker"
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                pieces.append(("text", str(part.get("text", ""))))
                continue
            if kind not in MEDIA_PART_TYPES:
                raise _at(MediaError(f"{where}: unsupported content part type {kind!r}"), where)
            try:
                source = _part_source(part, kind)
                if isinstance(source, str) and re.match(r"(?i)https?://|file://", source) \
                        and not (allow_paths and source[:7].lower() == "file://"):
                    if fetch is None:
                        raise MediaError(
                            "file:// URLs are not allowed unless --media-path is specified"
                            if source[:7].lower() == "file://" else "http(s) media URLs are not fetched by this "
                            "server: send the media as a data: URL (or start it with --media-urls)")
                    source = fetch(source)
                elif isinstance(source, str) and not allow_paths and source[:5].lower() != "data:":
                    source = _plain_base64(source)
                item = dataclasses.replace(projector.read(source, limits, allow_paths=allow_paths), source=where)
            except MediaError as exc:
                raise _at(type(exc)(f"{where}: {exc}"), where) from None
            if len(media) >= limits.max_items:
                raise _at(MediaTooLargeError(f"{where}: more than {limits.max_items} media in one request"), where)
            media.append(item)
            pieces.append(("marker", projector.marker))
        out.append({**message, "content": _joined(pieces)})
    return out, media


def _part_source(part: Mapping[str, Any], kind: str) -> Any:
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
        if url is None or url == "":
            raise MediaError("an image_url part needs image_url.url")
        return url
    if kind == "input_audio":
        value = part.get("input_audio")
        if not isinstance(value, Mapping):
            raise MediaError("an input_audio part needs input_audio.data (base64) and input_audio.format")
        data = value.get("data", value.get("url"))
        if not isinstance(data, str) or not data:
            raise MediaError("an input_audio part needs input_audio.data (base64)")
        if data[:5].lower() == "data:":
            return data
        fmt = value.get("format")
        if fmt is not None and fmt not in ("wav", "mp3", "flac"):
            raise MediaError(f"input_audio.format {fmt!r} is not supported (wav, mp3, flac are)")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"input_audio.data is not valid base64: {exc}") from None
    value = part.get(kind)
    if value is None:
        raise MediaError(f"an {kind} part needs its {kind!r} field")
    return value


def _at(error: MediaError, param: str) -> MediaError:
    """``error`` naming the request field it is about (the HTTP error's ``param``)."""
    error.param = param  # type: ignore[attr-defined]
    return error


def _plain_base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("a media URL must be a data: URL or base64 of the file") from None


def _joined(pieces: list[tuple[str, str]]) -> str:
    text = ""
    after_marker = False
    for kind, piece in pieces:
        if kind == "text":
            if text and not after_marker:
                text += "\n"
            after_marker = False
        else:
            after_marker = True
        text += piece
    return text
