"""Property tests over random workloads, checked against an independent model.

The model tracks what the test itself submitted, admitted and released, and recomputes every
rule from the policy: tenant order, strict tiers, capacity, concurrency, work conservation,
bounded waiting, lease accounting. The scheduler's internals are never consulted except for the
pool hold reported by `snapshot()` (the one documented exception to work conservation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_support import FAIRNESS, make_policy, scheduler

from extproc.policy import Policy
from extproc.scheduler import Admission, ManualClock, Scheduler, Ticket
from extproc.types import Outcome

TIERS = ("gold", "silver", "bronze")
INF = math.inf


@dataclass
class Queued:
    ticket: Ticket
    arrival: float
    seq: int

    @property
    def key(self) -> tuple[int, float, float, int]:
        deadline = INF if self.ticket.deadline is None else self.ticket.deadline
        return (-self.ticket.priority, deadline, self.arrival, self.seq)


@dataclass
class Model:
    policy: Policy
    queued: dict[str, Queued] = field(default_factory=dict)
    leases: dict[int, Ticket] = field(default_factory=dict)
    pool_inflight: dict[str, int] = field(default_factory=dict)
    pool_tokens: dict[str, int] = field(default_factory=dict)
    tenant_inflight: dict[str, int] = field(default_factory=dict)
    max_bypass: int | None = None
    bypassed: dict[str, int] = field(default_factory=dict)
    seq: int = 0
    admitted: int = 0

    def rank(self, tenant: str) -> int:
        return self.policy.tier_rank[self.policy.tenants[tenant].tier]

    def head(self, tenant: str, pool: str) -> Queued | None:
        mine = [
            q for q in self.queued.values() if q.ticket.tenant == tenant and q.ticket.pool == pool
        ]
        return min(mine, key=lambda q: q.key) if mine else None

    def conc_ok(self, tenant: str) -> bool:
        limit = self.policy.tenants[tenant].limits.max_concurrency
        return limit is None or self.tenant_inflight.get(tenant, 0) < limit

    def fits(self, pool: str, budget: int) -> bool:
        spec = self.policy.pools[pool]
        return (
            self.pool_inflight.get(pool, 0) < spec.max_inflight
            and self.pool_tokens.get(pool, 0) + budget <= spec.max_inflight_tokens
        )

    def admissible_heads(self, pool: str) -> list[Queued]:
        out = []
        for tenant in self.policy.tenants:
            head = self.head(tenant, pool)
            if head is not None and self.conc_ok(tenant) and self.fits(pool, head.ticket.budget):
                out.append(head)
        return out

    def over_share(self, tenant: str, pool: str) -> bool:
        """The tenant's admitted + queued budgets in the pool above its weight's fraction (of
        the tenants active there) of every tenant's admitted + queued budgets there."""
        demand: dict[str, int] = {}
        for t in self.leases.values():
            if t.pool == pool:
                demand[t.tenant] = demand.get(t.tenant, 0) + t.budget
        for q in self.queued.values():
            if q.ticket.pool == pool:
                demand[q.ticket.tenant] = demand.get(q.ticket.tenant, 0) + q.ticket.budget
        weights = {name: self.policy.tenants[name].weight for name in demand}
        total = sum(weights.values())
        if tenant not in demand or total <= 0:
            return False
        return demand[tenant] > sum(demand.values()) * weights[tenant] / total

    def count_bypasses(self, admitted: Ticket) -> None:
        """Room-blocked heads that this admission passes over while they are owed the pool:
        every one of a higher tier, and one of the admitted request's tier when its tenant is
        not over its weighted share of the pool's admitted + queued work. (A head of a tenant
        over its share waits for its fair-share turn, which the scheduler's band policy keeps:
        the fair-share tests below check that those tenants get their weights.)"""
        rank = self.rank(admitted.tenant)
        for tenant in self.policy.tenants:
            head = self.head(tenant, admitted.pool)
            if (
                tenant == admitted.tenant
                or head is None
                or not self.conc_ok(tenant)
                or self.rank(tenant) > rank
                or self.fits(admitted.pool, head.ticket.budget)
            ):
                continue
            if self.rank(tenant) == rank and self.over_share(tenant, admitted.pool):
                continue
            rid = head.ticket.request_id
            self.bypassed[rid] = self.bypassed.get(rid, 0) + 1
            if self.max_bypass is not None:
                assert self.bypassed[rid] <= self.max_bypass, "overtaken more than max_bypass"

    def apply_admission(self, admission: Admission, held: dict[str, Any] | None) -> None:
        t = admission.ticket
        if held is None or held["tenant"] != t.tenant:
            self.count_bypasses(t)
        queued = self.queued.get(t.request_id)
        assert queued is not None, f"admitted {t.request_id} was not queued"
        head = self.head(t.tenant, t.pool)
        assert head is queued, "tenant order broken: the head must go first"
        assert self.conc_ok(t.tenant), "max_concurrency exceeded"
        assert self.fits(t.pool, t.budget), "pool capacity over-committed"
        rank = self.rank(t.tenant)
        for other in self.admissible_heads(t.pool):
            assert self.rank(other.ticket.tenant) >= rank, "a higher tier was admissible"
        assert admission.lease.lease_id not in self.leases
        del self.queued[t.request_id]
        self.leases[admission.lease.lease_id] = t
        self.pool_inflight[t.pool] = self.pool_inflight.get(t.pool, 0) + 1
        self.pool_tokens[t.pool] = self.pool_tokens.get(t.pool, 0) + t.budget
        self.tenant_inflight[t.tenant] = self.tenant_inflight.get(t.tenant, 0) + 1
        self.admitted += 1

    def apply_release(self, lease_id: int) -> None:
        t = self.leases.pop(lease_id)
        self.pool_inflight[t.pool] -= 1
        self.pool_tokens[t.pool] -= t.budget
        self.tenant_inflight[t.tenant] -= 1

    def check_work_conserving(self, snapshot: dict[str, Any]) -> None:
        for pool in self.policy.pools:
            held = snapshot["pools"][pool]["held_for"]
            for head in self.admissible_heads(pool):
                tenant = head.ticket.tenant
                assert held is not None, f"admissible {head.ticket.request_id} left waiting"
                held_rank = self.policy.tier_rank[held["tier"]]
                assert tenant != held["tenant"], "the held-for head fits but was not admitted"
                assert self.rank(tenant) >= held_rank, "a hold blocked a higher tier"

    def check_against(self, snapshot: dict[str, Any]) -> None:
        for pool in self.policy.pools:
            assert snapshot["pools"][pool]["inflight"] == self.pool_inflight.get(pool, 0)
            assert snapshot["pools"][pool]["inflight_tokens"] == self.pool_tokens.get(pool, 0)
            queued = sum(1 for q in self.queued.values() if q.ticket.pool == pool)
            assert snapshot["pools"][pool]["queued"] == queued
        for tenant in self.policy.tenants:
            assert snapshot["tenants"][tenant]["inflight"] == self.tenant_inflight.get(tenant, 0)
        assert snapshot["leases"] == len(self.leases)
        assert snapshot["queued"] == len(self.queued)


