"""Reading image and audio file headers before llama.cpp decodes them: what the decoders will allocate
and how much work they will do, so that a small file cannot make them take gigabytes or minutes.

llama.cpp's helper decodes images with stb_image and audio with miniaudio. stb_image allocates what
an image's header states, inflates a PNG's data until its stream ends and walks every block of a
progressive JPEG once per scan; miniaudio sizes its output from the clip's length (a WAV's data chunk,
a FLAC's sample count, an MP3's frames) resampled to the projector's rate. Each check here bounds one
of these by the file's own numbers. Pure Python, no native calls.
"""

from __future__ import annotations

import struct
import zlib
from typing import Literal

from ..errors import MediaError

__all__ = ["media_kind_of_bytes", "image_size", "check_image_data", "audio_seconds", "MAX_JPEG_SCANS"]

MediaKind = Literal["image", "audio"]

#: Most scans a JPEG may have: each one makes the decoder walk every block of the image again (a
#: progressive JPEG has about 10; thousands of copied scans cost minutes of CPU).
MAX_JPEG_SCANS = 100


def media_kind_of_bytes(data: bytes) -> MediaKind:
    """"audio" for the files llama.cpp's helper decodes as audio (WAV, MP3, FLAC, by magic bytes, as
    the helper tells them), else "image"."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "audio"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "audio"
    if data[:4] == b"fLaC":
        return "audio"
    return "image"


# ---- images --------------------------------------------------------------------------------------
def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image file's header: PNG, JPEG, GIF or BMP. MediaError otherwise.

    Only these formats: their decoder (stb_image) allocates what the header says, so the size must be
    known before decoding; WebP would need ffmpeg, which llama.cpp runs only in builds with video.
    """
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise MediaError("a corrupt PNG file (no IHDR header)")
        return struct.unpack(">II", data[16:24])
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    if data[:6] in (b"GIF87a", b"GIF89a"):
        if len(data) < 10:
            raise MediaError("a corrupt GIF file (truncated header)")
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"BM":
        if len(data) < 26:
            raise MediaError("a corrupt BMP file (truncated header)")
        header = struct.unpack("<I", data[14:18])[0]
        if header == 12:
            return struct.unpack("<HH", data[18:22])
        width, height = struct.unpack("<ii", data[18:26])
        return abs(width), abs(height)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise MediaError("WebP images are not supported (PNG, JPEG, GIF and BMP are)")
    raise MediaError("not an image or audio file llama.cpp can decode (images: PNG, JPEG, GIF, BMP; "
                     "audio: WAV, MP3, FLAC)")


