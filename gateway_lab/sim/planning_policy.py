"""The policy a capacity-planning run admits with: capacity only, no business limits.

Planning asks "how many engines meet the SLO", so nothing else may turn requests away: tenants
keep their tier and weight (from a given policy, or one tier for everyone) but get no rate
limits, no concurrency cap, an effectively unbounded queue and no deadlines (no shedding).
Pools get the limits derived from their replicas (`fleet.derived_pool`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from extproc.policy.model import Fairness, Gateway, Limits, PolicyFile, Pool, Tenant
from extproc.policy.runtime import Policy, compile_policy

DAY_S = 86_400.0
DEFAULT_TIER = "default"


def planning_policy(
    tenants: Iterable[str], pools: Mapping[str, Pool], base: Policy | None = None
) -> Policy:
    """A policy for `tenants` on `pools`; tiers, weights and fairness from `base` if given."""
    unlimited = Limits(max_queued=10_000_000, max_queue_wait=DAY_S)
    tiers = list(base.source.tiers) if base is not None else [DEFAULT_TIER]
    specs: dict[str, Tenant] = {}
    for name in sorted(set(tenants)):
        known = base.tenant(name) if base is not None else None
        tier = known.tier if known is not None else tiers[-1]
        weight = known.weight if known is not None else 1.0
        specs[name] = Tenant(tier=tier, weight=weight, limits=unlimited)
    source = PolicyFile(
        version=1,
        tiers=tiers,
        tenants=specs,
        pools=dict(pools),
        fairness=base.source.fairness if base is not None else Fairness(),
        gateway=Gateway(lease_timeout=DAY_S),
    )
    return compile_policy(source, "<planning>")
