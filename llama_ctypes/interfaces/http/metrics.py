"""Prometheus metrics of one app, in its own registry (two apps in a process never mix counts).

Request counts, token totals and latency histograms are updated as requests end;
queue depth, slots in use and prefix-cache counters are read from each model's
``Server.stats()`` when ``/metrics`` is scraped, so they are never stale.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "llama_ctypes"
CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class _ServerCollector(Collector):
    """Gauges and counters read from every server's ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], Mapping[str, Mapping[str, Any]]]):
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        queue = GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a slot", labels=["model"])
        active = GaugeMetricFamily(f"{PREFIX}_slots_in_use", "Slots running a request", labels=["model"])
        total = GaugeMetricFamily(f"{PREFIX}_slots_total", "Slots (n_parallel)", labels=["model"])
        hits = CounterMetricFamily(f"{PREFIX}_prefix_cache_hits", "Requests that reused a cached prompt prefix",
                                   labels=["model"])
        misses = CounterMetricFamily(f"{PREFIX}_prefix_cache_misses", "Requests that found no cached prefix",
                                     labels=["model"])
        cached = CounterMetricFamily(f"{PREFIX}_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                                     labels=["model"])
        evaluated = CounterMetricFamily(f"{PREFIX}_prompt_tokens_evaluated", "Prompt tokens computed",
                                        labels=["model"])
        drafted = CounterMetricFamily(f"{PREFIX}_draft_tokens", "Speculative draft tokens verified",
                                      labels=["model"])
        accepted = CounterMetricFamily(f"{PREFIX}_draft_tokens_accepted", "Speculative draft tokens accepted",
                                       labels=["model"])
        in_graph = CounterMetricFamily(f"{PREFIX}_in_graph_requests", "Requests sampled inside the decode graph "
                                       "(backend_sampling)", labels=["model"])
        fallbacks = CounterMetricFamily(f"{PREFIX}_in_graph_fallbacks", "Requests that asked for backend_sampling "
                                        "and sampled as usual, by reason", labels=["model", "reason"])
        tier_entries = GaugeMetricFamily(f"{PREFIX}_prompt_cache_entries", "Prompt states kept by the prompt "
                                         "cache's tiers (ram, disk)", labels=["model", "tier"])
        tier_bytes = GaugeMetricFamily(f"{PREFIX}_prompt_cache_bytes", "Bytes held by the prompt cache's tiers "
                                       "(ram, disk)", labels=["model", "tier"])
        restored = CounterMetricFamily(f"{PREFIX}_prompt_cache_restored", "Prompt states restored from the prompt "
                                       "cache's tiers into a slot", labels=["model"])
        disk_hits = CounterMetricFamily(f"{PREFIX}_prompt_cache_disk_hits", "Prompt states read back from the "
                                        "disk tier", labels=["model"])
        tick = CounterMetricFamily(f"{PREFIX}_tick_seconds", "Scheduler thread time by part of the tick (text and "
                                   "handoff are parts of update)", labels=["model", "phase"])
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because a model is going away
            logger.exception("reading server stats for /metrics failed")
            stats = {}
        for model, s in stats.items():
            queue.add_metric([model], s["queue_length"])
            active.add_metric([model], s["active_slots"])
            total.add_metric([model], s["n_parallel"])
            hits.add_metric([model], s["cache_hits"])
            misses.add_metric([model], s["cache_misses"])
            cached.add_metric([model], s["cached_tokens"])
            evaluated.add_metric([model], s["prompt_tokens_evaluated"])
            drafted.add_metric([model], s.get("draft_tokens", 0))
            accepted.add_metric([model], s.get("draft_accepted", 0))
            in_graph.add_metric([model], s.get("in_graph_requests", 0))
            for tier in ("ram", "disk"):
                tier_entries.add_metric([model, tier], s.get(f"{tier}_cache_entries", 0))
                tier_bytes.add_metric([model, tier], s.get(f"{tier}_cache_bytes", 0))
            restored.add_metric([model], s.get("cache_restored", 0))
            disk_hits.add_metric([model], s.get("disk_cache_hits", 0))
            for reason, n in s.get("in_graph_fallbacks", {}).items():
                fallbacks.add_metric([model, reason], n)
            for phase, seconds in s.get("tick_seconds", {}).items():
                tick.add_metric([model, phase], seconds)
        return [queue, active, total, hits, misses, cached, evaluated, drafted, accepted, in_graph, fallbacks,
                tier_entries, tier_bytes, restored, disk_hits, tick]


def _llama_server_block(stats: list[Mapping[str, Any]], t: "_Totals", window: list[float]) -> str:
    """llama-server's own metrics (``llamacpp:*``, its ``--metrics``), totals over the app's models, so
    dashboards built for llama-server read this server too.

    Written by hand rather than through prometheus_client: llama-server names its counters as they are
    (``llamacpp:n_tokens_max`` is a counter without ``_total``), which the 0.0.4 text format allows and
    prometheus_client would rename.
    """
    def total(key: str) -> float:
        return float(sum(s.get(key, 0) for s in stats))

    ticks = total("ticks")
    busy = sum(s.get("avg_busy_slots", 0.0) * s.get("ticks", 0) for s in stats) / ticks if ticks else 0.0
    rows = (
        # (embedding and rerank inputs are prompts too: llama-server counts their tokens and decodes)
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed.",
         total("prompt_tokens_evaluated") + t.embed_tokens),
        ("counter", "prompt_tokens_cached_total", "Number of prompt tokens served from the cache.",
         total("cached_tokens")),
        ("counter", "prompt_seconds_total", "Prompt process time.", t.prompt_seconds),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed.", total("generated_tokens")),
        ("counter", "tokens_predicted_seconds_total", "Predict process time.", t.predicted_seconds),
        ("counter", "n_decode_total", "Total number of llama_decode() calls.", ticks + t.embed_decodes),
        # (a largest value never decreases, so llama-server counts it)
        ("counter", "n_tokens_max", "Largest observed n_tokens.",
         float(max((s.get("max_batch_tokens", 0) for s in stats), default=0))),
        ("counter", "spec_decode_num_draft_tokens_total", "Draft tokens verified.", total("draft_tokens")),
        ("counter", "spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", total("draft_accepted")),
        ("counter", "spec_decode_num_drafts_total", "Drafts verified.", total("drafts")),
        # (over the requests finished since the previous scrape, as llama-server's)
        ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
         window[0] / window[1] if window[1] else 0.0),
        ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
         window[2] / window[3] if window[3] else 0.0),
        ("gauge", "requests_processing", "Number of requests processing.", total("active_slots")),
        ("gauge", "requests_deferred", "Number of requests deferred.", total("queue_length")),
        ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call.", busy),
    )
    return "".join(f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value!r}\n"
                   for kind, name, doc, value in rows)


