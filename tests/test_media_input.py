"""Media inputs before any native call (core/media.py): forms, headers, limits, bad input."""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib

import numpy as np
import pytest
from media_files import png, wav
from PIL import Image

from llama_ctypes.core.media import MediaLimits, read_media
from llama_ctypes.core.media_probe import image_size
from llama_ctypes.errors import ArgumentTypeError, InvalidArgumentError, MediaError, MediaTooLargeError


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width×height, with one tiny (wrong) data chunk: a decompression bomb's shape."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    out = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    data = zlib.compress(b"\x00" * 64)
    idat = b"IDAT" + data
    return out + struct.pack(">I", len(data)) + idat + struct.pack(">I", zlib.crc32(idat))


RNG = np.random.default_rng(0)
IMG = RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_image_size_from_header(fmt):
    buf = io.BytesIO()
    Image.fromarray(IMG).save(buf, format=fmt)
    assert image_size(buf.getvalue()) == (40, 30)


def test_progressive_jpeg_size():
    buf = io.BytesIO()
    Image.fromarray(IMG).save(buf, format="JPEG", progressive=True)
    assert image_size(buf.getvalue()) == (40, 30)


def test_forms_of_one_image_share_an_id(tmp_path):
    data = png(IMG)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    ids = {read_media(x).id for x in (data, bytearray(data), memoryview(data), str(path), path, url)}
    assert len(ids) == 1
    got = read_media(data)
    assert (got.kind, got.raw, got.width, got.height) == ("image", False, 40, 30)
    # arrays and PIL images are raw RGB: one id for both, another than the file's (it is what gets decoded)
    raw = {read_media(IMG).id, read_media(Image.fromarray(IMG)).id,
           read_media(np.dstack([IMG, np.full((30, 40), 255, np.uint8)])).id}
    assert len(raw) == 1 and raw != ids
    assert read_media(IMG[:, :, ::-1].copy()).id not in raw


def test_audio_forms():
    pcm = np.sin(np.linspace(0, 100, 16000)).astype(np.float32)
    got = read_media(wav(pcm))
    assert got.kind == "audio" and not got.raw
    arr = read_media(pcm)
    assert arr.kind == "audio" and arr.raw and arr.data.dtype == np.float32
    assert read_media(pcm.astype(np.float64)).id == arr.id
    with pytest.raises(MediaError, match="at least 2 samples"):
        read_media(np.zeros(1, np.float32))
    with pytest.raises(MediaError, match="finite"):
        read_media(np.array([0.0, np.nan], np.float32))


@pytest.mark.parametrize("bad, match", [
    (b"hello, I am a text file", "not an image or audio"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "corrupt PNG"),
    (b"\xff\xd8\xff\xe0\x00\x02", "JPEG"),
    (b"GIF89a\x01", "corrupt GIF"),
    (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "WebP"),
    (b"", "empty"),
])
def test_bad_files(bad, match):
    with pytest.raises(MediaError, match=match):
        read_media(bad)


def test_decompression_bomb_refused_before_decoding():
    bomb = png_header_only(20000, 20000)
    assert len(bomb) < 200 and image_size(bomb) == (20000, 20000)
    with pytest.raises(MediaTooLargeError, match="20000×20000"):
        read_media(bomb)
    with pytest.raises(MediaTooLargeError):
        read_media(png_header_only(17000, 10), MediaLimits(max_pixels=10**9))  # max_side
    with pytest.raises(MediaError, match="empty"):
        read_media(png_header_only(0, 10))


def test_limits():
    data = png(IMG)
    with pytest.raises(MediaTooLargeError, match="bytes"):
        read_media(data, MediaLimits(max_bytes=len(data) - 1))
    with pytest.raises(MediaTooLargeError, match="data: URL"):
        read_media("data:image/png;base64," + base64.b64encode(data).decode(), MediaLimits(max_bytes=16))
    with pytest.raises(MediaTooLargeError):
        read_media(IMG, MediaLimits(max_pixels=100))
    with pytest.raises(InvalidArgumentError):
        MediaLimits(max_bytes=0)
    with pytest.raises(InvalidArgumentError):
        MediaLimits(max_audio_seconds=-1)


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,@@@@", "base64"),
    ("data:image/png,abcd", "base64"),
    ("data:nonsense", "data:"),
])
def test_bad_data_urls(url, match):
    with pytest.raises(MediaError, match=match):
        read_media(url)


def test_urls_paths_and_types(tmp_path):
    with pytest.raises(MediaError, match="not fetched"):
        read_media("https://example.com/cat.png")
    with pytest.raises(FileNotFoundError):
        read_media(str(tmp_path / "missing.png"))
    with pytest.raises(MediaError, match="directory"):
        read_media(tmp_path)
    (tmp_path / "a.png").write_bytes(png(IMG))
    with pytest.raises(MediaError, match="paths are not accepted"):
        read_media(str(tmp_path / "a.png"), allow_paths=False)
    with pytest.raises(ArgumentTypeError):
        read_media(12)
    with pytest.raises(MediaError, match="neither an image"):
        read_media(np.zeros((4, 4), np.uint8))
    with pytest.raises(MediaError, match="neither an image"):
        read_media(np.zeros((4, 4, 3), np.float32))


