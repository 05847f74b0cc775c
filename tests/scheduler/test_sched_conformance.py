"""Scheduler behaviour, run under both fair-share policies."""

from __future__ import annotations

import math

import pytest
from sched_support import FAIRNESS, make_policy, scheduler, ticket

from extproc.scheduler import ManualClock, Scheduler, Ticket
from extproc.types import Outcome


@pytest.fixture(params=FAIRNESS)
def fairness(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def submit_ok(sched: Scheduler, t: Ticket) -> Ticket:
    rejection = sched.submit(t)
    assert rejection is None, rejection
    return t


# --- basics -------------------------------------------------------------------------------------


def test_admit_release_exactly_once(fairness: str) -> None:
    policy = make_policy({"a": {"tier": "gold"}}, fairness=fairness)
    sched, clock = scheduler(policy)
    t = submit_ok(sched, ticket("a", input_tokens=300, max_output=50))
    clock.advance(0.25)
    [admission] = sched.dispatch()
    lease = admission.lease
    assert admission.ticket == t and admission.wait_s == pytest.approx(0.25)
    assert (lease.tenant, lease.pool, lease.tier, lease.budget) == ("a", "p", "gold", 350)
    assert lease.expires_at == pytest.approx(clock.now() + 600)
    assert sched.snapshot()["pools"]["p"]["inflight_tokens"] == 350
    assert sched.release(lease.lease_id) is True
    assert sched.release(lease.lease_id) is False
    snap = sched.snapshot()
    assert snap["pools"]["p"]["inflight"] == 0 and snap["pools"]["p"]["inflight_tokens"] == 0
    assert snap["tenants"]["a"]["inflight"] == 0 and snap["leases"] == 0


def test_strict_tier_priority(fairness: str) -> None:
    policy = make_policy(
        {"g": {"tier": "gold"}, "s": {"tier": "silver"}, "b": {"tier": "bronze"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, _clock = scheduler(policy)
    first = submit_ok(sched, ticket("b"))
    [running] = sched.dispatch()
    assert running.ticket == first
    order = [submit_ok(sched, ticket(name)) for name in ("b", "s", "b", "g", "s")]
    served = []
    lease = running.lease.lease_id
    for _ in order:
        sched.release(lease)
        [admission] = sched.dispatch()
        served.append(admission.ticket.tenant)
        lease = admission.lease.lease_id
    assert served == ["g", "s", "s", "b", "b"]


def test_tenant_order_priority_deadline_arrival(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy)
    blocker = submit_ok(sched, ticket("a"))
    [running] = sched.dispatch()
    assert running.ticket == blocker
    now = clock.now()
    late = submit_ok(sched, ticket("a", request_id="plain-1"))
    soon = submit_ok(sched, ticket("a", request_id="deadline-far", deadline=now + 500))
    sooner = submit_ok(sched, ticket("a", request_id="deadline-near", deadline=now + 400))
    urgent = submit_ok(sched, ticket("a", request_id="priority", priority=5))
    plain = submit_ok(sched, ticket("a", request_id="plain-2"))
    served = []
    lease = running.lease.lease_id
    for _ in range(5):
        sched.release(lease)
        [admission] = sched.dispatch()
        served.append(admission.ticket)
        lease = admission.lease.lease_id
    assert served == [urgent, sooner, soon, late, plain]


def test_max_concurrency_holds_in_queue(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"max_concurrency": 2}}, "b": {"tier": "silver"}},
        fairness=fairness,
    )
    sched, _clock = scheduler(policy)
    for _ in range(4):
        submit_ok(sched, ticket("a"))
    b = submit_ok(sched, ticket("b"))
    admitted = sched.dispatch()
    # a stops at 2; the lower tier b uses the room a cannot (a has no admissible request).
    assert [x.ticket.tenant for x in admitted] == ["a", "a", "b"]
    assert b in [x.ticket for x in admitted]
    assert sched.snapshot()["tenants"]["a"]["queued"] == 2
    assert sched.dispatch() == []
    sched.release(admitted[0].lease.lease_id)
    [next_a] = sched.dispatch()
    assert next_a.ticket.tenant == "a"


def test_pool_token_capacity(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 10, "max_inflight_tokens": 1000}},
    )
    sched, _clock = scheduler(policy)
    for _ in range(4):
        submit_ok(sched, ticket("a", input_tokens=200, max_output=100))
    admitted = sched.dispatch()
    assert len(admitted) == 3
    assert sched.snapshot()["pools"]["p"]["inflight_tokens"] == 900
    sched.release(admitted[0].lease.lease_id)
    assert len(sched.dispatch()) == 1