class _Totals:
    """Sums over finished generations (llama-server's time counters), and the same since the last
    scrape (``window``: llama-server's "bucket", which its two throughput gauges average over)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0  # evaluated (not cached) prompt tokens of finished requests
        self.prompt_seconds = 0.0
        self.predicted_steps = 0  # tokens after each request's first (the decode steps of its generation)
        self.predicted_seconds = 0.0
        self.embed_tokens = 0  # tokens of embedding and rerank inputs
        self.embed_decodes = 0  # their forward passes
        self.window = [0, 0.0, 0, 0.0]  # prompt tokens, prompt seconds, predicted steps, predicted seconds


#: Server.stats() fields that are not counters: across a sleep they are not carried over.
_GAUGES = frozenset({"n_parallel", "active_slots", "queue_length", "avg_batch_tokens", "avg_busy_slots",
                     "draft_acceptance", "ram_cache_entries", "ram_cache_bytes", "disk_cache_entries",
                     "disk_cache_bytes"})


def _carry(live: Mapping[str, Mapping[str, Any]], before: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each model's stats with the counters its servers had before a sleep added (they restart at 0
    when the model is loaded again; a counter must not go back). A model not loaded again keeps
    its stats as they were (idle)."""
    out: dict[str, Any] = {model: dict(s) for model, s in live.items()}
    for model, old in before.items():
        now = out.get(model)
        if now is None:
            out[model] = dict(old)
            continue
        ticks = now.get("ticks", 0) + old.get("ticks", 0)
        for key in ("avg_batch_tokens", "avg_busy_slots"):  # (per tick: weighted by each part's ticks)
            now[key] = (now.get(key, 0.0) * now.get("ticks", 0) + old.get(key, 0.0) * old.get("ticks", 0)) / ticks \
                if ticks else 0.0
        for key, value in old.items():
            if key in _GAUGES:
                continue
            if key == "max_batch_tokens":
                now[key] = max(now.get(key, 0), value)
            elif isinstance(value, dict):
                merged = dict(now.get(key, {}))
                for k, v in value.items():
                    merged[k] = merged.get(k, 0) + v
                now[key] = merged
            else:
                now[key] = now.get(key, 0) + value
    return out


