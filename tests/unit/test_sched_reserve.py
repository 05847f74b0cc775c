"""The headroom's reserve (extproc/scheduler/dispatch.py, adaptive.py): when the adaptive soft
limit is cut below what is in flight, a light tenant still gets up to `headroom` requests in
at once, instead of waiting for the backlogged tenants' requests to drain down to the cut."""

from __future__ import annotations

from extproc.policy import Policy, policy_from_text
from extproc.scheduler import ManualClock, Scheduler, Ticket
from extproc.scheduler.adaptive import AdaptiveSettings, EngineCapacities, EngineSample

HEADROOM = 2


def _policy(pool_keys: str) -> Policy:
    return policy_from_text(f"""\
version: 1
tiers: [standard]
tenants:
  flood: {{tier: standard, limits: {{max_queued: 1000}}}}
  quiet: {{tier: standard, limits: {{max_queued: 1000}}}}
pools:
  p: {{max_total_tokens: 100000, max_inflight_tokens: 10000000, endpoints: ["127.0.0.1:1"],
      prefill_budget_tokens: 0, {pool_keys}}}
""")


def _cut_pool() -> tuple[Scheduler, EngineCapacities, list[int]]:
    """The flooder holds 10 requests under a soft limit of 10; then the engines report a
    queue and the limit is cut to 9 (hard limit 9 + 2 = 11), then to 8 (hard 10): what is
    in flight, 10, is at the hard limit."""
    settings = AdaptiveSettings(
        initial_inflight=10, headroom=HEADROOM, decrease=0.9, cooldown_s=0.0, smoothing=1.0
    )
    capacities = EngineCapacities({"p": settings})
    clock = ManualClock(0.0)
    sched = Scheduler(_policy("max_inflight: 64"), clock, capacity_factory=capacities.factory)
    for i in range(40):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    flood = [a.lease.lease_id for a in sched.dispatch()]
    assert len(flood) == 10
    capacity = capacities.adaptive["p"]
    for at in (1.0, 2.0):
        clock.advance(1.0)
        capacity.observe(EngineSample(at=at, waiting=20.0, running=10.0, kv_usage=0.5))
    assert capacity.soft_limit() == 8 and capacity.hard_limit() == 10 == capacity.inflight
    return sched, capacities, flood


def test_a_light_tenant_takes_the_reserve_when_the_limit_was_cut_under_it() -> None:
    sched, _, flood = _cut_pool()
    assert sched.dispatch() == []  # the flooder waits for the drain to the cut limit
    for i in range(HEADROOM + 1):
        assert sched.submit(Ticket(f"q{i}", "quiet", "p", 100, 100)) is None
    admitted = sched.dispatch()
    assert [a.ticket.request_id for a in admitted] == ["q0", "q1"]  # the reserve: 2
    assert sched.snapshot()["pools"]["p"]["reserve_inflight"] == HEADROOM
    assert sched.dispatch() == []  # the third waits: the reserve is full
    sched.release(admitted[0].lease.lease_id)
    assert [a.ticket.request_id for a in sched.dispatch()] == ["q2"]
    # Releasing a flooder request frees no reserve slot and, at 11 in flight over a hard
    # limit of 10, admits nobody.
    sched.release(flood[0])
    assert sched.dispatch() == []


def test_the_reserve_is_only_for_light_tenants() -> None:
    sched, _, _ = _cut_pool()
    assert sched.submit(Ticket("late", "flood", "p", 100, 100)) is None
    assert sched.dispatch() == []


def test_a_static_pool_has_no_reserve_beyond_its_hard_limit() -> None:
    policy = _policy("max_inflight: 6, headroom: 2, adaptive: {enabled: false}")
    sched = Scheduler(policy, ManualClock(0.0))
    for i in range(10):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    assert len(sched.dispatch()) == 4  # the soft limit
    went = []
    for i in range(3):  # one at a time, so the quiet tenant stays within its share
        assert sched.submit(Ticket(f"q{i}", "quiet", "p", 100, 100)) is None
        went += [a.ticket.request_id for a in sched.dispatch()]
    assert went == ["q0", "q1"]  # the headroom; then the hard limit, max_inflight: no reserve