@st.composite
def workloads(
    draw: st.DrawFn, crowded: bool = False
) -> tuple[Policy, list[tuple[Any, ...]], int | None]:
    """A random policy and a random sequence of events.

    crowded: one pool with little token room, no limits and no time passing, so that big
    requests get stuck behind small ones (the case holds are for).
    """
    fairness = draw(st.sampled_from(FAIRNESS))
    n_tiers = draw(st.integers(1, 2 if crowded else 3))
    n_tenants = draw(st.integers(2, 4 if crowded else 5))
    tenants: dict[str, dict[str, Any]] = {}
    for i in range(n_tenants):
        limits: dict[str, Any] = {"max_queued": 1000, "max_queue_wait": "10m"}
        if not crowded:
            limits["max_queued"] = draw(st.sampled_from([0, 2, 5, 1000]))
            limits["max_queue_wait"] = f"{draw(st.integers(2, 60))}s"
            conc = draw(st.sampled_from([None, 1, 2, 4]))
            if conc is not None:
                limits["max_concurrency"] = conc
            if draw(st.booleans()):
                limits["tokens_per_minute"] = draw(st.integers(3000, 200_000))
            if draw(st.booleans()):
                limits["requests_per_minute"] = draw(st.integers(1, 600))
        tenants[f"t{i}"] = {
            "tier": TIERS[draw(st.integers(0, n_tiers - 1))],
            "weight": draw(st.sampled_from([0.5, 1, 2, 3])),
            "limits": limits,
        }
    pools = {
        f"p{j}": {
            "max_inflight": draw(st.integers(4, 8) if crowded else st.integers(1, 8)),
            "max_inflight_tokens": draw(st.integers(3300, 5000 if crowded else 8000)),
        }
        for j in range(1 if crowded else draw(st.sampled_from([1, 1, 2])))
    }
    policy = make_policy(
        tenants,
        fairness=fairness,
        tiers=TIERS[:n_tiers],
        pools=pools,
        quantum=draw(st.integers(100, 5000)),
        lease_timeout=f"{draw(st.integers(30, 300))}s",
    )
    submit = st.tuples(
        st.integers(0, n_tenants - 1),
        st.integers(0, len(pools) - 1),
        st.integers(0, 300) | st.integers(1000, 2500),
        st.integers(0, 800),
        st.integers(0, 3),
        st.none() if crowded else st.none() | st.integers(1, 40),
    )
    events = [
        st.tuples(st.just("submit"), st.lists(submit, min_size=1, max_size=6)),
        st.tuples(st.just("submit"), st.lists(submit, min_size=1, max_size=2)),
        st.tuples(st.just("release"), st.integers(0, 1000), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
        st.tuples(st.just("charge"), st.integers(0, 1000), st.integers(1, 300)),
    ]
    if not crowded:
        events.append(st.tuples(st.just("advance"), st.sampled_from([0.1, 0.5, 1.0, 3.0, 10.0])))
    ops = draw(st.lists(st.one_of(events), min_size=10, max_size=80))
    max_bypass = draw(
        st.sampled_from([None, 0, 3, 16]) if not crowded else st.sampled_from([0, 1, 3])
    )
    return policy, ops, max_bypass


def pump(sched: Scheduler, model: Model, clock: ManualClock) -> None:
    """What the adapter does after every event: poll, then dispatch; check everything."""
    now = clock.now()
    for rejection in sched.poll():
        q = model.queued.pop(rejection.request_id)
        if rejection.outcome is Outcome.EXPIRED:
            wait = model.policy.tenants[q.ticket.tenant].limits.max_queue_wait
            assert now - q.arrival >= wait - 1e-9
        else:
            assert rejection.outcome is Outcome.SHED
            assert q.ticket.deadline is not None
        assert rejection.http_status == 503 and (rejection.retry_after_s or 0) >= 1
    for q in model.queued.values():  # bounded waiting: nothing overdue survives poll()
        assert now - q.arrival < model.policy.tenants[q.ticket.tenant].limits.max_queue_wait
        assert q.ticket.deadline is None or q.ticket.deadline > now
    held = {name: pool["held_for"] for name, pool in sched.snapshot()["pools"].items()}
    for admission in sched.dispatch():
        pool_held = held.get(admission.ticket.pool)
        model.apply_admission(admission, pool_held)
        if pool_held is not None and pool_held["tenant"] == admission.ticket.tenant:
            held[admission.ticket.pool] = None
        assert admission.wait_s >= 0
    snapshot = sched.snapshot()
    model.check_work_conserving(snapshot)
    model.check_against(snapshot)
    next_at = sched.next_deadline()
    if model.queued:
        assert next_at is not None
        earliest_expiry = min(
            q.arrival + model.policy.tenants[q.ticket.tenant].limits.max_queue_wait
            for q in model.queued.values()
        )
        assert next_at <= earliest_expiry + 1e-9


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_random_workloads_keep_every_rule(
    workload: tuple[Policy, list[tuple[Any, ...]], int | None],
) -> None:
    policy, ops, max_bypass = workload
    sched, clock = scheduler(policy, max_bypass=max_bypass, min_drain_samples=3)
    model = Model(policy, max_bypass=max_bypass)
    tenants = list(policy.tenants)
    pools = list(policy.pools)
    released: list[int] = []
    for number, op in enumerate(ops):
        kind = op[0]
        if kind == "submit":
            for index, (ti, pi, tokens_in, tokens_out, priority, deadline_in) in enumerate(op[1]):
                t = Ticket(
                    request_id=f"r{number}-{index}",
                    tenant=tenants[ti],
                    pool=pools[pi],
                    input_tokens=tokens_in,
                    max_output_tokens=tokens_out,
                    priority=priority,
                    deadline=None if deadline_in is None else clock.now() + deadline_in,
                )
                rejection = sched.submit(t)
                if rejection is None:
                    model.seq += 1
                    model.queued[t.request_id] = Queued(t, clock.now(), model.seq)
                else:
                    assert rejection.request_id == t.request_id
                    assert rejection.outcome in {
                        Outcome.REJECTED_RATE,
                        Outcome.REJECTED_QUEUE_FULL,
                        Outcome.SHED,
                        Outcome.BAD_REQUEST,
                    }
                    if rejection.http_status == 429 and rejection.retry_after_s is not None:
                        assert rejection.retry_after_s >= 1
        elif kind == "release" and model.leases:
            for _ in range(min(op[2], len(model.leases))):
                lease_id = sorted(model.leases)[op[1] % len(model.leases)]
                t = model.leases[lease_id]
                halves = (t.input_tokens // 2, t.max_output_tokens // 3)
                actuals = halves if op[3] else (None, None)
                assert sched.release(lease_id, *actuals) is True
                model.apply_release(lease_id)
                released.append(lease_id)
        elif kind == "release" and released:
            assert sched.release(released[op[1] % len(released)]) is False
        elif kind == "advance":
            clock.advance(op[1])
            reclaimable = [
                lid
                for lid in model.leases
                if sched.lease(lid) is not None and sched.lease(lid).expires_at <= clock.now()  # type: ignore[union-attr]
            ]
            for lid in reclaimable:
                model.apply_release(lid)
        elif kind == "cancel" and model.queued:
            rid = sorted(model.queued)[op[1] % len(model.queued)]
            assert sched.cancel(rid) is True
            del model.queued[rid]
            assert sched.cancel(rid) is False
        elif kind == "charge" and model.leases:
            lease_id = sorted(model.leases)[op[1] % len(model.leases)]
            assert sched.charge_output(lease_id, op[2]) is True
        pump(sched, model, clock)

    # Drain: release everything, never advance time; every queued request must get its turn.
    for _ in range(10_000):
        if not model.leases and not model.queued:
            break
        for lease_id in list(model.leases):
            assert sched.release(lease_id) is True
            model.apply_release(lease_id)
        pump(sched, model, clock)
        assert model.leases or not model.queued, "requests wait while every pool is idle"
    assert not model.queued and not model.leases
    snapshot = sched.snapshot()
    assert snapshot["leases"] == 0 and snapshot["queued"] == 0
    for pool in snapshot["pools"].values():
        assert pool["inflight"] == 0 and pool["inflight_tokens"] == 0 and pool["held_for"] is None
        assert pool["prefilling_tokens"] == 0 and pool["prefilling_requests"] == 0
    for tenant in snapshot["tenants"].values():
        assert tenant["inflight"] == 0 and tenant["inflight_tokens"] == 0 and tenant["queued"] == 0


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads(crowded=True))
def test_crowded_pool_holds_for_big_requests(
    workload: tuple[Policy, list[tuple[Any, ...]], int | None],
) -> None:
    """Same rules where token room is scarce: a big head is overtaken <= max_bypass times."""
    test_random_workloads_keep_every_rule.hypothesis.inner_test(workload)  # type: ignore[attr-defined]


# --- fair share ---------------------------------------------------------------------------------


def fair_cost(t: Ticket) -> float:
    return t.input_tokens + 2.0 * t.max_output_tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fairness=st.sampled_from(FAIRNESS),
    weights=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=2, max_size=3),
    quantum=st.integers(200, 4000),
    slots=st.integers(1, 3),
    data=st.data(),
)
def test_backlogged_tenants_get_their_weighted_share(
    fairness: str, weights: list[int], quantum: int, slots: int, data: st.DataObject
) -> None:
    """Bounded unfairness at every admission, and weights respected in the long run."""
    names = [f"t{i}" for i in range(len(weights))]
    policy = make_policy(
        {n: {"tier": "gold", "weight": w} for n, w in zip(names, weights, strict=True)},
        fairness=fairness,
        quantum=quantum,
        pools={"p": {"max_inflight": slots, "max_inflight_tokens": 10_000_000}},
    )
    sched, clock = scheduler(policy)
    sizes = st.tuples(st.integers(1, 1500), st.integers(0, 400))
    counter = 0

    def submit(tenant: str) -> None:
        nonlocal counter
        counter += 1
        tokens_in, tokens_out = data.draw(sizes)
        t = Ticket(f"q{counter}", tenant, "p", tokens_in, tokens_out)
        assert sched.submit(t) is None

    for _ in range(3):
        for name in names:
            submit(name)
    max_cost = 1500 + 2 * 400
    # Deficit policies (drr, dlpm): a deficit stays below quantum x weight + one request.
    deficit_based = fairness in ("drr", "dlpm")
    bound = quantum + max_cost / min(weights) if deficit_based else max_cost / min(weights)
    served = dict.fromkeys(names, 0.0)
    weight = dict(zip(names, weights, strict=True))
    inflight: list[int] = []
    for _ in range(250):
        for admission in sched.dispatch():
            tenant = admission.ticket.tenant
            served[tenant] += fair_cost(admission.ticket)
            inflight.append(admission.lease.lease_id)
            submit(tenant)  # stay backlogged
            normalized = [served[n] / weight[n] for n in names]
            assert max(normalized) - min(normalized) <= bound + 1e-6
        index = data.draw(st.integers(0, len(inflight) - 1))
        clock.advance(0.1)
        assert sched.release(inflight.pop(index))
    normalized = [served[n] / weight[n] for n in names]
    if min(normalized) >= 20 * bound:
        assert max(normalized) / min(normalized) <= 1.1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fairness=st.sampled_from(FAIRNESS),
    weights=st.lists(st.sampled_from([1, 2, 3]), min_size=2, max_size=4),
    quantum=st.integers(100, 3000),
    light_cost=st.tuples(st.integers(1, 3000), st.integers(0, 500)),
    warmup=st.integers(0, 30),
    data=st.data(),
)
def test_no_starvation_inside_a_tier(
    fairness: str,
    weights: list[int],
    quantum: int,
    light_cost: tuple[int, int],
    warmup: int,
    data: st.DataObject,
) -> None:
    """A tenant arriving among flooders is served within a bound set by the policy."""
    flooders = [f"f{i}" for i in range(len(weights) - 1)]
    weight = dict(zip([*flooders, "light"], weights, strict=True))
    policy = make_policy(
        {n: {"tier": "silver", "weight": w} for n, w in weight.items()},
        fairness=fairness,
        quantum=quantum,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 10_000_000}},
    )
    sched, _clock = scheduler(policy)
    sizes = st.tuples(st.integers(50, 1500), st.integers(0, 300))
    counter = 0

    def submit(tenant: str, size: tuple[int, int] | None = None) -> Ticket:
        nonlocal counter
        counter += 1
        tokens_in, tokens_out = size or data.draw(sizes)
        t = Ticket(f"q{counter}", tenant, "p", tokens_in, tokens_out)
        assert sched.submit(t) is None
        return t

    for name in flooders:
        for _ in range(3):
            submit(name)
    lease = None

    def step() -> Admission:
        nonlocal lease
        if lease is not None:
            sched.release(lease)
        [admission] = sched.dispatch()
        lease = admission.lease.lease_id
        if admission.ticket.tenant != "light":
            submit(admission.ticket.tenant)
        return admission

    for _ in range(warmup):
        step()
    light = submit("light", light_cost)
    min_cost, max_cost = 50.0, 1500 + 2 * 300.0
    if fairness == "vtc":
        bound = len(flooders)
    else:
        visits = math.ceil(fair_cost(light) / (quantum * weight["light"])) + 1
        per_round = sum(
            math.floor((quantum * weight[f] + max_cost) / min_cost) + 1 for f in flooders
        )
        bound = visits * per_round
    others = 0
    while step().ticket != light:
        others += 1
        assert others <= bound, f"light tenant starved for {others} admissions"
