"""Image and audio inputs, before any native call: what a caller may pass, read into bytes or arrays
and checked against :class:`MediaLimits`.

An input is a path, encoded file bytes, a ``data:`` URL, a numpy array (H×W×3 ``uint8`` RGB for an
image, 1-D ``float32`` PCM at the projector's sample rate for audio) or a PIL image. Encoded files are
decoded later by llama.cpp's own helper (stb_image: PNG, JPEG, GIF, BMP; miniaudio: WAV, MP3, FLAC);
here an image file's header is read first so that a small file claiming a huge picture (a
decompression bomb) is refused before anything is decoded. Nothing here fetches a URL.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError, MediaError, MediaTooLargeError
from .media_probe import audio_seconds, check_image_data, image_size, media_kind_of_bytes

__all__ = ["MediaLimits", "MediaData", "MediaInput", "read_media"]

MediaInput = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, Any]
"""What ``media=`` and content parts accept (``Any``: a PIL image)."""

MediaKind = Literal["image", "audio"]


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one prompt's media, checked before decoding (defaults in parentheses).

    ``max_bytes`` (20 MiB): an encoded file, or a raw array's bytes. ``max_pixels`` (25 M) and
    ``max_side`` (16384): an image's size as its header states it. ``max_audio_seconds`` (600): decoded
    audio. ``max_items`` (16): images and clips in one prompt.
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 25_000_000
    max_side: int = 16384
    max_audio_seconds: float = 600.0
    max_items: int = 16

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_side", "max_items"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"MediaLimits.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.max_audio_seconds, (int, float)) and self.max_audio_seconds > 0):
            raise InvalidArgumentError(f"MediaLimits.max_audio_seconds must be > 0, got {self.max_audio_seconds!r}")


@dataclass(frozen=True)
class MediaData:
    """One input, read: ``data`` is encoded file bytes (``raw`` False) or a C-contiguous array (``raw``
    True: ``uint8`` H×W×3 for an image, ``float32`` samples for audio). ``id`` is a content hash
    (SHA-256 hex of what will be decoded, plus the shape of a raw array): equal inputs, equal ids."""

    kind: MediaKind
    data: bytes | np.ndarray
    raw: bool
    id: str
    width: int = 0  # an image's size (from the header for a file); 0 for audio
    height: int = 0
    source: str = ""  # where a request had it (``messages[0].content[1]``), for error messages

    @property
    def nbytes(self) -> int:
        return self.data.nbytes if isinstance(self.data, np.ndarray) else len(self.data)


_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def read_media(item: MediaInput, limits: MediaLimits | None = None, *, allow_paths: bool = True) -> MediaData:
    """Read one input into :class:`MediaData`, checked against ``limits``.

    MediaError for what cannot be an image or audio clip (an unknown format, a corrupt header, a bad
    ``data:`` URL), MediaTooLargeError over a limit, ArgumentTypeError for an unsupported type.
    ``allow_paths=False`` refuses file paths (an HTTP server never reads its own files for a client).
    """
    limits = limits or MediaLimits()
    if isinstance(item, MediaData):  # (checked again: its fields could say anything)
        again = _from_array(np.asarray(item.data), limits) if item.raw else _from_bytes(bytes(item.data), limits)
        return dataclasses.replace(again, source=item.source)
    if isinstance(item, np.ndarray):
        return _from_array(item, limits)
    if _is_pil_image(item):
        return _from_array(np.asarray(item.convert("RGB")), limits)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(item), limits)
    if isinstance(item, str) and item[:5].lower() == "data:":
        return _from_bytes(decode_data_url(item, limits), limits)
    if isinstance(item, str) and re.match(r"(?i)https?://", item):
        raise MediaError("media URLs are not fetched here: pass the file's bytes, a path or a data: URL "
                         "(the HTTP server fetches http(s) URLs only when started with --media-urls)")
    if isinstance(item, (str, os.PathLike)):
        if not allow_paths:
            raise MediaError("file paths are not accepted here: send the media as a data: URL")
        return _from_bytes(_read_file(Path(item), limits), limits)
    raise ArgumentTypeError(
        f"media must be a path, bytes, a data: URL, a numpy array or a PIL image, not {type(item).__name__}")


def decode_data_url(url: str, limits: MediaLimits) -> bytes:
    """The bytes of a ``data:[<mime>][;base64],<data>`` URL (base64 only); MediaError when malformed."""
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise MediaError("a media data: URL must look like data:<type>/<subtype>;base64,<data>")
    payload = url[m.end():]
    if len(payload) // 4 * 3 > limits.max_bytes:
        raise MediaTooLargeError(f"a data: URL of about {len(payload) // 4 * 3} bytes is over the limit of "
                                 f"{limits.max_bytes} bytes per media")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data: URL's base64 is invalid: {exc}") from None


def _read_file(path: Path, limits: MediaLimits) -> bytes:
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(f"{path} is not a regular file")
            if info.st_size > limits.max_bytes:
                raise MediaTooLargeError(f"{path} is {info.st_size} bytes, over the limit of {limits.max_bytes} "
                                         "per media")
            data = f.read(limits.max_bytes + 1)  # (a file may be longer than stat says: /proc)
        if len(data) > limits.max_bytes:
            raise MediaTooLargeError(f"{path} is over the limit of {limits.max_bytes} bytes per media")
        return data
    except FileNotFoundError:
        raise FileNotFoundError(f"media file not found: {path}") from None
    except IsADirectoryError:
        raise MediaError(f"{path} is a directory, not a media file") from None
    except OSError as exc:
        raise MediaError(f"cannot read {path}: {exc}") from None


def _from_bytes(data: bytes, limits: MediaLimits) -> MediaData:
    if len(data) > limits.max_bytes:
        raise MediaTooLargeError(f"a media file of {len(data)} bytes is over the limit of {limits.max_bytes}")
    if not data:
        raise MediaError("the media is empty (0 bytes)")
    digest = hashlib.sha256(data).hexdigest()
    if media_kind_of_bytes(data) == "audio":
        seconds = audio_seconds(data)  # (what the decoder will allocate, resampled: read before it runs)
        if seconds > limits.max_audio_seconds:
            raise MediaTooLargeError(f"an audio clip of {seconds:.1f} s is over the limit of "
                                     f"{limits.max_audio_seconds:g} s")
        return MediaData("audio", data, False, digest)
    width, height = image_size(data)
    _check_image_size(width, height, limits)
    check_image_data(data, width, height)
    return MediaData("image", data, False, digest, width, height)


def _from_array(arr: np.ndarray, limits: MediaLimits) -> MediaData:
    if arr.nbytes > limits.max_bytes:
        raise MediaTooLargeError(f"an array of {arr.nbytes} bytes is over the limit of {limits.max_bytes} per media")
    if arr.ndim == 3 and arr.shape[2] in (3, 4) and arr.dtype == np.uint8:
        height, width = int(arr.shape[0]), int(arr.shape[1])
        _check_image_size(width, height, limits)
        rgb = np.ascontiguousarray(arr[:, :, :3])
        digest = hashlib.sha256(b"rgb%dx%d:" % (width, height) + rgb.tobytes()).hexdigest()
        return MediaData("image", rgb, True, digest, width, height)
    if arr.ndim == 1 and arr.dtype in (np.float32, np.float64):
        pcm = np.ascontiguousarray(arr, dtype=np.float32)
        if pcm.size < 2:
            raise MediaError(f"an audio clip needs at least 2 samples, got {pcm.size}")
        if not np.isfinite(pcm).all():
            raise MediaError("audio samples must be finite (no NaN or infinity)")
        digest = hashlib.sha256(b"pcm%d:" % pcm.size + pcm.tobytes()).hexdigest()
        return MediaData("audio", pcm, True, digest)
    raise MediaError(
        f"an array of shape {arr.shape} and dtype {arr.dtype} is neither an image (H×W×3 uint8 RGB, or H×W×4: "
        "alpha dropped) nor audio (1-D float32 PCM at the projector's sample rate)")


def _check_image_size(width: int, height: int, limits: MediaLimits) -> None:
    if width < 1 or height < 1:
        raise MediaError(f"an image of {width}×{height} pixels is empty")
    if width > limits.max_side or height > limits.max_side or width * height > limits.max_pixels:
        raise MediaTooLargeError(
            f"an image of {width}×{height} pixels is over the limit ({limits.max_pixels} pixels, "
            f"{limits.max_side} per side)")


def _is_pil_image(item: Any) -> bool:
    cls = type(item)
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image" for c in cls.__mro__)
