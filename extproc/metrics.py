"""Prometheus metrics of the service. Tenant labels come only from the policy, never from input.

Counters and histograms are updated on the request path (extproc.service.gateway). Gauges that
describe live state (queue depth, in-flight work, bucket levels, fair-share counters) are
refreshed from `Scheduler.snapshot()` when /metrics is scraped: `Metrics.refresh`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric

UNKNOWN_TENANT = "unknown"
ChildT = TypeVar("ChildT", Counter, Histogram)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

_INTER_TOKEN_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
    2.5,
)  # fmt: skip

RELOAD_RESULTS = ("success", "error", "unchanged")


class Children(Generic[ChildT]):
    """The labelled children of a metric, looked up once per label set.

    `Metric.labels()` validates and locks on every call; on the request path a dict hit is a
    fraction of that. Only for metrics whose children are never removed (label values come
    from the policy, so the dict stays small).
    """

    def __init__(self, metric: ChildT) -> None:
        self._metric: ChildT = metric
        self._children: dict[tuple[str, ...], ChildT] = {}

    def __call__(self, *values: str) -> ChildT:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class WeightedHistogramChild:
    """One label set's buckets (the last one is +Inf) and sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        """`weight` observations of `value` (bucket `le` is inclusive, as Prometheus has it)."""
        self.counts[bisect.bisect_left(self._bounds, value)] += weight
        self.total += value * weight


class InterTokenClock:
    """One response's inter-token latency: the gap since the previous chunk that carried output
    tokens, per token of this chunk, counted once per token (the first such chunk only starts
    the clock: its gap is the time to first token)."""

    __slots__ = ("_histogram", "_last")

    def __init__(self, histogram: WeightedHistogramChild | None) -> None:
        self._histogram = histogram
        self._last: float | None = None

    def tokens_arrived(self, tokens: int, now: float, largest_gap: float | None = None) -> None:
        """`largest_gap`: the tokens came as one batch of chunks (counting in Envoy) and this
        was its longest gap: observed once, the other tokens at the mean of the rest."""
        last, self._last = self._last, now
        if last is None or self._histogram is None:
            return
        if largest_gap is None or tokens < 2:
            self._histogram.observe((now - last) / tokens, tokens)
            return
        self._histogram.observe(largest_gap, 1)
        rest = max(0.0, now - last - largest_gap)
        self._histogram.observe(rest / (tokens - 1), tokens - 1)