def test_request_larger_than_the_pool_is_a_bad_request(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 10, "max_inflight_tokens": 1000}},
    )
    sched, _clock = scheduler(policy)
    rejection = sched.submit(ticket("a", input_tokens=900, max_output=101))
    assert rejection is not None
    assert (rejection.outcome, rejection.http_status) == (Outcome.BAD_REQUEST, 400)


def test_unknown_tenant_pool_and_duplicate_id(fairness: str) -> None:
    sched, _clock = scheduler(make_policy({"a": {"tier": "gold"}}, fairness=fairness))
    unknown = sched.submit(ticket("nobody"))
    assert unknown is not None and unknown.http_status == 403
    no_pool = sched.submit(ticket("a", pool="nowhere"))
    assert no_pool is not None and no_pool.outcome is Outcome.UNAVAILABLE
    sched2, _ = scheduler(
        make_policy(
            {"a": {"tier": "gold"}},
            fairness=fairness,
            pools={"p": {"max_inflight": 1, "max_inflight_tokens": 1000}},
        )
    )
    submit_ok(sched2, ticket("a", request_id="x"))
    submit_ok(sched2, ticket("a", request_id="y"))
    dup = sched2.submit(ticket("a", request_id="y"))
    assert dup is not None and dup.http_status == 400


# --- fairness -----------------------------------------------------------------------------------


def test_weights_share_a_busy_pool(fairness: str) -> None:
    policy = make_policy(
        {"light": {"tier": "gold", "weight": 1}, "heavy": {"tier": "gold", "weight": 3}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
        quantum=500,
    )
    sched, _clock = scheduler(policy)
    for _ in range(60):
        submit_ok(sched, ticket("light", input_tokens=200, max_output=100))
        submit_ok(sched, ticket("heavy", input_tokens=200, max_output=100))
    counts = {"light": 0, "heavy": 0}
    [admission] = sched.dispatch()
    for _ in range(80):
        counts[admission.ticket.tenant] += 1
        sched.release(admission.lease.lease_id)
        [admission] = sched.dispatch()
    assert 18 <= counts["light"] <= 22 and 58 <= counts["heavy"] <= 62


def test_token_cost_not_request_count(fairness: str) -> None:
    """A tenant with 4x bigger requests gets about a quarter of the requests."""
    policy = make_policy(
        {"big": {"tier": "gold"}, "small": {"tier": "gold"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
        quantum=1000,
    )
    sched, _clock = scheduler(policy)
    for _ in range(100):
        submit_ok(sched, ticket("big", input_tokens=1600, max_output=200))
        submit_ok(sched, ticket("small", input_tokens=400, max_output=50))
    counts = {"big": 0, "small": 0}
    [admission] = sched.dispatch()
    for _ in range(100):
        counts[admission.ticket.tenant] += 1
        sched.release(admission.lease.lease_id)
        [admission] = sched.dispatch()
    assert 17 <= counts["big"] <= 23 and 77 <= counts["small"] <= 83


def test_charge_output_and_settlement_move_the_fair_share(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}, "b": {"tier": "gold"}},
        fairness=fairness,
        output_weight=2,
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=100, max_output=100))
    submit_ok(sched, ticket("a", input_tokens=100, max_output=100))
    [first, _second] = sched.dispatch()
    level = sched.snapshot()["tenants"]["a"]["fair_share"]["p"]
    sched.charge_output(first.lease.lease_id, 60)  # inside the reservation: no change
    assert sched.snapshot()["tenants"]["a"]["fair_share"]["p"] == level
    sched.charge_output(first.lease.lease_id, 60)  # 20 tokens above the reservation
    after = sched.snapshot()["tenants"]["a"]["fair_share"]["p"]
    sign = 1 if fairness == "vtc" else -1  # VTC counts up, a DRR deficit goes down
    assert sign * (after - level) == pytest.approx(40.0)
    assert sched.charge_output(999, 5) is False


