"""Greedy decoding against llama.cpp's own ``llama-server`` from the same build, on Gemma 3 270M.

With the same context settings, the same prompt and temperature 0, llama-server's ``/completion``
and ours must give the same top-k log-probabilities at every step (within float32 noise) and the
same tokens, except where the top two are a near tie (there a different kernel order may pick the
other one; the comparison stops at such a step).

llama-server's *defaults* differ in one way that matters to the numbers: with a sliding-window
model (Gemma 3) and no ``--swa-full``, it keeps a small SWA cache and saves context checkpoints,
so it decodes a prompt in two batches, all but the last 4 tokens and then those 4. Another batch
shape gives slightly different CPU results (about 0.1 in a log-probability on this model), enough
to change a close greedy choice. Ours keeps the full SWA cache (``swa_full=True``, which prefix
reuse needs) and decodes a prompt in one batch, which ``--swa-full`` gives llama-server too.
``test_llama_server_default_splits_the_prompt`` checks that explanation. Skipped when llama-server
is not built.
"""

from __future__ import annotations

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.core.batch import Batch
from llama_server import NOT_BUILT, LlamaServer, find_llama_server

pytestmark = pytest.mark.needs_tools  # (conftest.py builds llama-server first)

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "Once upon a time",
    "1, 2, 3, 4,",
    "import numpy as np\n\n",
    "Question: What is the boiling point of water?\nAnswer:",
]
N_PREDICT = 16
TOP_K = 5
# One thread on both sides: the same settings, and quick on a busy machine (the results do not depend on it).
THREADS = 1
# Log-probabilities: llama-server normalises in float32 over the 262k-token vocabulary (an offset
# common to a step's tokens, up to ~1e-3), ours in float64 here; the differences between a step's
# log-probabilities (the logits) agree to float32 rounding when the numerics are the same.
LOGPROB_TOLERANCE = 2e-3
LOGIT_TOLERANCE = 1e-4
# A greedy choice counts only when the top two differ by more than this.
NEAR_TIE = 0.02
# What ours runs with, in llama-server's flags (ContextParams defaults: n_ctx 4096, n_batch 2048,
# n_ubatch 512, one sequence, flash attention auto, full SWA cache).
SAME_SETTINGS = ["-c", "4096", "-b", "2048", "-ub", "512", "-np", "1", "-fa", "auto", "--swa-full",
                 "-t", str(THREADS), "-tb", str(THREADS), "--no-warmup", "--cache-ram", "0", "-fit", "off"]


@pytest.fixture(scope="module")
def llama_server_exe():
    exe = find_llama_server()
    if exe is None:
        pytest.fail(NOT_BUILT)
    return exe