class Metrics:
    """The app's registry and the metrics the endpoints update."""

    def __init__(self, server_stats: Callable[[], Mapping[str, Mapping[str, Any]]]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", ["model"],
                                     registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated by finished requests",
                                        ["model"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token", ["model"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tokens_per_s = Histogram(f"{PREFIX}_generation_tokens_per_second",
                                      "Generation speed of a request after its first token", ["model"],
                                      buckets=_TPS_BUCKETS, registry=r)
        self._live_stats = server_stats
        self._frozen: dict[str, Any] | None = None  # the stats when the models went to sleep
        self._carried: dict[str, Any] = {}  # the counters of the servers freed by sleeps
        self.totals = _Totals()
        r.register(_ServerCollector(self.server_stats))  # (last: registering reads the stats once)

    def server_stats(self) -> Mapping[str, Mapping[str, Any]]:
        """Every model's ``Server.stats()``, counters carried over sleeps; while asleep, as it fell asleep."""
        if self._frozen is not None:
            return self._frozen
        live = self._live_stats()
        return _carry(live, self._carried) if self._carried else live

    def freeze(self) -> None:
        """The models are going to sleep (their servers will close): keep showing their stats."""
        self._frozen = self.server_stats()  # type: ignore[assignment]

    def thaw(self, freed: Iterable[str] = ()) -> None:
        """The models are awake again: the counters of the ``freed`` models' servers are kept (their new
        servers' counters add to them); those of models that stayed loaded go on by themselves."""
        if self._frozen is not None:
            freed = set(freed)
            self._carried = {**self._carried, **{m: s for m, s in self._frozen.items() if m in freed}}
            self._frozen = None

    def take_window(self) -> list[float]:
        """The throughput window since the previous scrape, and a new one started (on the thread that
        records generations: a request finishing during a scrape counts in one window or the next)."""
        window, self.totals.window = self.totals.window, [0, 0.0, 0, 0.0]
        return window

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation_done(self, model: str, prompt_tokens: int, generated_tokens: int, timings: Any) -> None:
        """Record one finished generation (``timings``: a :class:`~llama_ctypes.Timings`, or None)."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generated_tokens.labels(model).inc(generated_tokens)
        if timings is not None:
            t = self.totals
            t.prompt_tokens += max(0, timings.prompt_tokens - timings.cached_tokens)
            t.prompt_seconds += timings.prompt_ms / 1e3
            t.predicted_steps += max(0, generated_tokens - 1)
            t.predicted_seconds += timings.generation_ms / 1e3
            w = t.window
            w[0] += max(0, timings.prompt_tokens - timings.cached_tokens)
            w[1] += timings.prompt_ms / 1e3
            w[2] += max(0, generated_tokens - 1)
            w[3] += timings.generation_ms / 1e3
        if timings is not None and generated_tokens:
            self.ttft.labels(model).observe(timings.ttft_ms / 1e3)
            if timings.tokens_per_s > 0:
                self.tokens_per_s.labels(model).observe(timings.tokens_per_s)

    def embedding_done(self, usage: Any) -> None:
        """Record an embedding or rerank request's work (an :class:`~llama_ctypes.features.embeddings.EmbedUsage`)."""
        self.totals.embed_tokens += usage.tokens
        self.totals.embed_decodes += usage.decodes

    def render(self, window: list[float] | None = None) -> bytes:
        """The text format (0.0.4): this app's metrics, then llama-server's ``llamacpp:*`` block. The two
        throughput gauges cover ``window`` (:meth:`take_window`; None: taken here), as llama-server's
        cover the time since the previous scrape."""
        if window is None:
            window = self.take_window()
        try:
            stats = list(self.server_stats().values())
        except Exception:  # a scrape must not fail because a model is going away
            logger.exception("reading server stats for /metrics failed")
            stats = []
        return generate_latest(self.registry) + _llama_server_block(stats, self.totals, window).encode()
