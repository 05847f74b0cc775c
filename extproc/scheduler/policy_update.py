"""Applying a new policy to live state (hot reload): new limits and weights at once,
in-flight leases kept, queued requests of removed tenants or pools answered."""

from __future__ import annotations

from extproc.policy.runtime import Policy
from extproc.scheduler import retry_after
from extproc.scheduler.live import Live
from extproc.scheduler.rejections import reject
from extproc.scheduler.types import Rejection
from extproc.types import Outcome


def apply_policy(live: Live, policy: Policy, now: float) -> list[Rejection]:
    """Changing the tier list or the fairness settings restarts fair-share state."""
    old = live.policy
    for name, changed in policy.tenants.items():
        previous = old.tenant(name)
        if previous is not None:
            live.limiter.rebase(name, previous, changed, now)
    live.policy = policy
    live.locality.update(policy)
    out: list[Rejection] = []
    for name, pool_spec in policy.pools.items():
        pool = live.pools.get(name)
        if pool is None:
            live.pools[name] = live.new_pool(name, pool_spec)
        else:
            pool.capacity.update(pool_spec)
            pool.retired = False
    for name, pool in list(live.pools.items()):
        if name not in policy.pools:
            pool.retired = True
            pool.held = None
            if pool.capacity.inflight == 0:
                del live.pools[name]
    if old.source.tiers != policy.source.tiers or old.source.fairness != policy.source.fairness:
        for state in live.tenants.values():
            state.bands.clear()
        for pool in live.pools.values():
            pool.bands = live.new_bands(pool.name)
            pool.held = None
    for entry in list(live.entries.values()):
        ticket = entry.ticket
        if policy.tenant(ticket.tenant) is None:
            live.remove(entry, now, refund=False)
            message = f"tenant {ticket.tenant!r} was removed from the policy while queued"
            out.append(reject(ticket, Outcome.UNAUTHORIZED, 403, None, message))
        elif ticket.pool not in policy.pools:
            live.remove(entry, now, refund=True)
            message = f"pool {ticket.pool!r} was removed from the policy while queued"
            out.append(
                reject(ticket, Outcome.UNAVAILABLE, 503, retry_after.POOL_REMOVED_S, message)
            )
    for state in list(live.tenants.values()):
        spec = policy.tenant(state.name)
        for pool_name, band in list(state.bands.items()):
            if spec is None or band.tier != spec.tier:
                queue = state.queues.get(pool_name)
                band.queued -= 0 if queue is None else queue.live
                del band.members[state.name]
                band.fair.forget(state.name)
                del state.bands[pool_name]
                pool = live.pools.get(pool_name)
                if pool is not None:
                    pool.lift_hold_of(state.name)
            else:
                band.fair.set_weight(state.name, spec.weight)
        live.sync_all(state)
        if spec is None and state.inflight == 0 and state.queued == 0:
            del live.tenants[state.name]
    live.rebuild_entry_timers()
    live.membership_version += 1
    return out
