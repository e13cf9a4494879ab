"""ServerParams: a Server's own settings (slots, batch, queue, caches, speculation), validated in one place.

The Server, the ModelManager (which routes a load's options with ``split_options``) and
``llama-ctypes serve`` (through the manager) all take them from here; model, context, sampling
and generation options go to their own dataclasses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...errors import ArgumentTypeError, InvalidArgumentError
from ..speculative.drafters import Drafter
from ..speculative.session import MAX_DRAFT
from .strategies import DecodeMaximal

__all__ = ["DEFAULT_MAX_QUEUE", "ServerParams"]

#: Requests that may wait for a slot by default: a flood fails fast (QueueFullError) instead of growing the
#: queue (~20 KB each) without bound. ``max_queue=0`` lifts the bound.
DEFAULT_MAX_QUEUE = 256


@dataclass(frozen=True)
class ServerParams:
    """A :class:`~llama_ctypes.Server`'s settings (see its docstring for each)."""

    n_parallel: int = 4
    n_ctx: int = 4096
    n_batch: int = 512
    batch_strategy: Any = DecodeMaximal
    max_queue: int = DEFAULT_MAX_QUEUE
    cache_prompt: bool = True
    prompt_cache_ram_mb: float = 0
    kv_unified: bool = True
    share_kv: bool = False
    speculative: Any = None
    n_draft: int = 4
    loras: Any = ()  # LoRA adapters to load at start: paths, (path, name) pairs or adapters (Server checks them)
    control_vector: Any = None  # a ControlVector for every request, or load_control_vector's arguments as a dict

    def __post_init__(self) -> None:
        if isinstance(self.n_parallel, bool) or not isinstance(self.n_parallel, int) or self.n_parallel < 1:
            raise InvalidArgumentError(f"n_parallel={self.n_parallel!r}: expected an integer >= 1")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InvalidArgumentError(f"max_queue={self.max_queue!r}: expected an integer >= 0")
        if self.share_kv and not self.kv_unified:
            raise InvalidArgumentError("share_kv=True needs kv_unified=True (slots can only share one KV buffer)")
        ram = self.prompt_cache_ram_mb
        if isinstance(ram, bool) or not isinstance(ram, (int, float)) or not 0 <= ram < 2**40:  # (NaN fails too)
            raise InvalidArgumentError(f"prompt_cache_ram_mb={ram!r}: expected a number >= 0")
        if self.speculative is not None:
            n = self.n_draft
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT:
                raise InvalidArgumentError(f"n_draft={n!r}: expected an integer in [1, {MAX_DRAFT}]")
            if not isinstance(self.speculative, (Drafter, str, os.PathLike)):
                raise ArgumentTypeError(f"speculative= takes a Drafter (NgramDraft, DraftModel), \"ngram\" or a "
                                        f"draft GGUF path, not {type(self.speculative).__name__}")
