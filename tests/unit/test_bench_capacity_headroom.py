"""Headroom and adaptive capacity: the pure scheduler side (no I/O)."""

from __future__ import annotations

import pytest

from extproc.policy import policy_from_text
from extproc.scheduler import ManualClock, Scheduler, Ticket
from extproc.scheduler.adaptive import (
    AdaptiveCapacity,
    AdaptiveSettings,
    AimdLimit,
    EngineCapacities,
    EngineSample,
)
from extproc.scheduler.capacity import StaticCapacity


def _policy(max_inflight: int, tiers: str = "[gold, silver]", quiet_tier: str = "gold") -> str:
    return f"""\
version: 1
tiers: {tiers}
tenants:
  flood: {{tier: gold, limits: {{max_queued: 1000}}}}
  quiet: {{tier: {quiet_tier}, limits: {{max_queued: 1000}}}}
  other: {{tier: gold, limits: {{max_queued: 1000}}}}
pools:
  p: {{max_total_tokens: 100000, max_inflight: {max_inflight}, max_inflight_tokens: 10000000,
       endpoints: ["127.0.0.1:1"], headroom: 0, adaptive: {{enabled: false}}}}
"""


def _ticket(rid: str, tenant: str, tokens_in: int = 1000, tokens_out: int = 200) -> Ticket:
    return Ticket(rid, tenant, "p", tokens_in, tokens_out)


def _sched(max_inflight: int, headroom: int, **kw: str) -> Scheduler:
    policy = policy_from_text(_policy(max_inflight, **kw))
    capacities = EngineCapacities(static_headroom={"p": headroom})
    return Scheduler(policy, ManualClock(0.0), capacity_factory=capacities.factory)


def _admitted(sched: Scheduler) -> list[str]:
    return [a.ticket.request_id for a in sched.dispatch()]


def test_static_capacity_splits_soft_and_hard() -> None:
    pool = policy_from_text(_policy(10)).pools["p"]
    cap = StaticCapacity(pool, headroom=3)
    assert (cap.max_inflight, cap.hard_inflight) == (7, 10)
    for _ in range(7):
        cap.acquire(1)
    assert not cap.has_slot() and cap.has_headroom() and cap.fits_headroom(1)
    assert StaticCapacity(pool).describe()["max_inflight"] == 10  # no headroom: one limit


def test_quiet_tenant_uses_headroom_while_flooder_fills_soft_limit() -> None:
    sched = _sched(6, 2)
    for i in range(10):
        assert sched.submit(_ticket(f"f{i}", "flood")) is None
    assert len(_admitted(sched)) == 4  # the soft limit
    assert sched.submit(_ticket("q1", "quiet", 100, 20)) is None
    assert sched.submit(_ticket("q2", "quiet", 100, 20)) is None
    assert _admitted(sched) == ["q1", "q2"]  # above the soft limit, at once
    assert sched.submit(_ticket("q3", "quiet", 100, 20)) is None
    assert _admitted(sched) == []  # the hard limit is reached


def test_backlogged_tenant_never_takes_headroom() -> None:
    sched = _sched(6, 2)
    for i in range(10):
        sched.submit(_ticket(f"f{i}", "flood"))
    assert len(_admitted(sched)) == 4
    lease = sched.snapshot()["pools"]["p"]
    assert lease["inflight"] == 4 and lease["hard_inflight"] == 6
    for i in range(3):
        sched.submit(_ticket(f"o{i}", "other"))  # another heavy tenant arrives
    # other's demand (3 x 1200 tokens) exceeds half of the admitted 4800: not light.
    assert _admitted(sched) == []


def test_lower_tier_light_tenant_may_use_headroom_after_higher_tiers() -> None:
    sched = _sched(4, 2, quiet_tier="silver")
    for i in range(5):
        sched.submit(_ticket(f"f{i}", "flood"))
    assert len(_admitted(sched)) == 2
    sched.submit(_ticket("q1", "quiet", 100, 20))
    assert _admitted(sched) == ["q1"]


