"""Limits per endpoint class and bursts in the scheduler: which buckets a request takes from,
honest Retry-After per bucket, the headers that name them, refunds, settlement, per-class
concurrency and reloads."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_support import make_policy, scheduler, submit_ok, ticket

from extproc.policy import Policy
from extproc.scheduler import Bucket
from extproc.scheduler.ratelimit import DIMENSIONS, bucket_for_key, bucket_of, capacity_exceeded
from extproc.types import Outcome

BIG_POOL = {"p": {"max_inflight": 1000, "max_inflight_tokens": 100_000_000}}


def _policy(limits: dict[str, Any], pools: dict[str, Any] | None = None) -> Policy:
    return make_policy({"a": {"tier": "gold", "limits": limits}}, pools=pools or BIG_POOL)


def test_a_burst_is_the_capacity_and_the_limit_the_refill() -> None:
    limits = _policy({"requests_per_minute": 600, "requests_burst": 20}).tenants["a"].limits
    requests, tokens = DIMENSIONS
    assert bucket_of("a", requests, limits) == Bucket("a:requests", 20.0, 10.0)
    assert bucket_of("a", tokens, limits) is None


def test_class_bucket_keys_name_their_class() -> None:
    spec = _policy(
        {"tokens_per_minute": 6000, "per_endpoint": {"completions": {"tokens_per_minute": 600}}}
    ).tenants["a"]
    assert bucket_for_key("a:tokens", spec) == Bucket("a:tokens", 6000.0, 100.0)
    assert bucket_for_key("a:tokens-completions", spec) == Bucket(
        "a:tokens-completions", 600.0, 10.0
    )
    assert bucket_for_key("a:tokens-chat", spec) is None
    assert bucket_for_key("a:requests-completions", spec) is None
    assert bucket_for_key("a:tokens-nonsense", spec) is None


def test_a_fresh_bucket_lets_the_burst_through_then_the_rate() -> None:
    sched, clock = scheduler(_policy({"requests_per_minute": 60, "requests_burst": 5}))
    for _ in range(5):
        submit_ok(sched, ticket("a"))
    rejected = sched.submit(ticket("a"))
    assert rejected is not None and rejected.retry_after_s == 1
    assert rejected.headers["x-ratelimit-limit-requests"] == "5"
    assert rejected.headers["x-ratelimit-remaining-requests"] == "0"
    assert rejected.headers["x-ratelimit-reset-requests"] == "5s"
    clock.advance(1.0)
    submit_ok(sched, ticket("a"))
    assert sched.submit(ticket("a")) is not None


def test_a_class_limit_rejects_its_class_only_with_honest_retry_after() -> None:
    policy = _policy(
        {
            "requests_per_minute": 600,
            "per_endpoint": {"chat": {"requests_per_minute": 30, "requests_burst": 2}},
        }
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a"))
    submit_ok(sched, ticket("a"))
    rejected = sched.submit(ticket("a"))
    assert rejected is not None and rejected.outcome is Outcome.REJECTED_RATE
    assert rejected.http_status == 429 and rejected.retry_after_s == 2  # 1 request at 0.5/s
    assert "(per_endpoint.chat.requests_per_minute)" in rejected.message
    assert rejected.headers == {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "598",
        "x-ratelimit-reset-requests": "200ms",
        "x-ratelimit-limit-requests-chat": "2",
        "x-ratelimit-remaining-requests-chat": "0",
        "x-ratelimit-reset-requests-chat": "4s",
    }
    completions = sched.submit(ticket("a", endpoint="completions"))
    assert completions is None  # another class: only the tenant-wide bucket applies
    clock.advance(1.99)
    assert sched.submit(ticket("a")) is not None
    clock.advance(0.01)  # exactly the advertised Retry-After
    submit_ok(sched, ticket("a"))
    [*admitted] = sched.dispatch()
    by_class = {a.ticket.endpoint: dict(a.ratelimit_headers) for a in admitted}
    assert set(by_class["completions"]) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    assert by_class["chat"]["x-ratelimit-remaining-requests-chat"] == "0"


def test_the_tenant_wide_cap_still_holds_beside_a_class_limit() -> None:
    policy = _policy(
        {
            "tokens_per_minute": 1200,
            "per_endpoint": {"completions": {"tokens_per_minute": 1200, "tokens_burst": 600}},
        }
    )
    sched, _clock = scheduler(policy)
    submit_ok(sched, ticket("a", input_tokens=500, max_output=100, endpoint="completions"))
    submit_ok(sched, ticket("a", input_tokens=500, max_output=0))
    rejected = sched.submit(ticket("a", input_tokens=100, max_output=100))
    assert rejected is not None and "(tokens_per_minute)" in rejected.message
    assert rejected.retry_after_s == 5  # 100 tokens short at 20/s
    both = sched.submit(ticket("a", input_tokens=100, max_output=100, endpoint="completions"))
    assert both is not None
    assert "(tokens_per_minute, per_endpoint.completions.tokens_per_minute)" in both.message
    assert both.retry_after_s == 10  # the class bucket is 200 short at 20/s: it binds
    assert both.headers["x-ratelimit-remaining-tokens-completions"] == "0"


def test_a_cost_above_a_class_burst_can_never_pass() -> None:
    limits = {"per_endpoint": {"completions": {"tokens_per_minute": 6000, "tokens_burst": 500}}}
    policy = _policy(limits)
    sched, _clock = scheduler(policy)
    big = ticket("a", input_tokens=400, max_output=101, endpoint="completions")
    rejected = sched.submit(big)
    assert rejected is not None and rejected.retry_after_s is None
    assert "per_endpoint.completions.tokens_burst 500: it can never pass" in rejected.message
    spec = policy.tenants["a"].limits
    assert capacity_exceeded(big, spec) == ("per_endpoint.completions.tokens_burst", 500)
    assert capacity_exceeded(ticket("a", input_tokens=400, max_output=101), spec) is None
    tenant_wide = _policy({"tokens_per_minute": 1000}).tenants["a"].limits
    assert capacity_exceeded(ticket("a", input_tokens=1001, max_output=0), tenant_wide) == (
        "tokens_per_minute",
        1000,
    )


def test_cancel_refunds_and_release_settles_the_buckets_the_request_took() -> None:
    limits = {
        "tokens_per_minute": 60000,
        "per_endpoint": {
            "chat": {"tokens_per_minute": 6000},
            "completions": {"tokens_per_minute": 6000},
        },
    }
    pools = {"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}}
    sched, _clock = scheduler(_policy(limits, pools))
    submit_ok(sched, ticket("a", input_tokens=1000, max_output=1000))
    [admitted] = sched.dispatch()
    waiting = submit_ok(sched, ticket("a", input_tokens=500, max_output=500))
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {"tokens": 57000.0, "tokens-chat": 3000.0, "tokens-completions": 6000.0}
    assert sched.cancel(waiting.request_id)
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {"tokens": 58000.0, "tokens-chat": 4000.0, "tokens-completions": 6000.0}
    sched.release(admitted.lease.lease_id, actual_input_tokens=900, actual_output_tokens=600)
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {"tokens": 58500.0, "tokens-chat": 4500.0, "tokens-completions": 6000.0}
    sched.correct_usage("a", "p", 0, 100, "completions")  # another class's correction
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {"tokens": 58400.0, "tokens-chat": 4500.0, "tokens-completions": 5900.0}


def test_a_class_concurrency_limit_holds_its_class_only() -> None:
    pools = {
        "p": {"max_inflight": 10, "max_inflight_tokens": 100_000},
        "q": {"max_inflight": 10, "max_inflight_tokens": 100_000},
    }
    limits = {"max_concurrency": 3, "per_endpoint": {"chat": {"max_concurrency": 1}}}
    sched, _clock = scheduler(_policy(limits, pools))
    first = submit_ok(sched, ticket("a"))
    second = submit_ok(sched, ticket("a"))
    other = submit_ok(sched, ticket("a", pool="q", endpoint="completions"))
    admitted = sched.dispatch()
    assert {a.ticket.request_id for a in admitted} == {first.request_id, other.request_id}
    snap = sched.snapshot()["tenants"]["a"]
    assert snap["inflight_by_endpoint"] == {"chat": 1, "completions": 1}
    assert snap["backlogged_pools"] == []  # its head in p is a chat request, chat is full
    more = submit_ok(sched, ticket("a", pool="q", endpoint="completions"))
    [next_one] = sched.dispatch()
    assert next_one.ticket.request_id == more.request_id
    assert sched.submit(ticket("a", pool="q", endpoint="completions")) is None
    assert sched.dispatch() == []  # the tenant-wide 3 is reached
    lease = next(a.lease for a in admitted if a.ticket.request_id == first.request_id)
    sched.release(lease.lease_id)
    [after] = sched.dispatch()
    assert after.ticket.request_id == second.request_id


def test_a_reload_clamps_a_lowered_burst_and_refills_at_the_new_rate() -> None:
    before = {"per_endpoint": {"chat": {"requests_per_minute": 60}}}
    sched, clock = scheduler(_policy(before))
    for _ in range(10):
        submit_ok(sched, ticket("a"))
    assert sched.snapshot()["tenants"]["a"]["buckets"] == {"requests-chat": 50.0}
    lowered = {"per_endpoint": {"chat": {"requests_per_minute": 120, "requests_burst": 5}}}
    sched.update_policy(_policy(lowered))
    assert sched.snapshot()["tenants"]["a"]["buckets"] == {"requests-chat": 5.0}
    for _ in range(5):
        submit_ok(sched, ticket("a"))
    clock.advance(1.0)  # 2 per second now
    assert sched.snapshot()["tenants"]["a"]["buckets"] == {"requests-chat": 2.0}
    assert sched.snapshot()["tenants"]["a"]["bucket_limits"] == {
        "requests-chat": {"capacity": 5.0, "limit": 120.0, "period_s": 60.0, "endpoint": "chat"}
    }


def test_queue_full_headers_name_the_class_buckets() -> None:
    limits = {"max_queued": 1, "per_endpoint": {"completions": {"requests_per_minute": 60}}}
    pools = {"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}}
    sched, _clock = scheduler(_policy(limits, pools))
    submit_ok(sched, ticket("a", endpoint="completions"))
    sched.dispatch()
    submit_ok(sched, ticket("a", endpoint="completions"))
    full = sched.submit(ticket("a", endpoint="completions"))
    assert full is not None and full.outcome is Outcome.REJECTED_QUEUE_FULL
    assert full.headers["x-ratelimit-remaining-requests-completions"] == "58"


@settings(max_examples=60, deadline=None)
@given(
    rate=st.integers(1, 600),
    burst_fraction=st.floats(0.01, 1.0),
    gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=60),
    class_rate=st.integers(1, 600),
)
def test_never_more_than_burst_plus_rate_times_t(
    rate: int, burst_fraction: float, gaps: list[float], class_rate: int
) -> None:
    """In any window of t seconds, a bucket admits at most its burst + rate * t: the
    tenant-wide one for every request, the class's for its class."""
    burst = max(1, int(rate * burst_fraction))
    limits = {
        "requests_per_minute": rate,
        "requests_burst": burst,
        "per_endpoint": {"completions": {"requests_per_minute": class_rate}},
    }
    sched, clock = scheduler(_policy(limits))
    admitted: list[tuple[float, str]] = []
    for index, gap in enumerate(gaps):
        clock.advance(gap)
        endpoint = "completions" if index % 2 else "chat"
        if sched.submit(ticket("a", max_output=0, endpoint=endpoint)) is None:
            admitted.append((clock.now(), endpoint))
    for start, _ in admitted:
        for end, _ in admitted:
            if end < start:
                continue
            window = [e for t, e in admitted if start <= t <= end]
            assert len(window) <= burst + rate / 60 * (end - start) + 1e-6
            ours = sum(1 for e in window if e == "completions")
            assert ours <= class_rate + class_rate / 60 * (end - start) + 1e-6
