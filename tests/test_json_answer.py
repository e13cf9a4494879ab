"""Large JSON answers are encoded off the event loop, a part at a time (interfaces/http/json_answer.py): the same
bytes as starlette's JSONResponse, and the loop keeps running meanwhile (one json.dumps of a 31 MB n_probs answer
held every client 0.74 s)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("starlette")
from starlette.responses import JSONResponse  # noqa: E402

from llama_ctypes.interfaces.http.json_answer import PART_ITEMS, encode_json, json_response  # noqa: E402


def _random(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([1, -2.5, "x\u00e9\"\\\n\u2028", None, True, False, 10**20, 1e-300, "", 0])
    sizes = [0, 1, 5, PART_ITEMS, PART_ITEMS + 1, 3 * PART_ITEMS + 7] if depth < 2 else [0, 1, 3]
    if r < 0.65:
        return [_random(rng, depth + 1) for _ in range(rng.choice(sizes))]
    return {f"k{i}": _random(rng, depth + 1) for i in range(rng.choice(sizes))}


def test_the_same_bytes_as_starlette():
    rng = random.Random(5)
    for i in range(300):
        value = _random(rng)
        assert encode_json(value) == JSONResponse(value).body, i
    odd = {1: "int key", "t": (1, 2), "big": [{2.5: "x"}] * (PART_ITEMS + 3)}  # (keys json converts itself)
    assert encode_json(odd) == JSONResponse(odd).body
    with pytest.raises(ValueError):
        encode_json({"a": [float("nan")] * (PART_ITEMS + 1)})


def test_the_event_loop_runs_while_a_large_answer_is_encoded():
    probs = [{"id": i, "token": "tok", "logprob": -0.5, "bytes": [116, 111, 107],
              "top_logprobs": [{"id": j, "token": "alt", "logprob": -1.5} for j in range(20)]} for i in range(30000)]
    answer = {"content": "x" * 1000, "completion_probabilities": probs}

    async def main() -> float:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        response = await json_response(answer)
        done.set()
        await ticker
        assert response.body == JSONResponse(answer).body and response.media_type == "application/json"
        return max(gaps)

    assert asyncio.run(main()) < 0.25
