"""Prometheus metrics of the service. Tenant labels come only from the policy, never from input."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

UNKNOWN_TENANT = "unknown"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "extproc_requests", "Requests by terminal outcome",
            ["tenant", "tier", "pool", "outcome"], registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "extproc_queue_wait_seconds", "Time held at the door before admission",
            ["tenant", "tier"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queued = Gauge(
            "extproc_queued_requests",
            "Requests waiting at the door",
            ["tenant", "tier"],
            registry=r,
        )
        self.inflight = Gauge(
            "extproc_pool_inflight_requests", "Admitted requests not yet finished", ["pool"],
            registry=r,
        )  # fmt: skip
        self.inflight_tokens = Gauge(
            "extproc_pool_inflight_tokens", "Estimated token budget of in-flight requests",
            ["pool"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "extproc_tokens",
            "Tokens served, from engine usage",
            ["tenant", "direction"],
            registry=r,
        )
        self.ttft = Histogram(
            "extproc_ttft_seconds", "Gateway-observed time to first token",
            ["tenant", "pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.estimation_error = Histogram(
            "extproc_estimation_error_ratio", "Estimated / actual prompt tokens",
            ["mode"], buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0),
            registry=r,
        )  # fmt: skip
        self.policy_reloads = Counter(
            "extproc_policy_reloads", "Policy reload attempts", ["result"], registry=r
        )
        self.reclaimed_leases = Counter(
            "extproc_reclaimed_leases", "Capacity leases reclaimed by the lease timeout", ["pool"],
            registry=r,
        )  # fmt: skip