def test_output_charged_only_as_it_streams_without_reservation() -> None:
    policy = make_policy({"a": {"tier": "gold"}, "b": {"tier": "gold"}}, fairness="vtc")
    sched, _clock = scheduler(policy, reserve_output=False)
    submit_ok(sched, ticket("a", input_tokens=100, max_output=500))
    [admission] = sched.dispatch()
    assert sched.snapshot()["tenants"]["a"]["fair_share"]["p"] == 100.0
    sched.charge_output(admission.lease.lease_id, 10)
    sched.charge_output(admission.lease.lease_id, 15)
    assert sched.snapshot()["tenants"]["a"]["fair_share"]["p"] == 150.0
    sched.release(admission.lease.lease_id, actual_input_tokens=120, actual_output_tokens=30)
    assert sched.snapshot()["tenants"]["a"]["fair_share"]["p"] == 180.0


def test_big_head_is_not_starved_by_small_requests(fairness: str) -> None:
    """Without a hold, small requests keep filling the token room a big head needs."""
    tenants = {"big": {"tier": "gold"}, "small": {"tier": "gold"}}
    pools = {"p": {"max_inflight": 10, "max_inflight_tokens": 1000}}

    def run(max_bypass: int | None) -> bool:
        sched, _clock = scheduler(
            make_policy(tenants, fairness=fairness, pools=pools), max_bypass=max_bypass
        )
        leases = []
        for _ in range(4):
            submit_ok(sched, ticket("small", input_tokens=150, max_output=50))
        leases = [a.lease.lease_id for a in sched.dispatch()]
        big = submit_ok(sched, ticket("big", input_tokens=700, max_output=100))
        for _ in range(200):
            submit_ok(sched, ticket("small", input_tokens=150, max_output=50))
            sched.release(leases.pop(0))
            for admission in sched.dispatch():
                if admission.ticket == big:
                    return True
                leases.append(admission.lease.lease_id)
        return False

    assert run(max_bypass=None) is False
    assert run(max_bypass=4) is True
    assert run(max_bypass=0) is True


# --- rate limits --------------------------------------------------------------------------------


def test_rate_limit_retry_after_is_exact(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"tokens_per_minute": 1000, "requests_per_minute": 60}}},
        fairness=fairness,
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=500, max_output=100))
    rejected = sched.submit(ticket("a", input_tokens=500, max_output=100))
    assert rejected is not None
    assert (rejected.outcome, rejected.http_status) == (Outcome.REJECTED_RATE, 429)
    # 400 left, 600 needed, refill 1000/60 per second: 12 s.
    assert rejected.retry_after_s == 12
    assert "tokens_per_minute" in rejected.message
    assert rejected.headers["x-ratelimit-remaining-tokens"] == "400"
    assert rejected.headers["x-ratelimit-limit-tokens"] == "1000"
    assert rejected.headers["x-ratelimit-reset-tokens"] == "36s"
    assert rejected.headers["x-ratelimit-remaining-requests"] == "59"
    clock.advance(11)
    again = sched.submit(ticket("a", input_tokens=500, max_output=100))
    assert again is not None and again.retry_after_s == 1
    clock.advance(1)
    submit_ok(sched, ticket("a", input_tokens=500, max_output=100))


