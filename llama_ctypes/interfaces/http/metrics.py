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
            for reason, n in s.get("in_graph_fallbacks", {}).items():
                fallbacks.add_metric([model, reason], n)
            for phase, seconds in s.get("tick_seconds", {}).items():
                tick.add_metric([model, phase], seconds)
        return [queue, active, total, hits, misses, cached, evaluated, drafted, accepted, in_graph, fallbacks, tick]


def _llama_server_block(stats: list[Mapping[str, Any]], t: "_Totals") -> str:
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
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed.", total("prompt_tokens_evaluated")),
        ("counter", "prompt_tokens_cached_total", "Number of prompt tokens served from the cache.",
         total("cached_tokens")),
        ("counter", "prompt_seconds_total", "Prompt process time.", t.prompt_seconds),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed.", total("generated_tokens")),
        ("counter", "tokens_predicted_seconds_total", "Predict process time.", t.predicted_seconds),
        ("counter", "n_decode_total", "Total number of llama_decode() calls.", ticks),
        # (a largest value never decreases, so llama-server counts it)
        ("counter", "n_tokens_max", "Largest observed n_tokens.",
         float(max((s.get("max_batch_tokens", 0) for s in stats), default=0))),
        ("counter", "spec_decode_num_draft_tokens_total", "Draft tokens verified.", total("draft_tokens")),
        ("counter", "spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", total("draft_accepted")),
        ("counter", "spec_decode_num_drafts_total", "Drafts verified.", total("drafts")),
        ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
         t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0),
        ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
         t.predicted_steps / t.predicted_seconds if t.predicted_seconds else 0.0),
        ("gauge", "requests_processing", "Number of requests processing.", total("active_slots")),
        ("gauge", "requests_deferred", "Number of requests deferred.", total("queue_length")),
        ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call.", busy),
    )
    return "".join(f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value!r}\n"
                   for kind, name, doc, value in rows)


class _Totals:
    """Sums over finished generations (llama-server's time counters)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0  # evaluated (not cached) prompt tokens of finished requests
        self.prompt_seconds = 0.0
        self.predicted_steps = 0  # tokens after each request's first (the decode steps of its generation)
        self.predicted_seconds = 0.0


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
        r.register(_ServerCollector(server_stats))
        self._server_stats = server_stats
        self.totals = _Totals()

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
        if timings is not None and generated_tokens:
            self.ttft.labels(model).observe(timings.ttft_ms / 1e3)
            if timings.tokens_per_s > 0:
                self.tokens_per_s.labels(model).observe(timings.tokens_per_s)

    def render(self) -> bytes:
        """The text format (0.0.4): this app's metrics, then llama-server's ``llamacpp:*`` block."""
        try:
            stats = list(self._server_stats().values())
        except Exception:  # a scrape must not fail because a model is going away
            logger.exception("reading server stats for /metrics failed")
            stats = []
        return generate_latest(self.registry) + _llama_server_block(stats, self.totals).encode()
