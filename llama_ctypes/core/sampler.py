"""Sampling: validated parameters and the llama.cpp sampler chain built from them."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import random
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ArgumentTypeError, ClosedError, GrammarError, IndexOutOfRangeError, InvalidArgumentError
from ..native import llama_h as L
from .backend import clear_native_error, native_error
from .deep_stack import DEEP_STACK
from .grammar_sampler import grammar_accept_fn, grammar_apply_fn, prefill_tokens, reset_grammar, taken_message
from .grammar_check import check_breadth, check_gbnf
from .trigger_check import check_trigger_pattern, normalize_trigger
from .handle import NativeHandle
from .params import INT32_MAX, split_options

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .model import Model


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked. Defaults follow llama.cpp's ``common`` defaults.

    ``temp <= 0`` means greedy decoding (argmax after penalties, bias and grammar).
    """

    temp: float = 0.8
    """Temperature; <= 0 is greedy."""
    top_k: int = 40
    """Keep the k most likely tokens; <= 0 disables."""
    top_p: float = 0.95
    """Nucleus sampling threshold; 1.0 disables."""
    min_p: float = 0.05
    """Drop tokens below min_p x the top probability; 0 disables."""
    typical_p: float = 1.0
    """Locally typical sampling; 1.0 disables."""
    top_n_sigma: float = -1.0
    """Keep tokens within n standard deviations of the top logit; <= 0 disables."""
    xtc_probability: float = 0.0
    """Exclude-top-choices: chance per step to drop the top tokens; 0 disables."""
    xtc_threshold: float = 0.1
    """XTC: tokens above this probability are candidates for exclusion."""
    dynatemp_range: float = 0.0
    """Dynamic temperature range (temp +- range); 0 disables."""
    dynatemp_exponent: float = 1.0
    """Dynamic temperature exponent."""
    mirostat: int = 0
    """Mirostat: 0 = off, 1 = v1, 2 = v2 (replaces top-k/p/min-p)."""
    mirostat_tau: float = 5.0
    """Mirostat target entropy."""
    mirostat_eta: float = 0.1
    """Mirostat learning rate."""
    penalty_last_n: int = 64
    """Tokens of history the penalties look at; 0 disables, -1 = the whole context."""
    penalty_repeat: float = 1.0
    """Repetition penalty; 1.0 disables."""
    penalty_freq: float = 0.0
    """Frequency penalty; 0 disables."""
    penalty_present: float = 0.0
    """Presence penalty; 0 disables."""
    dry_multiplier: float = 0.0
    """DRY repetition penalty strength; 0 disables."""
    dry_base: float = 1.75
    """DRY exponential base."""
    dry_allowed_length: int = 2
    """DRY: repeats up to this length are free."""
    dry_penalty_last_n: int = 64
    """DRY look-back in tokens; 0 disables, -1 = the whole context."""
    dry_sequence_breakers: Sequence[str] = ("\n", ":", '"', "*")
    """DRY: strings that end a repeated sequence."""
    adaptive_target: float = -1.0
    """Adaptive-p: pick tokens near this probability (0..1), replacing the random draw; < 0 disables."""
    adaptive_decay: float = 0.9
    """Adaptive-p: EMA decay of the observed probabilities (0..0.99); history is about 1/(1-decay) tokens."""
    logit_bias: Mapping[int, float] | None = None
    """Added to the logits of the given token ids (-inf bans a token)."""
    seed: int | None = None
    """RNG seed; None draws a fresh one."""
    min_keep: int = 0
    """Candidates every truncating sampler keeps at least."""
    grammar: str | None = None
    """GBNF grammar constraining the output."""
    json_schema: Mapping[str, Any] | str | None = None
    """JSON Schema the output must satisfy (converted to a grammar; exclusive with ``grammar``)."""
    grammar_root: str = "root"
    """Start rule of the grammar."""
    grammar_lazy_triggers: Sequence[str] = field(default=())
    """Regex patterns; when given, the grammar applies only after one matches (lazy grammar)."""
    grammar_prefill: str = ""
    """Text at the end of the prompt that the grammar's start rule expects (llama.cpp's chat code
    writes the generation prompt into its tool-call grammars); fed to the grammar before the first
    token and after a reset. Not for lazy grammars."""
    backend_sampling: bool = False
    """Sample inside ``llama_decode``'s compute graph (llama.cpp's backend sampling, llama-server's
    ``backend_sampling``): the logits row never leaves the device and the chain runs there. Falls back
    to the usual path, with the reason recorded, for what the graph cannot do (:attr:`in_graph_blocker`;
    the runner adds its own: logprobs, speculative decoding). Greedy picks the same tokens; seeded
    sampling draws from the same distribution."""

    def __hash__(self) -> int:
        # Consistent with the field-wise ==: json_schema and logit_bias may be dicts, so hash a
        # canonical rendering of every field.
        return hash(json.dumps([(f.name, getattr(self, f.name)) for f in fields(self)], sort_keys=True,
                               default=repr))

    def __post_init__(self) -> None:
        def check(cond: bool, name: str, expect: str) -> None:
            if not cond:
                raise InvalidArgumentError(f"{name}={getattr(self, name)!r}: expected {expect}")

        for name in ("temp", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                     "dynatemp_range", "dynatemp_exponent", "mirostat_tau", "mirostat_eta", "penalty_repeat",
                     "penalty_freq", "penalty_present", "dry_multiplier", "dry_base", "adaptive_target",
                     "adaptive_decay"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  name, "a finite number")
        check(isinstance(self.backend_sampling, bool), "backend_sampling", "True or False")
        for name in ("top_k", "mirostat", "penalty_last_n", "dry_allowed_length", "dry_penalty_last_n", "min_keep"):
            value = getattr(self, name)
            # (C int32_t parameters: a larger value would not even reach llama.cpp)
            check(isinstance(value, int) and not isinstance(value, bool) and -INT32_MAX <= value <= INT32_MAX, name,
                  "an integer in the int32 range")
        check(0.0 <= self.top_p <= 1.0, "top_p", "a value in [0, 1]")
        check(0.0 <= self.min_p <= 1.0, "min_p", "a value in [0, 1]")
        check(0.0 < self.typical_p <= 1.0, "typical_p", "a value in (0, 1]")
        check(0.0 <= self.xtc_probability <= 1.0, "xtc_probability", "a value in [0, 1]")
        check(0.0 <= self.xtc_threshold <= 1.0, "xtc_threshold", "a value in [0, 1]")
        check(self.mirostat in (0, 1, 2), "mirostat", "0, 1 or 2")
        check(self.mirostat_tau > 0 and self.mirostat_eta > 0 or self.mirostat == 0, "mirostat_tau",
              "positive mirostat_tau and mirostat_eta")
        check(self.penalty_repeat > 0, "penalty_repeat", "a value > 0 (1.0 disables)")
        check(self.penalty_last_n >= -1, "penalty_last_n", "-1, 0 or a positive integer")
        check(self.dry_penalty_last_n >= -1, "dry_penalty_last_n", "-1, 0 or a positive integer")
        check(self.dry_multiplier >= 0, "dry_multiplier", "a value >= 0")
        check(self.dry_base >= 1.0 or self.dry_multiplier == 0, "dry_base", "a value >= 1")
        check(self.dry_allowed_length >= 0, "dry_allowed_length", "a value >= 0")
        check(self.min_keep >= 0, "min_keep", "a value >= 0")
        check(self.dynatemp_range >= 0, "dynatemp_range", "a value >= 0")
        check(self.adaptive_target <= 1.0, "adaptive_target", "a value <= 1 (negative disables)")
        check(0.0 <= self.adaptive_decay <= 0.99, "adaptive_decay", "a value in [0, 0.99]")
        if self.seed is not None:
            check(isinstance(self.seed, int) and 0 <= self.seed < 0xFFFFFFFF, "seed", "an integer in [0, 2**32 - 1)")
        if self.logit_bias is not None:
            bias = {}
            for tok, value in dict(self.logit_bias).items():
                if not isinstance(tok, int) or tok < 0:
                    raise InvalidArgumentError(f"logit_bias key {tok!r}: expected a token id (int >= 0)")
                if not isinstance(value, (int, float)) or math.isnan(value):
                    raise InvalidArgumentError(f"logit_bias[{tok}]={value!r}: expected a number")
                bias[tok] = float(value)
            object.__setattr__(self, "logit_bias", bias)
        if self.grammar is not None:
            if not isinstance(self.grammar, str):
                raise ArgumentTypeError("grammar must be a GBNF string")
            check_gbnf(self.grammar)
        if self.json_schema is not None:
            if self.grammar is not None:
                raise InvalidArgumentError("pass either grammar or json_schema, not both")
            from .json_schema.convert import json_schema_to_gbnf

            # Validated and converted once, here; the GBNF then drives the grammar sampler.
            object.__setattr__(self, "grammar", json_schema_to_gbnf(self.json_schema))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        triggers = (self.grammar_lazy_triggers,) if isinstance(self.grammar_lazy_triggers, str) \
            else tuple(self.grammar_lazy_triggers)
        if any(not isinstance(t, str) or not t for t in triggers):
            raise InvalidArgumentError(f"grammar_lazy_triggers={self.grammar_lazy_triggers!r}: expected regex strings")
        if triggers and self.grammar is None:
            raise InvalidArgumentError("grammar_lazy_triggers need a grammar (or json_schema)")
        triggers = tuple(normalize_trigger(t) for t in triggers)
        for trigger in triggers:
            check_trigger_pattern(trigger)
        object.__setattr__(self, "grammar_lazy_triggers", triggers)
        if not isinstance(self.grammar_prefill, str):
            raise ArgumentTypeError("grammar_prefill must be a str")
        if self.grammar_prefill and (self.grammar is None or triggers):
            raise InvalidArgumentError("grammar_prefill needs a (non-lazy) grammar")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    @property
    def in_graph_blocker(self) -> str | None:
        """Why this chain cannot run inside the decode graph (a sampler llama.cpp has no backend
        version of, or penalties: see below), or None: logit bias, top-k, top-p, min-p, temperature
        (dynamic too), greedy and the random draw all can."""
        penalties = self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0 or self.penalty_present != 0)
        # (llama.cpp's penalties refuse the graph where a sequence may output more than one row per
        # decode, as every context here allows: the rest of the chain would still run there, partly)
        for reason, used in (("grammar", self.grammar is not None), ("dry", self.dry_multiplier > 0),
                             ("penalties", penalties),
                             ("mirostat", self.mirostat != 0 and not self.greedy),
                             ("top_n_sigma", self.top_n_sigma > 0 and not self.greedy),
                             ("typical_p", self.typical_p < 1.0 and not self.greedy),
                             ("xtc", self.xtc_probability > 0 and not self.greedy),
                             ("adaptive_p", self.adaptive_target >= 0 and not self.greedy)):
            if used:
                return reason
        return None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reshapes the logits: the choice is a bare argmax."""
        penalties = self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0 or self.penalty_present != 0)
        return (self.greedy and not self.logit_bias and self.grammar is None and not penalties
                and self.dry_multiplier == 0)


#: The largest k drawn from the row's k largest logits alone (and at most 1/32 of the vocabulary): past it
#: the heap that finds them costs about what llama.cpp's candidate array does, then more (a row of Gemma's
#: 262k: 55 against 355 µs at k = 40, 154 against 727 at 1024, even near 2048, 2.3 against 1.1 ms at 8192;
#: of a 32k vocabulary: 17 against 48 µs at 40, 99 against 216 at 512, 629 against 544 at 1536).
TOP_K_FIRST_MAX = 1024

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def _argmax_fn(logits_of: Callable[[int], np.ndarray]) -> Callable[[int], int]:
    """Greedy choice as a numpy argmax over the logits, in place of llama_sampler_sample.

    llama.cpp's greedy sampler first copies every logit into a candidate array
    (about 0.4 ms for a 262k vocabulary); argmax over a view of the logits
    picks the same token (the first maximum) in a tenth of the time.
    """
    return lambda idx: int(logits_of(idx).argmax())


@dataclass(frozen=True)
class PostSampling:
    """What the sampler chain left of one row when it picked ``token`` (llama-server's
    ``post_sampling_probs``): the chosen token's probability after truncation (top-k, top-p, min-p,
    ...) and temperature, and the most probable candidates left, by descending probability, none at
    probability 0. Greedy sampling leaves the chosen token alone, at probability 1."""

    token: int
    p: float
    ids: np.ndarray
    probs: np.ndarray


class SamplerBinding:
    """A Sampler claimed for one generation on one leased context: ``sample(idx) -> token``.

    Holds the sampler exclusively (a second generation using it raises BusyError) and keeps
    it from being freed until :meth:`release`.

    ``seq``: the sequence the generation decodes, for in-graph sampling (``params.backend_sampling``:
    a clone of the chain is attached to it, and its state comes back to the sampler at release);
    ``blocker``: the runner's reason not to sample in the graph (logprobs, speculative decoding).
    :attr:`in_graph` says whether the graph samples; :attr:`fallback` why not, when it was asked.
    """

    def __init__(self, sampler: "Sampler", lease, held: bool = False, candidates: int = 0,
                 seq: int | None = None, blocker: str | None = None) -> None:
        if sampler.model is not lease.ctx.model:
            raise InvalidArgumentError("this Sampler was made for another Model than the context's "
                                       "(token ids and grammars belong to one vocabulary)")
        sampler._begin_exclusive(held)
        self._sampler = sampler
        #: With ``candidates``: row -> :class:`PostSampling` of the last token sampled from it.
        self.post: dict[int, PostSampling] | None = {} if candidates else None
        self.in_graph = False
        self.fallback: str | None = None
        # In the graph: a clone of the chain (llama.cpp sets an attached chain up for the graph for good,
        # after which it cannot sample on the CPU or be attached again); its state goes back at release.
        self._clone: int | None = None
        self._attached: tuple[Any, int, int] | None = None  # (lease, seq, clone) while in the graph
        try:
            if sampler.params.backend_sampling and seq is not None:
                self.fallback = blocker or ("post_sampling_probs" if candidates else None) \
                    or sampler.params.in_graph_blocker
                if self.fallback is None:
                    self._attach(sampler, lease, seq)
                if self.fallback is not None:
                    logger.debug("backend_sampling: sequence %s samples as usual (%s)", seq, self.fallback)
            # ``(idx, logits row) -> token`` where the draw works on a candidate array of its own (a grammar,
            # or candidates kept): it can run on a copy of the row, off the thread that decodes.
            self._draw: Callable[[int, np.ndarray], int] | None = None
            if self.in_graph:  # (llama_sampler_sample returns the graph's token and accepts it)
                fn = lease.sample_fn(self._clone)
            elif candidates or sampler._grammar:
                if sampler._ptr is None:
                    raise ClosedError("Sampler is closed")
                self._draw = draw = sampler._candidates_fn(lease, candidates, self.post) if candidates \
                    else sampler._constrained_fn(lease)
                logits_of = lease.logits_view_fn()

                def fn(idx: int) -> int:
                    return draw(idx, logits_of(idx))
            else:
                fn = sampler._sample_fn(lease)
        except BaseException:
            self._detach()
            sampler._end_exclusive()
            raise
        self._held = True
        #: ``sample`` is a bare argmax of the row's logits: a runner may take it from one numpy
        #: operation over many rows instead (``ContextLease.logits_rows_fn``).
        self.argmax = not self.in_graph and not candidates and sampler._grammar is None \
            and sampler.params.plain_greedy
        #: ``sample`` is one native chain over the context's logits, with state of its own only (no
        #: grammar, no candidate arrays, not in the graph): a runner may call several bindings' at once
        #: from worker threads (the GIL is released in C), once the rows were read on its own thread
        #: (``ContextLease.has_logits``: llama.cpp reorders output rows at the first read).
        self.concurrent = not self.in_graph and not candidates and sampler._grammar is None \
            and not sampler.params.plain_greedy
        #: :meth:`draw` may stand for ``sample``: the draw works on a candidate array of its own
        #: (a grammar: its check may take long), so it can run off the decoding thread on a copy of the row.
        self.detachable = self._draw is not None

        def sample(idx: int) -> int:
            if not self._held:
                raise ClosedError("this SamplerBinding was released")
            return fn(idx)

        self.sample: Callable[[int], int] = sample

    def draw(self, idx: int, row: np.ndarray) -> int:
        """``sample(idx)`` from ``row``, a copy of that row's logits (``detachable`` bindings only), on any
        thread while no other call uses this binding: the row need not outlive the context's next decode."""
        if not self._held:
            raise ClosedError("this SamplerBinding was released")
        if self._draw is None:
            raise InvalidArgumentError("this binding samples from the context's own rows (not detachable)")
        return self._draw(idx, row)

    def _attach(self, sampler: "Sampler", lease, seq: int) -> None:
        if sampler._ptr is None:
            raise ClosedError("Sampler is closed")
        lib = sampler._lib
        clone = lib.llama_sampler_clone(sampler._ptr)
        if not clone:
            self.fallback = "the chain cannot be cloned"
            return
        self._clone = clone
        if lease.attach_sampler(seq, clone):
            self._attached = (lease, seq, clone)
            self.in_graph = True
        else:
            self.fallback = "not supported by the backend"

    def _detach(self) -> None:
        """Detach the clone from the context, give its state (RNG, penalty history) back to the sampler's
        own chain, free it. Idempotent."""
        if self._attached is not None:
            lease, seq, chain = self._attached
            self._attached = None
            lease.detach_sampler(seq, chain)
        clone, self._clone = self._clone, None
        if clone:
            lib, own = self._sampler._lib, self._sampler._ptr
            try:
                if self.in_graph and own:
                    lib.llama_sampler_copy(clone, own)
            finally:
                lib.llama_sampler_free(clone)

    def accept_forced(self, row: int, token: int) -> None:
        """``token`` is emitted at batch row ``row`` without sampling (a reasoning budget forced it): the
        chain accepts it (history, penalties), the grammar too when it allows it (the forced text lies
        outside the grammar's language otherwise), and with ``post`` it is recorded as certain."""
        if not self._held:
            raise ClosedError("this SamplerBinding was released")
        sampler = self._sampler
        lib = sampler._lib
        lib.llama_sampler_accept(self._clone if self.in_graph else sampler._ptr, token)
        if sampler._grammar and sampler._grammar_allows(token):
            grammar_accept_fn(lib)(sampler._grammar, token)
        if self.post is not None:
            self.post[row] = PostSampling(token, 1.0, np.array([token]), np.array([1.0]))

    def release(self) -> None:
        if self._held:
            self._held = False
            try:
                self._detach()  # (before the sampler may be freed: the context points at its chain)
            finally:
                self._sampler._end_exclusive()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


