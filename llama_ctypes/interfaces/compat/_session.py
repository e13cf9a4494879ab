"""A ``Llama``'s own context: llama-cpp-python's low-level loop (``eval``, ``sample``, ``generate``,
``input_ids``, ``save_state``/``load_state``) over our Context, Sampler and Vocab.

The one-call API (pooled contexts) serves completions without Python hooks; this context serves what
needs to run Python between tokens (``logits_processor``, ``stopping_criteria``), a prompt cache of
saved states (``set_cache``), and callers of the low-level methods. One user at a time: :class:`Busy`
serializes it (llama-cpp-python's single context has no lock at all).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ...core.context import Context
from ...core.model import Model
from ...core.params import ContextParams, split_options
from ...core.sampler import Sampler, SamplingParams
from ...core.vocab_context import VocabContext
from ...errors import ClosedError, ContextOverflowError, InvalidArgumentError

#: ``(input_ids, scores) -> scores``: one row of logits (float32, n_vocab) after the ids so far.
LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: ``(input_ids, logits) -> bool``: True stops the generation before the token is emitted.
StoppingCriteria = Callable[[np.ndarray, np.ndarray], bool]


class ContextView:
    """llama-cpp-python's ``Llama._ctx`` (its internal context wrapper) as far as code outside it reads
    it: ``ctx`` is the context object itself (a :class:`~llama_ctypes.Context`, or a
    :class:`~llama_ctypes.core.vocab_context.VocabContext` for a ``vocab_only`` model), never a raw pointer."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def n_ctx(self) -> int:
        return int(self.ctx.n_ctx)


class LogitsProcessorList(list):
    """llama-cpp-python's list of logits processors, run in order; itself one."""

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list):
    """llama-cpp-python's list of stopping criteria: any one stops; itself one."""

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return any(criterion(input_ids, logits) for criterion in self)


class MinTokensLogitsProcessor:
    """Bans end-of-generation until ``min_tokens`` tokens follow the prompt (llama-cpp-python's)."""

    def __init__(self, min_tokens: int, token_eos: int) -> None:
        self.min_tokens = int(min_tokens)
        self.token_eos = int(token_eos)
        self.prompt_tokens: int | None = None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        if len(input_ids) - self.prompt_tokens < self.min_tokens:
            scores[self.token_eos] = -np.inf
        return scores