class WeightedHistogram:
    """A Prometheus histogram whose observations carry a weight, for a metric updated once per
    streamed chunk: a chunk of n tokens counts as n observations in one step.

    prometheus_client's Histogram takes a lock for the sum and for the bucket on every observe
    (about 0.8 µs); this is plain arithmetic (about 0.2 µs). It is updated from the event loop's
    thread only; a scrape from another thread may read a bucket one step ahead of the sum,
    which is harmless. Children are never removed (label values come from the policy).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(sorted(buckets))
        self._children: dict[tuple[str, ...], WeightedHistogramChild] = {}
        registry.register(self)

    def __call__(self, *values: str) -> WeightedHistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = WeightedHistogramChild(self._bounds)
        return child

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        bounds = [*(repr(float(b)) for b in self._bounds), "+Inf"]
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, child.counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            family.add_metric(values, buckets, child.total)
        return [family]


def tenant_label(name: str | None, known: Collection[str]) -> str:
    """The label value for a tenant: its policy name, or "unknown" for anything else."""
    return name if name is not None and name in known else UNKNOWN_TENANT


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # -- per request, updated on the request path -------------------------------------------
        self.requests = Counter(
            "extproc_requests", "Requests by terminal outcome",
            ["tenant", "tier", "pool", "outcome"], registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "extproc_queue_wait_seconds", "Time held at the door before admission",
            ["tenant", "tier"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "extproc_tokens",
            "Tokens served, from engine usage",
            ["tenant", "direction"],
            registry=r,
        )
        self.envoy_to_handler = Histogram(
            "extproc_envoy_to_handler_seconds",
            "Envoy's receipt of a request -> its first message in the service's handler "
            "(Envoy's request.time against this host's clock)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "extproc_ttft_seconds", "Gateway-observed time to first token",
            ["tenant", "pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token = WeightedHistogram(
            "extproc_inter_token_seconds",
            "Gap between streamed response chunks that carry output tokens, per token of the"
            " later chunk (weighted: a chunk of n tokens counts n times)",
            ["tenant", "pool"], _INTER_TOKEN_BUCKETS, r,
        )  # fmt: skip
        self.estimation_error = Histogram(
            "extproc_estimation_error_ratio", "Estimated / actual prompt tokens",
            ["mode"], buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0),
            registry=r,
        )  # fmt: skip
        self.requests_of = Children(self.requests)
        self.queue_wait_of = Children(self.queue_wait)
        self.tokens_of = Children(self.tokens)
        self.ttft_of = Children(self.ttft)
        self.estimation_error_of = Children(self.estimation_error)
        # -- policy and lifecycle ---------------------------------------------------------------
        self.policy_reloads = Counter(
            "extproc_policy_reloads", "Policy reload attempts", ["result"], registry=r
        )
        for result in RELOAD_RESULTS:
            self.policy_reloads.labels(result)  # export zeroes, so rate() works from the start
        self.policy_last_reload = Gauge(
            "extproc_policy_last_reload_timestamp_seconds",
            "Unix time of the last reload attempt, by result",
            ["result"],
            registry=r,
        )
        self.policy_tenants = Gauge(
            "extproc_policy_tenants", "Tenants in the policy in force", registry=r
        )
        self.ready = Gauge(
            "extproc_ready", "1 when a valid policy is loaded and the service is not draining",
            registry=r,
        )  # fmt: skip
        self.draining = Gauge(
            "extproc_draining", "1 from SIGTERM until the process exits", registry=r
        )
        self.drained_requests = Counter(
            "extproc_drained_requests",
            "Queued requests answered 503 because the service was shutting down",
            registry=r,
        )
        # -- live state, refreshed from the scheduler snapshot at scrape time -------------------
        self.queued = Gauge(
            "extproc_queued_requests",
            "Requests waiting at the door",
            ["tenant", "tier"],
            registry=r,
        )
        self.tenant_inflight = Gauge(
            "extproc_tenant_inflight_requests", "Admitted requests of a tenant not yet finished",
            ["tenant", "tier"], registry=r,
        )  # fmt: skip
        self.tenant_inflight_tokens = Gauge(
            "extproc_tenant_inflight_tokens",
            "Estimated token budget of a tenant's in-flight requests",
            ["tenant", "tier"], registry=r,
        )  # fmt: skip
        self.bucket_level = Gauge(
            "extproc_tenant_bucket_level",
            "Rate-limit bucket level: requests or tokens available now",
            ["tenant", "bucket"], registry=r,
        )  # fmt: skip
        self.fair_share = Gauge(
            "extproc_tenant_fair_share",
            "Fair-share counter of a tenant in a pool (VTC counter or DRR deficit)",
            ["tenant", "pool"], registry=r,
        )  # fmt: skip
        self.served_tokens = Gauge(
            "extproc_tenant_served_tokens",
            "Tokens served to a tenant since start, as the scheduler accounts them",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "extproc_pool_inflight_requests", "Admitted requests not yet finished", ["pool"],
            registry=r,
        )  # fmt: skip
        self.inflight_tokens = Gauge(
            "extproc_pool_inflight_tokens", "Estimated token budget of in-flight requests",
            ["pool"], registry=r,
        )  # fmt: skip
        self.pool_queued = Gauge(
            "extproc_pool_queued_requests", "Requests waiting for a pool", ["pool"], registry=r
        )
        self.pool_max_inflight = Gauge(
            "extproc_pool_max_inflight_requests", "The pool's request capacity now", ["pool"],
            registry=r,
        )  # fmt: skip
        self.pool_max_inflight_tokens = Gauge(
            "extproc_pool_max_inflight_tokens", "The pool's token capacity now", ["pool"],
            registry=r,
        )  # fmt: skip
        self.pool_drain_rate = Gauge(
            "extproc_pool_drain_rate", "Completions per second, decaying average", ["pool"],
            registry=r,
        )  # fmt: skip
        self.latency_delta = Gauge(
            "extproc_tenant_latency_delta_seconds",
            "How much later than alone a tenant gets its tokens (mean; extproc.scheduler."
            "latency): kind ttft (first token) or token (per-token gap)",
            ["tenant", "kind"], registry=r,
        )  # fmt: skip
        self.pool_prefilling_tokens = Gauge(
            "extproc_pool_prefilling_tokens",
            "Prompt tokens admitted to a pool whose first token has not been seen", ["pool"],
            registry=r,
        )  # fmt: skip
        self.pool_delta_factor = Gauge(
            "extproc_pool_delta_factor",
            "The δ controller's factor on the backlogged tenants' share of a pool (1: open)",
            ["pool"], registry=r,
        )  # fmt: skip
        self.locality_tokens = Gauge(
            "extproc_locality_prefix_tokens",
            "Prompt tokens per replica of a dlpm pool: the locality index's predicted hits and "
            "lookups, and the engine's reported ones (vllm:prefix_cache_*)",
            ["pool", "replica", "source", "kind"], registry=r,
        )  # fmt: skip
        self.reclaimed_leases = Counter(
            "extproc_reclaimed_leases", "Capacity leases reclaimed by the lease timeout", ["pool"],
            registry=r,
        )  # fmt: skip
        self._reclaimed_seen: dict[str, int] = {}
        self.accounting_attached = Counter(
            "extproc_accounting_attached", "Responses whose accounting (an accounting stream, "
            "or Envoy's counting calls) reached this process, by whether this process admitted "
            "them (`admitting`) or another one did (`other`, settled through the shared state)",
            ["process"], registry=r,
        )  # fmt: skip
        self.attached_admitting = self.accounting_attached.labels("admitting")
        self.attached_other = self.accounting_attached.labels("other")
        # -- the service falling behind itself (extproc.service.overload) ------------------------
        self.shed = Counter(
            "extproc_shed", "Requests shed because the service fell behind (reason: lag, "
            "message_age or cpu_wait), new or queued, of tenants above their fair share",
            ["reason", "tier"],
            registry=r,
        )  # fmt: skip
        self.event_loop_lag = Gauge(
            "extproc_event_loop_lag_seconds", "Latest event-loop lag sampled by the monitor",
            registry=r,
        )  # fmt: skip
        self.cpu_wait = Gauge(
            "extproc_event_loop_cpu_wait_ratio", "Share of the last half second the event "
            "loop's thread was ready to run but had no CPU (sampled while "
            "gateway.overload.cpu_wait_fraction is set)",
            registry=r,
        )  # fmt: skip
        self.overloaded = Gauge(
            "extproc_overload_shedding", "1 while the service sheds tenants above their share",
            registry=r,
        )  # fmt: skip

    # -- policy reloads ---------------------------------------------------------------------------

    def reload_attempt(self, result: str) -> None:
        self.policy_reloads.labels(result).inc()
        self.policy_last_reload.labels(result).set(time.time())

    # -- scrape-time refresh ----------------------------------------------------------------------

    def refresh(self, snapshot: Mapping[str, Any], tenants: Collection[str]) -> None:
        """Set the live-state gauges from `Scheduler.snapshot()`.

        `tenants` are the policy's tenant names: a tenant outside it (one removed by a reload
        that still has requests in flight) is counted under "unknown", so label values stay
        bounded by the policy.
        """
        per_tenant = (
            self.queued, self.tenant_inflight, self.tenant_inflight_tokens, self.bucket_level,
            self.fair_share, self.served_tokens, self.latency_delta,
        )  # fmt: skip
        for gauge in per_tenant:
            gauge.clear()
        for name, state in snapshot.get("tenants", {}).items():
            tenant = tenant_label(name, tenants)
            tier = state.get("tier") or UNKNOWN_TENANT
            self.queued.labels(tenant, tier).inc(state.get("queued", 0))
            self.tenant_inflight.labels(tenant, tier).inc(state.get("inflight", 0))
            self.tenant_inflight_tokens.labels(tenant, tier).inc(state.get("inflight_tokens", 0))
            self.served_tokens.labels(tenant).inc(state.get("served_tokens", 0))
            if tenant == UNKNOWN_TENANT:
                continue
            for bucket, level in (state.get("buckets") or {}).items():
                self.bucket_level.labels(tenant, str(bucket)).set(level)
            for pool, level in (state.get("fair_share") or {}).items():
                self.fair_share.labels(tenant, str(pool)).set(level)
            for kind, series in (state.get("latency_delta") or {}).items():
                if series.get("mean_s") is not None:
                    label = "token" if kind == "tokens" else kind
                    self.latency_delta.labels(tenant, label).set(series["mean_s"])
        pools: Mapping[str, Any] = snapshot.get("pools", {})
        for gauge in (
            self.inflight, self.inflight_tokens, self.pool_queued, self.pool_max_inflight,
            self.pool_max_inflight_tokens, self.pool_drain_rate, self.pool_prefilling_tokens,
            self.pool_delta_factor,
        ):  # fmt: skip
            gauge.clear()
        for name, pool in pools.items():
            self.inflight.labels(name).set(pool.get("inflight", 0))
            self.inflight_tokens.labels(name).set(pool.get("inflight_tokens", 0))
            self.pool_queued.labels(name).set(pool.get("queued", 0))
            if pool.get("max_inflight") is not None:
                self.pool_max_inflight.labels(name).set(pool["max_inflight"])
            if pool.get("max_inflight_tokens") is not None:
                self.pool_max_inflight_tokens.labels(name).set(pool["max_inflight_tokens"])
            if pool.get("drain_rate") is not None:
                self.pool_drain_rate.labels(name).set(pool["drain_rate"])
            self.pool_prefilling_tokens.labels(name).set(pool.get("prefilling_tokens", 0))
            self.pool_delta_factor.labels(name).set(pool.get("delta_factor", 1.0))
        self._refresh_locality(snapshot.get("locality"))
        self._refresh_reclaimed(snapshot, pools)

    def _refresh_locality(self, locality: Mapping[str, Any] | None) -> None:
        self.locality_tokens.clear()
        for pool, replicas in (locality or {}).get("pools", {}).items():
            for index, row in enumerate(replicas):
                gauge = self.locality_tokens
                replica = str(index)
                gauge.labels(pool, replica, "index", "hit").set(row["predicted_hit_tokens"])
                gauge.labels(pool, replica, "index", "query").set(row["predicted_query_tokens"])
                gauge.labels(pool, replica, "engine", "hit").set(row["engine_hit_tokens"])
                gauge.labels(pool, replica, "engine", "query").set(row["engine_query_tokens"])

    def _refresh_reclaimed(self, snapshot: Mapping[str, Any], pools: Mapping[str, Any]) -> None:
        """Mirror the scheduler's reclaimed-lease totals into a counter (by pool when the
        snapshot carries per-pool counts, else under pool="all")."""
        totals: dict[str, int] = {
            name: int(pool["reclaimed_leases"])
            for name, pool in pools.items()
            if isinstance(pool.get("reclaimed_leases"), int)
        }
        if not totals:
            totals = {"all": int(snapshot.get("reclaimed_leases", 0))}
        for pool, total in totals.items():
            seen = self._reclaimed_seen.get(pool, 0)
            child = self.reclaimed_leases.labels(pool)
            if total > seen:
                child.inc(total - seen)
            self._reclaimed_seen[pool] = max(seen, total)
