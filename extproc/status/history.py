"""Successive readings of the service's counters, kept by the status view for rates and recent
latency quantiles (the service records totals only)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.metrics import Metrics
from extproc.status.readings import Buckets, Labels, by_first_label, counter_totals
from extproc.status.readings import histogram_buckets as read_buckets
from extproc.types import Outcome

REJECTIONS = {
    Outcome.REJECTED_RATE.value: "rate limit",
    Outcome.REJECTED_QUEUE_FULL.value: "queue full",
    Outcome.EXPIRED.value: "waited past its deadline",
    Outcome.SHED.value: "shed: cannot start before its deadline",
    Outcome.SHED_OVERLOAD.value: (
        "shed: the gateway is overloaded and this tenant is above its share"
    ),
    Outcome.UNAUTHORIZED.value: "unknown API key",
    Outcome.BAD_REQUEST.value: "bad request",
    Outcome.UNAVAILABLE.value: "unavailable",
}
"""Outcomes that are the gateway's refusals, with how the page names the reason."""


@dataclass(frozen=True)
class Reading:
    """The counters and histograms of one moment (`at`: time.monotonic())."""

    at: float
    requests: Mapping[Labels, float]
    """(tenant, tier, pool, outcome) -> requests."""
    tokens: Mapping[Labels, float]
    """(tenant, direction) -> tokens."""
    ttft: Mapping[str, Buckets]
    """tenant -> time to first token, over its pools."""
    inter_token: Mapping[str, Buckets]
    """tenant -> gap between output chunks per token, over its pools."""
    queue_wait: Mapping[str, Buckets]
    """tenant -> time held at the door."""

    @classmethod
    def of(cls, metrics: Metrics, at: float) -> Reading:
        return cls(
            at=at,
            requests=counter_totals(metrics.requests, ("tenant", "tier", "pool", "outcome")),
            tokens=counter_totals(metrics.tokens, ("tenant", "direction")),
            ttft=by_first_label(read_buckets(metrics.ttft, ("tenant", "pool"))),
            inter_token=by_first_label(read_buckets(metrics.inter_token, ("tenant", "pool"))),
            queue_wait=by_first_label(read_buckets(metrics.queue_wait, ("tenant", "tier"))),
        )


class Readings:
    """Readings at least `every_s` apart over the last `keep_s`; the baselines of differences."""

    def __init__(self, every_s: float, keep_s: float) -> None:
        self.every_s = every_s
        self.keep_s = keep_s
        self.kept: deque[Reading] = deque()

    def add(self, reading: Reading) -> None:
        kept = self.kept
        if not kept or reading.at - kept[-1].at >= self.every_s:
            kept.append(reading)
        while kept and reading.at - kept[0].at > self.keep_s:
            kept.popleft()

    def baseline(self, now: float, window_s: float) -> Reading | None:
        """The oldest reading within `window_s` before `now` (not `now`'s own)."""
        return next((r for r in self.kept if now - window_s <= r.at < now), None)
