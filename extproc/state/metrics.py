"""Prometheus metrics of the shared state, registered on the gateway's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MODES = ("shared", "local", "closed")
REFUSALS = ("capacity", "tier", "concurrency", "fair", "duplicate")

_RTT_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class StateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.up = Gauge(
            "extproc_state_backend_up", "1 while the shared state store (Redis) answers",
            registry=r,
        )  # fmt: skip
        self.mode = Gauge(
            "extproc_state_mode",
            "1 for the mode in force: shared (Redis), local (fallback share), closed (503)",
            ["mode"], registry=r,
        )  # fmt: skip
        self.transitions = Counter(
            "extproc_state_transitions", "Changes of state mode, by the mode entered",
            ["mode"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "extproc_state_errors", "Failed or timed-out round trips to the state store",
            registry=r,
        )  # fmt: skip
        self.reconnects = Counter(
            "extproc_state_reconnect_attempts", "Reconnection attempts, by result",
            ["result"], registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "extproc_state_gate_refusals",
            "Admissions chosen locally that the shared gate refused, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.reclaimed = Counter(
            "extproc_state_reclaimed_leases",
            "Shared capacity leases reclaimed after they expired (their holder stopped renewing)",
            registry=r,
        )  # fmt: skip
        self.remote_settlements = Counter(
            "extproc_state_remote_settlements",
            "Requests settled by an accounting stream on another process, by result",
            ["result"], registry=r,
        )  # fmt: skip
        self.closed_rejections = Counter(
            "extproc_state_closed_rejections",
            "Requests answered 503 because the state store was unreachable (on_failure: closed)",
            registry=r,
        )  # fmt: skip
        self.round_trip = Histogram(
            "extproc_state_round_trip_seconds", "One batch of state operations, send to reply",
            buckets=_RTT_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "extproc_state_batch_operations", "Operations per round trip",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )  # fmt: skip
        for mode in MODES:
            self.transitions.labels(mode)
            self.mode.labels(mode)
        for reason in REFUSALS:
            self.refusals.labels(reason)
        for result in ("success", "failure"):
            self.reconnects.labels(result)
        for result in ("settled", "not_found"):
            self.remote_settlements.labels(result)

    def set_mode(self, mode: str) -> None:
        for name in MODES:
            self.mode.labels(name).set(1 if name == mode else 0)
        self.up.set(1 if mode == "shared" else 0)
