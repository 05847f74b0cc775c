"""Scheduler conformance, run under every registered fair-share policy: rate limits and
bounded waiting (max_queued, expiry, deadlines, shedding)."""

from __future__ import annotations

import math

import pytest
from sched_support import make_policy, scheduler, submit_ok, ticket

from extproc.scheduler import ManualClock, Scheduler
from extproc.types import Outcome

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
