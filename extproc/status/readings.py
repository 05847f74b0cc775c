"""What the status view reads from the Prometheus registry (pure): counter totals and histogram
bucket counts by label set, and quantiles of bucket-count differences.

The service's counters and histograms (extproc.metrics) are the only record of outcomes,
tokens and latencies, so the view samples them and takes differences between samples for
rates and recent quantiles, as Prometheus' `rate()` and `histogram_quantile()` would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import Counter
from prometheus_client.registry import Collector

Labels = tuple[str, ...]
Buckets = tuple[tuple[float, float], ...]
"""(upper bound, cumulative count) pairs in bound order; the last bound is +inf."""


def counter_totals(counter: Counter, labels: tuple[str, ...]) -> dict[Labels, float]:
    """Each labelled child's total, keyed by the values of `labels` in that order."""
    totals: dict[Labels, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = tuple(sample.labels[name] for name in labels)
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def histogram_buckets(histogram: Collector, labels: tuple[str, ...]) -> dict[Labels, Buckets]:
    """Each labelled child's cumulative bucket counts, keyed like `counter_totals`."""
    found: dict[Labels, list[tuple[float, float]]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                key = tuple(sample.labels[name] for name in labels)
                found.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
    return {key: tuple(sorted(pairs)) for key, pairs in found.items()}


def merge_buckets(parts: list[Buckets]) -> Buckets:
    """Sum histograms with the same bounds (a tenant's over its pools)."""
    if not parts:
        return ()
    bounds = [bound for bound, _ in parts[0]]
    return tuple(
        (bound, sum(part[i][1] for part in parts if len(part) > i))
        for i, bound in enumerate(bounds)
    )


def subtract_buckets(now: Buckets, before: Buckets | None) -> Buckets:
    """The observations made between two readings of one histogram."""
    if not before:
        return now
    earlier = dict(before)
    return tuple((bound, count - earlier.get(bound, 0.0)) for bound, count in now)


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0..1) of cumulative buckets, interpolated linearly inside the bucket it
    falls in (Prometheus' histogram_quantile); None without observations. A quantile in the
    +inf bucket reads as the largest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True)
class Percentiles:
    p50_ms: float | None
    p99_ms: float | None
    count: int

    @classmethod
    def of(cls, buckets: Buckets) -> Percentiles:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000.0, 1)

        count = int(buckets[-1][1]) if buckets else 0
        return cls(ms(quantile(0.5, buckets)), ms(quantile(0.99, buckets)), count)

    def as_json(self) -> dict[str, float | int | None]:
        return {"p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "count": self.count}


def by_first_label(readings: Mapping[Labels, Buckets]) -> dict[str, Buckets]:
    """Histograms summed over every label but the first (per tenant)."""
    grouped: dict[str, list[Buckets]] = {}
    for key, buckets in readings.items():
        grouped.setdefault(key[0], []).append(buckets)
    return {name: merge_buckets(parts) for name, parts in grouped.items()}
