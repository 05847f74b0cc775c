"""Dispatch: which queued request goes next, across tiers (strict priority), fair share
(the band's policy) and tenant order (the head of the tenant's queue), and who may use a
pool's headroom. Choosing only; admitting is the caller's `admit`."""

from __future__ import annotations

from collections.abc import Callable

from extproc.policy.model import Tenant
from extproc.scheduler.live import Live, below_class_concurrency, below_concurrency
from extproc.scheduler.pools import PoolState
from extproc.scheduler.queues import TenantState
from extproc.scheduler.records import Hold, PoolUsage, QueueEntry
from extproc.scheduler.types import Admission, Ticket

_NO_USAGE = PoolUsage()


class Dispatcher:
    def __init__(self, live: Live, max_bypass: int | None) -> None:
        self._live = live
        self._max_bypass = max_bypass

    def run(self, admit: Callable[[PoolState, QueueEntry], Admission]) -> list[Admission]:
        """Admit every request that may go now, in order."""
        live = self._live
        admitted: list[Admission] = []
        # An admission in one pool can change another pool's options (a tenant reaching its
        # max_concurrency leaves every band and lifts a hold it had elsewhere), so go round
        # again until a whole pass admits nothing.
        progressed = True
        while progressed:
            before = len(admitted)
            for pool in live.pools.values():
                if pool.retired or not pool.waiting:
                    continue
                capacity = pool.capacity
                while capacity.has_slot():
                    entry = self.choose(pool)
                    if entry is None:
                        break
                    admitted.append(admit(pool, entry))
                while pool.waiting and not capacity.has_slot() and capacity.has_headroom():
                    entry = self.choose_headroom(pool)
                    if entry is None:
                        break
                    admitted.append(admit(pool, entry))
            progressed = len(admitted) > before and len(live.pools) > 1
        return admitted

    def _head(self, tenant: str, pool: PoolState) -> QueueEntry:
        return self._live.tenants[tenant].queues[pool.name].head()

    def choose(self, pool: PoolState) -> QueueEntry | None:
        """The next request for the pool: the highest tier with an admissible request, then
        that band's fair-share pick. Honours the pool's hold, and sets one when a blocked head
        has been overtaken `max_bypass` times."""
        capacity = pool.capacity
        held = pool.held
        if held is None and capacity.fits(pool.largest_queued_budget()):
            return self._choose_all_fit(pool)
        blocked: list[tuple[Hold, QueueEntry]] = []
        for band in pool.bands:
            if not band.members:
                continue
            candidates: list[tuple[str, float]] = []
            if held is not None and band.rank == held.rank:
                head = self._head(held.tenant, pool)
                if not capacity.fits(head.ticket.budget):
                    return None
                candidates.append((held.tenant, 0.0))
            else:
                for name in band.members:
                    head = self._head(name, pool)
                    if capacity.fits(head.ticket.budget):
                        candidates.append((name, self._live.fair_cost(head.ticket)))
                    else:
                        blocked.append((Hold(band.rank, name), head))
                if not candidates:
                    continue
            if self._max_bypass is not None and blocked:
                for hold, head in blocked:
                    if head.bypassed >= self._max_bypass:
                        pool.held = hold
                        return self.choose(pool)
                for _hold, head in blocked:
                    head.bypassed += 1
            chosen = candidates[0][0] if held is not None and band.rank == held.rank else None
            if chosen is None:
                chosen = band.fair.pick(candidates)
            return self._head(chosen, pool)
        return None

    def _choose_all_fit(self, pool: PoolState) -> QueueEntry | None:
        """`choose` when no hold is set and every queued request fits the pool (`fits` is
        monotone in the budget): every member of the first band with members is a candidate
        and none is bypassed, so the band's policy picks among all of them in its own time,
        not O(members)."""
        tenants = self._live.tenants
        fair_cost = self._live.fair_cost
        name = pool.name

        def cost_of(tenant: str) -> float:
            return fair_cost(tenants[tenant].queues[name].head().ticket)

        for band in pool.bands:
            if band.members:
                return tenants[band.fair.pick_member(cost_of)].queues[name].head()
        return None

    def choose_headroom(self, pool: PoolState) -> QueueEntry | None:
        """Above the soft limit, up to the hard one: the next request of a tenant below its
        fair share of the pool, in tier order, then fair-share order. A hold keeps lower
        tiers and the held tier's other tenants out; no bypass is counted here."""
        capacity = pool.capacity
        held = pool.held
        below = self.light_tenants(pool)
        if not below:
            return None
        for band in pool.bands:
            if held is not None and band.rank > held.rank:
                return None
            candidates: list[tuple[str, float]] = []
            for name in band.members:
                if name not in below or (
                    held is not None and band.rank == held.rank and name != held.tenant
                ):
                    continue
                head = self._head(name, pool)
                if capacity.fits_headroom(head.ticket.budget):
                    candidates.append((name, self._live.fair_cost(head.ticket)))
            if candidates:
                chosen = candidates[0][0] if len(candidates) == 1 else band.fair.pick(candidates)
                return self._head(chosen, pool)
        return None

    def light_tenants(self, pool: PoolState) -> set[str]:
        """Queued tenants of the pool whose whole demand (admitted plus queued token budgets)
        is within their weighted share of the pool's admitted work: the tenants a max-min fair
        allocation serves in full. Shares are over the tenants active in the pool (queued or
        admitted), all tiers together. A backlogged heavy tenant is never light."""
        policy = self._live.policy
        weights: dict[str, float] = {}
        for name in (*pool.waiting, *pool.users):
            spec = policy.tenant(name)
            if spec is not None:
                weights[name] = spec.weight
        total = sum(weights.values())
        if total <= 0:
            return set()
        work = pool.capacity.inflight_tokens
        users = pool.users
        light: set[str] = set()
        for name in pool.waiting:
            weight = weights.get(name)
            if weight is None:
                continue
            queued = self._live.tenants[name].queues[pool.name].tokens
            demand = users.get(name, _NO_USAGE).tokens + queued
            if demand <= work * weight / total:
                light.add(name)
        return light


def dispatchable_now(
    state: TenantState, spec: Tenant, pool: PoolState, rank: int, ticket: Ticket
) -> bool:
    """Would a new request go straight through (so it never occupies a queue slot)?"""
    if not below_concurrency(state, spec) or not pool.capacity.fits(ticket.budget):
        return False
    if not below_class_concurrency(state, spec, ticket.endpoint):
        return False
    if pool.held is not None and pool.held.rank <= rank:
        return False
    return all(not band.members for band in pool.bands[: rank + 1])
