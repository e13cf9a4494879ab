"""Image and audio files for the multimodal tests, made in memory (Pillow for images, ``wave`` for audio)."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
from PIL import Image


def png(arr: np.ndarray, fmt: str = "PNG") -> bytes:
    """An H×W×3 ``uint8`` array as an image file (PNG unless ``fmt`` says another Pillow format)."""
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """Float samples in [-1, 1] as a 16-bit mono WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