# ---- what a small file could make the decoders do (checked before any native call) ------------------
def wav_header_rate(n_bytes: int, rate: int, width: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(b"\x80" * n_bytes)
    return buf.getvalue()


def test_audio_length_is_read_before_decoding():
    from llama_ctypes.core.media_probe import audio_seconds

    # 4000 bytes at 1 Hz is 4000 s of audio: 64 M samples once resampled to 16 kHz
    with pytest.raises(MediaTooLargeError, match="4000.0 s"):
        read_media(wav_header_rate(4000, 1))
    assert audio_seconds(wav_header_rate(16000, 16000)) == 1.0
    truncated = bytearray(wav_header_rate(1000, 16000))
    truncated[40:44] = (10**9).to_bytes(4, "little")  # the data chunk claims a gigabyte
    with pytest.raises(MediaError, match="truncated WAV"):
        read_media(bytes(truncated))
    # FLAC: the STREAMINFO sample count is what the decoder allocates
    info = (16000 << 44) | (1 << 41) | (15 << 36) | (16000 * 3600 * 10)  # 10 hours
    flac = b"fLaC" + bytes([0x80, 0, 0, 34]) + b"\x10\x00\x10\x00" + b"\0" * 6 + info.to_bytes(8, "big") + b"\0" * 16
    with pytest.raises(MediaTooLargeError, match="36000.0 s"):
        read_media(flac)
    # MP3: frames counted (MPEG-1 layer III, 128 kbit/s, 44.1 kHz: 417 bytes and 1152 samples each)
    frame = bytes([0xFF, 0xFB, 0x90, 0x00]) + b"\0" * 413
    assert abs(audio_seconds(frame * 100) - 100 * 1152 / 44100) < 1e-9
    with pytest.raises(MediaTooLargeError):
        read_media(frame * 100, MediaLimits(max_audio_seconds=1.0))
    with pytest.raises(MediaError, match="free-format"):
        read_media(bytes([0xFF, 0xFB, 0x00, 0x00]) + b"\0" * 100)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_png_whose_data_inflates_beyond_its_size_is_refused():
    raw = zlib.compress(b"\x00" * (8 << 20), 9)  # 8 MiB of zeros: about 8 KB compressed
    bomb = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + png_chunk(b"IDAT", raw) + png_chunk(b"IEND", b""))
    assert len(bomb) < 20_000
    with pytest.raises(MediaError, match="inflates beyond"):
        read_media(bomb)
    # real files pass, interlaced ones included
    for interlace in (False, True):
        buf = io.BytesIO()
        Image.fromarray(IMG).save(buf, format="PNG", interlace=interlace)
        assert read_media(buf.getvalue()).width == 40
    buf = io.BytesIO()
    Image.fromarray(IMG[:, :, 0]).convert("1").save(buf, format="PNG")  # 1 bit per pixel
    assert read_media(buf.getvalue()).height == 30


def test_jpeg_with_thousands_of_scans_is_refused():
    buf = io.BytesIO()
    Image.fromarray(IMG).save(buf, format="JPEG", progressive=True)
    data = buf.getvalue()
    assert read_media(data).width == 40  # (a real progressive JPEG: about 10 scans)
    sos = data.index(b"\xff\xda")
    scan = data[sos:data.index(b"\xff\xda", sos + 2)]  # the first scan (and the tables after it), copied
    with pytest.raises(MediaError, match="scans"):
        read_media(data[:sos] + scan * 500 + data[sos:])


def test_truncated_uncompressed_bmp_is_refused():
    header = (b"BM" + (54).to_bytes(4, "little") + b"\0\0\0\0" + (54).to_bytes(4, "little") + (40).to_bytes(4, "little")
              + (5000).to_bytes(4, "little") + (5000).to_bytes(4, "little") + (1).to_bytes(2, "little")
              + (24).to_bytes(2, "little") + b"\0" * 24)
    with pytest.raises(MediaError, match="truncated BMP"):
        read_media(header + b"\0" * 80)


def test_media_data_is_checked_again_and_special_files_are_refused(tmp_path):
    from llama_ctypes.core.media import MediaData

    lying = MediaData("image", np.zeros((2, 2, 3), np.uint8), True, "x", 4000, 4000)
    again = read_media(lying)
    assert (again.width, again.height) == (2, 2)
    with pytest.raises(MediaTooLargeError):
        read_media(MediaData("image", png_header_only(20000, 20000), False, "x", 1, 1))
    with pytest.raises(MediaError, match="regular file"):
        read_media("/dev/zero")
