"""Comparing a small model's greedy output across two paths whose numerics differ.

Two runs of one prompt may round differently: a cached prefix versus a cold
prompt, one row versus a batch of rows, a speculative verification batch, another
CPU's kernels (AVX2 and AVX-512 pick other matmul paths; ``pytest --cpu-variant``
forces one). Where the model's two best tokens are within that rounding, either
run may pick either, and everything after that point may differ. So outputs are
compared only up to the first position where the reference's top-1 margin is
small: a divergence there is allowed (and ends the comparison); a divergence where
the margin was clear fails.

The reference must carry log-probabilities of its top alternatives (``logprobs >= 2``
on the Python API, ``top_logprobs >= 2`` over HTTP).
"""

from __future__ import annotations

from typing import Any, Sequence

#: Largest top-2 logprob gap (nats) at which two paths may pick different tokens. Kernel rounding
#: of a Q4_K model moves logprobs by ~1e-3..1e-2 nats between batch shapes and CPUs; a verification
#: batch of a speculative server by up to ~0.2 nats on a 270M model's rambling tail (callers pass more).
NEAR_TIE = 0.1


def divergence(out: Sequence[Any], ref: Sequence[Any]) -> int:
    """Index of the first position where ``out`` and ``ref`` differ (the shorter length if one is a
    prefix of the other)."""
    n = 0
    while n < min(len(out), len(ref)) and out[n] == ref[n]:
        n += 1
    return n


def assert_same_greedy(out: Sequence[Any], ref: Sequence[Any], ref_top: Sequence[Sequence[tuple[Any, float]]],
                       margin: float = NEAR_TIE, *, what: str = "", allow_prefix: bool = False) -> int:
    """``out`` equals greedy ``ref`` token for token, except after a position where ``out`` took an
    alternative that ``ref`` nearly tied with its own pick (within ``margin`` nats).

    ``ref_top[i]`` lists ``(token, logprob)`` of the reference's best alternatives at step ``i``, best
    first. Tokens may be ids or text pieces (HTTP). Returns the length of the agreeing prefix.
    ``allow_prefix``: one output may stop earlier than the other (e.g. a stop string or end of generation
    reached only after a near-tie branch): only the common part is compared.
    """
    prefix = f"{what}: " if what else ""
    n = divergence(out, ref)
    if n == len(out) == len(ref):
        return n
    if n == min(len(out), len(ref)):
        assert allow_prefix, f"{prefix}one output is a prefix of the other (at {n}: {len(out)} vs {len(ref)} tokens)"
        return n
    top = list(ref_top[n])
    assert len(top) >= 2, f"{prefix}the reference has no alternatives at step {n} (ask for logprobs >= 2)"
    assert top[0][0] == ref[n], f"{prefix}the reference's pick at {n} is not its top alternative: greedy?"
    near = [tok for tok, lp in top[1:] if top[0][1] - lp < margin]
    assert out[n] in near, (
        f"{prefix}diverged at step {n}: {out[n]!r} instead of {ref[n]!r}, where the reference's top alternatives "
        f"were {[(tok, round(lp, 4)) for tok, lp in top[:3]]} (a tie within {margin} nats: {near})")
    return n


def tops(logprobs: Sequence[Any]) -> list[list[tuple[int, float]]]:
    """``ref_top`` from a Completion's ``logprobs`` (TokenLogprob entries)."""
    return [[(alt.token, alt.logprob) for alt in entry.top] for entry in logprobs]


def assert_greedy_equivalent(out: Any, ref: Any, margin: float = NEAR_TIE, *, what: str = "") -> int:
    """:func:`assert_same_greedy` on two Completions (``ref`` run with ``logprobs >= 2``). Where they agree
    to the end, their finish reasons agree too."""
    assert ref.logprobs is not None and len(ref.logprobs) == len(ref.tokens), "the reference needs logprobs"
    n = assert_same_greedy(out.tokens, ref.tokens, tops(ref.logprobs), margin, what=what)
    if n == len(out.tokens) == len(ref.tokens):
        assert out.finish_reason == ref.finish_reason, f"{what}: {out.finish_reason} vs {ref.finish_reason}"
    return n


def http_tops(content: Sequence[Any]) -> tuple[list[str], list[list[tuple[str, float]]]]:
    """(tokens, ref_top) from an OpenAI chat ``logprobs.content`` list (objects or dicts)."""
    def get(x: Any, name: str) -> Any:
        return x[name] if isinstance(x, dict) else getattr(x, name)

    tokens = [get(t, "token") for t in content]
    top = [[(get(a, "token"), get(a, "logprob")) for a in get(t, "top_logprobs")] for t in content]
    return tokens, top


def http_clear_prefix(base_url: str, messages: Sequence[Any], max_tokens: int,
                      headers: dict[str, str] | None = None, margin: float = NEAR_TIE) -> tuple[str, list[str], bool]:
    """A chat's greedy reply over HTTP up to its first near tie: (that text, the reply's tokens, whether the
    whole reply is clear). The reference for comparing another path's free text (another API, a stream)."""
    import httpx

    r = httpx.post(f"{base_url}/v1/chat/completions", headers=headers or {}, timeout=120,
                   json={"messages": list(messages), "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
                         "top_logprobs": 2})
    assert r.status_code == 200, r.text
    tokens, top = http_tops(r.json()["choices"][0]["logprobs"]["content"])
    n = 0
    while n < len(tokens) and top[n][0][1] - top[n][1][1] >= margin:
        n += 1
    return "".join(tokens[:n]), tokens, n == len(tokens)
