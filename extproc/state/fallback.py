"""The local fallback: each process enforces its share of every limit while Redis is away.

With `state.replicas: N` processes expected, a process keeps 1/N of each tenant's
rate-limit dimensions (extproc.scheduler.ratelimit: rates and bursts) and max_concurrency,
tenant-wide and per endpoint class, and 1/N of each pool's max_inflight and
max_inflight_tokens (rounded up, at least 1; a pool's token room never below one request of
its largest size, so every routable request can still pass). Queue
settings (max_queued, max_queue_wait) and everything else are unchanged.
"""

from __future__ import annotations

import math

from extproc.policy.model import BucketLimits, Limits, Pool, Tenant
from extproc.policy.runtime import Policy, compile_policy
from extproc.scheduler.ratelimit import DIMENSIONS


def _share(value: int | None, replicas: int) -> int | None:
    return None if value is None else max(1, math.ceil(value / replicas))


_SHARED_FIELDS = [
    *(field for d in DIMENSIONS for field in (d.policy_field, d.burst_field)),
    "max_concurrency",
]


def _block(limits: BucketLimits, replicas: int) -> dict[str, int | None]:
    return {field: _share(getattr(limits, field), replicas) for field in _SHARED_FIELDS}


def _limits(limits: Limits, replicas: int) -> Limits:
    per_endpoint = {
        endpoint: block.model_copy(update=_block(block, replicas))
        for endpoint, block in limits.per_endpoint.items()
    }
    return limits.model_copy(update={**_block(limits, replicas), "per_endpoint": per_endpoint})


def _pool(pool: Pool, replicas: int) -> Pool:
    tokens = max(math.ceil(pool.max_inflight_tokens / replicas), pool.max_total_tokens)
    return pool.model_copy(
        update={
            "max_inflight": _share(pool.max_inflight, replicas),
            "max_inflight_tokens": min(pool.max_inflight_tokens, tokens),
        }
    )


def _tenant(tenant: Tenant, replicas: int) -> Tenant:
    return tenant.model_copy(update={"limits": _limits(tenant.limits, replicas)})


def local_share(policy: Policy, replicas: int) -> Policy:
    """The policy one of `replicas` processes enforces on its own."""
    if replicas <= 1:
        return policy
    source = policy.source.model_copy(
        update={
            "tenants": {name: _tenant(t, replicas) for name, t in policy.tenants.items()},
            "pools": {name: _pool(p, replicas) for name, p in policy.pools.items()},
        }
    )
    return compile_policy(source, policy.file)
