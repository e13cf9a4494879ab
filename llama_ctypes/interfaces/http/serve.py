"""``llama-ctypes serve``: the models to load (one GGUF, a Hub file, or a TOML config) and uvicorn.

A config file lists the models for a :class:`ModelManager`::

    memory_budget = "auto"          # optional: bytes, "auto", or {ram = ..., vram = [...]}

    [[models]]
    id = "chat"                     # the name requests use in "model"
    path = "qwen3-4b-q4_k_m.gguf"   # relative to this file; or hub = ["owner/repo", "file.gguf"]
    default = true                  # where requests without "model" go
    chat_template = "chatml"        # optional: a built-in name, or a Jinja file
    aliases = ["gpt-4o-mini"]       # optional: more names for it
    n_parallel = 4                  # any ModelManager.load option: server, model, context
    n_ctx = 8192                    # options and request defaults (temp, max_tokens, ...)

    [[models]]
    id = "embed"
    path = "bge-small-en-v1.5-q8_0.gguf"
    mode = "direct"                 # embedding and reranking models run in direct mode

The server starts listening at once; the models load in the background (503 until
they are ready). A model that fails to load stops the server with an error.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from ...errors import ArgumentTypeError, ClosedError, InvalidArgumentError

logger = logging.getLogger(__name__)

API_KEY_ENV = "LLAMA_CTYPES_API_KEY"

# -c/--ctx-size is the whole context, as llama-server's: each of a model's n_parallel slots gets an equal share.
_TOTAL_CTX = "n_ctx_total"
# CLI option → load option, applied to every model (a model's own config entry wins). Direct-mode
# models (embeddings, reranking) take only the model and thread options.
_CLI_LOAD_OPTIONS = {"n_parallel": "n_parallel", "ctx_size": _TOTAL_CTX, "batch_size": "n_batch",
                     "ubatch_size": "n_ubatch", "cache_type_k": "type_k", "cache_type_v": "type_v",
                     "n_gpu_layers": "n_gpu_layers", "threads": "n_threads", "flash_attn": "flash_attn",
                     "max_queue": "max_queue", "max_tokens": "max_tokens",
                     "temp": "temp", "seed": "seed", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                     "backend_sampling": "backend_sampling"}
# llama-server's spellings of flash_attn values
_FLASH_ATTN = {"on": "enabled", "off": "disabled"}
_DIRECT_OPTIONS = ("n_gpu_layers", "n_threads", "n_threads_batch")
#: A request without max_tokens runs until the end of its answer or of its slot's context (as llama-server).
DEFAULT_MAX_TOKENS = -1
# Keys of a config entry that belong to the HTTP layer, not to ModelManager.load.
_HTTP_KEYS = ("chat_template", "aliases", "tags", "load")



def vertex_ai_routes(args: Any, env: Mapping[str, str]) -> dict[str, Any]:
    """llama-server's Google Cloud compat: with ``AIP_MODE=PREDICTION``, Vertex AI's prediction route
    (``AIP_PREDICT_ROUTE``, default ``/predict``) and health route (``AIP_HEALTH_ROUTE``), on the port
    ``AIP_HTTP_PORT`` names (it overrides ``--port``). ``create_app`` options; ``args.port`` is set."""
    if env.get("AIP_MODE") != "PREDICTION":
        return {}

    def route(name: str, default: str | None) -> str | None:
        value = env.get(name) or default
        return value if value is None or value.startswith("/") else "/" + value

    port = env.get("AIP_HTTP_PORT") or "8080"
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:  # (int() takes '١' and '²'.isdigit())
        raise ArgumentTypeError(f"AIP_HTTP_PORT={port!r}: expected a port number")
    if int(port) != args.port:
        logger.warning("Vertex AI mode: AIP_HTTP_PORT %s overrides --port %d", port, args.port)
        args.port = int(port)
    return {"predict_route": route("AIP_PREDICT_ROUTE", "/predict"), "health_route": route("AIP_HEALTH_ROUTE", None)}

def _toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise SystemExit("llama-ctypes serve: --config needs Python 3.11+ (or the tomli package)") from None
    with open(path, "rb") as f:
        return tomllib.load(f)


def template_source(value: str | None, base: Path | None = None) -> str | None:
    """A chat template option: a file of Jinja source (relative to ``base``), else a built-in name or source."""
    if value is None:
        return None
    path = Path(value)
    if base is not None and not path.is_absolute():
        path = base / path
    return path.read_text() if path.is_file() else value


def models_from_config(path: Path) -> tuple[Any, list[dict[str, Any]]]:
    """(memory_budget, one dict of ModelManager.load arguments plus HTTP keys per model) from a TOML file."""
    data = _toml(path)
    unknown = sorted(set(data) - {"memory_budget", "models"})
    if unknown:
        raise InvalidArgumentError(f"{path}: unknown top-level keys {unknown} (expected memory_budget, [[models]])")
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise InvalidArgumentError(f"{path}: expected at least one [[models]] table")
    base = path.resolve().parent
    out = []
    for i, entry in enumerate(models):
        entry = dict(entry)
        if "id" not in entry or not isinstance(entry["id"], str):
            raise InvalidArgumentError(f"{path}: models[{i}] needs an id (a string)")
        if ("path" in entry) == ("hub" in entry):
            raise InvalidArgumentError(f"{path}: model {entry['id']!r} needs exactly one of path or hub")
        if "path" in entry:
            source: Any = Path(entry.pop("path")).expanduser()
            entry["source"] = str(source if source.is_absolute() else base / source)
        else:
            hub = entry.pop("hub")
            if not (isinstance(hub, list) and len(hub) == 2 and all(isinstance(h, str) for h in hub)):
                raise InvalidArgumentError(f"{path}: model {entry['id']!r}: hub = [\"owner/repo\", \"file.gguf\"]")
            entry["source"] = ("hub", hub[0], hub[1])
        if "chat_template" in entry:
            entry["chat_template"] = template_source(entry["chat_template"], base)
        if not isinstance(entry.get("load", True), bool):
            raise InvalidArgumentError(f"{path}: model {entry['id']!r}: load must be true or false")
        if "loras" in entry:
            entry["loras"] = _config_loras(path, entry["id"], entry["loras"], base)
        if "mmproj" in entry:
            mmproj = entry["mmproj"]
            if not isinstance(mmproj, str) or not mmproj:
                raise InvalidArgumentError(f"{path}: model {entry['id']!r}: mmproj must be a file (or \"auto\")")
            if mmproj != "auto":
                file = Path(mmproj).expanduser()
                entry["mmproj"] = str(file if file.is_absolute() else base / file)
        aliases = entry.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise InvalidArgumentError(f"{path}: model {entry['id']!r}: aliases must be a list of strings")
        out.append(entry)
    return data.get("memory_budget"), out


def _config_loras(path: Path, model_id: str, loras: Any, base: Path) -> list[tuple[str, str, float]]:
    """A model's ``loras = ["a.gguf", {path = "b.gguf", name = "b", scale = 0.5}]`` as the Server's
    ``(path, name, default scale)`` (paths relative to the config file; name: the file stem; scale 0)."""
    if not isinstance(loras, list):
        raise InvalidArgumentError(f"{path}: model {model_id!r}: loras must be a list of paths or tables")
    out = []
    for item in loras:
        item = {"path": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) \
                or set(item) - {"path", "name", "scale"}:
            raise InvalidArgumentError(f"{path}: model {model_id!r}: each lora is a path or "
                                       "{path = ..., name = ..., scale = ...}")
        file = Path(item["path"]).expanduser()
        file = file if file.is_absolute() else base / file
        scale = item.get("scale", 0.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise InvalidArgumentError(f"{path}: model {model_id!r}: lora scale must be a number")
        out.append((str(file), str(item.get("name") or file.stem), float(scale)))
    return out


def models_in_dir(folder: Path) -> list[dict[str, Any]]:
    """A catalog entry (not loaded until used) per GGUF file of ``folder`` (llama-server's ``--models-dir``);
    the id is the file name without ``.gguf``. Split files count once (their first part)."""
    if not folder.is_dir():
        raise ArgumentTypeError(f"--models-dir {folder}: no such folder")
    out = []
    for path in sorted(folder.glob("*.gguf")):
        stem = path.stem
        split = re.search(r"-(\d{5})-of-\d{5}$", stem)
        if split is not None and split.group(1) != "00001":
            continue  # (a later part of a split model: llama.cpp loads it from the first)
        if stem.startswith("mmproj"):
            continue  # (a projector, not a model)
        out.append({"id": stem, "source": str(path), "load": False})
    if not out:
        raise ArgumentTypeError(f"--models-dir {folder}: no .gguf file in it")
    return out


def _with_cli_options(spec: dict[str, Any], cli_opts: Mapping[str, Any]) -> dict[str, Any]:
    if spec.get("mode") == "direct":
        return {**{k: v for k, v in cli_opts.items() if k in _DIRECT_OPTIONS}, **spec}
    opts = dict(cli_opts)
    total = opts.pop(_TOTAL_CTX, None)
    out = {"max_tokens": DEFAULT_MAX_TOKENS, **opts, **spec}
    if total is not None and "n_ctx" not in spec:
        from ...engines.server.params import ServerParams

        n_parallel = out.get("n_parallel", ServerParams.n_parallel)
        if total < n_parallel:
            raise ArgumentTypeError(f"--ctx-size {total}: under one token per slot ({n_parallel} slots)")
        out["n_ctx"] = total // n_parallel
    return out


def _lora_args(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """``--lora`` / ``--lora-scaled`` as the Server's ``loras``: (path, name, default scale), named by the
    file's stem (ids are their order, as llama-server's)."""
    init = 0.0 if getattr(args, "lora_init_without_apply", False) else None
    out = []
    for path in getattr(args, "lora", None) or []:
        out.append((path, 1.0))
    for path, scale in getattr(args, "lora_scaled", None) or []:
        try:
            out.append((path, float(scale)))
        except ValueError:
            raise ArgumentTypeError(f"--lora-scaled {path} {scale}: the scale must be a number") from None
    loras = []
    for path, scale in out:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ArgumentTypeError(f"--lora {path}: no such file")
        loras.append((str(p), p.stem, scale if init is None else init))
    if len({name for _, name, _ in loras}) != len(loras):
        raise ArgumentTypeError("two --lora files have the same name (file stem); rename one")
    return loras


def model_specs(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """(memory_budget, model specs) from the command line: a config file, a Hub file or a GGUF path."""
    cli_opts = {load: getattr(args, name) for name, load in _CLI_LOAD_OPTIONS.items()
                if getattr(args, name, None) is not None}
    if "n_threads" in cli_opts:
        cli_opts["n_threads_batch"] = cli_opts["n_threads"]  # (llama-server: -tb defaults to -t)
    if "flash_attn" in cli_opts:
        cli_opts["flash_attn"] = _FLASH_ATTN.get(cli_opts["flash_attn"], cli_opts["flash_attn"])
    if cli_opts.get("seed") is not None and cli_opts["seed"] < 0:
        cli_opts["seed"] = None  # (llama-server: -1 = a random seed per request)
    if getattr(args, "swa_full", False):
        cli_opts["swa_full"] = True
    if getattr(args, "kv_unified", False) and args.no_kv_unified:
        raise ArgumentTypeError("pass either --kv-unified or --no-kv-unified")
    if getattr(args, "no_jinja", False):
        logger.warning("--no-jinja: chat templates are still rendered with Jinja here, from the model's own "
                       "template (llama-server's legacy path approximates it; docs/http_server.md)")
    if args.no_kv_unified:
        cli_opts["kv_unified"] = False
    elif getattr(args, "kv_unified", False):
        cli_opts["share_kv"] = True  # (llama-server's meaning: each slot may use the whole -c)
    elif getattr(args, "n_parallel", None) is not None:
        # As llama-server: slots given with -np get a KV stream each unless --kv-unified. At many
        # slots one buffer costs attention over every slot's cells (64 slots of Gemma 270M: 0.58x
        # the throughput; bench/server_overhead.py); without -np the 4 default slots share one.
        cli_opts["kv_unified"] = False
    if args.no_cache_prompt:
        cli_opts["cache_prompt"] = False
    cache_ram = getattr(args, "cache_ram", None)
    if cache_ram is not None:  # (llama-server's --cache-ram MiB; -1: no limit but the machine's RAM)
        if cache_ram < -1:
            raise ArgumentTypeError(f"--cache-ram {cache_ram}: expected MiB >= 0, or -1 (no limit)")
        if cache_ram == -1:
            from ...engines.manager import detect_system_memory

            cache_ram = (detect_system_memory() or 0) // 2**20
        cli_opts["prompt_cache_ram_mb"] = cache_ram
    if getattr(args, "cache_disk", None):
        cli_opts["prompt_cache_dir"] = str(Path(args.cache_disk).expanduser())
    if getattr(args, "cache_disk_mib", None) is not None:
        if not getattr(args, "cache_disk", None):
            raise ArgumentTypeError("--cache-disk-mib needs --cache-disk DIR")
        cli_opts["prompt_cache_disk_mb"] = args.cache_disk_mib
    if getattr(args, "model_draft", None):
        cli_opts["speculative"] = str(Path(args.model_draft).expanduser())
    elif getattr(args, "spec_ngram", False):
        cli_opts["speculative"] = "ngram"
    elif getattr(args, "spec_mtp", False):
        cli_opts["speculative"] = "mtp"
        cli_opts["load_mtp"] = True  # (the MTP layers are skipped at load otherwise)
    if getattr(args, "draft_max", None) is not None:
        if "speculative" not in cli_opts:
            raise ArgumentTypeError("--draft-max needs --model-draft, --spec-ngram or --spec-mtp")
        cli_opts["n_draft"] = args.draft_max
    loras = _lora_args(args)
    if loras:
        cli_opts["loras"] = loras
    cvec_files: list[Any] = [(f, 1.0) for f in getattr(args, "control_vector", None) or []]
    for path, scale in getattr(args, "control_vector_scaled", None) or []:
        try:
            cvec_files.append((path, float(scale)))
        except ValueError:
            raise ArgumentTypeError(f"--control-vector-scaled {path} {scale}: the scale must be a number") from None
    layer_range = getattr(args, "control_vector_layer_range", None)
    if cvec_files:
        cli_opts["control_vector"] = {"files": [(str(Path(f).expanduser()), s) for f, s in cvec_files],
                                      "layer_range": tuple(layer_range) if layer_range else None}
    elif layer_range:
        raise ArgumentTypeError("--control-vector-layer-range needs --control-vector")
    projector = {name: getattr(args, name) for name in ("image_min_tokens", "image_max_tokens")
                 if getattr(args, name, None) is not None}
    if getattr(args, "no_mmproj_offload", False):
        projector["use_gpu"] = False
    if projector:
        cli_opts["mmproj_params"] = projector
    if getattr(args, "rpc", None):
        cli_opts["rpc_servers"] = [e.strip() for e in args.rpc.split(",") if e.strip()]
    if getattr(args, "tensor_split", None):
        try:
            cli_opts["tensor_split"] = [float(x) for x in args.tensor_split.split(",")]
        except ValueError:
            raise ArgumentTypeError(f"--tensor-split {args.tensor_split!r}: expected numbers such as 1,1") from None
    template_file = getattr(args, "chat_template_file", None)
    if template_file:
        if args.chat_template:
            raise ArgumentTypeError("pass either --chat-template or --chat-template-file")
        if not Path(template_file).is_file():
            raise ArgumentTypeError(f"--chat-template-file {template_file}: no such file")
        args.chat_template = template_file
    model_arg = args.model
    if getattr(args, "model_flag", None):
        if model_arg:
            raise ArgumentTypeError("pass the model once: MODEL or --model")
        model_arg = args.model_flag
    hf_repo, hf_file = getattr(args, "hf_repo", None), getattr(args, "hf_file", None)
    if hf_file and not hf_repo:
        raise ArgumentTypeError("--hf-file needs --hf-repo")
    if sum(map(bool, (model_arg, args.hub, hf_repo))) > 1:
        raise ArgumentTypeError("pass the model once: MODEL, --model, --hub or --hf-repo")
    models_dir = getattr(args, "models_dir", None)
    if models_dir and (model_arg or args.hub or hf_repo):
        raise ArgumentTypeError("pass either MODEL, --hub or --models-dir")
    dir_specs = models_in_dir(Path(models_dir)) if models_dir else []
    preset = getattr(args, "models_preset", None)
    if preset:
        from .presets import preset_specs

        if args.config or model_arg or args.hub or hf_repo:
            raise ArgumentTypeError("pass either --models-preset (with or without --models-dir), --config or a model")
        if getattr(args, "serve_parser", None) is None:
            raise ArgumentTypeError("--models-preset is read with the serve command line's parser")
        return None, preset_specs(Path(preset).expanduser(), args, args.serve_parser, model_specs,
                                  {spec["id"]: spec["source"] for spec in dir_specs})
    if dir_specs and not args.config:
        return None, [_with_cli_options(spec, cli_opts) for spec in dir_specs]
    if args.config:
        if model_arg or args.hub:
            raise ArgumentTypeError("pass either MODEL, --hub or --config")
        budget, specs = models_from_config(Path(args.config))
        known = {s["id"] for s in specs}
        specs += [s for s in dir_specs if s["id"] not in known]
        specs = [_with_cli_options(spec, cli_opts) for spec in specs]
        if args.chat_template:
            for spec in specs:
                spec.setdefault("chat_template", template_source(args.chat_template))
        return budget, specs
    if args.hub:
        source: Any = ("hub", args.hub[0], args.hub[1])
        name = Path(args.hub[1]).stem
    elif hf_repo:  # (llama-server's -hf OWNER/NAME[:QUANT] [-hff FILE]: without a file, chosen at load by QUANT)
        from ...features import hub

        repo, _ = hub.split_repo_tag(hf_repo)
        source = ("hub", repo, hf_file) if hf_file else ("hub", hf_repo, None)
        name = Path(hf_file).stem if hf_file else hf_repo
    elif model_arg:
        source = str(Path(model_arg).expanduser())
        name = Path(model_arg).stem
    else:
        # No model: llama-server's router mode, an empty manager (models are added through the API)
        return None, []
    # (several aliases: the id is the first in sorted order, as llama-server's; all of them route to it)
    aliases = sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()})
    spec: dict[str, Any] = {"id": aliases[0] if aliases else name, "source": source}
    if aliases:
        spec["aliases"] = aliases
    tags = [t.strip() for t in (getattr(args, "tags", None) or "").split(",") if t.strip()]
    if tags:
        spec["tags"] = tags
    if args.embedding or getattr(args, "reranking", False):
        spec["mode"] = "direct"
    pooling = "rank" if getattr(args, "reranking", False) else getattr(args, "pooling", None)
    if pooling is not None:
        if spec.get("mode") != "direct":
            raise ArgumentTypeError("--pooling applies to embedding models: add --embedding")
        spec["pooling"] = pooling
    if args.chat_template:
        spec["chat_template"] = template_source(args.chat_template)
    mmproj = getattr(args, "mmproj", None)
    if mmproj:
        if getattr(args, "no_mmproj", False):
            raise ArgumentTypeError("pass either --mmproj or --no-mmproj")
        if not Path(mmproj).expanduser().is_file():
            raise ArgumentTypeError(f"--mmproj {mmproj}: no such file")
        spec["mmproj"] = str(Path(mmproj).expanduser())
    elif (args.hub or hf_repo) and not getattr(args, "no_mmproj", False):
        spec["mmproj"] = "auto"  # (the repository's projector when it has one, as llama-server's -hf)
    if "mmproj" not in spec and "mmproj_params" in cli_opts:
        raise ArgumentTypeError("--no-mmproj-offload and --image-*-tokens need a projector (--mmproj)")
    return None, [_with_cli_options(spec, cli_opts)]


def catalog_entries(specs: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
    """The catalog's entries of model specs, and the HTTP layer's settings of each (by id)."""
    from .catalog import CatalogEntry

    entries, settings = [], {}
    for spec in specs:
        load, settings[spec["id"]] = _split_http(spec)
        entries.append(CatalogEntry(spec["id"], load, tuple(spec.get("aliases", ())), spec.get("load", True)))
    return entries, settings


def _split_http(spec: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    from .routing import ModelSettings

    load = {k: v for k, v in spec.items() if k not in _HTTP_KEYS}
    settings = ModelSettings(chat_template=spec.get("chat_template"), aliases=tuple(spec.get("aliases", ())),
                             tags=tuple(spec.get("tags", ())))
    return load, settings


#: glibc's mallopt parameter for the size from which allocations are mmap'd (malloc.h).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


def pin_mmap_threshold(size: int = 128 * 1024) -> bool:
    """Keep a long-running server's memory from ratcheting up (glibc only; True when set).

    glibc serves allocations from 128 KiB up with mmap, returned to the system when freed, but raises
    that threshold (up to 32 MiB) each time such a block is freed. A server frees large blocks all the
    time (a sampler's candidates for a 262k vocabulary are 3 MiB, a parsed body tens), so they soon come
    from the heap, which fragments and does not shrink: in a 2,000-request soak RSS rose in steps of
    60-110 MB to +14 to +26 % and stayed there. With the threshold fixed it stays within 2 % (bench/soak.py).
    Left alone when ``MALLOC_MMAP_THRESHOLD_`` is set: the user chose.
    """
    if not sys.platform.startswith("linux") or os.environ.get(_MMAP_THRESHOLD_ENV):
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # (not glibc: musl has no such threshold to pin)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, size) == 1


def limits_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """The app's :class:`RequestLimits` and the server's :class:`ConnectionLimits` from the command line
    (an out-of-range value raises InvalidArgumentError naming the option)."""
    from .connections import ConnectionLimits
    from .limits import RequestLimits

    def build(cls: Any, names: Mapping[str, str]) -> Any:
        values = {field: getattr(args, option) for field, option in names.items()
                  if getattr(args, option, None) is not None}
        try:
            return cls(**values)
        except InvalidArgumentError as exc:
            field = str(exc).split("=", 1)[0].rsplit(".", 1)[-1]
            option = "--" + names.get(field, field).replace("_", "-")
            raise InvalidArgumentError(f"{option}: {str(exc).split(': ', 1)[-1]}") from None

    requests = build(RequestLimits, {"max_choices": "max_choices", "max_inputs": "max_inputs",
                                     "max_input_tokens": "max_input_tokens",
                                     "max_tokenize_bytes": "max_tokenize_bytes"})
    if getattr(args, "media_max_mb", None) is not None or getattr(args, "media_max_items", None) is not None:
        import dataclasses

        from ...core.media import MediaLimits

        media = {}
        if getattr(args, "media_max_mb", None) is not None:
            if not args.media_max_mb > 0:
                raise InvalidArgumentError(f"--media-max-mb: expected a positive size, got {args.media_max_mb}")
            media["max_bytes"] = int(args.media_max_mb * 2**20)
        if getattr(args, "media_max_items", None) is not None:
            media["max_items"] = args.media_max_items
        try:
            requests = dataclasses.replace(requests, media=MediaLimits(**media))
        except InvalidArgumentError as exc:
            option = "--media-max-mb" if "max_bytes" in str(exc) else "--media-max-items"
            raise InvalidArgumentError(f"{option}: {str(exc).split(': ', 1)[-1]}") from None
    connections = build(ConnectionLimits, {"header_timeout": "header_timeout", "body_timeout": "body_timeout",
                                           "write_timeout": "timeout", "keep_alive_timeout": "keep_alive_timeout",
                                           "max_connections": "max_connections"})
    return requests, connections


def api_keys(args: argparse.Namespace) -> list[str] | None:
    """The keys a request may carry: ``--api-key`` (comma-separated, as llama-server), the lines of
    ``--api-key-file``, else ``$LLAMA_CTYPES_API_KEY``; None: no key is asked for."""
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SystemExit(f"llama-ctypes serve: --api-key-file {path}: {exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise SystemExit(f"llama-ctypes serve: --api-key-file {path} holds no key")
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    return keys or None


def webui_option(args: argparse.Namespace) -> bool | str:
    """``--no-webui`` / ``--webui-path DIR`` as create_app's ``webui``."""
    path = getattr(args, "webui_path", None)
    if path and getattr(args, "webui", True) is False:
        raise ArgumentTypeError("pass either --no-webui or --webui-path")
    if path:
        if not (Path(path).expanduser() / "index.html").is_file():
            raise ArgumentTypeError(f"--webui-path {path}: no index.html in that folder")
        return path
    return getattr(args, "webui", True)


def slot_folder(path: str | None) -> Path | None:
    """``--slot-save-path``: the folder (made if missing, as llama-server does)."""
    if not path:
        return None
    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def media_folder(path: str | None) -> Path | None:
    """``--media-path``: an existing folder (llama-server refuses anything else at start too)."""
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SystemExit(f"llama-ctypes serve: --media-path {path}: not a directory")
    return folder


def listen_sockets(hosts: list[str], port: int) -> list[Any]:
    """Bound sockets on every address (llama-server's ``--host a,b``); a host that cannot be bound stops
    the server with the reason, as a single host does."""
    import socket

    out = []
    try:
        for host in hosts:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # (its IPv4 twin is listed apart)
            sock.bind(address)
            sock.set_inheritable(True)
    except OSError as exc:
        for sock in out:
            sock.close()
        raise SystemExit(f"llama-ctypes serve: cannot listen on {host}:{port}: {exc}") from None
    return out


def _sleep_seconds(value: float) -> float | None:
    """``--sleep-idle-seconds``: None (never) for -1, as llama-server; zero or another negative value is refused."""
    if value == -1 or value is None:
        return None
    if not 0 < value < float("inf"):
        raise SystemExit(f"llama-ctypes serve: --sleep-idle-seconds {value:g}: expected a positive number of "
                         "seconds (or -1: never)")
    return value


def agent_options(args: argparse.Namespace) -> tuple[Any, bool, str]:
    """The tools (a ``ToolBox`` or None), whether ``/cors-proxy`` is served, and the CORS origins:
    ``--tools``, ``--tools-runtime``, ``--mcp-servers-*``, ``--ui-mcp-proxy``, ``--agent`` as llama-server
    (with tools or MCP servers and no ``--cors-origins``, only pages on this machine are let in)."""
    from .tools.box import ToolBox
    from .tools.mcp import parse_mcp_config, read_mcp_config_file

    agent = getattr(args, "agent", None)
    names = getattr(args, "tools", None)
    proxy = getattr(args, "ui_mcp_proxy", None)
    if agent is True:
        names, proxy = names or "all", True if proxy is None else proxy
    elif agent is False:
        names, proxy = None, False
    enabled = [n.strip() for n in (names or "").split(",") if n.strip()]
    try:
        servers = []
        if getattr(args, "mcp_servers_config", None):
            servers += read_mcp_config_file(args.mcp_servers_config)
        if getattr(args, "mcp_servers_json", None):
            servers += parse_mcp_config(args.mcp_servers_json)
        runtime = getattr(args, "tools_runtime", None) or None
        box = ToolBox(enabled, runtime=runtime, mcp_servers=servers) if enabled or servers or runtime else None
    except (ValueError, OSError) as exc:
        raise SystemExit(f"llama-ctypes serve: {exc}") from None
    cors = getattr(args, "cors_origins", None)
    if not cors:
        cors = "*"
        if box is not None and (box.builtin or box.mcp is not None) or proxy:
            # (llama-server narrows it for tools and MCP servers; the proxy too here: with "*" any web page
            # could read any URL this server can reach, through the user's browser)
            logger.warning("server tools, MCP servers or the CORS proxy are enabled: browser pages are let in "
                           "only from this machine (change it with --cors-origins)")
            cors = "localhost"
    features = (box.features if box is not None else []) + (["MCP proxy (experimental)"] if proxy else [])
    if features:
        logger.warning("experimental features enabled: %s; do not use them where clients are not trusted",
                       ", ".join(features))
    return box, bool(proxy), cors


def _uvicorn_server() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which also stops the tools at the signal: uvicorn gives requests in flight
        up to 5 s to finish, and a tool call (a command, an MCP call) would take all of them."""

        def __init__(self, config: Any, tools: Any):
            super().__init__(config)
            self.tools = tools

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self.tools is not None:
                self.tools.stop_soon()

    return Server


def _close_tools(tools: Any) -> None:
    """Close the tools when the app's lifespan did not (uvicorn could not start): a container that
    ``--tools-runtime`` started must not outlive the server."""
    if tools is not None and not tools.closed:
        import asyncio

        asyncio.run(tools.close())


def run(args: argparse.Namespace) -> int:
    """Load the models in the background and serve until interrupted."""
    try:
        import uvicorn

        from ...engines.manager import ModelManager
        from .app import create_app
        from .catalog import FAILED_LOAD_RETRY_S, Catalog
        from .connections import guarded_protocol
        server_class = _uvicorn_server()
    except ImportError as exc:
        raise SystemExit(f"llama-ctypes serve needs the server extra: pip install 'llama_ctypes[server]' ({exc})")

    if getattr(args, "offline", False):
        os.environ["LLAMA_OFFLINE"] = "1"  # (llama-server's --offline: the Hub client reads only its cache)
    budget, specs = model_specs(args)
    router_mode = not (args.model or getattr(args, "model_flag", None) or args.hub or getattr(args, "hf_repo", None))
    limits, connections = limits_from_args(args)
    pin_mmap_threshold()  # (before the models load and the worker threads start)
    api_key = api_keys(args)
    hosts = [h.strip() for h in args.host.split(",") if h.strip()]
    if not hosts:
        raise SystemExit(f"llama-ctypes serve: --host {args.host!r}: no address")
    for host in hosts:
        if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            logger.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    verbose = bool(getattr(args, "verbose", False))
    if verbose:
        logging.getLogger("llama_ctypes").setLevel(logging.DEBUG)
    vertex = vertex_ai_routes(args, os.environ)
    tools, cors_proxy, cors_origins = agent_options(args)
    manager = ModelManager(memory_budget=budget)
    settings = {}
    try:
        catalog = Catalog(manager, max_loaded=getattr(args, "models_max", None) or None,
                          retry_failed_after=None if router_mode else FAILED_LOAD_RETRY_S,
                          autoload=not getattr(args, "no_models_autoload", False))
        if router_mode and (getattr(args, "models_dir", None) or getattr(args, "models_preset", None)):
            catalog.source = lambda: catalog_entries(model_specs(args)[1])  # (GET /models?reload=1 reads them again)
        entries, settings = catalog_entries(specs)
        for entry in entries:
            catalog.add(entry)
        # (the ones a config loads at start; a server with --no-models-autoload loads only on request)
        starting = [e for e in catalog.entries.values() if e.autoload and (catalog.autoload or len(specs) == 1)]
        if catalog.max_loaded is not None:
            starting = starting[:catalog.max_loaded]
        loads = [(e.id, catalog.load(e.id)) for e in starting]
        if not specs:
            logger.warning("no model given: serving with none loaded (llama-server's router mode)")
        app = create_app(manager, api_key=api_key, models=settings, max_body_bytes=int(args.max_body_mb * 2**20),
                         limits=limits, close_manager=True, slots_endpoint=getattr(args, "slots", True),
                         metrics_endpoint=getattr(args, "metrics", False),
                         verbose=verbose, reasoning_format=getattr(args, "reasoning_format", "auto"),
                         enable_thinking=getattr(args, "reasoning", "auto") != "off",
                         reasoning_budget=getattr(args, "reasoning_budget", -1),
                         reasoning_budget_message=getattr(args, "reasoning_budget_message", None) or "",
                         spm_infill=getattr(args, "spm_infill", False),
                         cors_origins=cors_origins, tools=tools, cors_proxy=cors_proxy,
                         api_prefix=(getattr(args, "api_prefix", None) or "").rstrip("/"),
                         catalog=catalog, router_mode=router_mode,
                         slot_save_path=slot_folder(getattr(args, "slot_save_path", None)),
                         webui=webui_option(args), media_urls=getattr(args, "media_urls", False),
                         media_path=media_folder(getattr(args, "media_path", None)),
                         sleep_idle_seconds=_sleep_seconds(getattr(args, "sleep_idle_seconds", -1)),
                         **vertex)
    except BaseException:
        manager.close()
        _close_tools(tools)
        raise
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    sockets = listen_sockets(hosts, args.port) if len(hosts) > 1 else None
    config = uvicorn.Config(app, host=hosts[0], port=args.port, log_level=level, access_log=level in ("debug", "info"),
                            lifespan="on", timeout_graceful_shutdown=5, log_config=None,
                            http=guarded_protocol(connections), timeout_keep_alive=connections.keep_alive_timeout)
    server = server_class(config, tools)
    failed: list[str] = []

    def loaded(model_id: str, future: Any) -> None:
        exc = None if future.cancelled() else future.exception()
        if exc is not None and not isinstance(exc, ClosedError):  # (closed: the server is stopping anyway)
            failed.append(f"{model_id}: {exc}")
            server.should_exit = True  # as llama-server: a model that cannot load stops the server

    for model_id, future in loads:
        future.add_done_callback(lambda f, m=model_id: loaded(m, f))
    urls = ", ".join(f"http://{'[' + h + ']' if ':' in h else h}:{args.port}" for h in hosts)
    print(f"llama-ctypes serve: {urls} ({', '.join(s['id'] for s in specs) or 'no model'})",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=sockets)
    finally:
        manager.close()  # (also when uvicorn could not start: the lifespan never ran)
        _close_tools(tools)
        for sock in sockets or ():
            sock.close()
    if failed:
        for line in failed:
            print(f"llama-ctypes serve: error: loading {line}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
