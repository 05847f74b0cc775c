"""Who is above its fair share right now: the tenants a service that falls behind itself
sheds first (extproc.service.overload), before any tenant within its share is touched.

Two measures, a tenant over either one is over its share:

* tokens, per pool: the headroom rule (`Dispatcher.light_tenants`) over every tenant active in
  the pool (queued or admitted). A tenant whose whole demand (admitted plus queued budgets) is
  above its weighted share of the pool's admitted work is over; a tenant alone in a pool never
  is, since its share is all the work.
* admissions per second, across pools: the gateway's own work is per request, so a tenant
  admitted faster than `RATE_SLACK` times its weighted share of the admission rate of every
  tenant admitted lately is over, even at the moments when the light tenant has nothing in
  flight (a 1 request/s tenant is idle between its requests most of the time).
"""

from __future__ import annotations

from extproc.scheduler import estimates
from extproc.scheduler.live import Live
from extproc.scheduler.pools import PoolState
from extproc.scheduler.rejections import reject
from extproc.scheduler.retry_after import UNKNOWN_QUEUE_WAIT_S
from extproc.scheduler.types import Rejection, Ticket
from extproc.types import Outcome

RATE_SLACK = 1.2
"""A tenant's admission rate may exceed its weighted share by this factor before it counts as
over: two tenants sending at the same rate are not told apart by Poisson noise."""


def over_share(live: Live, now: float) -> set[str]:
    """Tenants above their weighted fair share in any pool (tokens) or in admissions/s."""
    over: set[str] = set()
    for pool in live.pools.values():
        if not pool.retired:
            over.update(_over_tokens(live, pool))
    over.update(_over_rate(live, now))
    return over


def queued_tenants(live: Live) -> set[str]:
    """Tenants with a request queued now."""
    return {name for name, state in live.tenants.items() if state.queued > 0}


def _over_tokens(live: Live, pool: PoolState) -> list[str]:
    policy = live.policy
    weights: dict[str, float] = {}
    for name in (*pool.waiting, *pool.users):
        spec = policy.tenant(name)
        if spec is not None:
            weights[name] = spec.weight
    total = sum(weights.values())
    if total <= 0 or len(weights) < 2:
        return []
    work = pool.capacity.inflight_tokens
    over: list[str] = []
    for name, weight in weights.items():
        usage = pool.users.get(name)
        demand = 0 if usage is None else usage.tokens
        if name in pool.waiting:
            demand += live.tenants[name].queues[pool.name].tokens
        if demand > work * weight / total:
            over.append(name)
    return over


def _over_rate(live: Live, now: float) -> list[str]:
    policy = live.policy
    rates: dict[str, tuple[float, float]] = {}
    for name, state in live.tenants.items():
        spec = policy.tenant(name)
        if spec is None or state.dispatches.count == 0:
            continue
        rates[name] = (state.dispatches.level(now), spec.weight)
    if len(rates) < 2:
        return []
    total_rate = sum(rate for rate, _ in rates.values())
    total_weight = sum(weight for _, weight in rates.values())
    if total_rate <= 0 or total_weight <= 0:
        return []
    return [
        name
        for name, (rate, weight) in rates.items()
        if rate > RATE_SLACK * total_rate * weight / total_weight
    ]


def shed_retry_after(live: Live, ticket: Ticket, now: float) -> int:
    """The shed rule (retry_after.after_backlog) for the ticket's pool and tier."""
    spec = live.policy.tenant(ticket.tenant)
    wait_limit = spec.limits.max_queue_wait if spec is not None else UNKNOWN_QUEUE_WAIT_S
    return estimates.ticket_retry_after(live, ticket, wait_limit, now)


def shed_queued(live: Live, tenants: set[str], now: float, message: str) -> list[Rejection]:
    """Take the queued requests of `tenants` out (refunded): 429 with the shed Retry-After.
    O(their queued requests)."""
    out: list[Rejection] = []
    for name in tenants:
        state = live.tenants.get(name)
        if state is None or not state.queued:
            continue
        # A requeued entry is in `arrivals` twice: it leaves once (remove marks it dead).
        for entry in list(state.arrivals):
            if not entry.alive:
                continue
            ticket = entry.ticket
            live.remove(entry, now, refund=True)
            retry = shed_retry_after(live, ticket, now)
            out.append(reject(ticket, Outcome.SHED_OVERLOAD, 429, retry, message))
    return out
