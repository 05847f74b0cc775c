"""Estimates from the pools' drain rates: whether a deadline can still be met (shedding) and
the measurements Retry-After is computed from (extproc.scheduler.retry_after).

Only requests certainly ahead count: the backlog of higher tiers plus the tenant's own
requests before this one. Each needs one completion once the pool's free slots are used, so
the earliest start is a lower bound and shedding only hits requests that are truly doomed.
"""

from __future__ import annotations

from extproc.scheduler import retry_after
from extproc.scheduler.live import Live
from extproc.scheduler.pools import PoolState
from extproc.scheduler.queues import TenantQueue, TenantState
from extproc.scheduler.records import OrderKey, QueueEntry
from extproc.scheduler.types import Ticket


def queued_ahead_by_rank(live: Live, pool: PoolState) -> list[int]:
    """For each tier rank, how many requests of backlogged tenants of higher tiers wait (and,
    last, the whole backlog)."""
    ahead: list[int] = []
    total = 0
    for band in pool.bands:
        ahead.append(total)
        total += band.queued
    ahead.append(total)
    return ahead


def earliest_start(
    live: Live,
    pool: PoolState,
    rank: int,
    queue: TenantQueue,
    key: OrderKey,
    deadline: float,
    now: float,
) -> float | None:
    """An optimistic admission time from the pool's drain rate when it is past `deadline`,
    else None (also when the rate is unknown or the request could start now)."""
    rate = pool.drain.rate(now)
    if rate is None or rate <= 0:
        return None
    base = queued_ahead_by_rank(live, pool)[rank] + 1 - pool.capacity.free_slots()
    if now + (base + queue.live) / rate <= deadline:
        return None  # met even behind all of its tenant's queue: skip counting
    need = base + queue.count_before(key)
    if need <= 0 or now + need / rate <= deadline:
        return None
    return now + need / rate


def doomed(live: Live, now: float) -> list[QueueEntry]:
    """Queued requests whose deadline cannot be met at their pool's current drain rate.

    A pool is skipped without walking its queues when even the earliest deadline anywhere is
    met behind every queued request (no request needs more completions than that)."""
    found: list[QueueEntry] = []
    earliest = live.timers.earliest_deadline()
    if earliest is None:
        return found
    for pool in live.pools.values():
        if pool.retired or not pool.waiting:
            continue
        rate = pool.drain.rate(now)
        if rate is None or rate <= 0:
            continue
        free = pool.capacity.free_slots()
        most = len(live.entries) + 1 - free
        if most <= 0 or now + most / rate <= earliest:
            continue
        ahead_by_rank = queued_ahead_by_rank(live, pool)
        for name in pool.waiting:
            spec = live.policy.tenant(name)
            if spec is None:
                continue
            queue = live.tenants[name].queues[pool.name]
            if not queue.with_deadline:
                continue
            base = ahead_by_rank[live.rank(spec)]
            for index, entry in enumerate(queue.in_order()):
                deadline = entry.ticket.deadline
                need = base + index + 1 - free
                if deadline is not None and need > 0 and now + need / rate > deadline:
                    found.append(entry)
    return found


def may_shed(live: Live, now: float) -> bool:
    """Whether a pool with queued requests has a drain rate to judge deadlines by."""
    return any(
        pool.waiting and not pool.retired and pool.drain.rate(now) is not None
        for pool in live.pools.values()
    )


def backlog_retry_after(
    live: Live, pool: PoolState, rank: int, wait_limit: float, now: float
) -> int:
    """Retry-After for a request of this tier turned away from the pool (expired, shed)."""
    rate = pool.drain.rate(now)
    backlog = 0 if rate is None else queued_ahead_by_rank(live, pool)[rank + 1]
    return retry_after.after_backlog(backlog, rate, wait_limit)


def ticket_retry_after(live: Live, ticket: Ticket, wait_limit: float, now: float) -> int:
    spec = live.policy.tenant(ticket.tenant)
    pool = live.pools.get(ticket.pool)
    if spec is None or pool is None:
        return retry_after.UNKNOWN_S
    return backlog_retry_after(live, pool, live.rank(spec), wait_limit, now)


def queue_full_retry_after(state: TenantState, now: float) -> int:
    oldest = state.oldest()
    expires_in = None if oldest is None else oldest.expires_at - now
    return retry_after.after_queue_full(state.dispatches.rate(now), expires_in)
