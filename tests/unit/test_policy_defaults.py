"""Capacity defaults: what a pool without headroom / adaptive keys resolves to, the keys that
turn each off, existing settings kept, and `extproc policy check`'s explanation and warnings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.policy import PolicyError, policy_from_text
from extproc.policy.capacity import capacity_warnings, describe_pools
from extproc.policy.model import Pool, default_headroom
from extproc.scheduler import ManualClock, Scheduler, Ticket
from extproc.scheduler.adaptive import (
    AdaptiveCapacity,
    AdaptiveSettings,
    EngineCapacities,
    EngineSample,
)
from extproc.scheduler.capacity import StaticCapacity


def _text(max_inflight: int, keys: str = "", state: str = "") -> str:
    extra = f", {keys}" if keys else ""
    return f"""\
version: 1
tiers: [standard]
tenants:
  quiet: {{tier: standard, limits: {{max_queued: 1000}}}}
  flood: {{tier: standard, limits: {{max_queued: 1000}}}}
pools:
  p: {{max_total_tokens: 100000, max_inflight: {max_inflight}, max_inflight_tokens: 10000000,
       endpoints: ["127.0.0.1:1"]{extra}}}
{state}"""


def _pool(max_inflight: int, keys: str = "") -> Pool:
    return policy_from_text(_text(max_inflight, keys)).pools["p"]


@pytest.mark.parametrize(
    ("max_inflight", "headroom"),
    [(1, 0), (2, 1), (4, 1), (7, 1), (8, 2), (24, 6), (32, 8), (64, 8), (256, 8), (4096, 8)],
)
def test_omitted_headroom_is_a_quarter_of_max_inflight_between_1_and_8(
    max_inflight: int, headroom: int
) -> None:
    assert default_headroom(max_inflight) == headroom
    pool = _pool(max_inflight)
    assert pool.headroom is None and pool.effective_headroom == headroom
    assert StaticCapacity(pool).describe() == {
        "max_inflight": max_inflight - headroom,
        "hard_inflight": max_inflight,
        "headroom": headroom,
        "max_inflight_tokens": 10000000,
    }


@pytest.mark.parametrize(("written", "effective"), [(0, 0), (3, 3), (9, 9), (10, 9), (50, 9)])
def test_a_written_headroom_keeps_its_meaning(written: int, effective: int) -> None:
    pool = _pool(10, f"headroom: {written}")
    assert pool.effective_headroom == effective
    assert StaticCapacity(pool).describe()["max_inflight"] == 10 - effective


def test_omitted_adaptive_follows_the_engines_once_sampled_and_is_static_until_then() -> None:
    pool = _pool(24)
    assert pool.adaptive is None and pool.adaptive_enabled
    settings = AdaptiveSettings.from_pool(pool)
    assert settings == AdaptiveSettings(headroom=6, static_until_sampled=True)
    capacities = EngineCapacities()
    capacity = capacities.factory("p", pool)
    assert isinstance(capacity, AdaptiveCapacity) and capacities.adaptive == {"p": capacity}
    # No sample (engines without vLLM metrics): exactly the static limits.
    static = StaticCapacity(_pool(24, "adaptive: {enabled: false}"))
    assert (
        (capacity.soft_limit(), capacity.hard_limit())
        == (18, 24)
        == (
            static.max_inflight,
            static.hard_inflight,
        )
    )
    capacity.update(_pool(27))  # a reload while unsampled: still the static limit
    assert (capacity.soft_limit(), capacity.hard_limit()) == (21, 27)
    capacity.update(pool)
    # The first sample starts the controller where an explicit section starts (16).
    assert capacities.observe("p", EngineSample(1.0, 0.0, 4.0, 0.1))
    assert (capacity.soft_limit(), capacity.hard_limit()) == (16, 22)
    assert not capacity.controller.static()
    capacities.observe("p", EngineSample(2.0, 50.0, 16.0, 0.1))  # congested: x0.9
    assert capacity.soft_limit() == 14


def test_an_adaptive_section_keeps_its_meaning_and_starts_at_once() -> None:
    explicit = AdaptiveSettings.from_pool(_pool(24, "adaptive: {}"))
    assert explicit == AdaptiveSettings(headroom=6)
    capacity = AdaptiveCapacity(_pool(24, "adaptive: {}"), explicit)
    assert capacity.soft_limit() == 16  # before any sample, as before the defaults
    tuned = _pool(512, "headroom: 8, adaptive: {min_inflight: 2, initial_inflight: 32}")
    settings = AdaptiveSettings.from_pool(tuned)
    assert settings == AdaptiveSettings(min_inflight=2, initial_inflight=32, headroom=8)
    assert AdaptiveCapacity(tuned, settings).describe()["max_inflight"] == 32


def test_each_default_turns_off() -> None:
    pool = _pool(24, "headroom: 0, adaptive: {enabled: false}")
    assert not pool.adaptive_enabled and AdaptiveSettings.from_pool(pool) is None
    capacities = EngineCapacities()
    capacity = capacities.factory("p", pool)
    assert isinstance(capacity, StaticCapacity) and capacities.adaptive == {}
    assert capacity.describe()["max_inflight"] == capacity.describe()["hard_inflight"] == 24
    no_headroom = _pool(24, "headroom: 0")
    settings = AdaptiveSettings.from_pool(no_headroom)
    assert settings is not None and settings.headroom == 0
    only_static = _pool(24, "adaptive: {enabled: false}")
    assert StaticCapacity(only_static).describe()["headroom"] == 6


@pytest.mark.parametrize(
    ("keys", "field", "needle"),
    [
        ("adaptive: false", "pools.p.adaptive", "adaptive: false"),
        ("adaptive: {enabled: no}", "pools.p.adaptive.enabled", "enabled: no"),
        ("adaptive: {enable: false}", "pools.p.adaptive.enable", "enable: false"),
        ("headroom: -1", "pools.p.headroom", "headroom: -1"),
        ("headroom: auto", "pools.p.headroom", "headroom: auto"),
    ],
)
def test_capacity_keys_are_strict_with_file_line(keys: str, field: str, needle: str) -> None:
    text = _text(24, keys).replace(f", {keys}", f",\n       {keys}")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if needle in row)
    with pytest.raises(PolicyError) as caught:
        policy_from_text(text, "p.yaml")
    issues = [str(issue) for issue in caught.value.issues]
    assert any(issue.startswith(f"p.yaml:{line}: {field}") for issue in issues), issues


def test_a_plain_policy_keeps_headroom_for_the_light_tenant() -> None:
    """The issue's case: the flooder fills the soft limit; the quiet request is admitted at
    once (the scheduler's default, static capacity); with `headroom: 0` it waits."""
    for keys, quiet_admitted in (("", True), ("headroom: 0", False)):
        sched = Scheduler(policy_from_text(_text(6, keys)), ManualClock(0.0))
        for i in range(10):
            assert sched.submit(Ticket(f"f{i}", "flood", "p", 1000, 200)) is None
        flood = [a.ticket.request_id for a in sched.dispatch()]
        assert len(flood) == (5 if keys == "" else 6)
        sched.submit(Ticket("q0", "quiet", "p", 100, 20))
        admitted = [a.ticket.request_id for a in sched.dispatch()]
        assert admitted == (["q0"] if quiet_admitted else [])


def test_policy_check_explains_the_resolved_defaults() -> None:
    plain = policy_from_text(_text(24)).source
    assert describe_pools(plain) == [
        "pool p: max_inflight 24 (hard limit), headroom 6 (default: a quarter of max_inflight, "
        "1..8), soft limit adaptive (default) in [4, 18]: follows the engines' vLLM metrics, "
        "static 18 until they expose them"
    ]
    assert capacity_warnings(plain) == []
    tuned = policy_from_text(_text(512, "headroom: 8, adaptive: {initial_inflight: 32}")).source
    assert describe_pools(tuned) == [
        "pool p: max_inflight 512 (hard limit), headroom 8 (set), soft limit adaptive in "
        "[4, 504], starting at 32"
    ]
    assert capacity_warnings(tuned) == []
    static = policy_from_text(_text(24, "headroom: 30, adaptive: {enabled: false}")).source
    assert describe_pools(static) == [
        "pool p: max_inflight 24 (hard limit), headroom 23 (set 30, clamped below "
        "max_inflight), soft limit 1 static (adaptive: {enabled: false})"
    ]


def _warnings(keys: str, max_inflight: int = 24, state: str = "") -> list[str]:
    return [
        str(w) for w in capacity_warnings(policy_from_text(_text(max_inflight, keys, state)).source)
    ]


def test_warning_headroom_0_with_a_static_limit() -> None:
    (warning,) = _warnings("headroom: 0, adaptive: {enabled: false}")
    assert warning.startswith("pools.p.headroom: warning: headroom 0 with a static soft limit")
    (single,) = _warnings("adaptive: {enabled: false}", max_inflight=1)
    assert single.startswith("pools.p.headroom: warning: max_inflight 1 leaves no room for it")


def test_warning_headroom_0_with_the_adaptive_limit() -> None:
    (warning,) = _warnings("headroom: 0")
    assert warning.startswith("pools.p.headroom: warning: headroom 0: whenever the soft limit")


def test_warning_headroom_at_or_above_max_inflight() -> None:
    for headroom in (24, 100):
        (warning,) = _warnings(f"headroom: {headroom}")
        assert warning == (
            f"pools.p.headroom: warning: headroom {headroom} >= max_inflight 24: it is clamped "
            "to 23, leaving a soft limit of 1 for every backlogged tenant"
        )
    assert _warnings("headroom: 23") == []


def test_warning_adaptive_section_with_shared_state() -> None:
    state = "state: {backend: redis}\n"
    (warning,) = _warnings("adaptive: {}", state=state)
    assert warning.startswith("pools.p.adaptive: warning: adaptive does not apply with state")
    assert _warnings("", state=state) == []  # the default says so in the explanation only
    described = describe_pools(policy_from_text(_text(24, "", state)).source)
    assert described[0].endswith("soft limit 18 static (adaptive does not apply with "
                                 "state.backend: redis)")  # fmt: skip


def test_cli_check_prints_the_capacity_and_warns_on_stderr(tmp_path: Path) -> None:
    file = tmp_path / "p.yaml"
    file.write_text(_text(24, "headroom: 0, adaptive: {enabled: false}"))
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "policy", "check", str(file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        f"{file}: ok (2 tenants, 1 pools)",
        "  pool p: max_inflight 24 (hard limit), headroom 0 (set), soft limit 24 static "
        "(adaptive: {enabled: false})",
        "  pool p: engine priority on (body `priority` = tier rank x 2, + 1 when backlogged; "
        "engines need --scheduling-policy priority), prefill pacing off (default)",
        "  chat (/v1/chat/completions): pool p",
        "  completions (/v1/completions): pool p",
        "  embeddings (/v1/embeddings): no pool: answered 404",
        "  rerank (/v1/rerank, /v1/score): no pool: answered 404",
        "  overload: the tenants above their fair share are shed while the event loop lags "
        "over 100 ms, a message Envoy waits on is older than 2.5 s, or the loop's thread "
        "waits for a CPU off (default)",
    ]
    assert result.stderr.startswith(f"{file}: pools.p.headroom: warning: headroom 0 with")
