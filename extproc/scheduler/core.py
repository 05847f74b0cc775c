"""The admission scheduler: pure, deterministic, driven by an injected clock.

Layers, in order (ARCHITECTURE.md, "Admission order"):

a. rate limits at submit (requests/min and tokens/min buckets, max_queued); max_concurrency
   holds requests in the queue;
b. strict tier priority per pool;
c. token-weighted fair share between the tenants of a tier (DRR or VTC), per pool;
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
  requests of its own or lower tiers keep going past it is overtaken at most `max_bypass` times;
  then the pool is held for its tenant: its own and lower tiers dispatch nothing more to that
  pool until the head fits. Higher tiers are unaffected.

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
* Retry-After: rate limits -> exact whole seconds until the buckets hold the cost; queue full ->
  time until the tenant's next dispatch (its dispatch rate) or its oldest entry's expiry,
  whichever is sooner; expired/shed -> the pool's backlog at this tier and above divided by the
  drain rate, clamped to [1, max_queue_wait].
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Any

from extproc.policy.model import Pool, Tenant
from extproc.policy.runtime import Policy
from extproc.scheduler.capacity import Capacity, StaticCapacity
from extproc.scheduler.clock import Clock
from extproc.scheduler.fairness import FairnessPolicy, make_fairness
from extproc.scheduler.limits import (
    Bucket,
    LimitStore,
    MemoryLimitStore,
    Take,
    ratelimit_headers,
    retry_after_seconds,
)
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.types import Admission, Lease, Rejection, Ticket
from extproc.types import Outcome

SortKey = tuple[int, float, float, int]
_NONE = (0, 0)


@dataclass(eq=False, slots=True)
class _Entry:
    ticket: Ticket
    seq: int
    key: SortKey
    enqueued_at: float
    expires_at: float
    headers: dict[str, str]
    charged_requests: bool
    charged_tokens: int
    alive: bool = True
    bypassed: int = 0
    """Times a request of another tenant (same or lower tier) went ahead while this one, at
    the head of its tenant's queue, did not fit the pool's token room."""


class _TenantQueue:
    """One tenant's queued requests for one pool, in tenant order (a heap, lazy deletion)."""

    __slots__ = ("heap", "live", "tokens", "with_deadline")

    def __init__(self) -> None:
        self.heap: list[tuple[SortKey, _Entry]] = []
        self.live = 0
        self.tokens = 0
        """Token budgets of the live entries."""
        self.with_deadline = 0

    def push(self, entry: _Entry) -> None:
        heappush(self.heap, (entry.key, entry))
        self.live += 1
        self.tokens += entry.ticket.budget
        if entry.ticket.deadline is not None:
            self.with_deadline += 1

    def head(self) -> _Entry:
        heap = self.heap
        while heap and not heap[0][1].alive:
            heappop(heap)
        if not heap:
            raise LookupError("empty tenant queue")
        return heap[0][1]

    def pop_head(self) -> _Entry:
        entry = self.head()
        heappop(self.heap)
        entry.alive = False
        self.live -= 1
        self.tokens -= entry.ticket.budget
        if entry.ticket.deadline is not None:
            self.with_deadline -= 1
        return entry

    def discard(self, entry: _Entry) -> None:
        entry.alive = False
        self.live -= 1
        self.tokens -= entry.ticket.budget
        if entry.ticket.deadline is not None:
            self.with_deadline -= 1
        if len(self.heap) > 32 and len(self.heap) > 2 * self.live:
            self.heap = [item for item in self.heap if item[1].alive]
            heapify(self.heap)

    def in_order(self) -> list[_Entry]:
        return [entry for _key, entry in sorted(self.heap, key=lambda item: item[0]) if entry.alive]

    def count_before(self, key: SortKey) -> int:
        return sum(1 for k, entry in self.heap if entry.alive and k < key)


class _Band:
    """The tenants of one tier competing for one pool."""

    __slots__ = ("fair", "members", "rank", "tier")

    def __init__(self, rank: int, tier: str, fair: FairnessPolicy) -> None:
        self.rank = rank
        self.tier = tier
        self.fair = fair
        self.members: dict[str, None] = {}


class _Pool:
    __slots__ = ("bands", "capacity", "drain", "held", "name", "retired", "users", "waiting")

    def __init__(self, name: str, capacity: Capacity, bands: list[_Band], drain: DecayingRate):
        self.name = name
        self.capacity = capacity
        self.bands = bands
        self.drain = drain
        self.held: tuple[int, str] | None = None
        self.retired = False
        self.waiting: dict[str, None] = {}
        """Tenants with queued requests for this pool (backlogged or not)."""
        self.users: dict[str, list[int]] = {}
        """Tenants with admitted requests in this pool -> [requests, their token budgets]
        (for headroom shares)."""


class _Tenant:
    __slots__ = (
        "arrivals",
        "bands",
        "dispatches",
        "inflight",
        "inflight_tokens",
        "name",
        "queued",
        "queues",
        "served_requests",
        "served_tokens",
    )

    def __init__(self, name: str, dispatches: DecayingRate) -> None:
        self.name = name
        self.queues: dict[str, _TenantQueue] = {}
        self.bands: dict[str, _Band] = {}
        """Pool -> the band this tenant is a member of (only while backlogged)."""
        self.arrivals: deque[_Entry] = deque()
        self.dispatches = dispatches
        self.queued = 0
        self.inflight = 0
        self.inflight_tokens = 0
        self.served_requests = 0
        self.served_tokens = 0

    def oldest(self) -> _Entry | None:
        arrivals = self.arrivals
        while arrivals and not arrivals[0].alive:
            arrivals.popleft()
        return arrivals[0] if arrivals else None


