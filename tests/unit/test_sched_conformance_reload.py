"""Scheduler conformance, run under every registered fair-share policy: leases, policy
reload, per-pool fair share, drain."""

from __future__ import annotations

import pytest
from sched_support import FAIRNESS, make_policy, scheduler, submit_ok, ticket

from extproc.types import Outcome

# --- leases -------------------------------------------------------------------------------------


def test_expired_leases_are_reclaimed(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}},
        fairness=fairness,
        lease_timeout="5s",
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a"))
    [admission] = sched.dispatch()
    waiting = submit_ok(sched, ticket("a"))
    assert sched.next_deadline() == pytest.approx(admission.lease.expires_at)
    clock.advance(5)
    assert sched.poll() == []
    assert sched.reclaimed_leases == 1 and sched.snapshot()["reclaimed_leases"] == 1
    assert sched.release(admission.lease.lease_id) is False
    [next_one] = sched.dispatch()
    assert next_one.ticket == waiting


# --- policy reload ------------------------------------------------------------------------------


def test_policy_update_removes_a_tenant(fairness: str) -> None:
    tenants = {"a": {"tier": "gold"}, "gone": {"tier": "gold"}}
    pools = {"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}}
    sched, _clock = scheduler(make_policy(tenants, fairness=fairness, pools=pools))
    submit_ok(sched, ticket("gone"))
    [running] = sched.dispatch()
    queued = [submit_ok(sched, ticket("gone")) for _ in range(2)]
    kept = submit_ok(sched, ticket("a"))
    rejections = sched.update_policy(
        make_policy({"a": {"tier": "gold"}}, fairness=fairness, pools=pools)
    )
    assert [r.request_id for r in rejections] == [t.request_id for t in queued]
    for rejection in rejections:
        assert rejection.outcome is Outcome.UNAUTHORIZED and rejection.http_status == 403
        assert "removed from the policy" in rejection.message
    snap = sched.snapshot()
    assert snap["tenants"]["gone"]["removed"] and snap["tenants"]["gone"]["inflight"] == 1
    assert sched.submit(ticket("gone")) is not None
    assert sched.release(running.lease.lease_id)
    assert "gone" not in sched.snapshot()["tenants"]
    [admission] = sched.dispatch()
    assert admission.ticket == kept


def test_policy_update_applies_new_limits_weights_and_tiers(fairness: str) -> None:
    tenants = {"a": {"tier": "silver"}, "b": {"tier": "gold"}}
    pools = {"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}}
    sched, _clock = scheduler(make_policy(tenants, fairness=fairness, pools=pools))
    submit_ok(sched, ticket("b"))
    sched.dispatch()
    a1 = submit_ok(sched, ticket("a"))
    b1 = submit_ok(sched, ticket("b"))
    promoted = {"a": {"tier": "gold", "weight": 5}, "b": {"tier": "silver"}}
    wider = {"p": {"max_inflight": 3, "max_inflight_tokens": 100_000}}
    assert sched.update_policy(make_policy(promoted, fairness=fairness, pools=wider)) == []
    assert sched.snapshot()["tenants"]["a"]["tier"] == "gold"
    admitted = sched.dispatch()
    assert [x.ticket for x in admitted] == [a1, b1]
    # Switching the fairness policy restarts fair-share state but keeps queues and leases.
    other = next(name for name in FAIRNESS if name != fairness)
    a2 = submit_ok(sched, ticket("a"))
    assert sched.update_policy(make_policy(promoted, fairness=other, pools=pools)) == []
    assert sched.snapshot()["fairness"] == other
    for x in admitted:
        sched.release(x.lease.lease_id)
    sched.release(1)
    [last] = sched.dispatch()
    assert last.ticket == a2


def test_policy_update_shortens_the_queue_wait(fairness: str) -> None:
    tenants = {"a": {"tier": "gold", "limits": {"max_queue_wait": "60s"}}}
    pools = {"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}}
    sched, clock = scheduler(make_policy(tenants, fairness=fairness, pools=pools))
    submit_ok(sched, ticket("a"))
    sched.dispatch()
    waiting = submit_ok(sched, ticket("a"))
    clock.advance(10)
    shorter = {"a": {"tier": "gold", "limits": {"max_queue_wait": "5s"}}}
    sched.update_policy(make_policy(shorter, fairness=fairness, pools=pools))
    [expired] = sched.poll()
    assert expired.request_id == waiting.request_id and expired.outcome is Outcome.EXPIRED


def test_policy_update_removes_a_pool(fairness: str) -> None:
    tenants = {"a": {"tier": "gold"}}
    two = {
        "p": {"max_inflight": 1, "max_inflight_tokens": 100_000},
        "q": {"max_inflight": 1, "max_inflight_tokens": 100_000},
    }
    sched, _clock = scheduler(make_policy(tenants, fairness=fairness, pools=two))
    submit_ok(sched, ticket("a", pool="q"))
    [running] = sched.dispatch()
    waiting = submit_ok(sched, ticket("a", pool="q"))
    one = {"p": two["p"]}
    [rejected] = sched.update_policy(make_policy(tenants, fairness=fairness, pools=one))
    assert rejected.request_id == waiting.request_id and rejected.outcome is Outcome.UNAVAILABLE
    assert sched.snapshot()["pools"]["q"]["retired"] is True
    assert sched.release(running.lease.lease_id)
    assert "q" not in sched.snapshot()["pools"]


def test_fair_share_is_per_pool(fairness: str) -> None:
    """Heavy use of one pool does not cost a tenant its share of another pool."""
    pools = {
        "p": {"max_inflight": 1, "max_inflight_tokens": 100_000},
        "q": {"max_inflight": 8, "max_inflight_tokens": 1_000_000},
    }
    policy = make_policy(
        {"a": {"tier": "gold"}, "b": {"tier": "gold"}}, fairness=fairness, pools=pools, quantum=300
    )
    sched, _clock = scheduler(policy)
    for _ in range(8):
        submit_ok(sched, ticket("a", pool="q", input_tokens=50_000, max_output=1000))
    assert len(sched.dispatch()) == 8
    for _ in range(10):
        submit_ok(sched, ticket("a"))
        submit_ok(sched, ticket("b"))
    [admission] = sched.dispatch()
    served = []
    for _ in range(10):
        served.append(admission.ticket.tenant)
        sched.release(admission.lease.lease_id)
        [admission] = sched.dispatch()
    assert served.count("a") == 5 and served.count("b") == 5


def test_idle_scheduler_has_no_deadline_and_tickets_validate() -> None:
    sched, clock = scheduler(make_policy({"a": {"tier": "gold"}}))
    assert sched.next_deadline() is None and sched.poll() == [] and sched.dispatch() == []
    with pytest.raises(ValueError):
        ticket("a", input_tokens=-1)
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert sched.cancel("missing") is False and sched.release(12345) is False


def test_reject_all_queued_empties_queues_and_refunds() -> None:
    from extproc.policy import policy_from_text
    from extproc.scheduler import ManualClock, Scheduler, Ticket
    from extproc.types import Outcome
    from tests.conftest import policy_yaml

    limits = "{requests_per_minute: 10, max_queued: 10}"
    scheduler = Scheduler(
        policy_from_text(policy_yaml(globex_limits=limits, short_inflight=1)), ManualClock()
    )
    for index in range(3):
        ticket = Ticket(f"r{index}", "globex", "short", 10, 10)
        assert scheduler.submit(ticket) is None
    assert len(scheduler.dispatch()) == 1
    rejections = scheduler.reject_all_queued(7, "draining")
    assert [r.request_id for r in rejections] == ["r1", "r2"]
    assert all(r.outcome is Outcome.UNAVAILABLE and r.http_status == 503 for r in rejections)
    assert all(r.retry_after_s == 7 for r in rejections)
    assert scheduler.queued() == 0 and scheduler.inflight() == 1
    assert scheduler.snapshot()["tenants"]["globex"]["buckets"]["requests"] == 9.0
