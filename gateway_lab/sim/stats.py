"""Summaries of a simulation: latency percentiles, SLO attainment, outcomes, engine use."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from extproc.types import Outcome
from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.simulator import SimResult
from gateway_lab.sim.slo import Slo

QUANTILES = (0.5, 0.9, 0.99)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of sorted values."""
    if not ordered:
        raise ValueError("no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p99 and max of `values * scale` (default: seconds -> ms)."""
    ordered = sorted(v * scale for v in values)
    if not ordered:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    out: dict[str, float | int | None] = {
        "count": len(ordered),
        "mean": round(math.fsum(ordered) / len(ordered), 3),
    }
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = round(percentile(ordered, q), 3)
    out["max"] = round(ordered[-1], 3)
    return out


def _values(
    records: Iterable[RequestRecord], get: Callable[[RequestRecord], float | None]
) -> list[float]:
    out = []
    for record in records:
        value = get(record)
        if value is not None:
            out.append(value)
    return out


def summarize(records: Sequence[RequestRecord], slo: Slo) -> dict[str, Any]:
    """Latencies (ms), SLO attainment (fractions of all requests), outcomes, tokens, and the
    share of the completed requests' prompt tokens the engines found in their prefix caches."""
    total = len(records)
    outcomes = Counter(
        "unresolved" if record.outcome is None else record.outcome.value for record in records
    )
    completed = [record for record in records if record.completed]
    input_tokens = sum(record.input_tokens for record in completed)
    cached = sum(record.cached_tokens for record in completed)

    def share(predicate: Callable[[RequestRecord], bool]) -> float | None:
        return round(sum(1 for r in records if predicate(r)) / total, 6) if total else None

    return {
        "requests": total,
        "completed": len(completed),
        "outcomes": dict(sorted(outcomes.items())),
        "rejected": total - outcomes.get(Outcome.ADMITTED.value, 0) - outcomes.get("unresolved", 0),
        "ttft_ms": distribution(_values(completed, lambda r: r.ttft)),
        "e2e_ms": distribution(_values(completed, lambda r: r.e2e)),
        "tpot_ms": distribution(_values(completed, lambda r: r.tpot)),
        "queue_wait_ms": distribution(_values(records, lambda r: r.queue_wait)),
        "slo_attainment": {
            "ttft": share(slo.ttft_ok),
            "tpot": share(slo.tpot_ok),
            "e2e": share(slo.e2e_ok),
            "all": share(slo.met),
        },
        "preemptions": sum(record.preemptions for record in records),
        "preempted_requests": sum(1 for record in records if record.preemptions),
        "input_tokens": input_tokens,
        "output_tokens": sum(record.generated for record in records),
        "cached_input_tokens": cached,
        "prefix_cache_hit_rate": round(cached / input_tokens, 6) if input_tokens else None,
    }


def group_by(
    records: Iterable[RequestRecord], key: Callable[[RequestRecord], str | None]
) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        groups[key(record) or "(none)"].append(record)
    return dict(sorted(groups.items()))


def engine_summary(result: SimResult) -> dict[str, Any]:
    """Per pool: replicas, configuration, utilisation (busy-time fraction), preemptions, and
    the prefix cache's hit rate (cached prompt tokens / queried ones, as vLLM counts them)."""
    span = max(result.end_time, 1e-9)
    out: dict[str, Any] = {}
    for pool, engines in result.fleet.items():
        members = [replica for replica in result.replicas if replica.pool == pool]
        busy = [replica.busy_s / span for replica in members]
        tokens = sum(replica.output_tokens for replica in members)
        queries = sum(replica.prefix_cache_queries for replica in members)
        hits = sum(replica.prefix_cache_hits for replica in members)
        out[pool] = {
            "replicas": engines.replicas,
            "profile": engines.profile.name,
            "max_num_seqs": engines.profile.max_num_seqs,
            "max_model_len": engines.profile.max_model_len,
            "kv_tokens": engines.profile.kv_tokens,
            "utilisation": round(math.fsum(busy) / len(busy), 6) if busy else None,
            "utilisation_by_replica": {
                replica.name: round(value, 6) for replica, value in zip(members, busy, strict=True)
            },
            "steps": sum(replica.steps for replica in members),
            "preemptions": sum(replica.preemptions for replica in members),
            "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / span, 3),
            "prefix_caching": engines.profile.enable_prefix_caching,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": round(hits / queries, 6) if queries else None,
        }
    return out


def report(result: SimResult) -> dict[str, Any]:
    """Everything about a run, JSON-ready."""
    slo = result.slo
    records = result.records
    by_tenant = group_by(records, lambda r: r.tenant)
    by_pool = group_by(records, lambda r: r.pool)
    by_tenant_pool = group_by(records, lambda r: f"{r.tenant}/{r.pool or '(none)'}")
    return {
        "slo": slo.describe(),
        "simulated_s": round(result.end_time, 6),
        "wall_s": round(result.wall_s, 3),
        "events": result.events,
        "stopped_early": result.stopped_early,
        "overall": summarize(records, slo),
        "by_tenant": {name: summarize(group, slo) for name, group in by_tenant.items()},
        "by_pool": {name: summarize(group, slo) for name, group in by_pool.items()},
        "by_tenant_pool": {name: summarize(group, slo) for name, group in by_tenant_pool.items()},
        "engines": engine_summary(result),
        "scheduler": {
            "reclaimed_leases": result.snapshot.get("reclaimed_leases", 0),
            "leases_left": result.snapshot.get("leases", 0),
            "queued_left": result.snapshot.get("queued", 0),
        },
    }