@dataclass(slots=True)
class _LeaseState:
    lease: Lease
    ticket: Ticket
    charged_output: int
    """Output tokens already charged to the fair share (the reservation, then what streamed)."""
    fair_charged: float
    output_seen: int = 0
    entry: _Entry | None = None
    """The queue entry it came from, kept so that `requeue` can put it back."""


CapacityFactory = Callable[[str, Pool], Capacity]


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
        self.store: LimitStore = store if store is not None else MemoryLimitStore()
        self.reclaimed_leases = 0
        self._policy = policy
        self._capacity_factory = capacity_factory
        self._max_bypass = max_bypass
        self._reserve_output = reserve_output
        self._drain_halflife_s = drain_halflife_s
        self._min_drain_samples = min_drain_samples
        self._shed_interval = shed_check_interval_s
        self._next_shed_scan = -math.inf
        self._tenants: dict[str, _Tenant] = {}
        self._entries: dict[str, _Entry] = {}
        self._bucket_cache: dict[
            str, tuple[int | None, int | None, tuple[Bucket | None, Bucket | None]]
        ] = {}
        self._with_deadline = 0
        self._leases: dict[int, _LeaseState] = {}
        self._seq = 0
        self._lease_seq = 0
        self._expiries: list[tuple[float, int, _Entry]] = []
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._lease_expiries: list[tuple[float, int]] = []
        self._parked: set[tuple[str, str]] = set()
        self.membership_version = 0
        """Bumped whenever a tenant starts or stops competing for a pool (see `backlogged`)."""
        self._pools: dict[str, _Pool] = {
            name: self._new_pool(name, spec) for name, spec in policy.pools.items()
        }

    @property
    def policy(self) -> Policy:
        return self._policy

    # --- construction helpers -------------------------------------------------------------------

    def _new_bands(self) -> list[_Band]:
        fairness = self._policy.source.fairness
        return [
            _Band(rank, tier, make_fairness(fairness.policy, fairness.quantum))
            for rank, tier in enumerate(self._policy.source.tiers)
        ]

    def _new_pool(self, name: str, spec: Pool) -> _Pool:
        drain = DecayingRate(self._drain_halflife_s, self._min_drain_samples)
        return _Pool(name, self._capacity_factory(name, spec), self._new_bands(), drain)

    def _tenant(self, name: str) -> _Tenant:
        state = self._tenants.get(name)
        if state is None:
            state = _Tenant(name, DecayingRate(self._drain_halflife_s, self._min_drain_samples))
            self._tenants[name] = state
        return state

    def _buckets(self, name: str, spec: Tenant) -> tuple[Bucket | None, Bucket | None]:
        limits = spec.limits
        rpm = limits.requests_per_minute
        tpm = limits.tokens_per_minute
        cached = self._bucket_cache.get(name)
        if cached is not None and cached[0] == rpm and cached[1] == tpm:
            return cached[2]
        buckets = (
            None if rpm is None else Bucket(f"{name}:requests", float(rpm), rpm / 60.0),
            None if tpm is None else Bucket(f"{name}:tokens", float(tpm), tpm / 60.0),
        )
        self._bucket_cache[name] = (rpm, tpm, buckets)
        return buckets

    def _rank(self, spec: Tenant) -> int:
        return self._policy.tier_rank[spec.tier]

    @staticmethod
    def _below_concurrency(state: _Tenant, spec: Tenant) -> bool:
        limit = spec.limits.max_concurrency
        return limit is None or state.inflight < limit

    def fair_cost(self, ticket: Ticket) -> float:
        """The fair-share cost reserved for the ticket at dispatch (token units, unweighted)."""
        return self._fair_cost(ticket)

    def _fair_cost(self, ticket: Ticket) -> float:
        fairness = self._policy.source.fairness
        cost = fairness.input_weight * ticket.input_tokens
        if self._reserve_output:
            cost += fairness.output_weight * ticket.max_output_tokens
        return cost

    # --- membership -----------------------------------------------------------------------------

    def _sync(self, state: _Tenant, pool_name: str) -> None:
        """Make band membership and the pool's waiting set match the tenant's queue."""
        pool = self._pools.get(pool_name)
        queue = state.queues.get(pool_name)
        live = queue is not None and queue.live > 0
        if pool is not None:
            if live:
                pool.waiting[state.name] = None
            else:
                pool.waiting.pop(state.name, None)
        want: _Band | None = None
        spec = self._policy.tenant(state.name)
        if (
            live
            and pool is not None
            and not pool.retired
            and spec is not None
            and self._below_concurrency(state, spec)
            and (pool_name, state.name) not in self._parked
        ):
            want = pool.bands[self._rank(spec)]
        have = state.bands.get(pool_name)
        if have is want:
            return
        self.membership_version += 1
        if have is not None:
            del have.members[state.name]
            have.fair.on_idle(state.name)
            del state.bands[pool_name]
            if pool is not None and pool.held is not None and pool.held[1] == state.name:
                pool.held = None
        if want is not None and spec is not None:
            want.members[state.name] = None
            want.fair.on_backlogged(state.name, spec.weight)
            state.bands[pool_name] = want

    def _sync_all(self, state: _Tenant) -> None:
        for pool_name in list(state.queues):
            self._sync(state, pool_name)

    # --- submit ---------------------------------------------------------------------------------

    def _check(self, ticket: Ticket, now: float) -> Rejection | None:
        spec = self._policy.tenant(ticket.tenant)
        if spec is None:
            return _reject(ticket, Outcome.UNAUTHORIZED, 403, None, _unknown_tenant(ticket.tenant))
        pool = self._pools.get(ticket.pool)
        if pool is None or pool.retired:
            message = f"pool {ticket.pool!r} is not in the policy"
            return _reject(ticket, Outcome.UNAVAILABLE, 503, None, message)
        if ticket.request_id in self._entries:
            message = f"request id {ticket.request_id!r} is already queued"
            return _reject(ticket, Outcome.BAD_REQUEST, 400, None, message)
        budget = ticket.budget
        if not pool.capacity.can_ever_fit(budget):
            message = (
                f"request needs {budget} tokens (prompt + max_tokens), more than pool "
                f"{ticket.pool!r} ever admits at once; lower max_tokens or shorten the prompt"
            )
            return _reject(ticket, Outcome.BAD_REQUEST, 400, None, message)

        state = self._tenant(ticket.tenant)
        rank = self._rank(spec)
        queue = state.queues.get(ticket.pool)
        if queue is None:
            queue = state.queues[ticket.pool] = _TenantQueue()
        deadline = math.inf if ticket.deadline is None else ticket.deadline
        key: SortKey = (-ticket.priority, deadline, now, self._seq + 1)
        rpm, tpm = self._buckets(ticket.tenant, spec)

        if state.queued >= spec.limits.max_queued and not self._dispatchable_now(
            state, spec, pool, rank, budget
        ):
            retry = self._queue_full_retry_after(state, now)
            message = (
                f"tenant {ticket.tenant!r} already has {state.queued} requests queued "
                f"(max_queued {spec.limits.max_queued}); retry after {retry}s"
            )
            peeked = self._peek_headers(rpm, tpm, now)
            return _reject(ticket, Outcome.REJECTED_QUEUE_FULL, 429, retry, message, peeked)

        if ticket.deadline is not None:
            if ticket.deadline <= now:
                message = "the request's deadline has already passed"
                retry = self._backlog_retry_after(pool, rank, spec.limits.max_queue_wait, now)
                return _reject(ticket, Outcome.SHED, 503, retry, message)
            eta = self._earliest_start(pool, rank, queue, key, ticket.deadline, now)
            if eta is not None:
                retry = self._backlog_retry_after(pool, rank, spec.limits.max_queue_wait, now)
                message = (
                    f"pool {ticket.pool!r} cannot start the request before its deadline "
                    f"(earliest in {eta - now:.1f}s, deadline in {ticket.deadline - now:.1f}s)"
                )
                return _reject(ticket, Outcome.SHED, 503, retry, message)

        return None

    def rate_takes(self, ticket: Ticket) -> list[Take]:
        """The bucket charges `submit` makes for the ticket (requests, then tokens)."""
        spec = self._policy.tenant(ticket.tenant)
        if spec is None:
            return []
        rpm, tpm = self._buckets(ticket.tenant, spec)
        takes: list[Take] = []
        if rpm is not None:
            takes.append(Take(rpm, 1.0))
        if tpm is not None:
            takes.append(Take(tpm, float(ticket.budget)))
        return takes

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
        spec = self._policy.tenants[ticket.tenant]
        budget = ticket.budget
        state = self._tenant(ticket.tenant)
        queue = state.queues.get(ticket.pool)
        if queue is None:
            queue = state.queues[ticket.pool] = _TenantQueue()
        self._seq += 1
        deadline = math.inf if ticket.deadline is None else ticket.deadline
        key: SortKey = (-ticket.priority, deadline, now, self._seq)
        rpm, tpm = self._buckets(ticket.tenant, spec)
        headers: dict[str, str] = {}
        takes = self.rate_takes(ticket)
        if takes:
            result = self.store.try_take(takes, now)
            levels = dict(zip((t.bucket.key for t in takes), result.levels, strict=True))
            headers = ratelimit_headers(
                None if rpm is None else (rpm, levels[rpm.key]),
                None if tpm is None else (tpm, levels[tpm.key]),
            )
            if not result.ok:
                return self._rate_rejection(ticket, takes, result.levels, result.wait_s, headers)

        entry = _Entry(
            ticket=ticket,
            seq=self._seq,
            key=key,
            enqueued_at=now,
            expires_at=now + spec.limits.max_queue_wait,
            headers=headers,
            charged_requests=rpm is not None,
            charged_tokens=budget if tpm is not None else 0,
        )
        queue.push(entry)
        state.queued += 1
        state.arrivals.append(entry)
        self._entries[ticket.request_id] = entry
        heappush(self._expiries, (entry.expires_at, entry.seq, entry))
        if ticket.deadline is not None:
            self._with_deadline += 1
            heappush(self._deadlines, (ticket.deadline, entry.seq, entry))
        self._sync(state, ticket.pool)
        return None

    def _rate_rejection(
        self,
        ticket: Ticket,
        takes: list[Take],
        levels: tuple[float, ...],
        wait_s: float | None,
        headers: dict[str, str],
    ) -> Rejection:
        names = {"requests": "requests_per_minute", "tokens": "tokens_per_minute"}
        if wait_s is None:
            over = next(t for t in takes if t.cost > t.bucket.capacity)
            limit = names[over.bucket.key.rsplit(":", 1)[1]]
            message = (
                f"request needs {int(over.cost)} tokens (prompt + max_tokens) but tenant "
                f"{ticket.tenant!r} has {limit} {int(over.bucket.capacity)}: it can never pass; "
                "lower max_tokens or shorten the prompt"
            )
            return _reject(ticket, Outcome.REJECTED_RATE, 429, None, message, headers)
        short = [
            names[t.bucket.key.rsplit(":", 1)[1]]
            for t, level in zip(takes, levels, strict=True)
            if level < t.cost
        ]
        retry = retry_after_seconds(wait_s)
        message = (
            f"rate limit reached for tenant {ticket.tenant!r} ({', '.join(short)}); "
            f"retry after {retry}s"
        )
        return _reject(ticket, Outcome.REJECTED_RATE, 429, retry, message, headers)

    def _peek_headers(self, rpm: Bucket | None, tpm: Bucket | None, now: float) -> dict[str, str]:
        return ratelimit_headers(
            None if rpm is None else (rpm, self.store.level(rpm, now)),
            None if tpm is None else (tpm, self.store.level(tpm, now)),
        )

    def _dispatchable_now(
        self, state: _Tenant, spec: Tenant, pool: _Pool, rank: int, budget: int
    ) -> bool:
        """Would a new request go straight through (so it never occupies a queue slot)?"""
        if not self._below_concurrency(state, spec) or not pool.capacity.fits(budget):
            return False
        if pool.held is not None and pool.held[0] <= rank:
            return False
        return all(not band.members for band in pool.bands[: rank + 1])

    # --- dispatch -------------------------------------------------------------------------------

    def dispatch(self) -> list[Admission]:
        """Admit every request that may go now, in order."""
        if not self._entries:
            return []  # nothing queued anywhere
        now = self.clock.now()
        admitted: list[Admission] = []
        # An admission in one pool can change another pool's options (a tenant reaching its
        # max_concurrency leaves every band and lifts a hold it had elsewhere), so go round
        # again until a whole pass admits nothing.
        progressed = True
        while progressed:
            before = len(admitted)
            for pool in self._pools.values():
                if pool.retired or not pool.waiting:
                    continue
                capacity = pool.capacity
                while capacity.has_slot():
                    entry = self._choose(pool)
                    if entry is None:
                        break
                    admitted.append(self._admit(pool, entry, now))
                while pool.waiting and not capacity.has_slot() and capacity.has_headroom():
                    entry = self._choose_headroom(pool)
                    if entry is None:
                        break
                    admitted.append(self._admit(pool, entry, now))
            progressed = len(admitted) > before and len(self._pools) > 1
        return admitted

    def _choose(self, pool: _Pool) -> _Entry | None:
        """The next request for the pool: the highest tier with an admissible request, then
        that band's fair-share pick. Honours the pool's hold, and sets one when a blocked head
        has been overtaken `max_bypass` times."""
        capacity = pool.capacity
        held = pool.held
        blocked: list[tuple[int, str, _Entry]] = []
        for band in pool.bands:
            if not band.members:
                continue
            candidates: list[tuple[str, float]] = []
            if held is not None and band.rank == held[0]:
                head = self._tenants[held[1]].queues[pool.name].head()
                if not capacity.fits(head.ticket.budget):
                    return None
                candidates.append((held[1], 0.0))
            else:
                for name in band.members:
                    head = self._tenants[name].queues[pool.name].head()
                    if capacity.fits(head.ticket.budget):
                        candidates.append((name, self._fair_cost(head.ticket)))
                    else:
                        blocked.append((band.rank, name, head))
                if not candidates:
                    continue
            if self._max_bypass is not None and blocked:
                for rank, name, head in blocked:
                    if head.bypassed >= self._max_bypass:
                        pool.held = (rank, name)
                        return self._choose(pool)
                for _rank, _name, head in blocked:
                    head.bypassed += 1
            chosen = candidates[0][0] if held is not None and band.rank == held[0] else None
            if chosen is None:
                chosen = band.fair.pick(candidates)
            return self._tenants[chosen].queues[pool.name].head()
        return None

    def _choose_headroom(self, pool: _Pool) -> _Entry | None:
        """Above the soft limit, up to the hard one: the next request of a tenant below its
        fair share of the pool, in tier order, then fair-share order. A hold keeps lower
        tiers and the held tier's other tenants out; no bypass is counted here."""
        capacity = pool.capacity
        held = pool.held
        below = self._light_tenants(pool)
        if not below:
            return None
        for band in pool.bands:
            if held is not None and band.rank > held[0]:
                return None
            candidates: list[tuple[str, float]] = []
            for name in band.members:
                if name not in below or (
                    held is not None and band.rank == held[0] and name != held[1]
                ):
                    continue
                head = self._tenants[name].queues[pool.name].head()
                if capacity.fits_headroom(head.ticket.budget):
                    candidates.append((name, self._fair_cost(head.ticket)))
            if candidates:
                chosen = candidates[0][0] if len(candidates) == 1 else band.fair.pick(candidates)
                return self._tenants[chosen].queues[pool.name].head()
        return None

    def _light_tenants(self, pool: _Pool) -> set[str]:
        """Queued tenants of the pool whose whole demand (admitted plus queued token budgets)
        is within their weighted share of the pool's admitted work: the tenants a max-min fair
        allocation serves in full. Shares are over the tenants active in the pool (queued or
        admitted), all tiers together. A backlogged heavy tenant is never light."""
        weights: dict[str, float] = {}
        for name in (*pool.waiting, *pool.users):
            spec = self._policy.tenant(name)
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
            demand = users.get(name, _NONE)[1] + self._tenants[name].queues[pool.name].tokens
            if demand <= work * weight / total:
                light.add(name)
        return light

    def _admit(self, pool: _Pool, entry: _Entry, now: float) -> Admission:
        ticket = entry.ticket
        state = self._tenants[ticket.tenant]
        spec = self._policy.tenants[ticket.tenant]
        queue = state.queues[pool.name]
        queue.pop_head()
        if pool.held is not None and pool.held[1] == state.name:
            pool.held = None
        del self._entries[ticket.request_id]
        state.queued -= 1
        if ticket.deadline is not None:
            self._with_deadline -= 1
        budget = ticket.budget
        pool.capacity.acquire(budget)
        used = pool.users.setdefault(state.name, [0, 0])
        used[0] += 1
        used[1] += budget
        state.inflight += 1
        state.inflight_tokens += budget
        cost = self._fair_cost(ticket)
        state.bands[pool.name].fair.on_dispatch(state.name, cost)
        self._lease_seq += 1
        lease = Lease(
            lease_id=self._lease_seq,
            request_id=ticket.request_id,
            tenant=ticket.tenant,
            pool=pool.name,
            tier=spec.tier,
            budget=budget,
            admitted_at=now,
            expires_at=now + self._policy.source.gateway.lease_timeout,
        )
        reserved = ticket.max_output_tokens if self._reserve_output else 0
        self._leases[lease.lease_id] = _LeaseState(lease, ticket, reserved, cost, entry=entry)
        heappush(self._lease_expiries, (lease.expires_at, lease.lease_id))
        self._compact_timers()
        state.dispatches.record(now)
        state.served_requests += 1
        state.served_tokens += budget
        if self._below_concurrency(state, spec):
            self._sync(state, pool.name)
        else:
            self._sync_all(state)
        return Admission(ticket, lease, now - entry.enqueued_at, entry.headers)

    # --- shared-state hooks ---------------------------------------------------------------------

    def requeue(self, lease_id: int, *, park: bool = False) -> bool:
        """Undo an admission that was only tentative (a global gate refused it).

        The request goes back to its tenant's queue with its original order key (so it keeps
        its place and its queue-wait expiry), the pool capacity and tenant concurrency it took
        are freed, and its fair-share charge is reversed. It does not count as a completion.
        With `park`, the tenant is parked in that pool (see `park`). False if the lease is
        unknown or did not come from the queue.
        """
        held = self._leases.get(lease_id)
        if held is None or held.entry is None:
            return False
        pool = self._pools.get(held.lease.pool)
        if pool is None or pool.retired or self._policy.tenant(held.ticket.tenant) is None:
            return False  # nowhere to go back to: the caller releases it instead
        del self._leases[lease_id]
        entry, ticket, lease = held.entry, held.ticket, held.lease
        state = self._tenants[ticket.tenant]
        band = self._band_of(ticket.tenant, lease.pool)
        if band is not None and held.fair_charged:
            band.fair.charge(ticket.tenant, -held.fair_charged)
        state.served_requests -= 1
        state.served_tokens -= lease.budget
        self._free(held)
        state = self._tenant(ticket.tenant)
        queue = state.queues.get(ticket.pool)
        if queue is None:
            queue = state.queues[ticket.pool] = _TenantQueue()
        entry.alive = True
        queue.push(entry)
        state.queued += 1
        state.arrivals.appendleft(entry)
        self._entries[ticket.request_id] = entry
        heappush(self._expiries, (entry.expires_at, entry.seq, entry))
        if ticket.deadline is not None:
            self._with_deadline += 1
            heappush(self._deadlines, (ticket.deadline, entry.seq, entry))
        if park:
            self._parked.add((ticket.pool, ticket.tenant))
        self._sync_all(state)
        return True

    def park(self, pool: str, tenant: str) -> None:
        """Stop the tenant competing for the pool (it stays queued, its requests still expire)
        until `unpark`: it waits for something outside this scheduler, e.g. a global limit."""
        self._parked.add((pool, tenant))
        state = self._tenants.get(tenant)
        if state is not None:
            self._sync(state, pool)

    def unpark(self, pool: str | None = None, tenant: str | None = None) -> int:
        """Let parked tenants compete again (all of them, or those of a pool and/or a tenant);
        returns how many were unparked. Call `dispatch()` afterwards."""
        chosen = [
            (p, t)
            for p, t in self._parked
            if (pool is None or p == pool) and (tenant is None or t == tenant)
        ]
        for item in chosen:
            self._parked.discard(item)
            state = self._tenants.get(item[1])
            if state is not None:
                self._sync(state, item[0])
        return len(chosen)

    def parked(self) -> set[tuple[str, str]]:
        """(pool, tenant) pairs parked now."""
        return set(self._parked)

    def backlogged(self) -> list[tuple[str, int, str]]:
        """(pool, tier rank, tenant) for every tenant competing for a pool now: it has queued
        requests there, is below its concurrency limit and is not parked."""
        return [
            (pool.name, band.rank, name)
            for pool in self._pools.values()
            if not pool.retired
            for band in pool.bands
            for name in band.members
        ]

    def queued_tenants(self, pool: str) -> list[str]:
        """Tenants with requests queued for the pool (competing, parked or over concurrency)."""
        state = self._pools.get(pool)
        return [] if state is None else list(state.waiting)

    # --- leaving the queue ----------------------------------------------------------------------

    def cancel(self, request_id: str) -> bool:
        """The client went away while queued: drop the request and refund its charge."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        self._remove(entry, self.clock.now(), refund=True)
        return True

    def reject_all_queued(self, retry_after_s: int, message: str) -> list[Rejection]:
        """Answer every queued request (graceful drain): 503, refunded, queues left empty."""
        now = self.clock.now()
        out = []
        for entry in list(self._entries.values()):
            self._remove(entry, now, refund=True)
            out.append(_reject(entry.ticket, Outcome.UNAVAILABLE, 503, retry_after_s, message))
        return out

    def _remove(self, entry: _Entry, now: float, *, refund: bool) -> None:
        ticket = entry.ticket
        state = self._tenants[ticket.tenant]
        state.queues[ticket.pool].discard(entry)
        del self._entries[ticket.request_id]
        state.queued -= 1
        if ticket.deadline is not None:
            self._with_deadline -= 1
        if refund:
            spec = self._policy.tenant(ticket.tenant)
            if spec is not None:
                rpm, tpm = self._buckets(ticket.tenant, spec)
                if rpm is not None and entry.charged_requests:
                    self.store.give_back(rpm, 1.0, now)
                if tpm is not None and entry.charged_tokens:
                    self.store.give_back(tpm, float(entry.charged_tokens), now)
        self._sync(state, ticket.pool)

    # --- leases ---------------------------------------------------------------------------------

    def charge_output(self, lease_id: int, tokens: int) -> bool:
        """Output tokens streamed for an admitted request (a delta, not a running total)."""
        held = self._leases.get(lease_id)
        if held is None:
            return False
        if tokens <= 0:
            return True
        held.output_seen += tokens
        extra = held.output_seen - held.charged_output
        if extra > 0:
            held.charged_output = held.output_seen
            cost = self._policy.source.fairness.output_weight * extra
            held.fair_charged += cost
            band = self._band_of(held.lease.tenant, held.lease.pool)
            if band is not None:
                band.fair.charge(held.lease.tenant, cost)
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
        held = self._leases.pop(lease_id, None)
        if held is None:
            return False
        now = self.clock.now()
        if actual_input_tokens is not None or actual_output_tokens is not None:
            self._settle(held, actual_input_tokens, actual_output_tokens, now)
        pool = self._pools.get(held.lease.pool)
        if pool is not None:
            pool.drain.record(now)
        self._free(held)
        return True

    def _band_of(self, tenant: str, pool_name: str) -> _Band | None:
        spec = self._policy.tenant(tenant)
        pool = self._pools.get(pool_name)
        if spec is None or pool is None:
            return None
        return pool.bands[self._rank(spec)]

    def _settle(
        self, held: _LeaseState, actual_in: int | None, actual_out: int | None, now: float
    ) -> None:
        ticket = held.ticket
        in_tokens = ticket.input_tokens if actual_in is None else max(0, actual_in)
        out_tokens = ticket.max_output_tokens if actual_out is None else max(0, actual_out)
        fairness = self._policy.source.fairness
        fair_out = max(held.charged_output, held.output_seen) if actual_out is None else out_tokens
        final = fairness.input_weight * in_tokens + fairness.output_weight * fair_out
        self._charge_difference(
            ticket.tenant,
            held.lease.pool,
            in_tokens + out_tokens - ticket.budget,
            final - held.fair_charged,
            now,
        )

    def correct_usage(self, tenant: str, pool: str, input_delta: int, output_delta: int) -> None:
        """A settled request's count turned out different (extproc.service.reconcile): move
        the tenant's token bucket and fair-share counter by the difference."""
        fairness = self._policy.source.fairness
        cost = fairness.input_weight * input_delta + fairness.output_weight * output_delta
        self._charge_difference(tenant, pool, input_delta + output_delta, cost, self.clock.now())

    def _charge_difference(
        self, tenant: str, pool: str, delta_tokens: int, delta_cost: float, now: float
    ) -> None:
        """Move a tenant's served tokens, token bucket and fair-share counter by what its
        real usage differs from what was charged."""
        state = self._tenants.get(tenant)
        if state is not None:
            state.served_tokens += delta_tokens
        spec = self._policy.tenant(tenant)
        if spec is not None and delta_tokens != 0:
            _rpm, tpm = self._buckets(tenant, spec)
            if tpm is not None:
                self.store.adjust(tpm, float(delta_tokens), now)
        band = self._band_of(tenant, pool)
        if band is not None and delta_cost != 0:
            band.fair.charge(tenant, delta_cost)

    def pool_inflight(self, pool: str) -> int:
        """Requests admitted to the pool and not yet released."""
        found = self._pools.get(pool)
        return 0 if found is None else found.capacity.inflight

    def _free(self, held: _LeaseState) -> None:
        lease = held.lease
        state = self._tenants[lease.tenant]
        spec = self._policy.tenant(lease.tenant)
        was_blocked = spec is not None and not self._below_concurrency(state, spec)
        state.inflight -= 1
        state.inflight_tokens -= lease.budget
        pool = self._pools[lease.pool]
        pool.capacity.release(lease.budget)
        used = pool.users.get(lease.tenant)
        if used is not None:
            used[0] -= 1
            used[1] -= lease.budget
            if used[0] <= 0:
                del pool.users[lease.tenant]
        if pool.retired and pool.capacity.inflight == 0:
            del self._pools[lease.pool]
        if was_blocked:
            self._sync_all(state)
        if spec is None and state.inflight == 0 and state.queued == 0:
            del self._tenants[lease.tenant]

    def reclaim_expired_leases(self) -> int:
        """Free leases past their expiry (their release was lost); returns how many."""
        now = self.clock.now()
        heap = self._lease_expiries
        count = 0
        while heap and heap[0][0] <= now:
            _at, lease_id = heappop(heap)
            held = self._leases.pop(lease_id, None)
            if held is not None:
                self._free(held)
                count += 1
        self.reclaimed_leases += count
        return count

    # --- time -----------------------------------------------------------------------------------

    def poll(self) -> list[Rejection]:
        """Reclaim expired leases, expire and shed queued requests; returns their rejections."""
        self.reclaim_expired_leases()
        now = self.clock.now()
        out: list[Rejection] = []
        while self._expiries and self._expiries[0][0] <= now:
            _at, _seq, entry = heappop(self._expiries)
            if entry.alive:
                out.append(self._expire(entry, now))
        while self._deadlines and self._deadlines[0][0] <= now:
            _at, _seq, entry = heappop(self._deadlines)
            if entry.alive:
                out.append(self._shed(entry, now, "the request's deadline passed while queued"))
        if self._with_deadline and now >= self._next_shed_scan:
            self._next_shed_scan = now + self._shed_interval
            self._shed_doomed(now, out)
        return out

    def next_deadline(self) -> float | None:
        """The earliest clock time at which `poll()` has work, if nothing else happens first."""
        times: list[float] = []
        for heap in (self._expiries, self._deadlines):
            while heap and not heap[0][2].alive:
                heappop(heap)
            if heap:
                times.append(heap[0][0])
        leases = self._lease_expiries
        while leases and leases[0][1] not in self._leases:
            heappop(leases)
        if leases:
            times.append(leases[0][0])
        if self._with_deadline and self._may_shed():
            times.append(max(self._next_shed_scan, self.clock.now()))
        return min(times) if times else None

    def _may_shed(self) -> bool:
        """Whether a pool with queued requests has a drain rate to judge deadlines by."""
        now = self.clock.now()
        return any(
            pool.waiting and not pool.retired and pool.drain.rate(now) is not None
            for pool in self._pools.values()
        )

    def _expire(self, entry: _Entry, now: float) -> Rejection:
        ticket = entry.ticket
        self._remove(entry, now, refund=True)
        spec = self._policy.tenant(ticket.tenant)
        wait_limit = spec.limits.max_queue_wait if spec is not None else 1.0
        retry = self._retry_for(ticket, wait_limit, now)
        message = (
            f"request waited {now - entry.enqueued_at:.1f}s without a turn "
            f"(max_queue_wait {wait_limit:g}s); the service is busy"
        )
        return _reject(ticket, Outcome.EXPIRED, 503, retry, message)

    def _shed(self, entry: _Entry, now: float, message: str) -> Rejection:
        ticket = entry.ticket
        self._remove(entry, now, refund=True)
        spec = self._policy.tenant(ticket.tenant)
        wait_limit = spec.limits.max_queue_wait if spec is not None else 1.0
        return _reject(ticket, Outcome.SHED, 503, self._retry_for(ticket, wait_limit, now), message)

    def _retry_for(self, ticket: Ticket, wait_limit: float, now: float) -> int:
        spec = self._policy.tenant(ticket.tenant)
        pool = self._pools.get(ticket.pool)
        if spec is None or pool is None:
            return 1
        return self._backlog_retry_after(pool, self._rank(spec), wait_limit, now)

    # --- estimates ------------------------------------------------------------------------------

    def _queued_ahead_by_rank(self, pool: _Pool) -> list[int]:
        """For each tier rank, how many requests of backlogged tenants of higher tiers wait."""
        ahead: list[int] = []
        total = 0
        for band in pool.bands:
            ahead.append(total)
            for name in band.members:
                total += self._tenants[name].queues[pool.name].live
        ahead.append(total)
        return ahead

    def _earliest_start(
        self, pool: _Pool, rank: int, queue: _TenantQueue, key: SortKey, deadline: float, now: float
    ) -> float | None:
        """An optimistic admission time from the pool's drain rate when it is past `deadline`,
        else None (also when the rate is unknown or the request could start now).

        Only requests certainly ahead count: higher tiers' backlog and the tenant's own
        requests before this one. Each needs one completion once the pool's free slots are
        used, so the estimate is a lower bound and shedding only hits the truly doomed.
        """
        rate = pool.drain.rate(now)
        if rate is None or rate <= 0:
            return None
        base = self._queued_ahead_by_rank(pool)[rank] + 1 - pool.capacity.free_slots()
        if now + (base + queue.live) / rate <= deadline:
            return None  # met even behind all of its tenant's queue: skip counting
        need = base + queue.count_before(key)
        if need <= 0 or now + need / rate <= deadline:
            return None
        return now + need / rate

    def _shed_doomed(self, now: float, out: list[Rejection]) -> None:
        doomed: list[_Entry] = []
        for pool in self._pools.values():
            if pool.retired or not pool.waiting:
                continue
            rate = pool.drain.rate(now)
            if rate is None or rate <= 0:
                continue
            ahead_by_rank = self._queued_ahead_by_rank(pool)
            free = pool.capacity.free_slots()
            for name in pool.waiting:
                spec = self._policy.tenant(name)
                if spec is None:
                    continue
                queue = self._tenants[name].queues[pool.name]
                if not queue.with_deadline:
                    continue
                base = ahead_by_rank[self._rank(spec)]
                for index, entry in enumerate(queue.in_order()):
                    deadline = entry.ticket.deadline
                    need = base + index + 1 - free
                    if deadline is not None and need > 0 and now + need / rate > deadline:
                        doomed.append(entry)
        for entry in doomed:
            pool_name = entry.ticket.pool
            eta = "its deadline cannot be met at the pool's current drain rate"
            out.append(self._shed(entry, now, f"pool {pool_name!r}: {eta}"))

    def _backlog_retry_after(self, pool: _Pool, rank: int, wait_limit: float, now: float) -> int:
        """Seconds for the pool to drain the backlog of this tier and above (1..max wait)."""
        rate = pool.drain.rate(now)
        if rate is None or rate <= 0:
            return 1
        backlog = self._queued_ahead_by_rank(pool)[rank + 1]
        ceiling = max(1, math.ceil(wait_limit))
        return max(1, min(ceiling, math.ceil(backlog / rate)))

    def _queue_full_retry_after(self, state: _Tenant, now: float) -> int:
        """Seconds until one of the tenant's queue slots frees: its next dispatch (from its
        dispatch rate) or its oldest request's expiry, whichever comes first."""
        waits: list[float] = []
        rate = state.dispatches.rate(now)
        if rate is not None and rate > 0:
            waits.append(1.0 / rate)
        oldest = state.oldest()
        if oldest is not None:
            waits.append(max(0.0, oldest.expires_at - now))
        return retry_after_seconds(min(waits)) if waits else 1

    # --- policy ---------------------------------------------------------------------------------

    def update_policy(self, policy: Policy) -> list[Rejection]:
        """Hot reload. New limits and weights apply at once; in-flight leases are kept.

        Queued requests of removed tenants (or for removed pools) are returned as rejections.
        Changing the tier list or the fairness settings restarts fair-share state.
        """
        now = self.clock.now()
        old = self._policy
        self._policy = policy
        out: list[Rejection] = []
        for name, pool_spec in policy.pools.items():
            pool = self._pools.get(name)
            if pool is None:
                self._pools[name] = self._new_pool(name, pool_spec)
            else:
                pool.capacity.update(pool_spec)
                pool.retired = False
        for name, pool in list(self._pools.items()):
            if name not in policy.pools:
                pool.retired = True
                pool.held = None
                if pool.capacity.inflight == 0:
                    del self._pools[name]
        if old.source.tiers != policy.source.tiers or old.source.fairness != policy.source.fairness:
            for state in self._tenants.values():
                state.bands.clear()
            for pool in self._pools.values():
                pool.bands = self._new_bands()
                pool.held = None
        for entry in list(self._entries.values()):
            ticket = entry.ticket
            if policy.tenant(ticket.tenant) is None:
                self._remove(entry, now, refund=False)
                message = f"tenant {ticket.tenant!r} was removed from the policy while queued"
                out.append(_reject(ticket, Outcome.UNAUTHORIZED, 403, None, message))
            elif ticket.pool not in policy.pools:
                self._remove(entry, now, refund=True)
                message = f"pool {ticket.pool!r} was removed from the policy while queued"
                out.append(_reject(ticket, Outcome.UNAVAILABLE, 503, 1, message))
        for state in list(self._tenants.values()):
            spec = policy.tenant(state.name)
            for pool_name, band in list(state.bands.items()):
                if spec is None or band.tier != spec.tier:
                    del band.members[state.name]
                    band.fair.forget(state.name)
                    del state.bands[pool_name]
                    pool = self._pools.get(pool_name)
                    if pool is not None and pool.held is not None and pool.held[1] == state.name:
                        pool.held = None
                else:
                    band.fair.set_weight(state.name, spec.weight)
            self._sync_all(state)
            if spec is None and state.inflight == 0 and state.queued == 0:
                del self._tenants[state.name]
        self._rebuild_timers()
        self.membership_version += 1
        return out

    def _compact_timers(self) -> None:
        """Drop timer entries of requests and leases that are gone, once they dominate."""
        if len(self._lease_expiries) > 4 * len(self._leases) + 1024:
            self._lease_expiries = [
                (held.lease.expires_at, lease_id) for lease_id, held in self._leases.items()
            ]
            heapify(self._lease_expiries)
        if max(len(self._expiries), len(self._deadlines)) > 4 * len(self._entries) + 1024:
            self._rebuild_timers()

    def _rebuild_timers(self) -> None:
        entries = self._entries.values()
        for entry in entries:
            spec = self._policy.tenants[entry.ticket.tenant]
            entry.expires_at = entry.enqueued_at + spec.limits.max_queue_wait
        self._expiries = [(e.expires_at, e.seq, e) for e in entries]
        heapify(self._expiries)
        self._deadlines = [
            (e.ticket.deadline, e.seq, e) for e in entries if e.ticket.deadline is not None
        ]
        heapify(self._deadlines)

    # --- introspection --------------------------------------------------------------------------

    def lease(self, lease_id: int) -> Lease | None:
        held = self._leases.get(lease_id)
        return None if held is None else held.lease

    def queued(self) -> int:
        return len(self._entries)

    def inflight(self) -> int:
        return len(self._leases)

    def snapshot(self) -> dict[str, Any]:
        """Live per-tenant and per-pool state, JSON-ready (admin endpoint, tests, simulator)."""
        now = self.clock.now()
        tenants: dict[str, Any] = {}
        names: Iterable[str] = dict.fromkeys([*self._policy.tenants, *self._tenants])
        for name in names:
            spec = self._policy.tenant(name)
            state = self._tenants.get(name)
            item: dict[str, Any] = {
                "tier": spec.tier if spec is not None else None,
                "weight": spec.weight if spec is not None else None,
                "removed": spec is None,
                "queued": state.queued if state else 0,
                "inflight": state.inflight if state else 0,
                "inflight_tokens": state.inflight_tokens if state else 0,
                "served_requests": state.served_requests if state else 0,
                "served_tokens": state.served_tokens if state else 0,
            }
            if spec is not None:
                rpm, tpm = self._buckets(name, spec)
                buckets: dict[str, float] = {}
                if rpm is not None:
                    buckets["requests"] = self.store.level(rpm, now)
                if tpm is not None:
                    buckets["tokens"] = self.store.level(tpm, now)
                item["buckets"] = buckets
                rank = self._rank(spec)
                item["fair_share"] = {
                    pool_name: pool.bands[rank].fair.level(name)
                    for pool_name, pool in self._pools.items()
                }
                item["backlogged_pools"] = sorted(state.bands) if state else []
            tenants[name] = item
        pools: dict[str, Any] = {}
        for name, pool in self._pools.items():
            rate = pool.drain.rate(now)
            pools[name] = {
                "inflight": pool.capacity.inflight,
                "inflight_tokens": pool.capacity.inflight_tokens,
                "queued": sum(self._tenants[t].queues[name].live for t in pool.waiting),
                **pool.capacity.describe(),
                "drain_rate": rate,
                "held_for": None
                if pool.held is None
                else {"tier": pool.bands[pool.held[0]].tier, "tenant": pool.held[1]},
                "retired": pool.retired,
            }
        return {
            "tenants": tenants,
            "pools": pools,
            "queued": len(self._entries),
            "leases": len(self._leases),
            "reclaimed_leases": self.reclaimed_leases,
            "fairness": self._policy.source.fairness.policy,
        }


def _unknown_tenant(name: str) -> str:
    return f"tenant {name!r} is not in the policy"


def _reject(
    ticket: Ticket,
    outcome: Outcome,
    status: int,
    retry_after_s: int | None,
    message: str,
    headers: dict[str, str] | None = None,
) -> Rejection:
    return Rejection(
        request_id=ticket.request_id,
        tenant=ticket.tenant,
        outcome=outcome,
        http_status=status,
        retry_after_s=retry_after_s,
        message=message,
        headers=headers or {},
    )
