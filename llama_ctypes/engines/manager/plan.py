"""What loading one model will make, decided before anything is loaded: a pure, tested object.

From the model's capabilities (``generate``/``chat``, ``embed`` or ``rerank``), the
requested mode and the load's options, :meth:`LoadPlan.make` chooses the mode, checks
that the options fit it, fixes a direct-mode model's per-call context options, and lists
the contexts the mode creates (:meth:`LoadPlan.context_runs`) for llama.cpp's memory dry
run; :func:`charge` turns the dry runs into what the budget counts. The manager
(manager.py) owns the registry, the loading thread and the routing; this module decides.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from ...core.memory import MemoryUsage
from ...errors import ArgumentTypeError, InvalidArgumentError
from ...features import embeddings as _emb
from ..server.server import Server
from .budget import Footprint

__all__ = ["Mode", "Capability", "LoadPlan", "charge"]

Mode = Literal["server", "direct"]
Capability = Literal["generate", "chat", "embed", "rerank", "multimodal"]

# Server settings that size a direct-mode generation context too.
_DIRECT_SIZING = ("n_ctx", "n_batch", "kv_unified")
# Server settings that size the server's context (the rest configure its scheduling).
_SERVER_SIZING = ("n_parallel", "n_ctx", "n_batch", "kv_unified")
# Context options embed() sets itself (features/embeddings.py).
_EMBED_SETS = frozenset({"embeddings", "pooling", "n_seq_max", "n_ubatch", "n_ctx", "n_outputs_max"})
# The context embed()/rerank() create (features/embeddings.py), for the memory estimate.
_DIRECT_CONTEXT = {"n_ctx": 2048, "n_batch": 2048, "n_ubatch": 2048, "n_seq_max": _emb.MAX_SEQUENCES,
                   "kv_unified": True, "embeddings": True, "flash_attn": "disabled"}


@dataclass(frozen=True)
class LoadPlan:
    """The mode of one model and the options of every context it will make.

    Server mode: ``Server(model=..., **server_opts, **ctx_opts, **defaults)``. Direct mode:
    generate() uses ``call_opts``; embed()/rerank() use ``embed_opts`` with ``embed_batch``
    and ``embed_pooling``.
    """

    mode: Mode
    capabilities: tuple[Capability, ...]
    server_opts: Mapping[str, Any] = field(default_factory=dict)
    ctx_opts: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    call_opts: Mapping[str, Any] = field(default_factory=dict)
    embed_opts: Mapping[str, Any] = field(default_factory=dict)
    embed_pooling: str | None = None
    embed_batch: int = 2048

    @classmethod
    def make(cls, model_id: str, capabilities: Sequence[Capability], mode: Mode | None,
             server_opts: Mapping[str, Any], ctx_opts: Mapping[str, Any],
             defaults: Mapping[str, Any]) -> "LoadPlan":
        """Choose the mode (``mode``, else ``server`` for generative models and ``direct`` for the
        rest) and check the options against it. Raises InvalidArgumentError for a mode the model
        cannot run in, ArgumentTypeError for options the mode does not use.
        """
        caps = tuple(capabilities)
        chosen: Mode = mode or ("direct" if "generate" not in caps else "server")
        if chosen == "server":
            if "generate" not in caps:
                raise InvalidArgumentError(f"model {model_id!r} ({', '.join(caps)}) cannot run in server mode")
            return cls(chosen, caps, dict(server_opts), dict(ctx_opts), dict(defaults))
        server_only = sorted(set(server_opts) - set(_DIRECT_SIZING)) + sorted(defaults)
        if server_only:
            raise ArgumentTypeError(f"options {server_only} apply to server mode only")
        if "generate" in caps:
            caps = (*caps, "embed")  # a generative model embeds too, in its own context
        else:
            unused = sorted(k for k in (*server_opts, *ctx_opts) if k in _EMBED_SETS or k in ("n_ctx", "kv_unified"))
            if unused:
                raise ArgumentTypeError(f"options {unused} have no effect on an embedding model (embed sets them)")
        if ctx_opts.get("pooling") == "rank" and "rerank" not in caps:
            caps = (*caps, "rerank")  # (llama-server's --reranking: any model, read through rank pooling)
        call_opts = {**{k: server_opts[k] for k in _DIRECT_SIZING if k in server_opts}, **ctx_opts}
        if "n_batch" in server_opts and "n_ubatch" not in ctx_opts:  # as the server sizes it
            call_opts["n_ubatch"] = min(server_opts["n_batch"], 512)
        pooling = ctx_opts.get("pooling")
        return cls(chosen, caps, call_opts=call_opts,
                   embed_opts={k: v for k, v in ctx_opts.items() if k not in _EMBED_SETS},
                   embed_pooling=pooling if pooling not in (None, "unspecified") else None,
                   embed_batch=server_opts.get("n_batch", 2048))

    def context_runs(self) -> list[dict[str, Any]]:
        """The context options of every context this plan creates, for llama.cpp's dry run.

        Server mode: the server's context. Direct mode: the one generate() makes (generative
        models), then the one embed()/rerank() make.
        """
        if self.mode == "server":
            sized = {k: v for k, v in self.server_opts.items() if k in _SERVER_SIZING}
            return [Server.context_options(**sized, **self.ctx_opts)]
        runs = []
        if "generate" in self.capabilities:
            runs.append(dict(self.call_opts))
        if "embed" in self.capabilities or "rerank" in self.capabilities:
            n = self.embed_batch
            pooling = {"pooling": self.embed_pooling} if self.embed_pooling else {}
            runs.append({**_DIRECT_CONTEXT, "n_ctx": n, "n_batch": n, "n_ubatch": n, **self.embed_opts, **pooling})
        return runs


def adapter_bytes(loras: Any) -> int:
    """Bytes of the LoRA adapter files a load brings (``Server(loras=...)`` items: paths, ``(path, ...)``
    tuples; adapters already loaded are resident already). llama.cpp loads their tensors as stored."""
    total = 0
    for item in loras or ():
        path = item[0] if isinstance(item, tuple) and item else item
        if isinstance(path, (str, os.PathLike)):
            try:
                total += os.path.getsize(path)
            except OSError:
                pass  # (the load itself reports the missing file)
    return total


def charge(usages: Sequence[MemoryUsage], weights: bool, adapters: int = 0, projector: int = 0,
           projector_pool: Any = "ram") -> tuple[MemoryUsage, Footprint]:
    """The estimate of a whole load (the weights once) and the footprint the budget counts.

    ``usages``: one dry run per context run, each with the weights. ``weights``: whether the
    load brings the weights (a Model handed in is resident already: only its contexts count).
    ``adapters``: bytes of LoRA adapters it loads, counted in the pool that holds most of the weights
    (llama.cpp puts an adapter's tensors beside the weights they change). ``projector``: bytes of a
    multimodal projector's file, counted in ``projector_pool`` (libmtmd puts it on the first GPU unless
    told not to, wherever the text model's layers are). Memory on RPC workers is theirs: the budget
    covers this machine's pools only.
    """
    required = Footprint()
    local = [d for d in usages[0].devices if d.endpoint is None] if usages else []
    main = max(local, key=lambda d: d.model).pool if local else "ram"
    if adapters and local:
        required = Footprint({main: adapters})
    if projector:
        required = required + Footprint({projector_pool: projector})
    for i, usage in enumerate(usages):
        for d in usage.devices:
            charged = d.context + d.compute + (d.model if weights and i == 0 else 0)
            if charged and d.endpoint is None:
                required = required + Footprint({d.pool: charged})
    rows = tuple(d if i == 0 else dataclasses.replace(d, model=0) for i, u in enumerate(usages) for d in u.devices)
    return MemoryUsage(rows), required
