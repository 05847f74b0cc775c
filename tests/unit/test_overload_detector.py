"""OverloadDetector: when the service counts as falling behind, whom it sheds, and recovery."""

from __future__ import annotations

import pytest

from extproc.policy import PolicyError, policy_from_text
from extproc.policy.model import Gateway, Overload
from extproc.service.overload import LAG_WINDOW_S, OverloadDetector
from tests.conftest import policy_yaml


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def detector(**overload: object) -> tuple[OverloadDetector, Clock]:
    clock = Clock()
    settings = Gateway(message_timeout=2.0, overload=Overload(**overload))  # type: ignore[arg-type]
    return OverloadDetector(settings, lambda: {"flood"}, clock), clock


def test_lag_sheds_the_tenants_over_their_share_only_after_two_samples() -> None:
    found, clock = detector(lag_threshold_ms=50)
    assert not found.observe(0.2)  # one stall is not load
    assert not found.sheds("flood")
    clock.now += 0.02
    assert found.observe(0.2)
    assert found.reason == "lag"
    assert found.sheds("flood")
    assert not found.sheds("quiet")


def test_two_late_samples_count_only_within_the_window() -> None:
    found, clock = detector(lag_threshold_ms=50)
    found.observe(0.2)
    clock.now += LAG_WINDOW_S + 0.01
    assert not found.observe(0.2)  # two stalls far apart are not load
    clock.now += 0.1
    assert not found.observe(0.0)
    clock.now += 0.1
    assert found.observe(0.2)  # late, on time, late: a process descheduled in turns


def test_recovers_after_recover_ms_without_a_signal() -> None:
    found, clock = detector(lag_threshold_ms=50, recover_ms=500)
    found.observe(0.1)
    found.observe(0.1)
    clock.now += 0.4
    assert found.observe(0.0)  # still within recover_ms
    assert found.sheds("flood")
    clock.now += 0.2
    assert not found.observe(0.0)
    assert found.reason is None
    assert not found.sheds("flood")


def test_an_unanswered_message_older_than_its_share_of_message_timeout() -> None:
    found, clock = detector(message_age_fraction=0.5, recover_ms=100)
    found.stream_opened("a")
    clock.now += 0.5
    found.stream_opened("b")
    clock.now += 0.4
    assert not found.observe(0.0)  # oldest 0.9 s < 0.5 x 2 s
    clock.now += 0.2
    assert found.observe(0.0)
    assert found.reason == "message_age"
    found.stream_answered("a")  # b is 0.6 s old now
    clock.now += 0.2
    assert not found.observe(0.0)


def test_disabled_never_sheds() -> None:
    found, clock = detector(enabled=False)
    found.stream_opened("a")
    clock.now += 60
    for _ in range(5):
        assert not found.observe(10.0)
    assert not found.sheds("flood")


def test_reload_changes_the_thresholds() -> None:
    found, _clock = detector(lag_threshold_ms=50)
    found.configure(Gateway(overload=Overload(lag_threshold_ms=500)))
    found.observe(0.2)
    assert not found.observe(0.2)


def test_policy_keys_are_strict_and_the_default_is_on() -> None:
    assert policy_from_text(policy_yaml()).source.gateway.overload.enabled
    text = policy_yaml(extra="gateway:\n  overload: {lag_threshold_ms: 80, lag_ms: 3}\n")
    with pytest.raises(PolicyError) as caught:
        policy_from_text(text, "p.yaml")
    line = text.splitlines().index("  overload: {lag_threshold_ms: 80, lag_ms: 3}") + 1
    assert [str(i) for i in caught.value.issues] == [
        f"p.yaml:{line}: gateway.overload.lag_ms: unknown key"
    ]
    text = policy_yaml(extra="gateway:\n  overload: {lag_threshold_ms: 0}\n")
    with pytest.raises(PolicyError):
        policy_from_text(text, "p.yaml")
    off = policy_yaml(extra="gateway:\n  overload: {enabled: false}\n")
    assert not policy_from_text(off).source.gateway.overload.enabled


def test_the_tenants_over_at_the_start_stay_shed_and_a_light_one_never_joins() -> None:
    over = [{"flood"}]
    queued: list[set[str]] = [{"flood"}]
    clock = Clock()
    settings = Gateway(message_timeout=2.0, overload=Overload(lag_threshold_ms=50))
    found = OverloadDetector(settings, lambda: over[0], clock, queued=lambda: queued[0])
    found.observe(0.2)
    clock.now += 0.02
    assert found.observe(0.2) and found.shed_set == {"flood"}
    # The flood's requests were shed and its in-flight ones ended: the quiet tenant's one
    # request is now most of the pool's work, over its share by the rule, with nothing queued.
    over[0], queued[0] = {"quiet"}, set()
    clock.now += 0.02
    assert found.observe(0.2)
    assert found.shed_set == {"flood"} and not found.sheds("quiet")
    # A tenant over its share with requests queued joins during the episode.
    over[0], queued[0] = {"quiet", "batch"}, {"batch"}
    clock.now += 0.02
    assert found.observe(0.2)
    assert found.shed_set == {"flood", "batch"}
    # Once the episode is over, the next one starts from the rule again.
    clock.now += 2.0
    assert not found.observe(0.0) and found.shed_set == frozenset()
    over[0] = {"quiet"}
    found.observe(0.2)
    clock.now += 0.02
    assert found.observe(0.2) and found.shed_set == {"quiet"}


def test_describe_shows_whom_it_sheds_why_and_the_readings() -> None:
    found, clock = detector(lag_threshold_ms=50, cpu_wait_fraction=0.2)
    found.observe(0.004, 0.05)
    assert found.describe() == {
        "enabled": True, "shedding": False, "reason": None, "shed_tenants": [],
        "lag_ms": 4.0, "cpu_wait": 0.05, "lag_threshold_ms": 50.0, "cpu_wait_fraction": 0.2,
    }  # fmt: skip
    clock.now += 0.02
    found.observe(0.004, 0.3)
    shown = found.describe()
    assert (shown["shedding"], shown["reason"], shown["shed_tenants"]) == (
        True, "cpu_wait", ["flood"],
    )  # fmt: skip
    assert shown["cpu_wait"] == 0.3
    off, _clock = detector(enabled=False)
    off.observe(0.5)
    assert off.describe()["enabled"] is False and off.describe()["shedding"] is False