def check_image_data(data: bytes, width: int, height: int) -> None:
    """MediaError when the file's data would make the decoder do more than its size states: a PNG whose
    pixel data inflates beyond width × height, a JPEG with more than :data:`MAX_JPEG_SCANS` scans, an
    uncompressed BMP shorter than its pixels."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        _check_png(data, width, height)
    elif data[:2] == b"\xff\xd8":
        _check_jpeg_scans(data)
    elif data[:2] == b"BM":
        _check_bmp(data, width, height)


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png_raw_size(width: int, height: int, bits: int, interlaced: bool) -> int:
    """Bytes of a PNG's filtered pixel data (each row: a filter byte, then its packed pixels)."""
    def rows(w: int, h: int) -> int:
        return 0 if w == 0 or h == 0 else h * (1 + (w * bits + 7) // 8)

    if not interlaced:
        return rows(width, height)
    return sum(rows((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7)


def _check_png(data: bytes, width: int, height: int) -> None:
    if len(data) < 33:
        raise MediaError("a corrupt PNG file (truncated IHDR)")
    depth, color, _, _, interlace = struct.unpack(">BBBBB", data[24:29])
    if color not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
        raise MediaError(f"a corrupt PNG file (color type {color}, bit depth {depth})")
    expected = _png_raw_size(width, height, _PNG_CHANNELS[color] * depth, interlace == 1)
    inflater = zlib.decompressobj()
    produced = 0
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IEND":
            break
        if kind != b"IDAT" or inflater.eof:
            continue
        while body and not inflater.eof:
            try:
                out = inflater.decompress(body, 1 << 20)
            except zlib.error as exc:
                raise MediaError(f"a corrupt PNG file (its pixel data does not inflate: {exc})") from None
            produced += len(out)
            if produced > expected:
                raise MediaError(f"a corrupt PNG file: its pixel data inflates beyond the {expected} bytes "
                                 f"a {width}×{height} image holds")
            body = inflater.unconsumed_tail


# JPEG start-of-frame markers (baseline, progressive, lossless...): not DHT (C4), JPG (C8) or DAC (CC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(data: bytes) -> tuple[int, int]:
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise MediaError("a corrupt JPEG file (bad marker)")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            i += 2
            continue
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker in _SOF:
            if i + 9 > n:
                break
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return width, height
        if length < 2:
            raise MediaError("a corrupt JPEG file (bad segment length)")
        i += 2 + length
    raise MediaError("a corrupt or truncated JPEG file (no frame header)")


def _check_jpeg_scans(data: bytes) -> None:
    """Count the start-of-scan markers: walk the segments, skipping each scan's entropy-coded data."""
    scans, i, n = 0, 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return  # (the decoder reports what is wrong with it)
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker == 0xD9:  # end of image
            return
        if marker in (0x01, *range(0xD0, 0xD8)):
            i += 2
            continue
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        i += 2 + max(length, 2)
        if marker != 0xDA:
            continue
        scans += 1
        if scans > MAX_JPEG_SCANS:
            raise MediaError(f"a JPEG file with more than {MAX_JPEG_SCANS} scans is refused (each one costs a "
                             "pass over the whole image)")
        while True:  # the scan's data: up to a marker that is neither a stuffed 0xFF00 nor a restart
            i = data.find(b"\xff", i)
            if i < 0 or i + 1 >= n:
                return
            follower = data[i + 1]
            if follower == 0x00 or 0xD0 <= follower <= 0xD7:
                i += 2
                continue
            if follower == 0xFF:
                i += 1
                continue
            break


def _check_bmp(data: bytes, width: int, height: int) -> None:
    if len(data) < 34 or struct.unpack("<I", data[14:18])[0] < 40:
        return  # (an old-style header: stb reads its few fields; nothing large to allocate first)
    offset = struct.unpack("<I", data[10:14])[0]
    bpp, compression = struct.unpack("<HI", data[28:34])
    if compression in (0, 3) and bpp:  # uncompressed (or bit fields): every pixel is in the file
        row = (width * bpp + 31) // 32 * 4
        if len(data) < offset + row * height:
            raise MediaError(f"a truncated BMP file: {width}×{height} pixels need {offset + row * height} bytes, "
                             f"it has {len(data)}")


# ---- audio ---------------------------------------------------------------------------------------
def audio_seconds(data: bytes) -> float:
    """The clip's length in seconds as the decoder will size it: a WAV's data chunk, a FLAC's sample
    count (0 when it does not say), an MP3's frames. MediaError for a header that cannot be read."""
    if data[:4] == b"RIFF":
        return _wav_seconds(data)
    if data[:4] == b"fLaC":
        return _flac_seconds(data)
    return _mp3_seconds(data)


def _wav_seconds(data: bytes) -> float:
    pos, rate, block = 12, 0, 0
    while pos + 8 <= len(data):
        kind, size = struct.unpack("<4sI", data[pos:pos + 8])
        body = pos + 8
        if kind == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise MediaError("a corrupt WAV file (short fmt chunk)")
            _, _, rate, _, block = struct.unpack("<HHIIH", data[body:body + 14])
        elif kind == b"data":
            if not rate or not block:
                raise MediaError("a corrupt WAV file (no fmt chunk before its data, or a zero rate)")
            if size > len(data) - body:
                raise MediaError(f"a truncated WAV file: its data chunk claims {size} bytes, it has "
                                 f"{len(data) - body}")
            return size // block / rate
        pos = body + size + (size & 1)
    raise MediaError("a corrupt WAV file (no data chunk)")


def _flac_seconds(data: bytes) -> float:
    if len(data) < 8 + 18 or data[4] & 0x7F != 0:
        raise MediaError("a corrupt FLAC file (no STREAMINFO block first)")
    info = data[8:8 + 18]
    packed = int.from_bytes(info[10:18], "big")  # rate 20 bits, channels 3, bits 5, total samples 36
    rate = packed >> 44
    total = packed & ((1 << 36) - 1)
    if not rate:
        raise MediaError("a corrupt FLAC file (sample rate 0)")
    return total / rate


# MPEG audio: bitrates (kbit/s) by [version is MPEG-1][layer], sample rates by version.
_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mp3_seconds(data: bytes) -> float:
    """The duration of the MPEG audio frames of ``data`` (an ID3v2 tag skipped; garbage between frames
    skipped as the decoder resynchronises)."""
    pos, n, seconds, frames = 0, len(data), 0.0, 0
    if data[:3] == b"ID3" and n >= 10:
        size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F)
        pos = 10 + size + (10 if data[5] & 0x10 else 0)
    while pos + 4 <= n:
        if data[pos] != 0xFF or data[pos + 1] & 0xE0 != 0xE0:
            nxt = data.find(b"\xff", pos + 1)
            if nxt < 0:
                break
            pos = nxt
            continue
        header = int.from_bytes(data[pos:pos + 4], "big")
        version = (header >> 19) & 3  # 0: MPEG-2.5, 2: MPEG-2, 3: MPEG-1
        layer = 4 - ((header >> 17) & 3)  # 1, 2, 3 (4: reserved)
        bitrate_index = (header >> 12) & 15
        rate_index = (header >> 10) & 3
        if version == 1 or layer == 4 or bitrate_index == 15 or rate_index == 3:
            pos += 1
            continue
        if bitrate_index == 0:
            raise MediaError("free-format MP3 files are not supported")
        mpeg1 = version == 3
        bitrate = _BITRATES[(mpeg1, layer)][bitrate_index] * 1000
        rate = _RATES[version][rate_index]
        padding = (header >> 9) & 1
        if layer == 1:
            length, samples = (12 * bitrate // rate + padding) * 4, 384
        else:
            per = 144 if mpeg1 or layer == 2 else 72
            length, samples = per * bitrate // rate + padding, 1152 if mpeg1 or layer == 2 else 576
        seconds += samples / rate
        frames += 1
        pos += max(length, 4)
    if not frames:
        raise MediaError("not an MP3 file llama.cpp can decode (no MPEG audio frame)")
    return seconds
