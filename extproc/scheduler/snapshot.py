"""The read-only view of the scheduler's live state, JSON-ready (admin endpoint, tests,
simulator)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from extproc.scheduler.live import Live


def snapshot(live: Live, now: float, reclaimed_leases: int) -> dict[str, Any]:
    policy = live.policy
    tenants: dict[str, Any] = {}
    names: Iterable[str] = dict.fromkeys([*policy.tenants, *live.tenants])
    for name in names:
        spec = policy.tenant(name)
        state = live.tenants.get(name)
        item: dict[str, Any] = {
            "tier": spec.tier if spec is not None else None,
            "weight": spec.weight if spec is not None else None,
            "removed": spec is None,
            "queued": state.queued if state else 0,
            "inflight": state.inflight if state else 0,
            "inflight_tokens": state.inflight_tokens if state else 0,
            "inflight_by_endpoint": dict(state.inflight_by_class) if state else {},
            "served_requests": state.served_requests if state else 0,
            "served_tokens": state.served_tokens if state else 0,
        }
        if spec is not None:
            item["buckets"] = live.limiter.levels(name, spec, now)
            item["bucket_limits"] = live.limiter.describe(name, spec)
            rank = live.rank(spec)
            item["fair_share"] = {
                pool_name: pool.bands[rank].fair.level(name)
                for pool_name, pool in live.pools.items()
            }
            item["backlogged_pools"] = sorted(state.bands) if state else []
        delta = live.deltas.get(name)
        item["latency_delta"] = None if delta is None else delta.describe(now)
        tenants[name] = item
    pools: dict[str, Any] = {}
    for name, pool in live.pools.items():
        held = pool.held
        pools[name] = {
            "inflight": pool.capacity.inflight,
            "inflight_tokens": pool.capacity.inflight_tokens,
            "queued": sum(live.tenants[t].queues[name].live for t in pool.waiting),
            **pool.capacity.describe(),
            "drain_rate": pool.drain.rate(now),
            "held_for": None
            if held is None
            else {"tier": pool.bands[held.rank].tier, "tenant": held.tenant},
            "retired": pool.retired,
            "prefilling_tokens": pool.prefilling_tokens,
            "reserve_inflight": pool.reserve_inflight,
            "prefill_budget_tokens": _prefill_budget(live, name),
            "prefilling_requests": pool.prefilling_requests,
            "prefilling_limit": _prefilling_limit(live, name),
            "delta_factor": pool.delta.factor,
            "delta_violations": pool.delta.violations,
            "alone": pool.alone.describe(),
        }
    out: dict[str, Any] = {
        "tenants": tenants,
        "pools": pools,
        "queued": len(live.entries),
        "leases": len(live.leases),
        "reclaimed_leases": reclaimed_leases,
        "fairness": policy.source.fairness.policy,
    }
    if live.locality.enabled:
        out["locality"] = live.locality.describe()
    return out


def _prefill_budget(live: Live, pool: str) -> int | None:
    """The budget backlogged tenants are paced to now (the δ factor applied); None: off."""
    spec = live.policy.pools.get(pool)
    budget = 0 if spec is None else spec.effective_prefill_budget
    return live.pools[pool].delta.limit(budget) if budget else None


def _prefilling_limit(live: Live, pool: str) -> int | None:
    """The prompts the δ controller lets prefill at once in a pool without a prefill budget
    while it has cut (extproc.scheduler.latency.PACING_EXPONENT); None: not pacing."""
    spec = live.policy.pools.get(pool)
    state = live.pools[pool]
    if spec is None or spec.effective_prefill_budget or state.delta.factor >= 1.0:
        return None
    return state.delta.prefilling_limit(state.soft_now())
