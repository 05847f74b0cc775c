"""Token bucket math, the in-memory store, header formatting, rate estimators."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.scheduler import (
    Bucket,
    DecayingRate,
    MemoryLimitStore,
    Take,
    format_reset,
    ratelimit_headers,
)
from extproc.scheduler.limits import adjusted, given_back, refilled, take_all
from extproc.scheduler.retry_after import after_wait


def test_refill_is_continuous_and_capped() -> None:
    bucket = Bucket("k", 60.0, 1.0)
    assert refilled(0.0, 10.0, bucket, 10.5) == pytest.approx(0.5)
    assert refilled(0.0, 10.0, bucket, 1000.0) == 60.0
    assert refilled(5.0, 10.0, bucket, 9.0) == 5.0  # time going backwards adds nothing
    assert refilled(-30.0, 0.0, bucket, 10.0) == pytest.approx(-20.0)


def test_take_all_is_all_or_nothing() -> None:
    rpm = Bucket("r", 10.0, 10 / 60)
    tpm = Bucket("t", 1000.0, 1000 / 60)
    ok = take_all([10.0, 1000.0], [Take(rpm, 1), Take(tpm, 400)])
    assert ok.ok and ok.levels == (9.0, 600.0) and ok.wait_s == 0.0
    short = take_all([10.0, 100.0], [Take(rpm, 1), Take(tpm, 400)])
    assert not short.ok and short.levels == (10.0, 100.0)
    assert short.wait_s == pytest.approx(300 / (1000 / 60))
    never = take_all([10.0, 1000.0], [Take(rpm, 1), Take(tpm, 1001)])
    assert not never.ok and never.wait_s is None


def test_give_back_and_adjust() -> None:
    bucket = Bucket("k", 100.0, 1.0)
    assert given_back(90.0, 50.0, bucket) == 100.0
    assert adjusted(10.0, 30.0, bucket) == -20.0  # a debit may go negative
    assert adjusted(90.0, -30.0, bucket) == 100.0  # a refund never overfills


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0201, "21ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.25, "59.25s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (361.5, "6m1.5s"),
        (3600, "1h0m0s"),
        (3723, "1h2m3s"),
    ],
)
def test_format_reset_like_openai(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert after_wait(0.0) == 1
    assert after_wait(0.2) == 1
    assert after_wait(1.0) == 1
    assert after_wait(1.0000001) == 2
    assert after_wait(12.0) == 12


def test_ratelimit_headers_only_for_existing_limits() -> None:
    rpm = Bucket("r", 60.0, 1.0)
    tpm = Bucket("t", 6000.0, 100.0)
    both = ratelimit_headers([("requests", rpm, 59.0), ("tokens", tpm, 5400.0)])
    assert both == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert ratelimit_headers([]) == {}
    negative = ratelimit_headers([("tokens", tpm, -50.0)])
    assert negative["x-ratelimit-remaining-tokens"] == "0"
    assert negative["x-ratelimit-reset-tokens"] == "1m0.5s"


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 2_000_000),
    fill=st.floats(0.0, 1.0),
    cost_share=st.floats(0.0, 1.0),
    start=st.floats(0.0, 1e6),
)
def test_memory_store_retry_after_is_exact(
    capacity: int, fill: float, cost_share: float, start: float
) -> None:
    """After waiting retry_after the same take passes; one second earlier it does not."""
    bucket = Bucket("k", float(capacity), capacity / 60.0)
    store = MemoryLimitStore()
    drain = math.floor(capacity * fill)
    if drain:
        assert store.try_take([Take(bucket, drain)], start).ok
    cost = max(1, math.floor(capacity * cost_share))
    first = store.try_take([Take(bucket, cost)], start)
    if first.ok:
        return
    assert first.wait_s is not None
    retry = after_wait(first.wait_s)
    if retry > 1:
        assert not store.try_take([Take(bucket, cost)], start + retry - 1).ok
    assert store.try_take([Take(bucket, cost)], start + retry).ok


def test_memory_store_failed_take_changes_nothing() -> None:
    rpm = Bucket("r", 2.0, 2 / 60)
    tpm = Bucket("t", 100.0, 100 / 60)
    store = MemoryLimitStore()
    assert not store.try_take([Take(rpm, 1), Take(tpm, 150)], 0.0).ok
    assert store.level(rpm, 0.0) == 2.0
    store.adjust(tpm, 130.0, 0.0)
    assert store.level(tpm, 0.0) == -30.0
    assert store.level(tpm, 6.0) == pytest.approx(-20.0)
    store.give_back(tpm, 500.0, 6.0)
    assert store.level(tpm, 6.0) == 100.0


def test_decaying_rate_tracks_a_steady_stream() -> None:
    rate = DecayingRate(halflife_s=5.0, min_samples=4)
    assert rate.rate(0.0) is None
    for i in range(3):
        rate.record(i * 0.5)
    assert rate.rate(1.0) is None  # too few samples to act on
    for i in range(3, 200):
        rate.record(i * 0.5)
    assert rate.rate(99.5) == pytest.approx(2.0, rel=0.1)
    # Early on the warm-up correction keeps the estimate near the truth, not low.
    early = DecayingRate(halflife_s=30.0, min_samples=4)
    for i in range(10):
        early.record(i * 0.25)
    value = early.rate(2.25)
    assert value is not None and value == pytest.approx(4.0, rel=0.2)
    # Silence: the rate decays.
    later = rate.rate(120.0)
    assert later is not None and later < 0.2
