"""Dispatch: which queued request goes next, across tiers (strict priority), fair share
(the band's policy) and tenant order (the head of the tenant's queue), and who may use a
pool's headroom. Choosing only; admitting is the caller's `admit`."""

from __future__ import annotations

from collections.abc import Callable

from extproc.endpoints import EndpointClass
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

    def run(
        self, admit: Callable[[PoolState, QueueEntry, bool, bool], Admission]
    ) -> list[Admission]:
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
                    admitted.append(admit(pool, entry, self.light_now(pool, entry), False))
                while pool.waiting and not capacity.has_slot():
                    reserve = not capacity.has_headroom()
                    if reserve and pool.reserve_inflight >= capacity.headroom:
                        break
                    entry = self.choose_headroom(pool, reserve)
                    if entry is None:
                        break
                    admitted.append(admit(pool, entry, self.light_now(pool, entry), reserve))
            progressed = len(admitted) > before and len(live.pools) > 1
        return admitted

    def _head(self, tenant: str, pool: PoolState) -> QueueEntry:
        return self._live.tenants[tenant].queues[pool.name].head()

    def choose(self, pool: PoolState) -> QueueEntry | None:
        """The next request for the pool: the highest tier with an admissible request, then
        that band's fair-share pick. Honours the pool's hold, and sets one when a blocked head
        has been passed over `max_bypass` times while it was owed the pool: a blocked head of a
        higher tier always is; one of the chosen request's own band when its tenant is within
        its weighted share of the pool's work (not `over_share`), or once the band's
        fair-share pick among every member, blocked or not, has been its tenant (a DRR turn
        is a burst of the next tenant's requests: each of them counts). A tenant over its
        share whose requests are big is then served by its weight like the others, not
        whenever `max_bypass` smaller requests went past."""
        capacity = pool.capacity
        if self.backlog_paced(pool):
            return self._choose_light(pool, capacity.fits, self.within_share)
        held = pool.held
        if held is None and capacity.fits(pool.largest_queued_budget()):
            return self._choose_all_fit(pool)
        # blocked heads the request about to be chosen passes over while they are owed
        owed: list[tuple[Hold, QueueEntry]] = []
        for band in pool.bands:
            if not band.members:
                continue
            candidates: list[tuple[str, float]] = []
            chosen: str | None = None
            if held is not None and band.rank == held.rank:
                head = self._head(held.tenant, pool)
                if not capacity.fits(head.ticket.budget):
                    return None
                candidates.append((held.tenant, 0.0))
                chosen = held.tenant
            else:
                blocked: list[tuple[Hold, QueueEntry, float]] = []
                for name in band.members:
                    head = self._head(name, pool)
                    cost = self._live.fair_cost(head.ticket)
                    if capacity.fits(head.ticket.budget):
                        candidates.append((name, cost))
                    else:
                        blocked.append((Hold(band.rank, name), head, cost))
                if not candidates:
                    owed.extend((hold, head) for hold, head, _cost in blocked)
                    continue
                if blocked and self._max_bypass is not None:
                    turn = band.fair.pick(
                        candidates + [(hold.tenant, cost) for hold, _head, cost in blocked]
                    )
                    for hold, head, _cost in blocked:
                        if hold.tenant == turn:
                            head.turn_came = True
                        if head.turn_came or not self.over_share(pool, hold.tenant):
                            owed.append((hold, head))
                    if all(hold.tenant != turn for hold, _head, _cost in blocked):
                        chosen = turn
            if self._max_bypass is not None and owed:
                for hold, head in owed:
                    if head.bypassed >= self._max_bypass:
                        pool.held = hold
                        return self.choose(pool)
                for _hold, head in owed:
                    head.bypassed += 1
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

    def backlog_paced(self, pool: PoolState) -> bool:
        """Backlogged tenants wait now: the pool's prefilling prompt tokens reached its
        prefill budget, or its in-flight requests the δ controller's share of the soft limit
        (both scaled by the controller's factor), or, in a pool without a budget, its
        prefilling prompts the controller's share (extproc.scheduler.latency)."""
        spec = self._live.policy.pools.get(pool.name)
        if spec is None:
            return False
        delta = pool.delta
        budget = spec.effective_prefill_budget
        if budget and pool.prefilling_tokens >= delta.limit(budget):
            return True
        if delta.factor >= 1.0:
            return False
        soft = pool.soft_now()
        if not budget and pool.prefilling_requests >= delta.prefilling_limit(soft):
            return True
        return pool.capacity.inflight >= delta.limit(soft)

    def choose_headroom(self, pool: PoolState, reserve: bool = False) -> QueueEntry | None:
        """Above the soft limit, up to the hard one: the next request of a tenant below its
        fair share of the pool, in tier order, then fair-share order. A hold keeps lower
        tiers and the held tier's other tenants out; no bypass is counted here. `reserve`:
        the hard limit is below what is in flight, and the request would take one of the
        headroom's slots beyond it (`Capacity.fits_reserve`)."""
        capacity = pool.capacity
        fits = capacity.fits_reserve if reserve else capacity.fits_headroom
        return self._choose_light(pool, fits, self.is_light)

    def _choose_light(
        self,
        pool: PoolState,
        fits: Callable[[int], bool],
        light: Callable[[PoolState, str], bool],
    ) -> QueueEntry | None:
        """The next request of a tenant `light` calls light that `fits`, in tier then
        fair-share order."""
        held = pool.held
        below = {name for name in pool.waiting if light(pool, name)}
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
                if fits(head.ticket.budget):
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
        return {name for name in pool.waiting if self.is_light(pool, name)}

    def is_light(self, pool: PoolState, name: str) -> bool:
        """Whether the tenant's whole demand in the pool is within its weighted share of the
        pool's admitted work (see `light_tenants`)."""
        found = self._demand_and_fraction(pool, name)
        if found is None:
            return False
        demand, fraction = found
        return demand <= pool.capacity.inflight_tokens * fraction

    def within_share(self, pool: PoolState, name: str) -> bool:
        """Whether the tenant's whole demand in the pool is below its weighted share of the
        pool's whole demand (admitted and queued work, every tenant's): the light test of
        engine priority, prefill pacing and the δ controller. Unlike `is_light` it does not
        shrink when the pool is throttled, so throttling the backlogged tenants never turns a
        well-behaved tenant into one of them."""
        found = self._demand_and_fraction(pool, name)
        if found is None:
            return False
        demand, fraction = found
        work = pool.capacity.inflight_tokens + pool.queued_tokens
        # Strictly below: a tenant alone in the pool (all the demand is its own) is not light.
        return demand < work * fraction

    def light_now(self, pool: PoolState, entry: QueueEntry) -> bool:
        """Whether the tenant of the entry about to be admitted is light: within its share
        (`within_share`) and with nothing else queued for the pool. A tenant with a queue at
        the door is backlogged whatever its share of the work: given engine priority over
        another backlogged tenant, it would take the engine's service from the one the door
        just admitted by fair share (a chat tenant beside embedding batches, say)."""
        tenant = entry.ticket.tenant
        queue = self._live.tenants[tenant].queues.get(pool.name)
        if queue is not None and queue.live > 1:
            return False
        return self.within_share(pool, tenant)

    def over_share(self, pool: PoolState, name: str) -> bool:
        """Whether the tenant's whole demand in the pool is above its weighted share of the
        pool's whole demand (the complement of `within_share`, which is strict: at its share
        exactly a tenant is neither)."""
        found = self._demand_and_fraction(pool, name)
        if found is None:
            return False
        demand, fraction = found
        return demand > (pool.capacity.inflight_tokens + pool.queued_tokens) * fraction

    def _demand_and_fraction(self, pool: PoolState, name: str) -> tuple[int, float] | None:
        """The tenant's admitted + queued tokens in the pool and its weight's fraction of the
        pool's active tenants' weights (None: not a tenant, or no active weight)."""
        policy = self._live.policy
        spec = policy.tenant(name)
        if spec is None:
            return None
        total = pool.weight_total(policy, self._weight_of)
        if total <= 0:
            return None
        state = self._live.tenants.get(name)
        queue = None if state is None else state.queues.get(pool.name)
        queued = 0 if queue is None else queue.tokens
        return pool.users.get(name, _NO_USAGE).tokens + queued, spec.weight / total

    def _weight_of(self, name: str) -> float | None:
        spec = self._live.policy.tenant(name)
        return None if spec is None else spec.weight


def dispatchable_now(
    state: TenantState, spec: Tenant, pool: PoolState, rank: int, ticket: Ticket
) -> bool:
    """Would a new request go straight through (so it never occupies a queue slot)?"""
    return _straight_through(state, spec, pool, rank, ticket.endpoint, ticket.budget)


def some_request_dispatchable_now(
    state: TenantState, spec: Tenant, pool: PoolState, rank: int, endpoint: EndpointClass
) -> bool:
    """Would some new request to `endpoint` (the smallest, `fits` being monotone) go straight
    through: `dispatchable_now` before the request's size is known."""
    return _straight_through(state, spec, pool, rank, endpoint, 1)


def _straight_through(
    state: TenantState, spec: Tenant, pool: PoolState, rank: int, endpoint: EndpointClass,
    budget: int,
) -> bool:  # fmt: skip
    if not below_concurrency(state, spec) or not pool.capacity.fits(budget):
        return False
    if not below_class_concurrency(state, spec, endpoint):
        return False
    if pool.held is not None and pool.held.rank <= rank:
        return False
    return all(not band.members for band in pool.bands[: rank + 1])
