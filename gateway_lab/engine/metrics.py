"""vLLM's Prometheus metrics for one emulated engine, in a private registry.

Names, help texts, labels (`model_name`, `engine`) and histogram buckets follow vLLM V1's
`PrometheusStatLogger`. Gauges and counters are read live from the EngineCore at scrape time;
latency histograms are filled by the server as tokens are delivered. A hand-rolled collector
(rather than prometheus_client's Counter/Histogram) keeps several engines in one process
independent and, like vLLM, emits no `_created` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from gateway_lab.engine.model import EngineCore

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_LABELS = ("model_name", "engine")


class Histogram:
    """A cumulative Prometheus histogram without locks (the event loop is single-threaded)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cumulative += n
            out.append((repr(float(bound)), cumulative))  # Go-style: 1.0, 0.001
        out.append(("+Inf", cumulative + self.counts[-1]))
        return out


class EngineMetrics(Collector):
    """All `vllm:` series of one engine."""

    def __init__(self, core: EngineCore, model_name: str, engine: str = "0") -> None:
        self.core = core
        self.labels = [model_name, engine]
        self.ttft = Histogram(TTFT_BUCKETS)
        self.inter_token = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        core = self.core
        labels = self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, hist.buckets(), hist.sum)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            core.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            core.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_usage
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            core.preemptions_total,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", core.prompt_tokens_total
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            core.generation_tokens_total,
        )
        # Counted at a request's first admission (a lookup repeated after a preemption is
        # kept apart by vLLM and not exported); both stay 0 with prefix caching off.
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            core.prefix_cache_queries_total,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            core.prefix_cache_hits_total,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*_LABELS, "finished_reason"),
        )
        for reason, n in self.success.items():
            success.add_metric([*labels, reason], n)
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            self.ttft,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            self.inter_token,
        )
        # The older name of the same observations; vLLM emitted both for several releases.
        yield histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            self.inter_token,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            self.e2e,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            self.queue_time,
        )