def test_aimd_grows_while_binding_and_backs_off_on_queue() -> None:
    settings = AdaptiveSettings(
        min_inflight=2, initial_inflight=4, target_waiting=1.0, cooldown_s=1.0, smoothing=1.0
    )
    limit = AimdLimit(settings, ceiling=10)
    limit.observe(EngineSample(0.0, 0, 4, 0.1), peak_inflight=4)
    assert limit.limit == 5
    limit.observe(EngineSample(0.1, 0, 2, 0.1), peak_inflight=2)  # not binding: no growth
    assert limit.limit == 5
    limit.observe(EngineSample(0.2, 5, 5, 0.1), peak_inflight=5)  # engine queue: back off
    assert limit.limit == pytest.approx(4.5)
    limit.observe(EngineSample(0.5, 0, 4, 0.1), peak_inflight=5)  # cooldown: no change
    assert limit.limit == pytest.approx(4.5)
    limit.observe(EngineSample(1.3, 0, 4, 0.95), peak_inflight=5)  # KV above target
    assert limit.limit == pytest.approx(4.05)
    for step in range(100):
        limit.observe(EngineSample(3.0 + step, 0, 4, 0.1), peak_inflight=100)
    assert limit.limit == 10  # the ceiling
    for step in range(100):
        limit.observe(EngineSample(200.0 + 2 * step, 50, 4, 0.1), peak_inflight=100)
    assert limit.limit == 2  # the floor


def test_adaptive_capacity_feeds_the_scheduler() -> None:
    policy = policy_from_text(_policy(64))
    settings = AdaptiveSettings(
        min_inflight=1, initial_inflight=2, headroom=1, smoothing=1.0, cooldown_s=0.0
    )
    capacities = EngineCapacities({"p": settings})
    sched = Scheduler(policy, ManualClock(0.0), capacity_factory=capacities.factory)
    capacity = capacities.adaptive["p"]
    assert isinstance(capacity, AdaptiveCapacity)
    for i in range(8):
        sched.submit(_ticket(f"f{i}", "flood"))
    assert len(_admitted(sched)) == 2
    assert capacities.observe("p", EngineSample(1.0, 0, 2, 0.2))  # binding, no queue: +1
    assert len(_admitted(sched)) == 1
    assert capacities.observe("p", EngineSample(2.0, 3, 3, 0.2))  # queue: x0.9 -> 2
    assert sched.snapshot()["pools"]["p"]["max_inflight"] == 2
    assert _admitted(sched) == []
    assert not capacities.observe("other", EngineSample(3.0, 0, 0, 0.0))


def test_settings_from_mapping_reject_unknown_keys() -> None:
    assert AdaptiveSettings.from_mapping({"headroom": 4}).headroom == 4
    with pytest.raises(ValueError, match="unknown"):
        AdaptiveSettings.from_mapping({"head_room": 4})
    with pytest.raises(ValueError):
        AdaptiveSettings(decrease=1.5)


def test_settings_from_the_policy_fields() -> None:
    """The `pools.NAME.adaptive` / `headroom` fields of extproc/policy/model.py map onto
    AdaptiveSettings."""
    from extproc.policy.model import Pool

    pool = Pool.model_validate(
        {
            "max_total_tokens": 8192, "max_inflight": 64, "max_inflight_tokens": 100000,
            "endpoints": ["127.0.0.1:1"], "headroom": 6,
            "adaptive": {"cooldown": "2s", "poll_interval": "250ms", "target_waiting": 2},
        },
        strict=False,
    )  # fmt: skip
    settings = AdaptiveSettings.from_pool(pool)
    assert settings is not None
    assert (settings.cooldown_s, settings.poll_interval_s) == (2.0, 0.25)
    assert (settings.headroom, settings.target_waiting, settings.min_inflight) == (6, 2.0, 4)
    capacities = EngineCapacities()
    capacity = capacities.factory("p", pool)
    assert isinstance(capacity, AdaptiveCapacity) and capacity.hard_limit() == 16 + 6
    static = Pool.model_validate(
        {"max_total_tokens": 8192, "max_inflight": 64, "max_inflight_tokens": 100000,
         "endpoints": ["127.0.0.1:1"], "headroom": 6, "adaptive": {"enabled": False}},
        strict=False,
    )  # fmt: skip
    assert AdaptiveSettings.from_pool(static) is None
    assert capacities.factory("p", static).describe()["max_inflight"] == 58
    assert "p" not in capacities.adaptive