class Sampler(NativeHandle):
    """A llama.cpp sampler chain built from :class:`SamplingParams`.

    Holds its own state (RNG, penalty history, grammar position), so it serves
    one generation at a time: a generation claims it from its first token to
    its end, and a second concurrent use raises :class:`BusyError`. Closing it
    while a generation runs is safe (it is freed when that generation ends).
    ``reset()`` clears that state.

    ``n_ctx`` is the window that ``-1`` penalty windows (``penalty_last_n``,
    ``dry_penalty_last_n``) stand for: "the whole context". Default: the
    model's training context, which covers any context made from it.
    """

    _kind = "Sampler"

    def __init__(self, model: "Model", params: SamplingParams | None = None, n_ctx: int | None = None, *,
                 holder: Any = None):
        super().__init__()
        self._ptr = None
        self._grammar = None  # the grammar sampler, outside the chain (see _constrained_fn)
        self.params = params or SamplingParams()
        self.model = model
        self._lib = model._lib
        # The chain may point into the model's vocabulary. ``holder`` (a Context of this model)
        # keeps the model alive, so a sampler for it can be made even after Model.close().
        if holder is not None and holder.model is not model:
            raise InvalidArgumentError("holder must be a Context of the same Model")
        model._acquire(held=holder is not None)
        try:
            self.n_ctx = max(int(n_ctx), 1) if n_ctx else max(model.n_ctx_train, 1)
            if self.params.grammar is not None:
                self._grammar = self._grammar_sampler(model.vocab.native())
            self._ptr = self._build()
        except BaseException:
            if self._grammar:
                self._lib.llama_sampler_free(self._grammar)
            self._mark_dead()
            model._release()
            raise

    @classmethod
    def create(cls, model: "Model", **opts: Any) -> "Sampler":
        """Build a sampler from keyword options (the fields of :class:`SamplingParams`)."""
        (sampling,) = split_options(opts, SamplingParams, where="Sampler.create: unknown")
        return cls(model, SamplingParams(**sampling))

    def _build(self):
        lib, p, vocab = self._lib, self.params, self.model.vocab.native()
        n_vocab = lib.llama_vocab_n_tokens(vocab)
        # llama.cpp clamps negative windows to 0, which turns the sampler off: -1 means the whole context.
        # No window is longer than the context: llama.cpp allocates a ring buffer of the window's
        # size, so 2**31 - 1 would cost seconds per token (llama-server clamps the same way).
        penalty_last_n = self.n_ctx if p.penalty_last_n == -1 else min(p.penalty_last_n, self.n_ctx)
        dry_last_n = self.n_ctx if p.dry_penalty_last_n == -1 else min(p.dry_penalty_last_n, self.n_ctx)
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = lib.llama_sampler_chain_init(chain_params)
        seed = p.seed if p.seed is not None else random.getrandbits(32) % 0xFFFFFFFF

        added: list[str] = []

        def add(smpl, what: str) -> None:
            if not smpl:  # the chain is freed by the handler below
                raise InvalidArgumentError(f"llama.cpp rejected the {what} sampler settings")
            lib.llama_sampler_chain_add(chain, smpl)
            added.append(what)

        try:
            if p.logit_bias:
                bad = [t for t in p.logit_bias if t >= n_vocab]
                if bad:
                    raise InvalidArgumentError(f"logit_bias token ids {bad} are outside the vocabulary "
                                               f"(size {n_vocab})")
                arr = (L.llama_logit_bias * len(p.logit_bias))(
                    *[L.llama_logit_bias(t, b) for t, b in p.logit_bias.items()])
                add(lib.llama_sampler_init_logit_bias(n_vocab, len(arr), arr), "logit_bias")
            if p.penalty_last_n != 0 and (p.penalty_repeat != 1.0 or p.penalty_freq != 0 or p.penalty_present != 0):
                add(lib.llama_sampler_init_penalties(n_vocab, penalty_last_n, p.penalty_repeat, p.penalty_freq,
                                                     p.penalty_present), "penalties")
            if p.dry_multiplier > 0:
                breakers = [s.encode() for s in p.dry_sequence_breakers]
                arr = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
                add(lib.llama_sampler_init_dry(vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                               dry_last_n, arr, len(breakers)), "dry")
            if p.greedy:
                add(lib.llama_sampler_init_greedy(), "greedy")
            elif p.mirostat == 1:
                add(lib.llama_sampler_init_temp(p.temp), "temp")
                add(lib.llama_sampler_init_mirostat(n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100), "mirostat")
            elif p.mirostat == 2:
                add(lib.llama_sampler_init_temp(p.temp), "temp")
                add(lib.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta), "mirostat_v2")
            else:
                if p.top_n_sigma > 0:
                    add(lib.llama_sampler_init_top_n_sigma(p.top_n_sigma), "top_n_sigma")
                if p.top_k > 0:
                    # (keeping more than the vocabulary keeps it all; the backend's top-k asserts k <= n_vocab)
                    add(lib.llama_sampler_init_top_k(min(p.top_k, n_vocab)), "top_k")
                if p.typical_p < 1.0:
                    add(lib.llama_sampler_init_typical(p.typical_p, p.min_keep), "typical_p")
                if p.top_p < 1.0:
                    add(lib.llama_sampler_init_top_p(p.top_p, p.min_keep), "top_p")
                if p.min_p > 0.0:
                    add(lib.llama_sampler_init_min_p(p.min_p, p.min_keep), "min_p")
                if p.xtc_probability > 0:
                    add(lib.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, seed), "xtc")
                add(lib.llama_sampler_init_temp_ext(p.temp, p.dynatemp_range, p.dynatemp_exponent), "temp")
                if p.adaptive_target >= 0:  # like dist, it picks the token: it ends the chain
                    add(lib.llama_sampler_init_adaptive_p(p.adaptive_target, p.adaptive_decay, seed), "adaptive_p")
                else:
                    add(lib.llama_sampler_init_dist(seed), "dist")
        except BaseException:
            lib.llama_sampler_free(chain)
            raise
        # The seed actually used, so a run can be reproduced even when none was given.
        self.seed = seed
        #: k where the chain starts with top_k(k <= TOP_K_FIRST_MAX), nothing before it reading or changing logits (a
        #: bias, penalties, DRY, top-n-sigma): a row is then drawn from its k largest logits alone, found in
        #: one pass (lcx_sampler_sample_top_k), not from a candidate array of the whole vocabulary.
        self._top_k_first = p.top_k if added[:1] == ["top_k"] and p.top_k <= min(TOP_K_FIRST_MAX, n_vocab // 32) \
            else 0
        return chain

    def _grammar_sampler(self, vocab):
        lib, p = self._lib, self.params
        check_breadth(p.grammar, self.model.n_vocab)
        grammar, root = p.grammar.encode(), p.grammar_root.encode()
        clear_native_error()
        patterns = [t.encode() for t in p.grammar_lazy_triggers]
        arr = (ctypes.c_char_p * max(1, len(patterns)))(*patterns)
        error = ctypes.c_void_p()
        # llama.cpp's GBNF parser and its left-recursion check recurse once per nesting level: a grammar
        # check_gbnf allows (2000 levels) overflows a small thread stack (256 KiB), so the parse runs on a
        # thread with a large one.
        def discard(made) -> None:  # (an interrupt came while it was made)
            if made:
                lib.llama_sampler_free(made)
            if error.value:
                lib.lcx_string_free(error.value)

        smpl = DEEP_STACK.run(lib.lcx_sampler_init_grammar, vocab, grammar, root, arr, len(patterns),
                              ctypes.byref(error), cleanup=discard)
        if error.value:  # a C++ exception: a trigger pattern std::regex cannot parse, a grammar too broad
            message = taken_message(lib, error)
            if message.startswith("grammar too broad"):
                raise GrammarError(message)
            raise GrammarError(f"invalid grammar_lazy_triggers {list(p.grammar_lazy_triggers)!r}: {message}")
        if not smpl:
            raise GrammarError("invalid GBNF grammar: " + native_error("syntax error or undefined rule"))
        try:
            self._prefill(smpl)
        except BaseException:
            lib.llama_sampler_free(smpl)
            raise
        return smpl

    def _prefill(self, grammar) -> None:
        """Advance the grammar past ``grammar_prefill`` (as common/sampling.cpp does for chat grammars)."""
        text = self.params.grammar_prefill
        if not text:
            return
        tokens = prefill_tokens(self.model.vocab, text)
        if tokens is None:
            raise GrammarError(f"grammar_prefill {text!r}: no tokenization of it spells it exactly")
        for token in tokens:
            # llama.cpp throws (and the process aborts) on accepting a token the grammar refuses.
            if not self._grammar_allows(token, grammar):
                raise GrammarError(f"grammar_prefill {text!r} does not match the grammar's start")
            grammar_accept_fn(self._lib)(grammar, token)

    def _free(self) -> None:
        if self._ptr:
            self._lib.llama_sampler_free(self._ptr)
            self._ptr = None
        if self._grammar:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None
        self.model._release()

    # ---- use ---------------------------------------------------------------------
    def sample(self, ctx, idx: int = -1) -> int:
        """Pick a token from the logits of row ``idx`` of ``ctx``'s last decode, and accept it.

        ``ctx`` is a Context (claimed for the call) or a ContextLease the caller holds.
        """
        from .context import ContextLease

        if isinstance(ctx, ContextLease):
            if not ctx.has_logits(idx):  # llama.cpp's sampler asserts on a row without logits
                raise IndexOutOfRangeError(f"no logits for batch row {idx} (was it decoded as an output?)")
            binding = self.bind(ctx)
            try:
                return binding.sample(idx)
            finally:
                binding.release()
        with ctx.lease() as lease:
            return self.sample(lease, idx)

    def bind(self, lease, held: bool = False, candidates: int = 0, seq: int | None = None,
             blocker: str | None = None) -> SamplerBinding:
        """Claim this sampler for a generation on a leased context (see :class:`SamplerBinding`).

        ``held``: the caller keeps the sampler alive with :meth:`hold`, so a close requested
        meanwhile does not stop the claim. ``candidates`` > 0: each sample keeps that many of the
        candidates the chain left (``binding.post``); the tokens drawn are the same (with a grammar,
        which then masks before the chain instead of checking after it: the same for greedy).
        """
        return SamplerBinding(self, lease, held, candidates, seq, blocker)

    def _sample_fn(self, lease) -> Callable[[int], int]:
        # Without a grammar (SamplerBinding draws with one): a numpy argmax for plain greedy, else the
        # llama.cpp chain on the context's row.
        if self._ptr is None:
            raise ClosedError("Sampler is closed")
        if self.params.plain_greedy:
            return _argmax_fn(lease.logits_view_fn())
        return lease.sample_fn(self._ptr, top_k=self._top_k_first)

    def _constrained_fn(self, lease) -> Callable[[int, np.ndarray], int]:
        """Grammar sampling as llama.cpp's common sampler does it: sample first, check the grammar after.

        Checking one token against the grammar is cheap; masking a whole
        vocabulary is not (tens of ms for 262k tokens). So the chain samples
        from the raw logits, and only when the grammar rejects its choice is
        the full candidate list masked and sampled again. For greedy decoding
        the result is exactly the grammar-first result.
        """
        lib, chain, grammar, n_vocab = self._lib, self._ptr, self._grammar, lease.ctx.n_vocab
        apply, accept, accept_grammar = lib.llama_sampler_apply, lib.llama_sampler_accept, grammar_accept_fn(lib)
        apply_grammar = grammar_apply_fn(lib)
        cand = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        cand["id"] = np.arange(n_vocab, dtype=np.int32)
        arr = L.llama_token_data_array(cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n_vocab, -1, False)
        one = np.zeros(1, dtype=_TOKEN_DATA)
        one_arr = L.llama_token_data_array(one.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), 1, -1, False)
        arr_ref, one_ref = ctypes.byref(arr), ctypes.byref(one_arr)

        def reset_candidates(row: np.ndarray) -> None:
            cand["id"] = np.arange(n_vocab, dtype=np.int32)  # samplers may reorder the array
            cand["logit"] = row
            cand["p"] = 0.0
            arr.data = cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data))
            arr.size, arr.selected, arr.sorted = n_vocab, -1, False

        def selected() -> int:
            return int(arr.data[arr.selected].id)

        def draw(idx: int, row: np.ndarray) -> int:
            reset_candidates(row)
            apply(chain, arr_ref)
            tok = selected()
            one[0] = (tok, 0.0, 0.0)
            one_arr.size, one_arr.selected, one_arr.sorted = 1, -1, False
            apply_grammar(grammar, one_ref)
            if not np.isfinite(one[0]["logit"]):
                reset_candidates(row)
                apply_grammar(grammar, arr_ref)
                apply(chain, arr_ref)
                tok = selected()
                if not np.isfinite(arr.data[arr.selected].logit):
                    # Nothing the grammar allows survived (e.g. logit_bias bans every token it
                    # allows); llama.cpp would abort the process on accepting the token.
                    raise GrammarError("no token allowed by the grammar is left after logit_bias and the "
                                       "other samplers (is every end-of-generation token banned?)")
            accept_grammar(grammar, tok)
            accept(chain, tok)
            return tok

        return draw

    def _candidates_fn(self, lease, keep: int, out: dict[int, PostSampling]) -> Callable[[int, np.ndarray], int]:
        """Sampling through the chain on a candidate array of our own, so that what the chain leaves of
        it can be read (``out[idx]``, the ``keep`` most probable). The chain sees what
        ``llama_sampler_sample`` would give it, so the same token is drawn; a grammar masks first
        (llama.cpp's exact path, which the rejection shortcut of :meth:`_constrained_fn` equals for
        greedy)."""
        if self._ptr is None:
            raise ClosedError("Sampler is closed")
        lib, chain, grammar, n_vocab = self._lib, self._ptr, self._grammar, lease.ctx.n_vocab
        apply, accept, accept_grammar = lib.llama_sampler_apply, lib.llama_sampler_accept, grammar_accept_fn(lib)
        apply_grammar = grammar_apply_fn(lib)
        cand = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        arr = L.llama_token_data_array(cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n_vocab, -1, False)
        arr_ref, greedy = ctypes.byref(arr), self.params.greedy
        ids = np.arange(n_vocab, dtype=np.int32)

        def draw(idx: int, row: np.ndarray) -> int:
            cand["id"] = ids
            cand["logit"] = row
            cand["p"] = 0.0
            arr.data = cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data))
            arr.size, arr.selected, arr.sorted = n_vocab, -1, False
            if grammar:
                apply_grammar(grammar, arr_ref)
            apply(chain, arr_ref)
            # (a sampler may point the array at a buffer of its own: read it through the array)
            size, sel = arr.size, arr.selected
            if not 0 <= sel < size:
                raise GrammarError("the sampler chain selected no token")
            # (a view, read before anything else runs the chain: what is kept below is copied out of it)
            left = np.frombuffer((ctypes.c_char * (size * _TOKEN_DATA.itemsize)).from_address(
                ctypes.addressof(arr.data.contents)), dtype=_TOKEN_DATA)
            tok = int(left["id"][sel])
            if not np.isfinite(left["logit"][sel]):
                raise GrammarError("no token allowed by the grammar is left after logit_bias and the "
                                   "other samplers (is every end-of-generation token banned?)")
            if greedy:  # (as llama-server at temperature 0: the chosen token alone, certain)
                out[idx] = PostSampling(tok, 1.0, np.array([tok]), np.array([1.0]))
            else:
                probs = left["p"].astype(np.float64)
                top = np.argpartition(-probs, keep)[:keep] if size > keep else np.arange(size)
                top = top[np.lexsort((left["id"][top], -probs[top]))]
                top = top[probs[top] > 0]
                out[idx] = PostSampling(tok, float(probs[sel]), left["id"][top].astype(np.int64), probs[top])
            if grammar:
                accept_grammar(grammar, tok)
            accept(chain, tok)
            return tok

        return draw

    def sample_logits(self, logits: np.ndarray) -> int:
        """Pick a token from a logits row the caller gives (n_vocab floats, e.g. one a Python logits
        processor changed), through the grammar and the chain, and accept it.

        ``-inf`` bans a token; NaN or ``+inf`` raise InvalidArgumentError, and GrammarError when
        nothing allowed is left (llama.cpp's samplers would pick garbage or abort)."""
        n_vocab = self.model.n_vocab
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        if row.shape[0] != n_vocab:
            raise InvalidArgumentError(f"a logits row of {row.shape[0]} values; this model has {n_vocab} tokens")
        if np.isnan(row).any() or np.isposinf(row).any():
            raise InvalidArgumentError("logits hold NaN or +inf (ban a token with -inf)")
        with self._exclusively():
            if self._ptr is None:
                raise ClosedError("Sampler is closed")
            lib = self._lib
            cand = np.zeros(n_vocab, dtype=_TOKEN_DATA)
            cand["id"] = np.arange(n_vocab, dtype=np.int32)
            cand["logit"] = row
            arr = L.llama_token_data_array(cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n_vocab, -1,
                                           False)
            if self._grammar:
                grammar_apply_fn(lib)(self._grammar, ctypes.byref(arr))
            if not np.isfinite(cand["logit"]).any():
                raise GrammarError("no token is left to sample (every logit is -inf, or the grammar allows none "
                                   "of the others)")
            lib.llama_sampler_apply(self._ptr, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise GrammarError("the sampler chain selected no token")
            picked = arr.data[arr.selected]
            tok = int(picked.id)
            if np.isnan(picked.logit) or picked.logit == -np.inf:  # (+inf: a logit_bias that forces it)
                raise GrammarError("no token is left to sample after the grammar and the other samplers")
            if self._grammar:
                grammar_accept_fn(lib)(self._grammar, tok)
            lib.llama_sampler_accept(self._ptr, tok)
            return tok

    def accept(self, token: int) -> None:
        """Tell stateful samplers (penalties, grammar) that ``token`` was emitted.

        Raises TokenizationError for an id outside the vocabulary and GrammarError for a token
        the grammar does not allow here (llama.cpp would abort the process on either).
        """
        token = self.model.vocab.check_token(token)
        with self._exclusively():
            if self._grammar and not self._grammar_allows(token):
                raise GrammarError(f"the grammar does not allow token {token} here")
            self._lib.llama_sampler_accept(self._ptr, token)
            if self._grammar:
                grammar_accept_fn(self._lib)(self._grammar, token)

    def _grammar_allows(self, token: int, grammar=None) -> bool:
        one = np.zeros(1, dtype=_TOKEN_DATA)
        one[0] = (token, 0.0, 0.0)
        arr = L.llama_token_data_array(one.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), 1, -1, False)
        grammar_apply_fn(self._lib)(grammar or self._grammar, ctypes.byref(arr))
        return bool(np.isfinite(one[0]["logit"]))

    def reset(self) -> None:
        """Clear history (penalties, grammar state, mirostat); the RNG is not re-seeded."""
        with self._exclusively():
            self._lib.llama_sampler_reset(self._ptr)
            if self._grammar:
                reset_grammar(self._lib, self._grammar)
                self._prefill(self._grammar)

    @property
    def names(self) -> list[str]:
        """Names of the samplers in the chain, in order (a grammar, applied first, is listed first)."""
        with self._shared():  # reading the chain's names is safe while a generation samples
            lib = self._lib
            names = ["grammar"] if self._grammar else []
            return names + [(lib.llama_sampler_name(lib.llama_sampler_chain_get(self._ptr, i)) or b"").decode()
                            for i in range(lib.llama_sampler_chain_n(self._ptr))]

    def __repr__(self) -> str:
        if self._closed or not self._ptr:
            return "<Sampler closed>"
        return f"<Sampler {' -> '.join(self.names)}>"
