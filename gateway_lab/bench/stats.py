"""Figures of a benchmark's records: first-token percentiles, time per output token, every
inter-token gap, Jain's index, status counts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gateway_lab.bench.records import Record, percentile


def ttft_stats(records: Sequence[Record]) -> dict[str, Any]:
    """P50/P90/P99/max of the first-chunk times (ms) of the answered (and censored) ones."""
    values = [r.ttft for r in records if r.ttft is not None and (r.status == 200 or r.censored)]
    censored = sum(1 for r in records if r.censored)
    return {
        "count": len(values),
        "censored": censored,
        "p50_ms": percentile(values, 50) * 1000.0,
        "p90_ms": percentile(values, 90) * 1000.0,
        "p99_ms": percentile(values, 99) * 1000.0,
        "max_ms": max(values) * 1000.0 if values else math.nan,
        "mean_ms": sum(values) / len(values) * 1000.0 if values else math.nan,
    }


def tpot_stats(records: Sequence[Record]) -> dict[str, Any]:
    """P50/P99 of each complete answered request's time per output token after its first
    chunk (ms): (end - first chunk) / (output tokens - 1), the inter-token time a client sees
    averaged over one response, not every gap."""
    values = [
        (r.end - r.ttft - r.start) / (r.output_tokens - 1)
        for r in records
        if r.status == 200 and r.complete and r.ttft is not None and r.output_tokens > 1
    ]
    return {
        "count": len(values),
        "p50_ms": percentile(values, 50) * 1000.0,
        "p99_ms": percentile(values, 99) * 1000.0,
    }


def gap_stats(records: Sequence[Record]) -> dict[str, Any]:
    """P50/P99/max of every inter-token gap (ms) across the answered responses that kept their
    chunks (`Chunks.gaps`: from the first output chunk to the second and on, never the TTFT;
    n tokens in one chunk are n gaps of 1/n of the wait), pooled: one slow gap counts once
    among all the others, where `tpot_stats` would average it into its response."""
    per_response = [r.chunks.gaps() for r in records if r.status == 200 and r.chunks is not None]
    values = [gap for gaps in per_response for gap in gaps]
    return {
        "count": len(values),
        "responses": sum(1 for gaps in per_response if gaps),
        "p50_ms": percentile(values, 50) * 1000.0,
        "p99_ms": percentile(values, 99) * 1000.0,
        "max_ms": max(values) * 1000.0 if values else math.nan,
    }


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    if not values or all(v == 0 for v in values):
        return math.nan
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def status_counts(records: Sequence[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        key = str(record.status)
        counts[key] = counts.get(key, 0) + 1
    return counts


def within(records: Sequence[Record], tenant: str, start: float, end: float) -> list[Record]:
    return [r for r in records if r.tenant == tenant and start <= r.start < end]


def fmt(value: float, digits: int = 1) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (f"{value:.{digits}f}")
    )
