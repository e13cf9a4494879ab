"""What generates: the protocol chat, tool calls, structured output and the manager run on.

A :class:`GenerationTarget` streams a prompt (text or token ids), generates it to a
:class:`~llama_ctypes.core.generation.Completion`, and names the :class:`Model` whose
vocabulary and templates the caller uses. Three implement it: :class:`LocalTarget`,
the one-call API over the model's context pool (each call runs on its own context),
the batching ``Server`` (engines), which needs nothing from this module, and a ``SpeculativeSession``
(through :class:`StreamTarget`); callers take any through :func:`as_target`, which also takes a bare Model.

Thread safety: a LocalTarget may be shared; each call checks a context out of the
model's pool.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from ..errors import ArgumentTypeError
from .generation import Completion, TextStream
from .model import Model
from .one_call import stream

__all__ = ["GenerationTarget", "LocalTarget", "StreamTarget", "as_target", "iterate_in_thread"]


@runtime_checkable
class GenerationTarget(Protocol):
    """Something that generates for a model: a :class:`LocalTarget`, a ``Server`` or a ``SpeculativeSession``."""

    @property
    def model(self) -> Model: ...

    def stream(self, prompt: str | Sequence[int], **opts: Any) -> Iterator[str]:
        """Text pieces (a stream with ``completion()``, ``cancel()``, ``close()``, ``tokens``)."""

    def stream_tokens(self, tokens: Sequence[int], **opts: Any) -> Iterator[str]:
        """:meth:`stream` for token ids (``session=`` where the target keeps conversations)."""

    def generate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        """Generate to completion."""

    async def agenerate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        """:meth:`generate` without blocking the event loop."""

    def astream(self, prompt: str | Sequence[int], **opts: Any) -> AsyncIterator[str]:
        """:meth:`stream` as an async iterator."""


class StreamTarget:
    """The :class:`GenerationTarget` methods that follow from ``stream``: a class with ``model`` and
    ``stream(prompt, **opts)`` gets ``stream_tokens``, ``generate``, ``agenerate`` and ``astream``."""

    def stream(self, prompt: str | Sequence[int], **opts: Any) -> TextStream:  # pragma: no cover - abstract
        raise NotImplementedError

    def stream_tokens(self, tokens: Sequence[int], *, session: Any = None, **opts: Any) -> TextStream:
        if session is not None:
            raise ArgumentTypeError("session= needs a Server (it keeps a conversation on its slot)")
        # (a MediaPrompt stays one: its media spans go with it)
        return self.stream(tokens if getattr(tokens, "spans", None) is not None else list(tokens), **opts)

    def generate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        return self.stream(prompt, **opts).completion()

    async def agenerate(self, prompt: str | Sequence[int], **opts: Any) -> Completion:
        return await asyncio.to_thread(self.generate, prompt, **opts)

    async def astream(self, prompt: str | Sequence[int], **opts: Any) -> AsyncIterator[str]:
        async for piece in iterate_in_thread(await asyncio.to_thread(self.stream, prompt, **opts)):
            yield piece


class LocalTarget(StreamTarget):
    """The one-call API as a target: every call runs on a context of ``model``'s pool.

    options: given to every call, before the call's own (e.g. the context options a manager fixes
    when it loads a model: ``n_ctx``, ``type_k``, ...).
    """

    def __init__(self, model: Model, options: Mapping[str, Any] | None = None):
        if not isinstance(model, Model):
            raise ArgumentTypeError(f"model={model!r}: expected a Model")
        self._model = model
        self._options = dict(options or {})

    @property
    def model(self) -> Model:
        return self._model

    def stream(self, prompt: str | Sequence[int], **opts: Any) -> TextStream:
        return stream(self._model, prompt, **{**self._options, **opts})

    def __repr__(self) -> str:
        return f"LocalTarget({self._model!r})"


def as_target(target: Model | GenerationTarget) -> GenerationTarget:
    """``target`` as a :class:`GenerationTarget`: a Model becomes a :class:`LocalTarget`."""
    if isinstance(target, Model):
        return LocalTarget(target)
    if isinstance(target, GenerationTarget):
        return target
    raise ArgumentTypeError(f"expected a Model or a Server (a GenerationTarget), got {type(target).__name__}")


async def iterate_in_thread(iterator: Any) -> AsyncIterator:
    """Drive a blocking stream from a worker thread; leaving early (or being cancelled) stops it.

    A step in flight is never abandoned: the stream is cancelled (thread-safe on our
    streams), the step awaited, and only then the iterator closed, in a worker thread,
    so a generator is never closed while it runs.
    """
    done = object()
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(asyncio.to_thread(next, iterator, done))
            item = await asyncio.shield(step)
            step = None
            if item is done:
                return
            yield item
    finally:
        cancel = getattr(iterator, "cancel", None)
        if cancel is not None:
            cancel()
        if step is not None:
            try:
                await asyncio.shield(step)
            except BaseException:  # the step's own outcome no longer matters
                pass
        close = getattr(iterator, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
