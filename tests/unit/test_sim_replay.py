"""replay_admissions: the scheduler alone, driven like the live AdmissionController."""

from __future__ import annotations

from typing import Any

from sim_support import make_policy

from extproc.scheduler import ManualClock, Scheduler, Ticket
from extproc.types import Outcome
from gateway_lab.sim.replay import ReplayArrival, replay_admissions

TENANTS: dict[str, dict[str, Any]] = {
    "g": {"tier": "gold"},
    "s1": {"tier": "silver"},
    "s2": {"tier": "silver", "limits": {"max_queue_wait": "0.5s"}},
}
ONE: dict[str, dict[str, Any]] = {"p": {"max_inflight": 1}}


def ticket(request_id: str, tenant: str, tokens: int = 100) -> Ticket:
    return Ticket(request_id, tenant, "p", tokens, tokens)


def test_tier_first_then_arrival_order() -> None:
    policy = make_policy(TENANTS, ONE)
    arrivals = [
        (0.0, ticket("r1", "s1")),
        (0.1, ticket("r2", "s1")),
        (0.2, ticket("r3", "g")),
        (0.3, ticket("r4", "g")),
    ]
    result = replay_admissions(policy, arrivals, hold_s=1.0)
    assert result.order == ["r1", "r3", "r4", "r2"]
    assert result.admitted_at == {"r1": 0.0, "r3": 1.0, "r4": 2.0, "r2": 3.0}
    assert result.rejected == {}
    assert result.snapshot["leases"] == 0


def test_matches_driving_the_scheduler_by_hand() -> None:
    policy = make_policy(TENANTS, {"p": {"max_inflight": 2}})
    tickets = [ticket(f"r{i}", ["g", "s1", "s2"][i % 3], 50 + 10 * i) for i in range(9)]
    replayed = replay_admissions(policy, [(0.0, t) for t in tickets], hold_s=0.1)

    clock = ManualClock()
    scheduler = Scheduler(policy, clock)
    order: list[str] = []
    leases: list[tuple[float, int]] = []
    for t in tickets:
        assert scheduler.submit(t) is None
        for admission in scheduler.dispatch():
            order.append(admission.ticket.request_id)
            leases.append((clock.now() + 0.1, admission.lease.lease_id))
    while leases:
        leases.sort()
        at, lease_id = leases.pop(0)
        clock.set(at)
        scheduler.release(lease_id, None, None)
        scheduler.poll()
        for admission in scheduler.dispatch():
            order.append(admission.ticket.request_id)
            leases.append((clock.now() + 0.1, admission.lease.lease_id))
    assert replayed.order == order


def test_timers_expire_waiting_requests_and_cancel_drops_them() -> None:
    policy = make_policy(TENANTS, ONE)
    arrivals = [
        ReplayArrival(0.0, ticket("r1", "s1")),  # holds the pool forever
        ReplayArrival(0.1, ticket("r2", "s2")),  # max_queue_wait 0.5s: expires at 0.6
        ReplayArrival(0.2, ticket("r3", "s1"), cancel_at=0.4),
    ]
    result = replay_admissions(policy, arrivals)
    assert result.order == ["r1"]
    assert result.rejected == {"r2": Outcome.EXPIRED}
    assert result.cancelled == ["r3"]


def test_per_arrival_hold_and_actual_output() -> None:
    policy = make_policy(TENANTS, ONE)
    arrivals = [
        ReplayArrival(0.0, ticket("r1", "g"), hold_s=0.25, output_tokens=7),
        ReplayArrival(0.0, ticket("r2", "g"), hold_s=0.5),
    ]
    result = replay_admissions(policy, arrivals)
    assert result.admitted_at == {"r1": 0.0, "r2": 0.25}
    # settled: r1 with its actual 7 output tokens, r2 with its estimate
    assert result.snapshot["tenants"]["g"]["served_tokens"] == (100 + 7) + (100 + 100)
