"""The scheduler's live state, shared by its parts, and the one rule that keeps it consistent:
band membership follows each tenant's queue (`sync`)."""

from __future__ import annotations

from collections.abc import Callable

from extproc.endpoints import EndpointClass
from extproc.policy.model import Pool, Tenant
from extproc.policy.runtime import Policy
from extproc.scheduler.capacity import Capacity
from extproc.scheduler.fairness import LocalityAware
from extproc.scheduler.limits import LimitStore
from extproc.scheduler.locality import LocalityIndex
from extproc.scheduler.pools import Band, PoolState, new_bands
from extproc.scheduler.queues import TenantQueue, TenantState, Timers
from extproc.scheduler.ratelimit import RateLimiter
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.records import LeaseState, QueueEntry
from extproc.scheduler.types import Ticket

CapacityFactory = Callable[[str, Pool], Capacity]


class Live:
    """Pools, tenants, queued entries, leases, parked tenants, timers and rate limits."""

    def __init__(
        self,
        policy: Policy,
        store: LimitStore,
        *,
        capacity_factory: CapacityFactory,
        reserve_output: bool,
        drain_halflife_s: float,
        min_drain_samples: int,
    ) -> None:
        self.policy = policy
        self.limiter = RateLimiter(store)
        self.timers = Timers()
        self.reserve_output = reserve_output
        self._capacity_factory = capacity_factory
        self._drain_halflife_s = drain_halflife_s
        self._min_drain_samples = min_drain_samples
        self.tenants: dict[str, TenantState] = {}
        self.entries: dict[str, QueueEntry] = {}
        self.leases: dict[int, LeaseState] = {}
        self.parked: set[tuple[str, str]] = set()
        self.membership_version = 0
        """Bumped whenever a tenant starts or stops competing for a pool."""
        self.locality = LocalityIndex(policy)
        self.pools: dict[str, PoolState] = {
            name: self.new_pool(name, spec) for name, spec in policy.pools.items()
        }

    # --- construction ---------------------------------------------------------------------------

    def new_bands(self, pool_name: str) -> list[Band]:
        source = self.policy.source
        bands = new_bands(source.tiers, source.fairness)
        for band in bands:
            if isinstance(band.fair, LocalityAware):
                band.fair.bind_locality(self._head_cached_tokens(pool_name))
        return bands

    def _head_cached_tokens(self, pool_name: str) -> Callable[[str], float]:
        """For a locality-aware band: the cached prefix of a member's head request."""
        tenants, locality = self.tenants, self.locality

        def cached(tenant: str) -> float:
            ticket = tenants[tenant].queues[pool_name].head().ticket
            return locality.cached_tokens(pool_name, ticket.prefix_blocks)

        return cached

    def new_pool(self, name: str, spec: Pool) -> PoolState:
        drain = DecayingRate(self._drain_halflife_s, self._min_drain_samples)
        return PoolState(name, self._capacity_factory(name, spec), self.new_bands(name), drain)

    def tenant(self, name: str) -> TenantState:
        state = self.tenants.get(name)
        if state is None:
            rate = DecayingRate(self._drain_halflife_s, self._min_drain_samples)
            state = self.tenants[name] = TenantState(name, rate)
        return state

    # --- lookups --------------------------------------------------------------------------------

    def rank(self, spec: Tenant) -> int:
        return self.policy.tier_rank[spec.tier]

    def band_of(self, tenant: str, pool_name: str) -> Band | None:
        spec = self.policy.tenant(tenant)
        pool = self.pools.get(pool_name)
        if spec is None or pool is None:
            return None
        return pool.bands[self.rank(spec)]

    def fair_cost(self, ticket: Ticket) -> float:
        fairness = self.policy.source.fairness
        cost = fairness.input_weight * ticket.input_tokens
        if self.reserve_output:
            cost += fairness.output_weight * ticket.max_output_tokens
        return cost

    # --- membership -----------------------------------------------------------------------------

    def sync(self, state: TenantState, pool_name: str) -> None:
        """Make band membership and the pool's waiting set match the tenant's queue."""
        pool = self.pools.get(pool_name)
        queue = state.queues.get(pool_name)
        live = queue is not None and queue.live > 0
        if pool is not None:
            if live:
                pool.waiting[state.name] = None
            else:
                pool.waiting.pop(state.name, None)
        want: Band | None = None
        spec = self.policy.tenant(state.name)
        if (
            queue is not None
            and live
            and pool is not None
            and not pool.retired
            and spec is not None
            and below_concurrency(state, spec)
            and (
                not spec.limits.class_concurrency
                or head_below_class_concurrency(state, spec, queue)
            )
            and (pool_name, state.name) not in self.parked
        ):
            want = pool.bands[self.rank(spec)]
        have = state.bands.get(pool_name)
        if have is want:
            return
        self.membership_version += 1
        queued = 0 if queue is None else queue.live
        if have is not None:
            have.queued -= queued
            del have.members[state.name]
            have.fair.on_idle(state.name)
            del state.bands[pool_name]
            if pool is not None:
                pool.lift_hold_of(state.name)
        if want is not None and spec is not None:
            want.queued += queued
            want.members[state.name] = None
            want.fair.on_backlogged(state.name, spec.weight)
            state.bands[pool_name] = want

    def sync_all(self, state: TenantState) -> None:
        for pool_name in list(state.queues):
            self.sync(state, pool_name)

    # --- queue entries --------------------------------------------------------------------------

    def enqueue(self, entry: QueueEntry, *, first: bool = False) -> TenantState:
        """Put an entry in its tenant's queue (`first`: it was the oldest arrival, requeued)."""
        ticket = entry.ticket
        state = self.tenant(ticket.tenant)
        entry.alive = True
        state.queue(ticket.pool).push(entry)
        band = state.bands.get(ticket.pool)
        if band is not None:
            band.queued += 1
        state.queued += 1
        arrivals = state.arrivals
        if first:
            arrivals.appendleft(entry)
        else:
            arrivals.append(entry)
        if len(arrivals) > 2 * state.queued + 32:
            state.prune_arrivals()
        self.entries[ticket.request_id] = entry
        self.timers.entry_queued(entry)
        pool = self.pools.get(ticket.pool)
        if pool is not None:
            pool.budget_queued(ticket.budget)
        return state

    def remove(self, entry: QueueEntry, now: float, *, refund: bool) -> None:
        """Take a queued entry out (cancelled, expired, shed, drained), refunding its charge."""
        ticket = entry.ticket
        state = self.tenants[ticket.tenant]
        state.queues[ticket.pool].discard(entry)
        band = state.bands.get(ticket.pool)
        if band is not None:
            band.queued -= 1
        pool = self.pools.get(ticket.pool)
        if pool is not None:
            pool.budget_left(ticket.budget)
        del self.entries[ticket.request_id]
        state.queued -= 1
        self.timers.entry_left(entry)
        if refund:
            spec = self.policy.tenant(ticket.tenant)
            if spec is not None:
                self.limiter.refund(ticket.tenant, spec, entry.charged, now)
        self.sync(state, ticket.pool)

    def rebuild_entry_timers(self) -> None:
        """Recompute every queued entry's expiry from its tenant's (current) max_queue_wait."""
        entries = self.entries.values()
        for entry in entries:
            spec = self.policy.tenants[entry.ticket.tenant]
            entry.expires_at = entry.enqueued_at + spec.limits.max_queue_wait
        self.timers.rebuild_entries(entries)


def below_concurrency(state: TenantState, spec: Tenant) -> bool:
    limit = spec.limits.max_concurrency
    return limit is None or state.inflight < limit


def below_class_concurrency(state: TenantState, spec: Tenant, endpoint: EndpointClass) -> bool:
    """Below the max_concurrency of the class's `per_endpoint` block (if it sets one)."""
    block = spec.limits.per_endpoint.get(endpoint)
    limit = None if block is None else block.max_concurrency
    return limit is None or state.inflight_by_class.get(endpoint, 0) < limit


def head_below_class_concurrency(state: TenantState, spec: Tenant, queue: TenantQueue) -> bool:
    """The head of the tenant's queue is of a class below its concurrency limit. Tenant order
    is never broken, so a head of a class at its limit holds the tenant back in that pool (the
    way the tenant's own max_concurrency does in every pool)."""
    return below_class_concurrency(state, spec, queue.head().ticket.endpoint)
