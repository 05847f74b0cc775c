"""The scheduler's tables and pure rules: limit dimensions, the fairness registry, Retry-After."""

from __future__ import annotations

from typing import get_args

import pytest
from sched_support import make_policy, scheduler, ticket

from extproc.policy.model import Fairness, Limits
from extproc.scheduler import DIMENSIONS, FAIRNESS_POLICIES, Bucket, make_fairness
from extproc.scheduler import retry_after as ra
from extproc.scheduler.ratelimit import bucket_for_key


def test_every_dimension_reads_a_policy_field_and_has_unique_names() -> None:
    for dimension in DIMENSIONS:
        assert dimension.policy_field in Limits.model_fields
        assert dimension.period_s > 0
    assert len({d.name for d in DIMENSIONS}) == len(DIMENSIONS)
    assert len({d.header_suffix for d in DIMENSIONS}) == len(DIMENSIONS)


def test_every_dimension_charges_reports_and_refunds() -> None:
    limits = {d.policy_field: 100000 for d in DIMENSIONS}
    policy = make_policy({"a": {"tier": "gold", "limits": limits}})
    sched, _clock = scheduler(policy)
    t = ticket("a", input_tokens=30, max_output=20)
    assert sched.submit(t) is None
    buckets = sched.snapshot()["tenants"]["a"]["buckets"]
    assert buckets == {d.name: 100000.0 - d.cost(t) for d in DIMENSIONS}
    assert [take.bucket.key for take in sched.rate_takes(t)] == [f"a:{d.name}" for d in DIMENSIONS]
    assert sched.cancel(t.request_id)
    assert sched.snapshot()["tenants"]["a"]["buckets"] == {d.name: 100000.0 for d in DIMENSIONS}
    t2 = ticket("a")
    assert sched.submit(t2) is None
    [admission] = sched.dispatch()
    for d in DIMENSIONS:
        for header in ("limit", "remaining", "reset"):
            assert f"x-ratelimit-{header}-{d.header_suffix}" in admission.ratelimit_headers


def test_a_bucket_key_names_its_dimension() -> None:
    limits = {d.policy_field: 600 for d in DIMENSIONS}
    spec = make_policy({"a": {"tier": "gold", "limits": limits}}).tenants["a"]
    for d in DIMENSIONS:
        bucket = bucket_for_key(f"a:{d.name}", spec)
        assert bucket == Bucket(f"a:{d.name}", 600.0, 600 / d.period_s)
    assert bucket_for_key("a:nonsense", spec) is None
    unlimited = make_policy({"a": {"tier": "gold"}}).tenants["a"]
    assert all(bucket_for_key(f"a:{d.name}", unlimited) is None for d in DIMENSIONS)


def test_fairness_registry_matches_the_policy_file_names() -> None:
    names = get_args(Fairness.model_fields["policy"].annotation)
    assert set(names) == set(FAIRNESS_POLICIES)
    for name, cls in FAIRNESS_POLICIES.items():
        assert cls.name == name
        assert make_fairness(name, 64).name == name
    with pytest.raises(ValueError, match="unknown fairness policy"):
        make_fairness("nope", 64)


def test_retry_after_after_wait_rounds_up_to_whole_seconds() -> None:
    assert ra.after_wait(0.0) == 1
    assert ra.after_wait(2.5) == 3


def test_retry_after_backlog_is_clamped_to_the_queue_wait() -> None:
    assert ra.after_backlog(10, None, 30.0) == ra.UNKNOWN_S
    assert ra.after_backlog(10, 0.0, 30.0) == ra.UNKNOWN_S
    assert ra.after_backlog(10, 2.0, 30.0) == 5
    assert ra.after_backlog(0, 2.0, 30.0) == 1
    assert ra.after_backlog(1000, 2.0, 30.0) == 30
    assert ra.after_backlog(1000, 2.0, 0.2) == 1


def test_retry_after_queue_full_takes_the_sooner_slot() -> None:
    assert ra.after_queue_full(None, None) == ra.UNKNOWN_S
    assert ra.after_queue_full(0.25, None) == 4
    assert ra.after_queue_full(0.25, 2.2) == 3
    assert ra.after_queue_full(None, -5.0) == 1
