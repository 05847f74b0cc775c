"""The admission scheduler: pure, deterministic, driven by an injected clock.

Layers, in order (ARCHITECTURE.md, "Admission order"):

a. rate limits at submit (buckets: requests/min, tokens/min, the tenant's and its endpoint
   class's; max_queued); max_concurrency (tenant-wide and per class) holds requests queued;
b. strict tier priority per pool;
c. token-weighted fair share between the tenants of a tier (a registered policy: DRR, VTC),
   per pool;
d. inside a tenant: priority, then deadline, then arrival, then sequence number;
e. pool capacity (requests and tokens in flight), leases released exactly once; above the
   pool's soft request limit, up to its hard limit (the headroom), only tenants below their
   fair share of the pool are dispatched;
f. bounded waiting: expiry after max_queue_wait, shedding of requests whose deadline cannot be
   met.

Every method is synchronous and returns what happened; the caller (the asyncio adapter or the
simulator) calls `dispatch()` after anything that can free or add work (submit, release, cancel,
poll, update_policy) and sleeps until `next_deadline()`.

Definitions used throughout:

* A tenant is *backlogged* in a pool when it has queued requests for the pool and is below its
  max_concurrency. Only backlogged tenants take part in the pool's fair share.
* A request is *admissible* when it is the head of its tenant's queue for the pool (tenant
  order is never broken), its tenant is backlogged, and the pool has room for its budget right
  now. `dispatch()` is work-conserving: when it returns, no admissible request waits, except
  behind a *hold* (below).
* Hold (anti-starvation): a head that does not fit the pool's free token room while smaller
  requests of its own or lower tiers keep going past it is overtaken at most `max_bypass` times
  while it is owed the pool; then the pool is held for its tenant: its own and lower tiers
  dispatch nothing more to that pool until the head fits. Higher tiers are unaffected. A head
  is owed the pool by a lower tier always, and within its tier when its tenant is not over its
  weighted share of the pool's work or once the band's fair-share pick has been its tenant:
  a tenant of big requests gets its weight, not the pool after every `max_bypass` small ones.

Hooks for shared state (several replicas, one Redis; extproc.state): the core stays
synchronous and knows nothing about Redis. An adapter that must confirm an admission with a
global gate uses four small hooks, all documented where they are defined:

* `check(ticket)` runs every submit check that does not charge a bucket, so an adapter can take
  the buckets from an asynchronous store in between, then `submit` (which re-checks);
* `requeue(lease_id, park=...)` undoes a tentative admission the gate refused: the request goes
  back to its place in its tenant's queue, capacity and fair-share charges are reversed;
* `park(pool, tenant)` / `unpark(...)`: a parked tenant is not backlogged in that pool (it
  does not compete) until unparked: it waits on a condition outside this scheduler;
* `backlogged()` with `membership_version`: which tenants compete for which pool now, so the
  adapter can publish its backlog to the other replicas.

Design decisions:

* Fair-share state is per (pool, tenant): one fairness object per (pool, tier) band. Each pool
  is a separate resource with its own capacity and its own cost per token (a long-context
  engine is not a short one); VTC's and DRR's guarantees are per server, and a tenant that
  only used the long pool should not lose its share of the short pool, where it never
  competed. Fleet-wide consumption per tenant is capped by the token buckets, which are global.
* Costs: fair-share cost = input_weight * prompt + output_weight * max_output, reserved at
  dispatch; streamed output above the reservation is charged as it arrives
  (`charge_output`); `release` with actuals settles the difference (refund or debit) into both
  the fair share and the tokens-per-minute bucket.
* Headroom (docs/benchmarks.md, noisy neighbour): a tenant's fair share of a pool is its
  weight over the summed weights of the tenants active in the pool (queued or admitted), all
  tiers together, of the pool's admitted work in tokens (budgets). Once the soft limit is full,
  a queued tenant whose
  whole demand (admitted + queued budgets) is within that share -- a light tenant, which a
  max-min fair allocation would serve in full -- may still go, in tier then fair-share order,
  until the hard limit. So a quiet tenant does not wait for a whole request of the tenant that
  keeps the soft limit full, while backlogged tenants never take the headroom.
  The soft limit may move (adaptive capacity); the core only asks the Capacity object.
* Drain rate: per pool, an exponentially decaying average of completions (releases) per second
  with warm-up correction; unknown until `min_drain_samples` completions. Shedding estimates the
  earliest admission as now + (requests certainly ahead + 1 - free slots) / drain rate, where
  "certainly ahead" = backlog of higher tiers + the tenant's own requests before this one: a
  lower bound, so only requests that are doomed even in the best case are shed.
* Retry-After: the rules and constants are pure functions in extproc.scheduler.retry_after.

The parts behind this facade: `live` (the shared state: pools, tenants, queued entries,
leases, and band membership kept in step with the queues), `queues` (tenant order, the wait,
deadline and lease timers), `ratelimit` (the limit dimensions as data, the buckets),
`dispatch` (who goes next, headroom), `leases` (admit, settle, free), `estimates` (drain-rate
shedding and Retry-After inputs), `retry_after`, `policy_update`, `snapshot`, `rejections`,
and `fairness` (the fair-share policies, registered by name).
"""