def test_requests_per_minute(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"requests_per_minute": 2}}}, fairness=fairness
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a"))
    submit_ok(sched, ticket("a"))
    third = sched.submit(ticket("a"))
    assert third is not None and third.retry_after_s == 30
    assert "requests_per_minute" in third.message
    assert "x-ratelimit-limit-tokens" not in third.headers
    clock.advance(29.5)
    assert sched.submit(ticket("a")) is not None
    clock.advance(0.5)
    submit_ok(sched, ticket("a"))


def test_never_passable_request(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"tokens_per_minute": 1000}}}, fairness=fairness
    )
    sched, _clock = scheduler(policy)
    rejected = sched.submit(ticket("a", input_tokens=900, max_output=101))
    assert rejected is not None and rejected.outcome is Outcome.REJECTED_RATE
    assert rejected.http_status == 429 and rejected.retry_after_s is None
    assert "can never pass" in rejected.message and "1000" in rejected.message
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == 1000.0


def test_admission_carries_ratelimit_headers(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"tokens_per_minute": 6000, "requests_per_minute": 60}}},
        fairness=fairness,
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=500, max_output=100))
    [admission] = sched.dispatch()
    assert dict(admission.ratelimit_headers) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",
    }


def test_cancel_refunds_the_buckets(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"tokens_per_minute": 6000, "requests_per_minute": 60}}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    sched.dispatch()
    waiting = submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {"requests": 58.0, "tokens": 2000.0}
    assert sched.cancel(waiting.request_id) is True
    assert sched.cancel(waiting.request_id) is False
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {"requests": 59.0, "tokens": 4000.0}
    assert sched.snapshot()["tenants"]["a"]["queued"] == 0
    assert sched.dispatch() == []


def test_release_settles_the_token_bucket(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"tokens_per_minute": 6000}}}, fairness=fairness
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    first, second = sched.dispatch()
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == 2000.0
    # Used less than reserved: refund.
    sched.release(first.lease.lease_id, actual_input_tokens=900, actual_output_tokens=100)
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == 3000.0
    # Used more than estimated: debit, may go below zero.
    sched.release(second.lease.lease_id, actual_input_tokens=4000, actual_output_tokens=2500)
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == -1500.0
    assert sched.snapshot()["tenants"]["a"]["served_tokens"] == 1000 + 6500
    rejected = sched.submit(ticket("a", input_tokens=10, max_output=0))
    assert rejected is not None and rejected.retry_after_s == math.ceil(1510 / 100)


def test_a_later_correction_moves_bucket_and_served_tokens(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"tokens_per_minute": 6000}}}, fairness=fairness
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    [admitted] = sched.dispatch()
    sched.release(admitted.lease.lease_id, actual_input_tokens=900, actual_output_tokens=100)
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == 5000.0
    # The engine's counters said 920 in and 130 out: 50 more tokens.
    sched.correct_usage("a", "p", 20, 30)
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == 4950.0
    assert sched.snapshot()["tenants"]["a"]["served_tokens"] == 1050
    sched.correct_usage("a", "p", -50, 0)  # and a refund
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == 5000.0


# --- bounded waiting ----------------------------------------------------------------------------


def test_max_queued(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"max_queued": 2, "max_queue_wait": "20s"}}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a"))
    [running] = sched.dispatch()
    submit_ok(sched, ticket("a"))
    clock.advance(5)
    submit_ok(sched, ticket("a"))
    full = sched.submit(ticket("a"))
    assert full is not None
    assert (full.outcome, full.http_status) == (Outcome.REJECTED_QUEUE_FULL, 429)
    # No dispatch history yet: the slot frees when the oldest entry expires, 15 s from now.
    assert full.retry_after_s == 15
    assert "max_queued 2" in full.message
    sched.release(running.lease.lease_id)
    assert len(sched.dispatch()) == 1
    submit_ok(sched, ticket("a"))


