"""The event loop thread's wait for a CPU (extproc.service.cpu_wait) and the overload
detector's use of it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.defaults import default_policy_path
from extproc.policy import PolicyError, load_policy, policy_from_text
from extproc.policy.capacity import describe_overload
from extproc.policy.model import Gateway as GatewaySettings
from extproc.service.cpu_wait import CpuWait, schedstat_path
from extproc.service.overload import OverloadDetector
from tests.conftest import policy_yaml
from tests.spinners import spinners


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, waited_ms: float) -> None:
    path.write_text(f"123456 {int(waited_ms * 1e6)} 42\n")


def test_the_share_is_taken_over_the_last_window(tmp_path: Path) -> None:
    path, clock = tmp_path / "schedstat", Clock()
    write(path, 0.0)
    wait = CpuWait(path, window_s=0.5, clock=clock)
    assert wait.available
    assert wait.sample() is None  # one reading: no span yet
    for step in range(1, 6):  # 100 ms apart, 20 ms of waiting each
        clock.now = step * 0.1
        write(path, step * 20.0)
        assert wait.sample() == pytest.approx(0.2)
    for step in range(6, 11):  # then 80 ms of each 100 waiting
        clock.now = step * 0.1
        write(path, 100.0 + (step - 5) * 80.0)
        share = wait.sample()
    assert share == pytest.approx(0.8)  # the old, calm readings left the window


def test_no_counter_no_signal(tmp_path: Path) -> None:
    wait = CpuWait(tmp_path / "missing")
    assert not wait.available
    assert wait.sample() is None


@pytest.fixture
def thread_on_a_crowded_cpu() -> Iterator[Path]:
    """A spinner's schedstat, with a second spinner on the same CPU."""
    with spinners(2, cpu=min(os.sched_getaffinity(0))) as (first, _second):
        yield schedstat_path(first, first)


def test_a_thread_sharing_its_cpu_waits_about_half_the_time(
    thread_on_a_crowded_cpu: Path,
) -> None:
    wait = CpuWait(thread_on_a_crowded_cpu, window_s=0.3)
    assert wait.available
    share = None
    deadline = time.monotonic() + 10.0
    while share is None or share < 0.25:
        assert time.monotonic() < deadline, f"the share stayed at {share}"
        time.sleep(0.05)
        share = wait.sample()
    assert share <= 1.0


def test_this_thread_reads_its_own_counter() -> None:
    assert CpuWait(schedstat_path()).available


def detector(cpu_wait_fraction: float | None) -> tuple[OverloadDetector, Clock]:
    clock = Clock()
    overload = {"cpu_wait_fraction": cpu_wait_fraction, "recover_ms": 500}
    settings = GatewaySettings.model_validate({"overload": overload})
    return OverloadDetector(settings, lambda: {"flooder"}, clock), clock


def test_waiting_for_a_cpu_past_the_threshold_sheds_until_it_recovers() -> None:
    overload, clock = detector(0.2)
    assert not overload.observe(0.0, 0.15)
    clock.now = 0.02
    assert overload.observe(0.0, 0.25)
    assert overload.reason == "cpu_wait" and overload.shed_set == {"flooder"}
    assert overload.cpu_wait == 0.25
    clock.now = 0.3
    assert overload.observe(0.0, 0.05)  # still within recover_ms
    clock.now = 0.6
    assert not overload.observe(0.0, 0.05)
    assert overload.reason is None


def test_without_a_threshold_the_wait_is_ignored() -> None:
    overload, _clock = detector(None)
    assert not overload.observe(0.0, 0.99)
    assert not overload.observe(0.0, None)


def test_the_threshold_is_validated_with_its_place() -> None:
    text = "version: 1\ngateway:\n  overload: {cpu_wait_fraction: 1.5}\n"
    with pytest.raises(PolicyError) as error:
        policy_from_text(text, file="p.yaml")
    message = str(error.value)
    assert "p.yaml:3" in message and "cpu_wait_fraction" in message


def test_the_shipped_policy_turns_it_on_and_policy_check_says_so() -> None:
    shipped = load_policy(default_policy_path()).source
    assert shipped.gateway.overload.cpu_wait_fraction == 0.15
    assert describe_overload(shipped) == [
        "overload: the tenants above their fair share are shed while the event loop lags over "
        "100 ms, a message Envoy waits on is older than 2.5 s, or the loop's thread waits for "
        "a CPU over 15% of the time"
    ]
    plain = policy_from_text(policy_yaml(extra="gateway: {message_timeout: 10s}\n")).source
    assert describe_overload(plain)[0].endswith(
        "is older than 5 s, or the loop's thread waits for a CPU off (default)"
    )
    off = policy_from_text(policy_yaml(extra="gateway: {overload: {enabled: false}}\n")).source
    assert describe_overload(off) == ["overload shedding off (set)"]
