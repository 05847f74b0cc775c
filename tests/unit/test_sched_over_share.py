"""Scheduler.over_share / shed_queued_of: who a service that falls behind itself sheds first."""

from __future__ import annotations

from extproc.scheduler import Admission, Scheduler
from extproc.types import Outcome
from tests.unit.sched_support import make_policy, scheduler, submit_ok, ticket

TWO = {
    "flood": {"tier": "gold", "weight": 1},
    "quiet": {"tier": "gold", "weight": 1},
}


def admit_all(sched: Scheduler) -> list[Admission]:
    return sched.dispatch()


def test_tenant_above_its_token_share_is_over_and_the_light_one_is_not() -> None:
    policy = make_policy(TWO, pools={"p": {"max_inflight": 4, "max_inflight_tokens": 100_000}})
    sched, _clock = scheduler(policy)
    for _ in range(3):
        submit_ok(sched, ticket("flood"))
    submit_ok(sched, ticket("quiet"))
    assert len(admit_all(sched)) == 4
    for _ in range(5):
        submit_ok(sched, ticket("flood"))  # queued: the pool is full
    assert sched.over_share() == {"flood"}


def test_a_tenant_alone_is_never_over() -> None:
    policy = make_policy(TWO, pools={"p": {"max_inflight": 2, "max_inflight_tokens": 100_000}})
    sched, _clock = scheduler(policy)
    for _ in range(6):
        submit_ok(sched, ticket("flood"))
    admit_all(sched)
    assert sched.queued() == 4
    assert sched.over_share() == set()


def test_weights_set_the_share() -> None:
    tenants = {"big": {"tier": "gold", "weight": 3}, "small": {"tier": "gold", "weight": 1}}
    policy = make_policy(tenants, pools={"p": {"max_inflight": 8, "max_inflight_tokens": 100_000}})
    sched, _clock = scheduler(policy)
    for _ in range(3):
        submit_ok(sched, ticket("big"))
    submit_ok(sched, ticket("small"))
    admit_all(sched)
    assert sched.over_share() == set()  # 3:1 work at 3:1 weights
    submit_ok(sched, ticket("big"))
    admit_all(sched)
    assert sched.over_share() == {"big"}


def test_admission_rate_counts_while_the_light_tenant_has_nothing_in_flight() -> None:
    policy = make_policy(TWO, pools={"p": {"max_inflight": 64, "max_inflight_tokens": 1_000_000}})
    sched, clock = scheduler(policy)
    for _second in range(4):
        for _ in range(20):
            submit_ok(sched, ticket("flood"))
        submit_ok(sched, ticket("quiet"))
        for admission in admit_all(sched):
            sched.release(admission.lease.lease_id)
        clock.advance(1.0)
    assert sched.inflight() == 0 and sched.queued() == 0
    assert sched.over_share() == {"flood"}


def test_equal_rates_are_not_told_apart() -> None:
    policy = make_policy(TWO, pools={"p": {"max_inflight": 64, "max_inflight_tokens": 1_000_000}})
    sched, clock = scheduler(policy)
    for _ in range(10):
        for name in ("flood", "quiet", "flood", "quiet"):
            submit_ok(sched, ticket(name))
        for admission in admit_all(sched):
            sched.release(admission.lease.lease_id)
        clock.advance(0.5)
    assert sched.over_share() == set()


def test_shed_queued_of_answers_only_those_tenants_with_retry_after() -> None:
    policy = make_policy(
        {**TWO, "other": {"tier": "silver", "weight": 1}},
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("quiet"))
    admit_all(sched)
    flood = [submit_ok(sched, ticket("flood")) for _ in range(3)]
    kept = submit_ok(sched, ticket("other"))
    rejections = sched.shed_queued_of({"flood"}, "shed for the test")
    assert sorted(r.request_id for r in rejections) == sorted(t.request_id for t in flood)
    for rejection in rejections:
        assert rejection.outcome is Outcome.SHED_OVERLOAD
        assert rejection.http_status == 429
        assert rejection.retry_after_s is not None and rejection.retry_after_s >= 1
        assert rejection.message == "shed for the test"
    assert sched.queued() == 1
    assert sched.cancel(kept.request_id)  # still queued: untouched
    assert sched.shed_queued_of({"flood"}, "again") == []


def test_shed_retry_after_follows_the_shed_rule() -> None:
    policy = make_policy(TWO)
    sched, _clock = scheduler(policy)
    # No drain rate measured yet: the rule's smallest answer.
    assert sched.shed_retry_after(ticket("flood")) == 1


def test_once_the_heavy_tenants_work_drains_the_light_one_reads_over_and_is_not_queued() -> None:
    # Why the overload detector keeps an episode's shed set: the rule alone turns on the
    # light tenant once most of the shed tenant's requests have ended.
    policy = make_policy(TWO, pools={"p": {"max_inflight": 8, "max_inflight_tokens": 100_000}})
    sched, _clock = scheduler(policy)
    for _ in range(4):
        submit_ok(sched, ticket("flood", input_tokens=14, max_output=64))
    submit_ok(sched, ticket("quiet", input_tokens=15, max_output=64))
    admitted = admit_all(sched)
    for _ in range(6):
        submit_ok(sched, ticket("flood", input_tokens=14, max_output=64))
    assert sched.over_share() == {"flood"}
    assert sched.tenants_with_queued() == {"flood"}
    assert [r.tenant for r in sched.shed_queued_of({"flood"}, "shed")] == ["flood"] * 6
    flood = [a for a in admitted if a.lease.tenant == "flood"]
    for admission in flood[1:]:  # one of its requests is still streaming
        sched.release(admission.lease.lease_id)
    assert "quiet" in sched.over_share()  # 79 of 157 tokens in flight: over half
    assert sched.tenants_with_queued() == set()
