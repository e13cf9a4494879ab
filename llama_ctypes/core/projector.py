"""A multimodal projector (an ``mmproj`` GGUF) over a text Model: images and audio into prompts.

llama.cpp's libmtmd does the work: :class:`Projector` owns its ``mtmd_context``, turns a text with
media markers plus the media into chunks (``mtmd_tokenize``), and encodes an image or audio chunk
into embeddings (``mtmd_encode_chunk``). A :class:`MediaPrompt` is the result: the prompt's token ids
where each media chunk holds placeholder ids, so that prefix reuse (``common_prefix``) works on it as on
text; the context's lease decodes the embeddings in place of the placeholders
(core/lease_media.py). Placeholders are negative (never a vocabulary id) and derived from the media's
content hash: the same image at the same place reuses its KV, another image never does.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

from ..errors import InvalidArgumentError, MediaError, MediaTooLargeError, ModelLoadError
from ..native import mtmd_h as M
from .backend import clear_native_error, init_mtmd, native_error
from .gguf_file import check_gguf_file
from .handle import Hold, NativeHandle
from .media import MediaData, MediaKind, MediaLimits, read_media
from .params import default_threads
from .rpc.client import local_offload_devices

if TYPE_CHECKING:
    from .model import Model

__all__ = ["MEDIA_MARKER", "ProjectorParams", "Projector", "MediaPrompt", "MediaSpan", "MediaChunks"]

logger = logging.getLogger(__name__)

MEDIA_MARKER = "<__media__>"
"""Where an image or audio clip goes in a raw prompt (``lc.generate(model, prompt, media=[...])``)."""


@dataclass(frozen=True)
class ProjectorParams:
    """How a projector runs (llama.cpp's defaults: ``mtmd_context_params_default``).

    ``use_gpu`` (True): encode on the first local GPU when there is one (never on an RPC worker's device:
    llama.cpp would pick one, and a lost worker aborted the load). ``n_threads`` (None: the CPUs this
    process may use). ``image_min_tokens``/``image_max_tokens`` (None: the projector's metadata) bound the
    tokens of one image for projectors with dynamic resolution. ``warmup`` (True): one encode at load,
    so the first request does not pay for graph allocation.
    """

    use_gpu: bool = True
    n_threads: int | None = None
    image_min_tokens: int | None = None
    image_max_tokens: int | None = None
    warmup: bool = True

    def __post_init__(self) -> None:
        for name in ("n_threads", "image_min_tokens", "image_max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"ProjectorParams.{name} must be a positive integer or None, got {value!r}")
        if (self.image_min_tokens and self.image_max_tokens and self.image_min_tokens > self.image_max_tokens):
            raise InvalidArgumentError("ProjectorParams.image_min_tokens is over image_max_tokens")


@dataclass(frozen=True)
class MediaSpan:
    """One image or audio chunk of a :class:`MediaPrompt`: prompt entries ``start .. start + n_tokens``."""

    start: int
    n_tokens: int
    n_pos: int  # positions it takes (n_tokens, except on M-RoPE models)
    kind: MediaKind
    id: str  # the chunk's content id
    index: int  # of the chunk in its MediaChunks

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


class MediaPrompt(list):
    """A prompt's token ids with images or audio: each media chunk's entries are one placeholder id.

    A ``list`` so that every generation path takes it as a prompt; ``spans`` says where the media is
    and ``chunks`` holds the native chunks (and, through them, the projector) until the prompt is
    dropped. A slice is a plain list without media: only the lease's prefill reads the spans.
    """

    spans: tuple[MediaSpan, ...]
    chunks: "MediaChunks"
    encoded: dict[int, np.ndarray | BaseException]
    """Embeddings of the spans encoded so far, by span start (or the error encoding gave): kept with the
    prompt, so the choices of one request and a prompt used twice encode each image once."""
    encoding: set[int]
    """Span starts whose encode is running (a Server encodes off its scheduler thread)."""

    def embeddings(self, span: MediaSpan) -> np.ndarray:
        """The span's embeddings, encoded now (in this thread) unless they were already."""
        got = self.encoded.get(span.start)
        if got is None:
            try:
                got = self.chunks.projector.encode(self.chunks, span.index)
            except Exception as exc:
                got = exc
            self.encoded[span.start] = got
        if isinstance(got, BaseException):
            raise got
        return got

    def next_span(self, n: int) -> MediaSpan | None:
        """The first span not wholly within the first ``n`` entries."""
        for span in self.spans:
            if span.end > n:
                return span
        return None

    def span_at(self, i: int) -> MediaSpan | None:
        """The span holding entry ``i``, if any."""
        for span in self.spans:
            if span.start <= i < span.end:
                return span
        return None

    def cut_point(self, n: int) -> int:
        """``n`` moved back to the start of a span it would split (a media chunk is decoded whole)."""
        span = self.span_at(n)
        return span.start if span is not None and span.start < n else n

    def check(self) -> None:
        """Raise unless the list still matches its spans and chunks (it is a list: it can be changed).

        Every span lies in the list, in order, holds its own placeholder and nothing else, and names a
        media chunk of that many tokens; no other entry is negative; the chunks are still there
        (ClosedError when they were closed)."""
        at = 0
        for span in self.spans:
            if not at <= span.start < span.end <= len(self):
                raise InvalidArgumentError("this MediaPrompt was changed: its media spans no longer fit it")
            if any(t < 0 for t in self[at:span.start]):
                raise InvalidArgumentError("this MediaPrompt was changed: a media placeholder outside its span")
            placeholder = placeholder_id(f"{span.id}/{span.n_tokens}")
            if any(t != placeholder for t in self[span.start:span.end]):
                raise InvalidArgumentError("this MediaPrompt was changed: a media span holds other entries")
            with self.chunks.using(span.index) as chunk:
                if int(self.chunks._lib.mtmd_input_chunk_get_n_tokens(chunk)) != span.n_tokens:
                    raise InvalidArgumentError("this MediaPrompt's spans do not match its media chunks")
            at = span.end
        if any(t < 0 for t in self[at:]):
            raise InvalidArgumentError("this MediaPrompt was changed: a media placeholder outside its span")

    @property
    def text_tokens(self) -> list[int]:
        """The ids that are real tokens (media placeholders left out)."""
        return [t for t in self if t >= 0]


def placeholder_id(chunk_id: str) -> int:
    """A negative id for a media chunk's prompt entries, from its content id (never a vocabulary id)."""
    digest = hashlib.sha256(chunk_id.encode("utf-8", "surrogateescape")).digest()
    return -1 - int.from_bytes(digest[:7], "little")


class Projector(NativeHandle):
    """An ``mmproj`` GGUF loaded over a text model: what turns images and audio into embeddings.

    Made by :meth:`Model.attach_projector` (or ``load_model(..., mmproj=)``), closed with its model. Thread
    safety: share it freely; encodes are serialised by its own lock (libmtmd keeps one output buffer).
    """

    _kind = "Projector"

    def __init__(self, model: "Model", path: str | os.PathLike, params: ProjectorParams | None = None):
        super().__init__()
        self._ptr = None
        self._model_hold: Hold | None = None
        self.path = Path(path)
        self.params = params or ProjectorParams()
        self._encode_lock = threading.Lock()
        try:
            checked = check_gguf_file(self.path)
            self._lib = init_mtmd()
            self._model_hold = model.hold()  # libmtmd keeps the text model's pointer
            self.model = model
            self.marker = f"<__media_{secrets.token_hex(8)}__>"
            """The marker the projector looks for: random, so that text from a user never places media."""
            self._ptr = self._load(checked, model)
        except BaseException:
            if self._model_hold is not None:
                self._model_hold.release()
            self._mark_dead()
            raise
        lib = self._lib
        kinds = []
        if lib.mtmd_support_vision(self._ptr):
            kinds.append("vision")
        if lib.mtmd_support_audio(self._ptr):
            kinds.append("audio")
        self.modalities: frozenset[str] = frozenset(kinds)
        """What it takes: ``{"vision"}``, ``{"audio"}`` or both."""
        rate = int(lib.mtmd_get_audio_sample_rate(self._ptr)) if "audio" in kinds else None
        self.audio_sample_rate: int | None = rate
        """Samples per second of the PCM arrays it takes as audio (None without audio)."""
        self.uses_mrope = bool(lib.mtmd_decode_use_mrope(self._ptr))
        self.n_embd = model.n_embd_inp

    def _load(self, path: Path, model: "Model"):
        lib, p = self._lib, self.params
        native = lib.mtmd_context_params_default()
        native.use_gpu = bool(p.use_gpu)
        if p.use_gpu:  # (left NULL, clip takes the first GPU-type device: an RPC worker's counts as one)
            local = local_offload_devices(lib, "layer")
            native.use_gpu = bool(local)
            native.device = local[0] if local else None
        native.print_timings = False
        native.n_threads = p.n_threads or default_threads()
        native.warmup = bool(p.warmup)
        native.image_min_tokens = p.image_min_tokens or -1
        native.image_max_tokens = p.image_max_tokens or -1
        marker = self.marker.encode()
        native.media_marker = marker
        clear_native_error()
        with model._shared():
            ptr = lib.mtmd_init_from_file(os.fsencode(path), model._ptr, native)
        if not ptr:
            raise ModelLoadError(f"could not load the projector {path}: "
                                 f"{native_error('not an mmproj file, or one for another text model', lines=2)}")
        return ptr

    def _free(self) -> None:
        if self._ptr:
            self._lib.mtmd_free(self._ptr)
            self._ptr = None
        if self._model_hold is not None:
            self._model_hold.release()
            self._model_hold = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else ", ".join(sorted(self.modalities))
        return f"<Projector {self.path.name} ({state})>"

    # ---- media -> chunks ------------------------------------------------------------------------
    def read(self, item, limits: MediaLimits | None = None, *, allow_paths: bool = True) -> MediaData:
        """Read one input (see core/media.py) and check that this projector takes its kind."""
        data = read_media(item, limits, allow_paths=allow_paths)
        self.check_kind(data.kind)
        if data.kind == "audio" and data.raw and self.audio_sample_rate:
            seconds = data.data.size / self.audio_sample_rate
            limit = (limits or MediaLimits()).max_audio_seconds
            if seconds > limit:
                raise MediaTooLargeError(f"an audio clip of {seconds:.1f} s is over the limit of {limit:g} s")
        return data

    def check_kind(self, kind: MediaKind) -> None:
        wanted = "vision" if kind == "image" else "audio"
        if wanted not in self.modalities:
            raise MediaError(f"the projector {self.path.name} takes no {kind} input "
                             f"(it takes: {', '.join(sorted(self.modalities)) or 'nothing'})")

    def tokenize(self, text: str, media: Sequence[MediaData], *, add_special: bool = True,
                 parse_special: bool = True, limits: MediaLimits | None = None) -> MediaPrompt:
        """``text`` with one :attr:`marker` per item of ``media``, as a :class:`MediaPrompt`.

        Images and audio are decoded and preprocessed here (not encoded: that happens when the prompt is
        decoded, or ahead of it in a Server). MediaError for a marker count that does not match, a file
        that does not decode, or a kind the projector does not take.
        """
        limits = limits or MediaLimits()
        if len(media) > limits.max_items:
            raise MediaTooLargeError(f"{len(media)} media in one prompt; the limit is {limits.max_items}")
        n_markers = text.count(self.marker)
        if n_markers != len(media):
            raise MediaError(f"the prompt has {n_markers} media marker(s) for {len(media)} media")
        for item in media:
            self.check_kind(item.kind)
        lib = self._lib
        with self._shared():
            bitmaps: list[int] = []
            try:
                for item in media:
                    bitmaps.append(self._named(item, lambda: self._bitmap(item, limits)))
            except BaseException:
                for bm in bitmaps:
                    lib.mtmd_bitmap_free(bm)
                raise
            try:
                data = text.encode("utf-8")
                inp = M.mtmd_input_text(data, len(data), add_special, parse_special)
                arr = (ctypes.c_void_p * max(1, len(bitmaps)))(*bitmaps)
                chunks = lib.mtmd_input_chunks_init()
                if not chunks:
                    raise MemoryError("mtmd_input_chunks_init failed")
                clear_native_error()
                rc = lib.mtmd_tokenize(self._ptr, chunks, ctypes.byref(inp), arr, len(bitmaps))
            finally:
                for bm in bitmaps:
                    lib.mtmd_bitmap_free(bm)
            if rc != 0:
                lib.mtmd_input_chunks_free(chunks)
                raise MediaError(f"the media could not be prepared ({native_error(f'mtmd_tokenize: {rc}')})")
            owner = MediaChunks(self, chunks)
        return owner.prompt()

    @staticmethod
    def _named(item: MediaData, make):
        """``make()``, its MediaError naming where the request had ``item`` (``param``, as HTTP errors do)."""
        try:
            return make()
        except MediaError as exc:
            if not item.source:
                raise
            error = type(exc)(f"{item.source}: {exc}")
            error.param = item.source  # type: ignore[attr-defined]
            raise error from None

    def _bitmap(self, item: MediaData, limits: MediaLimits) -> int:
        """A new ``mtmd_bitmap *`` for ``item`` (the caller frees it), its id set to the content hash."""
        lib = self._lib
        if item.raw:
            arr = item.data
            if item.kind == "image":
                bm = lib.mtmd_bitmap_init(item.width, item.height, arr.ctypes.data)
            else:
                bm = lib.mtmd_bitmap_init_from_audio(arr.size, arr.ctypes.data)
        else:
            buf = item.data
            clear_native_error()
            wrapper = lib.mtmd_helper_bitmap_init_from_buf(self._ptr, buf, len(buf), False,
                                                           lib.mtmd_helper_init_opt_default())
            bm = wrapper.bitmap
            if not bm:
                raise MediaError(f"the {item.kind} could not be decoded ({native_error('corrupt or truncated')})")
            if bool(lib.mtmd_bitmap_is_audio(bm)) != (item.kind == "audio"):
                lib.mtmd_bitmap_free(bm)
                raise MediaError(f"the file decoded as another kind of media than its header says ({item.kind})")
            if item.kind == "audio" and self.audio_sample_rate:
                seconds = lib.mtmd_bitmap_get_n_bytes(bm) / 4 / self.audio_sample_rate
                if seconds > limits.max_audio_seconds:
                    lib.mtmd_bitmap_free(bm)
                    raise MediaTooLargeError(
                        f"an audio clip of {seconds:.1f} s is over the limit of {limits.max_audio_seconds:g} s")
                if lib.mtmd_bitmap_get_n_bytes(bm) < 8:
                    lib.mtmd_bitmap_free(bm)
                    raise MediaError("the audio clip holds less than 2 samples")
        if not bm:
            raise MemoryError(f"could not make a bitmap for the {item.kind}")
        lib.mtmd_bitmap_set_id(bm, item.id.encode())
        return bm

    # ---- chunks -> embeddings -------------------------------------------------------------------
    def encode(self, chunks: "MediaChunks", index: int) -> np.ndarray:
        """Embeddings of media chunk ``index``: float32 ``[n_tokens, n_embd]`` (a copy; thread-safe)."""
        lib = self._lib
        # (held: the chunks hold the projector, so work on them goes on after a close() until they go)
        with chunks.using(index) as chunk, self._shared(held=True), self._encode_lock:
            n_tokens = int(lib.mtmd_input_chunk_get_n_tokens(chunk))
            clear_native_error()
            rc = lib.mtmd_encode_chunk(self._ptr, chunk)
            if rc != 0:
                raise MediaError(f"encoding the media failed ({native_error(f'mtmd_encode_chunk: {rc}')})")
            out = lib.mtmd_get_output_embd(self._ptr)
            if not out:
                raise MediaError("encoding the media gave no output")
            embd = np.ctypeslib.as_array(out, shape=(n_tokens, self.n_embd)).copy()
        if not np.isfinite(embd).all():
            # (a clip of NaN samples, say: such cells would spoil the attention of a whole batch)
            raise MediaError("the media encoded to non-finite values (NaN or infinity); refused")
        return embd

    def uses_non_causal(self, chunks: "MediaChunks", index: int) -> bool:
        """Whether the chunk's embeddings are decoded with non-causal attention (one ubatch for all)."""
        with chunks.using(index) as chunk, self._shared(held=True):
            return bool(self._lib.mtmd_decode_use_non_causal(self._ptr, chunk))

    def decode_chunk_rc(self, chunks: "MediaChunks", index: int, embd: np.ndarray, ctx_ptr, pos: int, seq: int,
                        n_batch: int) -> int:
        """``mtmd_helper_decode_image_chunk``: the embeddings into a llama context at ``pos`` of ``seq``
        (the caller holds the context's lease); llama.cpp's return code."""
        new_pos = M.llama_pos(0)
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        with chunks.using(index) as chunk, self._shared(held=True):
            n_tokens = int(self._lib.mtmd_input_chunk_get_n_tokens(chunk))
            if embd.shape != (n_tokens, self.n_embd):  # (the helper reads n_tokens × n_embd floats)
                raise InvalidArgumentError(f"embeddings of shape {embd.shape} for a chunk of "
                                           f"{n_tokens}×{self.n_embd}")
            return int(self._lib.mtmd_helper_decode_image_chunk(
                self._ptr, ctx_ptr, chunk, embd.ctypes.data, pos, seq, n_batch, ctypes.byref(new_pos), None, None))


class MediaChunks(NativeHandle):
    """The native chunks of one tokenized prompt (``mtmd_input_chunks``); they keep the projector alive."""

    _kind = "MediaChunks"

    def __init__(self, projector: Projector, ptr) -> None:
        super().__init__()
        self._lib = projector._lib
        self._ptr = ptr
        self._hold = projector.hold()
        self.projector = projector
        self._count = int(self._lib.mtmd_input_chunks_size(ptr))

    def _free(self) -> None:
        if self._ptr:
            self._lib.mtmd_input_chunks_free(self._ptr)
            self._ptr = None
        self._hold.release()

    @contextlib.contextmanager
    def using(self, index: int) -> Iterator[int]:
        """The native pointer of media chunk ``index``, valid (the chunks kept alive) inside the ``with``."""
        with self._shared(held=True):
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._count:
                raise InvalidArgumentError(f"no media chunk {index!r} in these {self._count} chunks")
            chunk = self._lib.mtmd_input_chunks_get(self._ptr, index)
            if self._lib.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                raise InvalidArgumentError(f"chunk {index} is text, not media")
            yield chunk

    def prompt(self) -> MediaPrompt:
        """The chunks as a :class:`MediaPrompt`."""
        lib = self._lib
        prompt = MediaPrompt()
        spans = []
        n = int(lib.mtmd_input_chunks_size(self._ptr))
        for i in range(n):
            chunk = lib.mtmd_input_chunks_get(self._ptr, i)
            kind = lib.mtmd_input_chunk_get_type(chunk)
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t(0)
                ptr = lib.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                prompt.extend(ptr[:count.value] if count.value else ())
                continue
            n_tokens = int(lib.mtmd_input_chunk_get_n_tokens(chunk))
            raw_id = lib.mtmd_input_chunk_get_id(chunk)
            chunk_id = raw_id.decode("utf-8", "replace") if raw_id else f"anonymous-{secrets.token_hex(8)}"
            span = MediaSpan(len(prompt), n_tokens, int(lib.mtmd_input_chunk_get_n_pos(chunk)),
                             "image" if kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE else "audio", chunk_id, i)
            spans.append(span)
            prompt.extend([placeholder_id(f"{chunk_id}/{n_tokens}")] * n_tokens)
        prompt.spans = tuple(spans)
        prompt.chunks = self
        prompt.encoded = {}
        prompt.encoding = set()
        return prompt


def media_of(items: Iterable, projector: Projector, limits: MediaLimits | None = None,
             *, allow_paths: bool = True) -> list[MediaData]:
    """Read every item for ``projector`` (kinds checked), in order."""
    return [projector.read(item, limits, allow_paths=allow_paths) for item in items]