def _server_steps(server: LlamaServer, prompt: str, n_predict: int) -> list[dict[int, float]]:
    """Per generated token, {token id: logprob} of the top-k (the first is the chosen token)."""
    response = server.post("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                           "n_probs": TOP_K, "cache_prompt": False})
    response.raise_for_status()
    steps = []
    for item in response.json()["completion_probabilities"]:
        top = {t["id"]: t["logprob"] for t in item["top_logprobs"]}
        steps.append({item["id"]: item["logprob"], **top})
    return steps


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _our_steps(model, prompt: str, n_predict: int, split: int = 0) -> list[dict[int, float]]:
    """Greedy decoding with a Context (as lc.generate decodes: the prompt in one batch, then one
    token per decode), keeping the top-k log-probabilities; ``split`` decodes the prompt's last
    ``split`` tokens as a second batch."""
    ctx = lc.Context.create(model, n_threads=THREADS)
    try:
        ids = lc.Tokenizer.encode(model, prompt)
        batch = Batch(ctx.n_batch, 1)
        cut = len(ids) - split if 0 < split < len(ids) else len(ids)
        for start, end in ((0, cut), (cut, len(ids))):
            if end > start:
                batch.clear()
                batch.add_sequence(ids[start:end], start, 0, output_last=True)
                ctx.decode(batch)
        steps = []
        for pos in range(len(ids), len(ids) + n_predict):
            logprobs = _log_softmax(ctx.logits(-1))
            top = np.argsort(-logprobs)[:TOP_K]
            steps.append({int(t): float(logprobs[t]) for t in top})
            batch.clear()
            batch.add_sequence([int(top[0])], pos, 0, output_last=True)
            ctx.decode(batch)
        return steps
    finally:
        ctx.close()


def _chosen(steps) -> list[int]:
    return [next(iter(step)) for step in steps]


def _margin(step: dict[int, float]) -> float:
    first, second = sorted(step.values(), reverse=True)[:2]
    return first - second


def _agreeing_prefix(ours: list[int], theirs: list[int], margins: list[float], what: str) -> int:
    """Steps on which both chose the same token; a different choice must be a near tie."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert margins[i] < NEAR_TIE, (
                f"{what}: step {i} chose {a} where llama-server chose {b}, with a clear margin {margins[i]:.4f}")
            return i
    return min(len(ours), len(theirs))


def _compare(ours_steps, server_steps, what: str) -> int:
    n = _agreeing_prefix(_chosen(ours_steps), _chosen(server_steps), [_margin(s) for s in server_steps], what)
    for i in range(n + 1 if n < len(server_steps) else n):  # the step that diverged still has comparable logits
        ours, theirs = ours_steps[i], server_steps[i]
        common = [t for t in theirs if t in ours]
        assert common, f"{what}: step {i}: no common top-{TOP_K} token"
        for token in common:
            assert abs(ours[token] - theirs[token]) < LOGPROB_TOLERANCE, (
                f"{what}: step {i}, token {token}: logprob ours {ours[token]:.5f}, llama-server {theirs[token]:.5f}")
            relative = (ours[token] - ours[common[0]]) - (theirs[token] - theirs[common[0]])
            assert abs(relative) < LOGIT_TOLERANCE, (
                f"{what}: step {i}, token {token}: logit differences disagree by {relative:.2e}")
    return n


@pytest.fixture(scope="module")
def same_settings_server(llama_server_exe, gemma_path):
    with LlamaServer(llama_server_exe, gemma_path, SAME_SETTINGS) as server:
        yield server


@pytest.fixture(scope="module")
def server_steps(same_settings_server):
    """llama-server's steps with our settings, per prompt."""
    return {prompt: _server_steps(same_settings_server, prompt, N_PREDICT) for prompt in PROMPTS}


def test_tokenization_matches(same_settings_server, gemma):
    for prompt in PROMPTS:
        theirs = same_settings_server.post("/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
        assert lc.Tokenizer.encode(gemma, prompt) == theirs, prompt


def test_greedy_steps_match_llama_server(server_steps, gemma):
    agreed = 0
    for prompt in PROMPTS:
        agreed += _compare(_our_steps(gemma, prompt, N_PREDICT), server_steps[prompt], repr(prompt))
    assert agreed >= len(PROMPTS) * N_PREDICT * 3 // 4  # near ties are rare


def test_generate_matches_llama_server(server_steps, gemma):
    for prompt in PROMPTS:
        theirs = server_steps[prompt]
        ours = lc.generate(gemma, prompt, max_tokens=N_PREDICT, temp=0, n_threads=THREADS).tokens
        _agreeing_prefix(ours, _chosen(theirs), [_margin(s) for s in theirs], f"generate {prompt!r}")


def test_server_matches_llama_server(server_steps, gemma):
    # cache_prompt=False: a reused prefix would decode the rest of a prompt as another batch shape
    # (llama-server's prompt cache does the same; the test asks it for cache_prompt=False as well).
    with lc.Server(model=gemma, n_parallel=2, cache_prompt=False, n_threads=THREADS) as server:
        for prompt in PROMPTS:
            theirs = server_steps[prompt]
            ours = server.generate(prompt, max_tokens=N_PREDICT, temp=0).tokens
            _agreeing_prefix(ours, _chosen(theirs), [_margin(s) for s in theirs], f"Server {prompt!r}")


def test_llama_server_default_splits_the_prompt(llama_server_exe, gemma, gemma_path):
    """Without --swa-full llama-server decodes a prompt's last 4 tokens as a batch of their own:
    its first-token log-probabilities are ours with the prompt split the same way."""
    args = [a for a in SAME_SETTINGS if a != "--swa-full"]
    split_differs = False
    with LlamaServer(llama_server_exe, gemma_path, args) as server:
        for prompt in PROMPTS:
            theirs = _server_steps(server, prompt, 1)
            ours_split = _our_steps(gemma, prompt, 1, split=4)
            _compare(ours_split, theirs, f"split {prompt!r}")
            whole = _our_steps(gemma, prompt, 1)
            split_differs |= any(abs(whole[0].get(t, 0.0) - lp) > 10 * LOGPROB_TOLERANCE
                                 for t, lp in theirs[0].items())
    assert split_differs, "the split should change the numbers for some prompt"
