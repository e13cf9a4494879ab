"""The completions a ``Llama`` runs on its own context (``_session.py``) rather than the one-call API:
Python hooks between tokens (``logits_processor``, ``stopping_criteria``), a prompt cache of saved
states, and echo with the prompt's own logprobs (``logits_all``). A mixin of :class:`.llama.Llama`.
"""

from __future__ import annotations

import codecs
import logging
import time
import uuid
from typing import Any, Iterator

import numpy as np

from ...core.sampler import SamplingParams
from ...errors import ArgumentTypeError, InvalidArgumentError, LlamaError
from ...features.chat import ChatParams, prompt_tokens, render_prompt
from ._session import LlamaState, LogitsProcessorList, StoppingCriteriaList
from ._shapes import collect, completion_chunk, token_usage

logger = logging.getLogger(__name__.rsplit(".", 1)[0] + ".llama")


class HookedCalls:
    """``Llama``'s methods that run on its own context, one call at a time (its ``_session`` lock)."""

    def _hooked_completion(self, envelope: dict[str, Any], prompt: Any, prefix: str, opts: dict[str, Any],
                           logits_processor: Any, stopping_criteria: Any,
                           prompt_logprobs: bool = False) -> Iterator[dict[str, Any]]:
        """A completion on the own context, chunk by chunk: Python hooks between tokens, the cache.

        ``prompt_logprobs`` (echo with logprobs; needs ``logits_all``): the logprobs start with the prompt's
        own tokens, read from the rows after each prompt token (the first one has none, as OpenAI's)."""
        if isinstance(logits_processor, (list, tuple)) and not callable(logits_processor):
            logits_processor = LogitsProcessorList(logits_processor)  # (a plain list of processors)
        if isinstance(stopping_criteria, (list, tuple)) and not callable(stopping_criteria):
            stopping_criteria = StoppingCriteriaList(stopping_criteria)
        for name, hook in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
            if hook is not None and not callable(hook):
                raise ArgumentTypeError(f"{name} must be callable (or a list of callables)")
        vocab = self._model.vocab
        tokens = vocab.tokenize(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) \
            else vocab.check_tokens(prompt).tolist()
        max_tokens, stops = opts.pop("max_tokens"), [s for s in opts.pop("stop") if s]
        n_logprobs = opts.pop("logprobs", None)
        params = SamplingParams(**opts)
        if len(tokens) >= self.n_ctx():
            raise InvalidArgumentError(f"a prompt of {len(tokens)} tokens does not fit n_ctx={self.n_ctx()}")
        last_row: list[np.ndarray] = []  # the raw logits of the step being sampled (logprobs; one row kept)
        entries: list[tuple[float, dict[int, float]]] = []

        def processor(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
            if n_logprobs is not None:
                last_row[:] = [scores.copy()]
            return logits_processor(ids, scores) if logits_processor else scores

        def chunks() -> Iterator[dict[str, Any]]:
            if self.cache is not None:
                self._load_from_cache(tokens)
            with self._session.lock:
                out: list[int] = []
                text, sent, finish = "", 0, "length"
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # (as the plain path: U+FFFD)
                gen = self._session.generate(tokens, params, logits_processor=processor,
                                             stopping_criteria=stopping_criteria)
                try:
                    if prefix:
                        yield completion_chunk(envelope, prefix, None, None)
                    while len(out) < max_tokens and len(tokens) + len(out) < self.n_ctx():
                        tok = next(gen, None)
                        if tok is None or vocab.is_eog(tok):
                            finish = "stop"
                            break
                        out.append(tok)
                        if n_logprobs is not None and last_row:
                            entries.append(_logprob_entry(last_row.pop(), tok, n_logprobs))
                        text += decoder.decode(vocab.token_bytes(tok))
                        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                        if cut >= 0:
                            text, finish = text[:cut], "stop"
                            break
                        safe = len(text) - max((n for s in stops for n in range(len(s) - 1, 0, -1)
                                                if text.endswith(s[:n])), default=0)
                        if safe > sent:
                            yield completion_chunk(envelope, text[sent:safe], None, None)
                            sent = safe
                finally:
                    gen.close()
                if prompt_logprobs and n_logprobs is not None:
                    prompt_part = _prompt_logprobs(vocab, tokens, self._session.rows(), n_logprobs)
            if self.cache is not None:
                state = self.save_state()
                try:
                    self.cache[state.input_ids.tolist()] = state
                except OSError:  # (a full or unwritable cache directory: the completion stands)
                    logger.warning("the prompt cache could not store a state", exc_info=True)
            text += decoder.decode(b"", final=True)
            logprobs = _raw_logprobs(vocab, out, entries, len(prefix)) if n_logprobs is not None else None
            if prompt_logprobs and logprobs is not None:
                logprobs = _joined(prompt_part, logprobs)
            if text[sent:]:
                yield completion_chunk(envelope, text[sent:], None, None)
            yield {**completion_chunk(envelope, "", logprobs, finish), "usage": token_usage(len(tokens), len(out))}

        return chunks()

    def _hooked_chat(self, messages: list[dict[str, Any]], opts: dict[str, Any], max_tokens: int | None,
                     stop: Any, stream: bool, logits_processor: Any, name: str, chat_template: str | None) -> Any:
        """A chat completion on the own context with a logits processor (outlines' chat mode): the messages
        rendered as create_chat_completion renders them, the reply not parsed (no tools, no reasoning)."""
        params = ChatParams(chat_template=chat_template)
        text, _ = render_prompt(self._model, messages, params)
        tokens = prompt_tokens(self._model, text)
        opts["max_tokens"] = self._max_tokens(max_tokens)
        if opts["max_tokens"] == -1:
            opts["max_tokens"] = max(1, self.n_ctx() - len(tokens))
        opts["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        envelope = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": name}
        chunks = self._hooked_completion(envelope, tokens, "", opts, logits_processor, None)

        def deltas() -> Iterator[dict[str, Any]]:
            yield {**envelope, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]}
            for chunk in chunks:
                choice = chunk["choices"][0]
                if choice["text"]:
                    yield {**envelope, "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"content": choice["text"]}, "logprobs": None, "finish_reason": None}]}
                if choice["finish_reason"] is not None:
                    yield {**envelope, "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}

        if stream:
            return deltas()
        done = collect(chunks)
        choice = done["choices"][0]
        return {**envelope, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": choice["text"]}, "logprobs": None,
            "finish_reason": choice["finish_reason"]}], "usage": done["usage"]}

    def _load_from_cache(self, tokens: list[int]) -> None:
        """Restore the cached state that shares the longest prefix with ``tokens`` when it beats what the own
        context holds. A state of another model or context size, or an unreadable entry, is a miss."""
        held = self._session.input_ids[:self._session.n_tokens].tolist()
        have = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
        try:
            state = self.cache[tokens]
        except KeyError:
            return
        except Exception:  # noqa: BLE001 - a corrupt disk entry: a miss, not a failed completion
            logger.warning("the prompt cache could not read an entry; treated as a miss", exc_info=True)
            return
        if not isinstance(state, LlamaState) or state.model_path != self.model_path or state.n_tokens > self.n_ctx():
            return
        ids = state.input_ids.tolist()
        common = next((i for i, (a, b) in enumerate(zip(ids, tokens)) if a != b), min(len(ids), len(tokens)))
        if common > have:
            try:
                self.load_state(state)
            except LlamaError:  # (saved by another context shape: llama.cpp refuses it) a miss
                logger.warning("the prompt cache's state does not fit this Llama; treated as a miss")


