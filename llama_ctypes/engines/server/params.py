"""ServerParams: a Server's own settings (slots, batch, queue, caches, speculation), validated in one place.

The Server, the ModelManager (which routes a load's options with ``split_options``) and
``llama-ctypes serve`` (through the manager) all take them from here; model, context, sampling
and generation options go to their own dataclasses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...core.memory import detect_system_memory
from ...errors import ArgumentTypeError, InvalidArgumentError
from ..speculative.drafters import Drafter
from ..speculative.session import MAX_DRAFT
from .strategies import DecodeMaximal

__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_PROMPT_CACHE_DISK_MB", "ServerParams", "default_prompt_cache_ram_mb"]

#: Requests that may wait for a slot by default: a flood fails fast (QueueFullError) instead of growing the
#: queue (~20 KB each) without bound. ``max_queue=0`` lifts the bound.
DEFAULT_MAX_QUEUE = 256

#: The disk tier's default budget (MiB), when a directory is given.
DEFAULT_PROMPT_CACHE_DISK_MB = 10240.0
#: llama-server's ``--cache-ram`` default (MiB): the most the RAM tier of evicted prefixes takes by default.
LLAMA_SERVER_CACHE_RAM_MB = 8192
#: ...and at most this share of the machine's memory (a laptop keeps its RAM; each loaded model has a tier).
CACHE_RAM_SHARE = 1 / 8


def default_prompt_cache_ram_mb() -> float:
    """The RAM tier's budget when none is given (MiB): llama-server's 8192, at most 1/8 of this machine's memory
    (cgroup limit included); 1024 where the platform cannot say. Memory is taken only as prefixes are evicted."""
    total = detect_system_memory()
    if total is None:
        return 1024.0
    return float(min(LLAMA_SERVER_CACHE_RAM_MB, total * CACHE_RAM_SHARE / 2**20))


@dataclass(frozen=True)
class ServerParams:
    """A :class:`~llama_ctypes.Server`'s settings (see its docstring for each)."""

    n_parallel: int = 4
    n_ctx: int = 4096
    n_batch: int = 512
    batch_strategy: Any = DecodeMaximal
    max_queue: int = DEFAULT_MAX_QUEUE
    cache_prompt: bool = True
    prompt_cache_ram_mb: float | None = None  # None: default_prompt_cache_ram_mb(); 0: off
    prompt_cache_dir: Any = None  # a directory for the disk tier (prompt_cache_disk.py); None: no disk tier
    prompt_cache_disk_mb: float = DEFAULT_PROMPT_CACHE_DISK_MB
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
        if ram is not None and (isinstance(ram, bool) or not isinstance(ram, (int, float))
                                or not 0 <= ram < 2**40):  # (NaN fails too)
            raise InvalidArgumentError(f"prompt_cache_ram_mb={ram!r}: expected a number >= 0 (MiB), or None")
        if self.prompt_cache_dir is not None:
            if not isinstance(self.prompt_cache_dir, (str, os.PathLike)) or not str(self.prompt_cache_dir):
                raise ArgumentTypeError(f"prompt_cache_dir={self.prompt_cache_dir!r}: expected a directory path")
            disk = self.prompt_cache_disk_mb
            if isinstance(disk, bool) or not isinstance(disk, (int, float)) or not 0 < disk < 2**40:
                raise InvalidArgumentError(f"prompt_cache_disk_mb={disk!r}: expected a number > 0 (MiB)")
            if self.control_vector is not None:
                raise InvalidArgumentError("prompt_cache_dir with a control vector: the states on disk would not "
                                           "say which vector computed them; use one or the other")
        if self.speculative is not None:
            n = self.n_draft
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT:
                raise InvalidArgumentError(f"n_draft={n!r}: expected an integer in [1, {MAX_DRAFT}]")
            if not isinstance(self.speculative, (Drafter, str, os.PathLike)):
                raise ArgumentTypeError(f"speculative= takes a Drafter (NgramDraft, DraftModel), \"ngram\" or a "
                                        f"draft GGUF path, not {type(self.speculative).__name__}")
