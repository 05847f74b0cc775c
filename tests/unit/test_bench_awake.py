"""The keep-awake spinners of the low-load benchmark: one per CPU asked, at the lowest
priority, out of the way of any other process, and gone after the block."""

from __future__ import annotations

import os
import time

import pytest

from gateway_lab.bench import awake, lowload
from gateway_lab.bench.host_trace import process_schedstat
from tests.spinners import spinners


def wait_until_idle_policy(pid: int) -> None:
    deadline = time.monotonic() + 10.0
    while os.sched_getscheduler(pid) != os.SCHED_IDLE:
        assert time.monotonic() < deadline, "the spinner never lowered itself"
        time.sleep(0.01)


def test_a_spinner_gives_its_cpu_to_any_other_process() -> None:
    cpu = min(os.sched_getaffinity(0))
    with awake.kept_awake({cpu}) as (spinner,):
        wait_until_idle_policy(spinner)
        assert os.sched_getaffinity(spinner) == {cpu}
        with spinners(1, cpu=cpu) as (busy,):
            spun_before, _ = process_schedstat(spinner)
            ran_before, _ = process_schedstat(busy)
            deadline = time.monotonic() + 10.0
            while process_schedstat(busy)[0] - ran_before < 500.0:
                assert time.monotonic() < deadline, "the busy process did not get its CPU"
                time.sleep(0.05)
            ran = process_schedstat(busy)[0] - ran_before
            spun = process_schedstat(spinner)[0] - spun_before
    # SCHED_IDLE's weight is 3 against a normal task's 1024.
    assert spun < 0.05 * ran, f"the spinner took {spun:.0f} ms beside {ran:.0f} ms"
    with pytest.raises(ProcessLookupError):
        os.sched_getscheduler(spinner)


def test_awake_arms_are_measured_against_straight_awake() -> None:
    arm = {"ttft_p50_ms": 0.0, "ttft_p99_ms": 0.0}
    by_arm = {
        "straight": {**arm, "ttft_p50_ms": 30.0, "ttft_p99_ms": 40.0},
        "straight-awake": {**arm, "ttft_p50_ms": 29.0, "ttft_p99_ms": 35.0},
        "service": {**arm, "ttft_p50_ms": 33.0, "ttft_p99_ms": 45.0},
        "service-awake": {**arm, "ttft_p50_ms": 30.0, "ttft_p99_ms": 37.0},
    }
    added = lowload.compare(by_arm)
    assert added["service"] == {"added_p50_ms": 3.0, "added_p99_ms": 5.0}
    assert added["service-awake"] == {"added_p50_ms": 1.0, "added_p99_ms": 2.0}