def _logprob_entry(row: np.ndarray, tok: int, n: int) -> tuple[float, dict[int, float]]:
    """The chosen token's log-probability and the ``n`` best, from one raw logits row (then dropped)."""
    row = row.astype(np.float64)
    logp = row - (np.max(row) + np.log(np.sum(np.exp(row - np.max(row)))))
    top = np.argpartition(-logp, n)[:n] if 0 < n < logp.size else np.arange(logp.size if n else 0)
    top = top[np.argsort(-logp[top])]
    return float(logp[tok]), {int(t): float(logp[t]) for t in top}


def _raw_logprobs(vocab: Any, tokens: list[int], entries: list[tuple[float, dict[int, float]]],
                  offset: int) -> dict[str, Any]:
    """llama-cpp-python's completion logprobs, from the logits before the processors ran."""
    out: dict[str, Any] = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for tok, (chosen, top) in zip(tokens, entries):
        piece = vocab.token_bytes(tok).decode("utf-8", "replace")
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(chosen)
        entry = {vocab.token_bytes(t).decode("utf-8", "replace"): lp for t, lp in top.items()}
        entry[piece] = chosen
        out["top_logprobs"].append(entry)
        offset += len(piece)
    return out


def _prompt_logprobs(vocab: Any, tokens: list[int], rows: np.ndarray, n: int) -> dict[str, Any]:
    """The prompt's own logprobs (echo): token i's from the row after token i - 1. BOS is left out and the
    first token shown has none (None), as llama-cpp-python and OpenAI give them; offsets from 0."""
    out: dict[str, Any] = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    offset = 0
    for i, tok in enumerate(tokens):
        if vocab.bos is not None and tok == vocab.bos:
            continue
        piece = vocab.token_bytes(tok).decode("utf-8", "replace")
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        if len(out["tokens"]) == 1:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            chosen, top = _logprob_entry(rows[i - 1], tok, n)
            entry = {vocab.token_bytes(t).decode("utf-8", "replace"): lp for t, lp in top.items()}
            entry[piece] = chosen
            out["token_logprobs"].append(chosen)
            out["top_logprobs"].append(entry)
        offset += len(piece)
    return out


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}