from __future__ import annotations

import math
from typing import Any

from extproc.endpoints import EndpointClass
from extproc.policy.model import Pool
from extproc.policy.runtime import Policy
from extproc.scheduler import estimates, retry_after, shares
from extproc.scheduler.capacity import Capacity, StaticCapacity
from extproc.scheduler.clock import Clock
from extproc.scheduler.dispatch import (
    Dispatcher,
    dispatchable_now,
    some_request_dispatchable_now,
)
from extproc.scheduler.leases import Leases
from extproc.scheduler.limits import LimitStore, MemoryLimitStore, Take
from extproc.scheduler.live import CapacityFactory, Live
from extproc.scheduler.locality import LocalityIndex
from extproc.scheduler.policy_update import apply_policy
from extproc.scheduler.ratelimit import headers_for
from extproc.scheduler.records import OrderKey, QueueEntry
from extproc.scheduler.rejections import rate_limited, reject, unknown_tenant
from extproc.scheduler.snapshot import snapshot
from extproc.scheduler.types import Admission, Lease, Rejection, Ticket
from extproc.types import Outcome

__all__ = ["CapacityFactory", "Scheduler"]


def _static_capacity(_name: str, pool: Pool) -> Capacity:
    return StaticCapacity(pool)


class Scheduler:
    """Admission decisions for every pool. Not thread-safe: one event loop drives it."""

    def __init__(
        self,
        policy: Policy,
        clock: Clock,
        store: LimitStore | None = None,
        *,
        capacity_factory: CapacityFactory = _static_capacity,
        max_bypass: int | None = 16,
        reserve_output: bool = True,
        drain_halflife_s: float = 10.0,
        min_drain_samples: int = 8,
        shed_check_interval_s: float = 0.5,
    ) -> None:
        """
        max_bypass: how often a head request that does not fit the pool's free token room may
            be overtaken by smaller ones before the pool is held for it (None: never hold).
        reserve_output: charge max_output to the fair share at dispatch (and settle later);
            False charges output only as it streams (the VTC paper's accounting).
        drain_halflife_s, min_drain_samples: the pools' completion-rate estimators.
        shed_check_interval_s: how often queued requests with deadlines are re-checked.
        """
        self.clock = clock
        self.reclaimed_leases = 0
        self._live = Live(
            policy,
            store if store is not None else MemoryLimitStore(),
            capacity_factory=capacity_factory,
            reserve_output=reserve_output,
            drain_halflife_s=drain_halflife_s,
            min_drain_samples=min_drain_samples,
        )
        self._dispatcher = Dispatcher(self._live, max_bypass)
        self._leases = Leases(self._live)
        self._shed_interval = shed_check_interval_s
        self._next_shed_scan = -math.inf
        self._seq = 0

    @property
    def policy(self) -> Policy:
        return self._live.policy

    @property
    def store(self) -> LimitStore:
        return self._live.limiter.store

    @property
    def locality(self) -> LocalityIndex:
        """What each pool's replicas are believed to hold (fairness `dlpm`; else empty)."""
        return self._live.locality

    @property
    def membership_version(self) -> int:
        """Bumped whenever a tenant starts or stops competing for a pool (see `backlogged`)."""
        return self._live.membership_version

    def fair_cost(self, ticket: Ticket) -> float:
        """The fair-share cost reserved for the ticket at dispatch (token units, unweighted)."""
        return self._live.fair_cost(ticket)

    # --- submit ---------------------------------------------------------------------------------

    def _order_key(self, ticket: Ticket, now: float, seq: int) -> OrderKey:
        deadline = math.inf if ticket.deadline is None else ticket.deadline
        return (-ticket.priority, deadline, now, seq)

    def _check(self, ticket: Ticket, now: float) -> Rejection | None:
        live = self._live
        spec = live.policy.tenant(ticket.tenant)
        if spec is None:
            return reject(ticket, Outcome.UNAUTHORIZED, 403, None, unknown_tenant(ticket.tenant))
        pool = live.pools.get(ticket.pool)
        if pool is None or pool.retired:
            message = f"pool {ticket.pool!r} is not in the policy"
            return reject(ticket, Outcome.UNAVAILABLE, 503, None, message)
        if ticket.request_id in live.entries:
            message = f"request id {ticket.request_id!r} is already queued"
            return reject(ticket, Outcome.BAD_REQUEST, 400, None, message)
        budget = ticket.budget
        if not pool.capacity.can_ever_fit(budget):
            message = (
                f"request needs {budget} tokens (prompt + max_tokens), more than pool "
                f"{ticket.pool!r} ever admits at once; lower max_tokens or shorten the prompt"
            )
            return reject(ticket, Outcome.BAD_REQUEST, 400, None, message)

        state = live.tenant(ticket.tenant)
        rank = live.rank(spec)
        queue = state.queue(ticket.pool)
        if state.queued >= spec.limits.max_queued and not dispatchable_now(
            state, spec, pool, rank, ticket
        ):
            return self._queue_full(ticket.request_id, ticket.tenant, ticket.endpoint, now)

        if ticket.deadline is not None:
            wait_limit = spec.limits.max_queue_wait
            if ticket.deadline <= now:
                message = "the request's deadline has already passed"
                retry = estimates.backlog_retry_after(live, pool, rank, wait_limit, now)
                return reject(ticket, Outcome.SHED, 503, retry, message)
            key = self._order_key(ticket, now, self._seq + 1)
            eta = estimates.earliest_start(live, pool, rank, queue, key, ticket.deadline, now)
            if eta is not None:
                retry = estimates.backlog_retry_after(live, pool, rank, wait_limit, now)
                message = (
                    f"pool {ticket.pool!r} cannot start the request before its deadline "
                    f"(earliest in {eta - now:.1f}s, deadline in {ticket.deadline - now:.1f}s)"
                )
                return reject(ticket, Outcome.SHED, 503, retry, message)

        return None

    def _queue_full(
        self, request_id: str, tenant: str, endpoint: EndpointClass, now: float
    ) -> Rejection:
        live = self._live
        spec = live.policy.source.tenants[tenant]
        state = live.tenant(tenant)
        retry = estimates.queue_full_retry_after(state, now)
        message = (
            f"tenant {tenant!r} already has {state.queued} requests queued "
            f"(max_queued {spec.limits.max_queued}); retry after {retry}s"
        )
        return Rejection(
            request_id=request_id,
            tenant=tenant,
            outcome=Outcome.REJECTED_QUEUE_FULL,
            http_status=429,
            retry_after_s=retry,
            message=message,
            headers=live.limiter.peek_headers(tenant, endpoint, spec, now),
        )

    def queue_full_whatever_the_body(
        self, request_id: str, tenant: str, endpoint: EndpointClass
    ) -> Rejection | None:
        """The queue-full refusal `submit` would give any request of `tenant` to `endpoint`
        now, whatever its pool and size; None when that depends on the request. It does not
        when the tenant has `max_queued` requests queued and no request of it could go
        straight through any pool (`some_request_dispatchable_now`). The service asks at the
        request headers: refused there, a request costs the door two messages fewer (Envoy
        sends no body, and the accounting stream no request headers)."""
        live = self._live
        spec = live.policy.tenant(tenant)
        state = live.tenants.get(tenant)
        if spec is None or state is None or state.queued < spec.limits.max_queued:
            return None
        rank = live.rank(spec)
        pools = [pool for pool in live.pools.values() if not pool.retired]
        if not pools or any(
            some_request_dispatchable_now(state, spec, pool, rank, endpoint) for pool in pools
        ):
            return None
        return self._queue_full(request_id, tenant, endpoint, self.clock.now())

    def rate_takes(self, ticket: Ticket) -> list[Take]:
        """The bucket charges `submit` makes for the ticket (in dimension order)."""
        spec = self._live.policy.tenant(ticket.tenant)
        return [] if spec is None else self._live.limiter.takes(ticket, spec)

    def check(self, ticket: Ticket) -> Rejection | None:
        """Every check `submit` makes before it charges the rate-limit buckets, without
        queueing anything: an adapter whose limit store is asynchronous calls it, takes the
        buckets itself, then calls `submit` (which checks again: time has passed)."""
        return self._check(ticket, self.clock.now())

    def submit(self, ticket: Ticket) -> Rejection | None:
        """Queue a request (None) or turn it away. Call `dispatch()` afterwards."""
        now = self.clock.now()
        rejection = self._check(ticket, now)
        if rejection is not None:
            return rejection
        live = self._live
        spec = live.policy.source.tenants[ticket.tenant]
        self._seq = seq = self._seq + 1
        limiter = live.limiter
        buckets = limiter.buckets(ticket.tenant, ticket.endpoint, spec)
        headers: dict[str, str] = {}
        charged: dict[str, float] = {}
        if buckets:
            charges = [(item, item.dimension.cost(ticket)) for item in buckets]
            result = limiter.store.try_take(
                [Take(item.bucket, cost) for item, cost in charges], now
            )
            headers = headers_for(zip(buckets, result.levels, strict=True))
            if not result.ok:
                return rate_limited(ticket, charges, result.levels, result.wait_s, headers)
            charged = {item.name: cost for item, cost in charges}
        key = self._order_key(ticket, now, seq)
        expires_at = now + spec.limits.max_queue_wait
        entry = QueueEntry(ticket, seq, key, now, expires_at, headers, charged)
        state = live.enqueue(entry)
        if ticket.pool not in state.bands or spec.limits.class_concurrency:
            # a member stays one as its queue grows, unless a new head's class is at its limit
            live.sync(state, ticket.pool)
        return None

    # --- dispatch -------------------------------------------------------------------------------

    def dispatch(self) -> list[Admission]:
        """Admit every request that may go now, in order."""
        if not self._live.entries:
            return []  # nothing queued anywhere
        now = self.clock.now()
        return self._dispatcher.run(
            lambda pool, entry, light, reserve: self._leases.admit(pool, entry, now, light, reserve)
        )

    # --- shared-state hooks ---------------------------------------------------------------------

    def requeue(self, lease_id: int, *, park: bool = False) -> bool:
        """Undo an admission that was only tentative (a global gate refused it).

        The request goes back to its tenant's queue with its original order key (so it keeps
        its place and its queue-wait expiry), the pool capacity and tenant concurrency it took
        are freed, and its fair-share charge is reversed. It does not count as a completion.
        With `park`, the tenant is parked in that pool (see `park`). False if the lease is
        unknown or did not come from the queue.
        """
        live = self._live
        held = live.leases.get(lease_id)
        if held is None or held.entry is None:
            return False
        pool = live.pools.get(held.lease.pool)
        if pool is None or pool.retired or live.policy.tenant(held.ticket.tenant) is None:
            return False  # nowhere to go back to: the caller releases it instead
        del live.leases[lease_id]
        entry, ticket, lease = held.entry, held.ticket, held.lease
        state = live.tenants[ticket.tenant]
        band = live.band_of(ticket.tenant, lease.pool)
        if band is not None and held.fair_charged:
            band.fair.charge(ticket.tenant, -held.fair_charged)
        state.served_requests -= 1
        state.served_tokens -= lease.budget
        self._leases.free(held)
        state = live.enqueue(entry, first=True)
        if park:
            live.parked.add((ticket.pool, ticket.tenant))
        live.sync_all(state)
        return True

    def park(self, pool: str, tenant: str) -> None:
        """Stop the tenant competing for the pool (it stays queued, its requests still expire)
        until `unpark`: it waits for something outside this scheduler, e.g. a global limit."""
        self._live.parked.add((pool, tenant))
        state = self._live.tenants.get(tenant)
        if state is not None:
            self._live.sync(state, pool)

    def unpark(self, pool: str | None = None, tenant: str | None = None) -> int:
        """Let parked tenants compete again (all of them, or those of a pool and/or a tenant);
        returns how many were unparked. Call `dispatch()` afterwards."""
        live = self._live
        chosen = [
            (p, t)
            for p, t in live.parked
            if (pool is None or p == pool) and (tenant is None or t == tenant)
        ]
        for pool_name, tenant_name in chosen:
            live.parked.discard((pool_name, tenant_name))
            state = live.tenants.get(tenant_name)
            if state is not None:
                live.sync(state, pool_name)
        return len(chosen)

    def parked(self) -> set[tuple[str, str]]:
        """(pool, tenant) pairs parked now."""
        return set(self._live.parked)

    def backlogged(self) -> list[tuple[str, int, str]]:
        """(pool, tier rank, tenant) for every tenant competing for a pool now: it has queued
        requests there, is below its concurrency limit and is not parked."""
        return [
            (pool.name, band.rank, name)
            for pool in self._live.pools.values()
            if not pool.retired
            for band in pool.bands
            for name in band.members
        ]

    def queued_tenants(self, pool: str) -> list[str]:
        """Tenants with requests queued for the pool (competing, parked or over concurrency)."""
        state = self._live.pools.get(pool)
        return [] if state is None else list(state.waiting)

    # --- leaving the queue ----------------------------------------------------------------------

    def cancel(self, request_id: str) -> bool:
        """The client went away while queued: drop the request and refund its charge."""
        entry = self._live.entries.get(request_id)
        if entry is None:
            return False
        self._live.remove(entry, self.clock.now(), refund=True)
        return True

    def reject_all_queued(self, retry_after_s: int, message: str) -> list[Rejection]:
        """Answer every queued request (graceful drain): 503, refunded, queues left empty."""
        now = self.clock.now()
        out = []
        for entry in list(self._live.entries.values()):
            self._live.remove(entry, now, refund=True)
            out.append(reject(entry.ticket, Outcome.UNAVAILABLE, 503, retry_after_s, message))
        return out

    def over_share(self) -> set[str]:
        """Tenants above their fair share now (extproc.scheduler.shares): the ones shed first
        when the service itself falls behind. O(tenants + active tenants per pool)."""
        return shares.over_share(self._live, self.clock.now())

    def tenants_with_queued(self) -> set[str]:
        """Tenants with a request queued now, in any pool (`queued_tenants`: in one)."""
        return shares.queued_tenants(self._live)

    def shed_queued_of(self, tenants: set[str], message: str) -> list[Rejection]:
        """Answer the queued requests of `tenants` (overload): 429 + Retry-After, refunded."""
        return shares.shed_queued(self._live, tenants, self.clock.now(), message)

    def shed_retry_after(self, ticket: Ticket) -> int:
        """Retry-After for a request shed before it queued: the shed rule for its pool."""
        return shares.shed_retry_after(self._live, ticket, self.clock.now())

    # --- leases ---------------------------------------------------------------------------------

    def charge_output(self, lease_id: int, tokens: int, largest_gap: float | None = None) -> bool:
        """Output tokens streamed for an admitted request (a delta, not a running total);
        `largest_gap` (s), when they came as one batch of chunks: its longest gap."""
        held = self._live.leases.get(lease_id)
        if held is None:
            return False
        self._leases.charge_output(held, tokens, self.clock.now(), largest_gap)
        return True

    def first_token(self, lease_id: int, ago: float = 0.0) -> bool:
        """The admitted request's first token (or first response byte) passed, `ago` seconds
        before now (it is told late when its end overtook the call): its prompt is no longer
        being prefilled (prefill pacing) and its TTFT is a δ sample. Idempotent; a chunk of
        output tokens implies it. Call `dispatch()` afterwards."""
        held = self._live.leases.get(lease_id)
        if held is None:
            return False
        self._leases.first_token(held, self.clock.now() - max(0.0, ago))
        return True

    def release(
        self,
        lease_id: int,
        actual_input_tokens: int | None = None,
        actual_output_tokens: int | None = None,
    ) -> bool:
        """Free an admitted request's capacity, exactly once (False if already released).

        With actuals, settle: the token bucket and the fair share are corrected from the
        reserved estimate to real usage (refund or debit). A missing actual keeps its estimate.
        """
        held = self._live.leases.pop(lease_id, None)
        if held is None:
            return False
        now = self.clock.now()
        if actual_input_tokens is not None or actual_output_tokens is not None:
            self._leases.settle(held, actual_input_tokens, actual_output_tokens, now)
        pool = self._live.pools.get(held.lease.pool)
        if pool is not None:
            pool.drain.record(now)
        self._leases.free(held)
        return True

    def correct_usage(
        self,
        tenant: str,
        pool: str,
        input_delta: int,
        output_delta: int,
        endpoint: EndpointClass = "chat",
        *,
        fair: bool = True,
    ) -> None:
        """A settled request's count turned out different (extproc.service.reconcile): move
        the token buckets (the tenant's, its class's) and, unless the request was outside it
        (`fair` False: `Lease.fair_exempt`), the fair share by the difference."""
        self._leases.correct(
            tenant, pool, endpoint, input_delta, output_delta, self.clock.now(), fair=fair
        )

    def pool_inflight(self, pool: str) -> int:
        """Requests admitted to the pool and not yet released."""
        found = self._live.pools.get(pool)
        return 0 if found is None else found.capacity.inflight

    def reclaim_expired_leases(self) -> int:
        """Free leases past their expiry (their release was lost); returns how many."""
        count = self._leases.reclaim_expired(self.clock.now())
        self.reclaimed_leases += count
        return count

    # --- time -----------------------------------------------------------------------------------

    def poll(self) -> list[Rejection]:
        """Reclaim expired leases, expire and shed queued requests; returns their rejections."""
        timers = self._live.timers
        if timers.leases_due(self.clock.now()):
            self.reclaim_expired_leases()
        now = self.clock.now()
        out = [self._expire(entry, now) for entry in timers.expired(now)]
        for entry in timers.past_deadline(now):
            out.append(self._shed(entry, now, "the request's deadline passed while queued"))
        if timers.with_deadline and now >= self._next_shed_scan:
            self._next_shed_scan = now + self._shed_interval
            for entry in estimates.doomed(self._live, now):
                eta = "its deadline cannot be met at the pool's current drain rate"
                out.append(self._shed(entry, now, f"pool {entry.ticket.pool!r}: {eta}"))
        return out

    def next_deadline(self) -> float | None:
        """The earliest clock time at which `poll()` has work, if nothing else happens first."""
        live = self._live
        at = live.timers.next_time(live.leases.__contains__)
        if live.timers.with_deadline and estimates.may_shed(live, self.clock.now()):
            scan = max(self._next_shed_scan, self.clock.now())
            at = scan if at is None else min(at, scan)
        return at

    def _wait_limit(self, tenant: str) -> float:
        spec = self._live.policy.tenant(tenant)
        return spec.limits.max_queue_wait if spec is not None else retry_after.UNKNOWN_QUEUE_WAIT_S

    def _expire(self, entry: QueueEntry, now: float) -> Rejection:
        ticket = entry.ticket
        self._live.remove(entry, now, refund=True)
        wait_limit = self._wait_limit(ticket.tenant)
        retry = estimates.ticket_retry_after(self._live, ticket, wait_limit, now)
        message = (
            f"request waited {now - entry.enqueued_at:.1f}s without a turn "
            f"(max_queue_wait {wait_limit:g}s); the service is busy"
        )
        return reject(ticket, Outcome.EXPIRED, 503, retry, message)

    def _shed(self, entry: QueueEntry, now: float, message: str) -> Rejection:
        ticket = entry.ticket
        self._live.remove(entry, now, refund=True)
        wait_limit = self._wait_limit(ticket.tenant)
        retry = estimates.ticket_retry_after(self._live, ticket, wait_limit, now)
        return reject(ticket, Outcome.SHED, 503, retry, message)

    # --- policy ---------------------------------------------------------------------------------

    def update_policy(self, policy: Policy) -> list[Rejection]:
        """Hot reload. New limits and weights apply at once; in-flight leases are kept.

        Queued requests of removed tenants (or for removed pools) are returned as rejections.
        Changing the tier list or the fairness settings restarts fair-share state.
        """
        return apply_policy(self._live, policy, self.clock.now())

    # --- introspection --------------------------------------------------------------------------

    def lease(self, lease_id: int) -> Lease | None:
        held = self._live.leases.get(lease_id)
        return None if held is None else held.lease

    def queued(self) -> int:
        return len(self._live.entries)

    def inflight(self) -> int:
        return len(self._live.leases)

    def snapshot(self) -> dict[str, Any]:
        """Live per-tenant and per-pool state, JSON-ready (admin endpoint, tests, simulator)."""
        return snapshot(self._live, self.clock.now(), self.reclaimed_leases)
