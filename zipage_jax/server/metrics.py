"""Prometheus metrics: vLLM's names where vLLM has one, `zipage:` for compression.

Engine counters and gauges are read from the engine thread's latest stats snapshot at scrape
time, the warm-up's progress from the engine's warm-up status; latency histograms are observed
by the engine thread as outputs arrive.

Under data-parallel serving the stats snapshot also holds each replica's (`replicas`, a list of
EngineStats or None, and `serving`, a list of bools): every engine gauge and counter then has one
sample per replica, labelled `replica` ("0", "1", ...; sum them for the whole server), and
zipage:replica_serving says which replicas take requests. A single engine's have no such label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.stats import EngineStats

# vLLM's buckets
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)

# (name, help, EngineStats field); counters are exposed with a _total suffix
_GAUGES = (
    ("vllm:num_requests_running", "Sequences in the running batch.", "num_running"),
    ("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", "kv_usage"),
    ("zipage:seqs_at_budget", "Sequences whose KV cache is at its compression budget.", "seqs_at_budget"),
    ("zipage:query_slots_in_use", "Query-cache slots held by compressible sequences.", "query_slots_in_use"),
    ("zipage:query_slots_total", "Query-cache slots in the engine.", "num_query_slots"),
    ("zipage:kv_free_blocks", "Free blocks in the KV-cache pool.", "num_free_blocks"),
    ("zipage:kv_total_blocks", "Usable blocks in the KV-cache pool.", "num_kv_blocks"),
    ("zipage:programs_ready", "Programs built since the engine started, the warm-up's included: compiled, or "
     "loaded from the executable store.", "num_compiles"),
)
_COUNTERS = (
    ("vllm:prompt_tokens", "Prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Generated tokens.", "generation_tokens"),
    ("vllm:num_preemptions", "Preemptions of running sequences.", "num_preemptions"),
    ("vllm:prefix_cache_queries", "Prefix-cache lookups.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix-cache hits.", "prefix_cache_hits"),
    ("zipage:compressions", "KV-cache compressions run.", "num_compressions"),
    ("zipage:kv_tokens_evicted", "KV tokens evicted by compression.", "kv_tokens_evicted"),
    ("zipage:engine_recoveries", "Device-state rebuilds after a failed engine step.", "num_recoveries"),
    ("zipage:compile_seconds", "Seconds spent building programs: tracing, lowering and compiling them, or "
     "loading them from the executable store.", "compile_seconds"),
    ("zipage:programs_loaded", "Programs loaded from the executable store (neither traced nor compiled).",
     "num_programs_loaded"),
)
_REPLICA_SERVING = "zipage:replica_serving"  # data-parallel serving only
# (name, help, WarmupStatus field), all 0 when no warm-up ran
_WARMUP = (
    ("zipage:warmup_programs_total", "Programs in the warm-up's grid (0 without a warm-up).", "total"),
    ("zipage:warmup_programs_ready", "Programs of the warm-up's grid built so far (a forward step of the grid may "
     "count as several in zipage:programs_ready).", "ready"),
    ("zipage:warmup_programs_failed", "Programs of the warm-up's grid whose build failed (a step that needs one "
     "builds it then).", "failed"),
    ("zipage:warmup_serving_ready", "1 once the warm-up has built its serving set (the largest program of "
     "each kind): the server is ready; 0 while it builds, and without a warm-up.", "serving_ready"),
    ("zipage:warmup_done", "1 once the warm-up has built its whole grid; 0 while it builds, and without a "
     "warm-up.", "done"),
)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None], warmup: Callable[[], Any]):
        self._model_name = model_name
        self._stats = stats
        self._warmup = warmup

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # still loading
            return
        replicas = getattr(stats, "replicas", None)  # data-parallel serving: each replica's stats
        for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, doc, field in table:
                if replicas is None:
                    family = kind(name, doc, labels=["model_name"])
                    family.add_metric([self._model_name], getattr(stats, field))
                else:
                    family = kind(name, doc, labels=["model_name", "replica"])
                    for i, replica in enumerate(replicas):
                        if replica is not None:
                            family.add_metric([self._model_name, str(i)], getattr(replica, field))
                yield family
        if replicas is not None:
            family = GaugeMetricFamily(_REPLICA_SERVING, "1 while the replica takes requests; 0 while it restarts "
                                       "or builds its warm-up's serving set.", labels=["model_name", "replica"])
            for i, serving in enumerate(stats.serving):
                family.add_metric([self._model_name, str(i)], float(serving))
            yield family
        status = self._warmup()
        for name, doc, field in _WARMUP:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], 0 if status is None else float(getattr(status, field)))
            yield family


def observe_times(histogram: Histogram, value: float, times: int) -> None:
    """`histogram.observe(value)` `times` times, in one update of its sum and of the bucket the
    value falls in (what observing one by one does to them; tests/server/test_metrics_batch.py
    holds the two equal, so a prometheus_client that keeps its histograms otherwise fails there)."""
    if times == 1:
        histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * times)
    for i, bound in enumerate(histogram._upper_bounds):
        if value <= bound:
            histogram._buckets[i].inc(times)
            break


class ServerMetrics:
    """The app's own registry (several apps may live in one process). `stats()`: the engine's
    latest stats snapshot (None while loading); `warmup()`: its warm-up's WarmupStatus (None
    without a warm-up)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None],
                 warmup: Callable[[], Any] = lambda: None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats, warmup))
        labels = ["model_name"]
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                               buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens.", labels,
                              buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                              buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests (per completion), by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._refused = Counter("zipage:requests_refused", "Requests refused before they were queued, by reason.",
                                labels + ["reason"], registry=self.registry)
        self._refused.labels(model_name, "queue_full")  # exposed (at 0) from the start
        self._model_name = model_name
        self._last_token: dict[str, dict[int, float]] = {}  # request id -> completion index -> time

    def observe(self, output: RequestOutput, now: float) -> None:
        """Called by the engine thread for every output it delivers."""
        last = self._last_token.setdefault(output.request_id, {})
        for o in output.outputs:
            if not o.delta_token_ids:
                continue
            if o.index not in last:
                if o.metrics.get("ttft_s") is not None:
                    self._ttft.observe(o.metrics["ttft_s"])
            else:
                observe_times(self._itl, (now - last[o.index]) / len(o.delta_token_ids), len(o.delta_token_ids))
            last[o.index] = now
        if output.finished:
            self.discard(output.request_id)
            for o in output.outputs:
                self._e2e.observe(o.metrics.get("latency_s", 0.0))
                self._success.labels(self._model_name, o.finish_reason).inc()

    def refused(self, reason: str) -> None:
        self._refused.labels(self._model_name, reason).inc()

    def discard(self, request_id: str) -> None:
        self._last_token.pop(request_id, None)