@dataclass
class LlamaState:
    """A saved ``Llama`` context: its tokens, the logits after the last one, the llama.cpp state bytes
    and the seed (picklable; :class:`LlamaDiskCache` stores these)."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes
    llama_state_size: int
    seed: int
    model_path: str = field(default="")


class Busy:
    """The own context's lock. Held across a generation's yields, so it may be released by another thread
    than the one that took it (a stream iterated from a thread pool); plain ``threading.Lock`` allows that.
    The thread that holds it asking again gets an error instead of a deadlock (an unfinished ``generate()``
    or stream left open, then another call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> "Busy":
        me = threading.get_ident()
        if self._owner == me:
            raise InvalidArgumentError("this Llama's own context is in use by an unfinished generate() or "
                                       "stream in this thread: consume or close it first")
        self._lock.acquire()
        self._owner = me
        return self

    def __exit__(self, *exc: Any) -> None:
        self._owner = None
        self._lock.release()


class Session:
    """The context a ``Llama`` owns for its low-level methods (created on first use).

    ``logits_all``: the logits after every token held are kept (an ``n_ctx`` x ``n_vocab`` float32 array,
    allocated on first use, as llama-cpp-python's ``scores``), so any held position can be sampled
    from and a prompt's own log-probabilities read; otherwise only the last row is kept.
    """

    def __init__(self, model: Model, ctx_opts: dict[str, Any], loras: dict | None, logits_all: bool = False) -> None:
        self._model = model
        self._ctx_opts = ctx_opts
        self._loras = loras
        self._ctx: Context | None = None
        self._vocab_ctx: VocabContext | None = None
        self._create_lock = threading.Lock()  # (two threads' first use make one context)
        self._closed = False
        self.lock = Busy()
        self.n_ctx = int(ctx_opts["n_ctx"])
        self.input_ids = np.zeros(self.n_ctx, dtype=np.intc)
        self.n_tokens = 0
        self._last_scores: np.ndarray | None = None  # the logits after input_ids[n_tokens - 1]
        self.logits_all = bool(logits_all)
        self._rows: np.ndarray | None = None  # logits_all: row i = the logits after input_ids[i]
        self._rows_valid = 0  # how many leading rows of _rows belong to what is held

    def handle(self) -> Context | VocabContext:
        """The context itself (created on first use): a :class:`VocabContext` for a ``vocab_only`` model,
        as llama-cpp-python keeps a context even for one."""
        if not self._model.params.vocab_only:
            return self._context()
        with self._create_lock:
            if self._closed:
                raise ClosedError("this Llama was closed")
            vocab_ctx = self._vocab_ctx
            if vocab_ctx is None:
                (opts,) = split_options(self._ctx_opts, ContextParams, where="Llama: unknown")
                vocab_ctx = self._vocab_ctx = VocabContext(self._model, ContextParams(**opts))
                if self._closed:  # (close() ran in another thread while this one created it: never kept)
                    self.close()
                    raise ClosedError("this Llama was closed")
            return vocab_ctx

    def _context(self) -> Context:
        with self._create_lock:
            return self._context_locked()

    def _context_locked(self) -> Context:
        ctx = self._ctx
        if ctx is None:
            if self._closed:
                raise ClosedError("this Llama was closed")
            ctx = Context.create(self._model, **self._ctx_opts)
            if ctx.encoder_only or ctx.embedding_only:  # (its logits are not a next-token distribution)
                ctx.close()
                raise InvalidArgumentError(f"{self._model.path.name} is an embedding or encoder-only model: it "
                                           "embeds (Llama(embedding=True).embed), it cannot generate")
            self._ctx = ctx
            if self._closed:  # (close() ran in another thread while this one created it: never kept)
                self.close()
                raise ClosedError("this Llama was closed")
            if self._loras:
                with ctx.lease() as lease:  # (a ClosedError if close() came meanwhile)
                    lease.set_loras(self._loras)
        return ctx

    # ---- the low-level methods ------------------------------------------------------------------

    def eval(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` after what the context holds; the logits of the last are kept."""
        tokens = self._model.vocab.check_tokens([int(t) for t in tokens]).tolist()
        if not tokens:
            return
        if self.n_tokens + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"{self.n_tokens} tokens held and {len(tokens)} more do not fit n_ctx="
                                       f"{self.n_ctx}", n_tokens=self.n_tokens + len(tokens), n_ctx=self.n_ctx)
        ctx = self._context()
        with ctx.lease() as lease:
            held = lease.tokens
            if len(held) != self.n_tokens:  # (a failed decode cleared it: our record follows)
                self.n_tokens = self._rows_valid = 0
            try:
                if self.logits_all:
                    self._eval_all_rows(lease, ctx, tokens)
                else:
                    lease.extend(tokens)
            except BaseException:
                self.n_tokens, self._last_scores, self._rows_valid = 0, None, 0
                raise
            self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
            self.n_tokens += len(tokens)
            self._last_scores = lease.logits(-1)

    def _eval_all_rows(self, lease: Any, ctx: Context, tokens: list[int]) -> None:
        """Decode tokens in runs with a logits row for each, stored after the rows held."""
        rows = self._rows
        if rows is None:
            rows = self._rows = np.zeros((self.n_ctx, self._model.n_vocab), dtype=np.float32)
        step = max(1, min(ctx.max_batch, ctx.n_outputs_max))
        at = self.n_tokens
        for start in range(0, len(tokens), step):
            run = tokens[start:start + step]
            lease.decode_run(run)  # (ClosedError once close() ran in another thread, which drops self._rows)
            for i in range(len(run)):
                rows[at + start + i] = lease.logits(i)
        if self._rows_valid == at:  # (rows before `at` unknown, e.g. after a state without them: stay so)
            self._rows_valid = at + len(tokens)

    def rows(self) -> np.ndarray:
        """logits_all: the logits after each token held, ``(n_tokens, n_vocab)`` (a read-only view that a
        later eval overwrites, as llama-cpp-python's ``scores``)."""
        if self._rows is None or self._rows_valid < self.n_tokens:
            raise InvalidArgumentError("no logits for every token held: eval() them with logits_all=True")
        view = self._rows[:self.n_tokens]
        view.flags.writeable = False
        return view

    def row(self, idx: int) -> np.ndarray:
        """A copy of the logits after token ``idx`` held (any with logits_all, else only the last)."""
        if not -self.n_tokens <= idx < self.n_tokens:
            raise InvalidArgumentError(f"idx={idx}: {self.n_tokens} tokens are held")
        idx %= self.n_tokens
        if idx == self.n_tokens - 1:
            return self.scores()
        if not self.logits_all:
            raise InvalidArgumentError(f"idx={idx}: only the logits after the last token held "
                                       f"(idx={self.n_tokens - 1}) are kept (Llama(logits_all=True) keeps every row)")
        return self.rows()[idx].copy()

    def truncate(self, n: int) -> bool:
        """Keep only the first ``n`` tokens; False (everything dropped) when the memory cannot cut there."""
        if n >= self.n_tokens:
            return True
        ctx = self._context()
        with ctx.lease() as lease:
            if len(lease.tokens) == self.n_tokens and lease.truncate(n):
                self.n_tokens, self._last_scores = n, None
                self._rows_valid = min(self._rows_valid, n)
                if self.logits_all and n and self._rows_valid == n:
                    self._last_scores = self._rows[n - 1].copy()  # (kept: the prefix's last row is known)
                return True
            lease.clear()
        self.n_tokens, self._last_scores, self._rows_valid = 0, None, 0
        return False

    def reset(self) -> None:
        self.truncate(0)

    def scores(self) -> np.ndarray:
        """The logits after the last token held (a copy)."""
        if self._last_scores is None:
            raise InvalidArgumentError("no logits: eval() some tokens first")
        return self._last_scores.copy()

    def sample(self, sampler: Sampler, logits_processor: LogitsProcessor | None, idx: int | None = None) -> int:
        row = self.scores() if idx is None else self.row(idx)
        if logits_processor is not None:
            row = np.asarray(logits_processor(self.input_ids[:self.n_tokens], row), dtype=np.float32)
        return sampler.sample_logits(row)

    def generate(self, tokens: Sequence[int], params: SamplingParams, *, reset: bool = True,
                 logits_processor: LogitsProcessor | None = None,
                 stopping_criteria: StoppingCriteria | None = None) -> Iterator[int]:
        """Tokens sampled after ``tokens`` (an endless iterator, as llama-cpp-python's): the longest
        prefix already held is kept (all of it when its logits are there), the rest decoded."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise InvalidArgumentError("the prompt is empty (no tokens)")
        if reset and self.n_tokens:
            held = self.input_ids[:self.n_tokens].tolist()
            common = 0
            for a, b in zip(held, tokens):
                if a != b:
                    break
                common += 1
            if self.logits_all:  # (the prompt's rows are needed: reuse only what has them)
                common = min(common, self._rows_valid)
            if common == len(tokens) == self.n_tokens and self._last_scores is not None:
                tokens = []  # everything held, with its logits: sample at once
            else:
                common = min(common, len(tokens) - 1)
                if not self.truncate(common):
                    common = 0
                tokens = tokens[common:]
        elif reset:
            self.reset()
        sampler = Sampler(self._model, params)
        try:
            while True:
                self.eval(tokens)
                tok = self.sample(sampler, logits_processor)
                if stopping_criteria is not None and stopping_criteria(self.input_ids[:self.n_tokens],
                                                                       self.scores()):
                    return
                tokens = yield tok
                if tokens is None:
                    tokens = [tok]
        finally:
            sampler.close()

    # ---- state --------------------------------------------------------------------------------------

    def save_state(self, seed: int, model_path: str) -> LlamaState:
        ctx = self._context()
        with ctx.lease() as lease:
            data = lease.state_get()
        if self.logits_all and self.n_tokens and self._rows_valid >= self.n_tokens:
            scores = self._rows[:self.n_tokens]  # (every row, as llama-cpp-python's logits_all state)
        else:
            scores = self._last_scores if self._last_scores is not None else np.zeros(0, dtype=np.float32)
        return LlamaState(input_ids=self.input_ids[:self.n_tokens].copy(), scores=scores.copy(),
                          n_tokens=self.n_tokens, llama_state=data, llama_state_size=len(data), seed=seed,
                          model_path=model_path)

    def load_state(self, state: LlamaState) -> None:
        if not isinstance(state, LlamaState):
            raise InvalidArgumentError(f"load_state takes a LlamaState, not {type(state).__name__}")
        n_tokens = state.n_tokens
        try:  # (a LlamaState is a plain object: its fields may have been set to anything)
            ids = self._model.vocab.check_tokens(np.asarray(state.input_ids).reshape(-1))
            scores = np.asarray(state.scores, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"the state's input_ids and scores must be arrays of numbers: {exc}") from None
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or not 0 <= n_tokens <= self.n_ctx \
                or len(ids) != n_tokens:
            raise InvalidArgumentError(f"a state of {n_tokens!r} tokens does not fit n_ctx={self.n_ctx}")
        if np.isnan(scores).any() or np.isposinf(scores).any():
            raise InvalidArgumentError("the state's logits hold NaN or +inf")
        n_vocab = self._model.n_vocab
        all_rows = scores.ndim == 2 and scores.shape == (n_tokens, n_vocab) and n_tokens > 0
        if not all_rows and (scores.ndim != 1 or scores.size not in (0, n_vocab)):
            raise InvalidArgumentError("the state's logits are not of this model's vocabulary")
        ctx = self._context()
        tokens = ids.tolist()
        with ctx.lease() as lease:
            try:
                lease.state_set(state.llama_state, tokens)
            except BaseException:
                self.n_tokens, self._last_scores = 0, None
                raise
        self.input_ids[:n_tokens] = ids
        self.n_tokens = int(n_tokens)
        self._rows_valid = 0
        if all_rows:
            self._last_scores = scores[-1].copy()
            if self.logits_all:
                if self._rows is None:
                    self._rows = np.zeros((self.n_ctx, n_vocab), dtype=np.float32)
                self._rows[:n_tokens] = scores
                self._rows_valid = int(n_tokens)
        else:
            self._last_scores = scores.copy() if scores.size else None

    def close(self) -> None:
        """Free the own context (a generation still running in another thread fails with ClosedError at its
        next token). Idempotent; nothing may use the session afterwards."""
        self._closed = True
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()
        vocab_ctx, self._vocab_ctx = self._vocab_ctx, None
        if vocab_ctx is not None:
            vocab_ctx.close()
        self.n_tokens, self._last_scores, self._rows_valid, self._rows = 0, None, 0, None