def test_max_queued_zero_admits_only_what_goes_straight_through(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"max_queued": 0}}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a"))
    assert len(sched.dispatch()) == 1
    rejected = sched.submit(ticket("a"))
    assert rejected is not None and rejected.outcome is Outcome.REJECTED_QUEUE_FULL
    assert rejected.retry_after_s is not None and rejected.retry_after_s >= 1


def test_expiry_at_max_queue_wait(fairness: str) -> None:
    policy = make_policy(
        {
            "a": {
                "tier": "gold",
                "limits": {"max_queue_wait": "10s", "tokens_per_minute": 6000},
            }
        },
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=2000, max_output=1000))
    sched.dispatch()
    start = clock.now()
    waiting = submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    assert sched.next_deadline() == pytest.approx(start + 10)
    clock.set(start + 9.999)
    assert sched.poll() == []
    clock.set(start + 10)
    [expired] = sched.poll()
    assert expired.request_id == waiting.request_id
    assert (expired.outcome, expired.http_status) == (Outcome.EXPIRED, 503)
    assert expired.retry_after_s is not None and expired.retry_after_s >= 1
    assert "max_queue_wait" in expired.message
    # 6000 - 3000 - 2000 + 10 s of refill (1000) + the refund (2000).
    assert sched.snapshot()["tenants"]["a"]["buckets"]["tokens"] == pytest.approx(4000)
    assert sched.snapshot()["tenants"]["a"]["queued"] == 0


def test_deadline_passed_is_shed(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a"))
    sched.dispatch()
    now = clock.now()
    too_late = sched.submit(ticket("a", deadline=now))
    assert too_late is not None and too_late.outcome is Outcome.SHED
    assert too_late.http_status == 503
    waiting = submit_ok(sched, ticket("a", deadline=now + 5))
    assert sched.next_deadline() == pytest.approx(now + 5)
    clock.advance(4.9)
    assert sched.poll() == []
    clock.advance(0.1)
    [shed] = sched.poll()
    assert shed.request_id == waiting.request_id and shed.outcome is Outcome.SHED


def warm_drain_rate(sched: Scheduler, clock: ManualClock, n: int, tenant: str) -> int:
    """Run n requests through a one-slot pool, one completion a second; leave one running."""
    for _ in range(n):
        submit_ok(sched, ticket(tenant))
        [admission] = sched.dispatch()
        clock.advance(1.0)
        sched.release(admission.lease.lease_id)
    submit_ok(sched, ticket(tenant))
    [running] = sched.dispatch()
    return running.lease.lease_id


def test_doomed_request_is_shed_early(fairness: str) -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"max_queue_wait": "10m"}}, "b": {"tier": "silver"}},
        fairness=fairness,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy, min_drain_samples=5)
    running = warm_drain_rate(sched, clock, 20, "a")  # drains ~1 request/s; pool now full
    rate = sched.snapshot()["pools"]["p"]["drain_rate"]
    assert rate == pytest.approx(1.0, rel=0.15)
    for _ in range(10):
        submit_ok(sched, ticket("a"))  # 10 gold requests ahead of any silver one
    now = clock.now()
    doomed = sched.submit(ticket("b", deadline=now + 5))
    assert doomed is not None and doomed.outcome is Outcome.SHED and doomed.http_status == 503
    assert "deadline" in doomed.message
    assert doomed.retry_after_s is not None and doomed.retry_after_s >= 10
    fine = submit_ok(sched, ticket("b", deadline=now + 60))
    # Later the pool stalls (no completions): the estimate drops, poll sheds it before 60 s.
    clock.advance(40)
    shed = sched.poll()
    assert [r.request_id for r in shed] == [fine.request_id]
    assert sched.release(running)


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
    other = "vtc" if fairness == "drr" else "drr"
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
