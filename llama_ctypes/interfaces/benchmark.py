"""Single-sequence speed of a model through llama_ctypes (used by ``llama-ctypes bench`` and bench/).

The shapes follow llama-bench: prefill is one prompt of ``n_prompt`` tokens
from an empty cache; decode is ``n_gen`` single-token steps from an empty
cache (ours also samples greedily and detokenizes, which llama-bench does not).
"""

from __future__ import annotations

import statistics
import time

from ..core.batch import Batch
from ..core.context import Context
from ..core.model import Model
from ..core.sampler import Sampler
from ..core.tokenizer import Tokenizer


def measure(model: Model, n_prompt: int = 512, n_gen: int = 128, reps: int = 3,
            threads: int | None = None) -> dict[str, float]:
    """Medians over ``reps``: pp and tg tokens/s, decode-only tokens/s, TTFT (ms), per-token overheads (µs)."""
    ctx = Context.create(model, n_ctx=n_prompt + n_gen + 16, n_batch=max(512, n_prompt), n_threads=threads)
    # token ids spread over the vocabulary, away from its special tokens at either end
    prompt = [(i * 7919) % (model.n_vocab - 1000) + 500 for i in range(n_prompt)]
    bos = Tokenizer.bos(model) or 0
    runs: dict[str, list[float]] = {k: [] for k in ("pp", "tg", "tg_decode_only", "ttft_ms", "python_us_per_token",
                                                   "outside_decode_us")}
    try:
        with Sampler.create(model, temp=0) as smp:  # warm-up, as llama-bench does
            ctx.generate(smp, prompt[:32], max_tokens=4, ignore_eos=True)
        batch = Batch(ctx.n_batch)
        for _ in range(reps):
            ctx.clear()
            batch.clear()
            batch.add_sequence(prompt, 0, 0, output_last=True)
            t0 = time.perf_counter()
            ctx.decode(batch)
            ctx.logits(-1)  # (waits for the device, as llama-bench does: llama_decode returns before a GPU ends)
            runs["pp"].append(n_prompt / (time.perf_counter() - t0))
            ctx.clear()
            with Sampler.create(model, temp=0) as smp:
                done = ctx.generate(smp, [bos], max_tokens=n_gen + 1, ignore_eos=True)
            t = done.timings
            runs["tg"].append(t.tokens_per_s)
            runs["tg_decode_only"].append((len(done.tokens) - 1) / (t.decode_ms / 1e3))
            runs["ttft_ms"].append(t.ttft_ms)
            runs["python_us_per_token"].append(t.python_us_per_token)
            runs["outside_decode_us"].append(t.outside_decode_us_per_token)
    finally:
        ctx.close()
    return {k: statistics.median(v) for k, v in runs.items()}
