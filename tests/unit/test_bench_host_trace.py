"""The benchmark's host trace: /proc's counters read right, rates over a span, and the slow
requests matched to what the machine did while they ran."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gateway_lab.bench import host_trace
from gateway_lab.bench.host_trace import HostSampler, Sample, around, slow_requests, timeline
from tests.spinners import SPIN, spinners

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def test_cpu_states_are_read_per_cpu_in_ms() -> None:
    text = (
        "cpu  10 0 5 100 0 0 0 7 0 0\n"
        "cpu0 4 0 2 50 0 0 0 3 0 0\n"
        "cpu1 6 0 3 50 0 0 0 4 0 0\n"
        "intr 1 2 3\n"
    )
    cpus = host_trace.read_cpus(text)
    assert set(cpus) == {"cpu0", "cpu1"}
    assert cpus["cpu1"]["steal"] == pytest.approx(4 * TICK_MS)
    assert cpus["cpu0"]["idle"] == pytest.approx(50 * TICK_MS)


@pytest.fixture
def two_spinners_on_one_cpu() -> Iterator[list[int]]:
    """Two busy processes sharing one CPU: each is runnable while the other runs."""
    with spinners(2, cpu=min(os.sched_getaffinity(0))) as pids:
        yield pids


def test_a_process_sharing_its_cpu_shows_time_waiting_to_run(
    two_spinners_on_one_cpu: list[int],
) -> None:
    first = two_spinners_on_one_cpu[0]
    ran_before, waited_before = host_trace.process_schedstat(first)
    began = time.monotonic()
    while time.monotonic() - began < 1.0:
        ran, waited = host_trace.process_schedstat(first)
        if waited - waited_before > 200.0:
            break
        time.sleep(0.05)
    assert ran > ran_before
    assert waited - waited_before > 200.0, "two spinners on one CPU: each waits for the other"


def test_a_gone_process_reads_as_nothing() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    assert host_trace.process_schedstat(done.pid) == (0.0, 0.0)


def sample(at: float, steal_ms: float, idle_ms: float, ran_ms: float, waited_ms: float) -> Sample:
    cpus = {"cpu0": {"steal": steal_ms, "idle": idle_ms}}
    return Sample(at, cpus, {"extproc": (ran_ms, waited_ms)})


SAMPLES = [
    sample(100.0, 0.0, 0.0, 0.0, 0.0),
    sample(101.0, 0.0, 500.0, 500.0, 0.0),  # a quiet second: half idle, nobody waits
    sample(102.0, 300.0, 500.0, 600.0, 400.0),  # 300 ms stolen, the service waited 400 ms
    sample(103.0, 300.0, 1000.0, 1100.0, 400.0),
]


def test_rates_cover_the_span_asked_for() -> None:
    busy = around(SAMPLES, 101.2, 101.8)
    assert busy is not None
    assert (busy["from"], busy["to"]) == (101.0, 102.0)
    assert busy["cpus"]["cpu0"] == {"steal": 300.0, "idle": 0.0}
    assert busy["procs"]["extproc"] == {"cores": 0.1, "wait_ms_per_s": 400.0}
    whole = around(SAMPLES, 100.0, 103.0)
    assert whole is not None
    assert whole["cpus"]["cpu0"]["steal"] == pytest.approx(100.0)
    assert around(SAMPLES[:1], 100.0, 101.0) is None


def test_the_slowest_requests_get_the_host_of_their_own_span() -> None:
    joined = [
        {"sent": 100.3, "ttft": 40.0, "door": 2.0},
        {"sent": 101.5, "ttft": 250.0, "door": 120.0},
        {"sent": 102.4, "ttft": 45.0, "door": 2.5},
    ]
    report = slow_requests(joined, SAMPLES, (100.0, 103.0), slowest=2)
    first, second = report["slowest"]
    assert first["at_s"] == 1.5 and first["ms"] == {"ttft": 250.0, "door": 120.0}
    assert first["host"]["cpus"]["cpu0"]["steal"] == 300.0
    assert second["host"]["cpus"]["cpu0"]["steal"] == 0.0
    assert report["window"]["procs"]["extproc"]["wait_ms_per_s"] == pytest.approx(133.3, abs=0.1)


def test_the_timeline_has_a_row_per_second_with_its_slowest_request() -> None:
    joined = [{"sent": 101.5, "ttft": 250.0}, {"sent": 101.7, "ttft": 50.0}]
    rows = timeline(joined, SAMPLES, (100.0, 103.0))
    assert [r["at_s"] for r in rows] == [0.0, 1.0, 2.0]
    assert math.isnan(rows[0]["slowest_ms"]) and rows[1]["slowest_ms"] == 250.0
    assert [r["steal_ms_per_s"] for r in rows] == [0.0, 300.0, 0.0]
    assert rows[1]["wait_ms_per_s"] == {"extproc": 400.0}


def test_the_sampler_follows_the_named_processes_and_their_children() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])",
        ]
    )
    try:
        deadline = time.monotonic() + 10.0
        while not host_trace.process_labels({"parent": parent.pid}).keys() - {"parent"}:
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.02)
        with HostSampler({"parent": parent.pid}, interval_s=0.05) as sampler:
            while len(sampler.samples) < 4:
                assert time.monotonic() < deadline + 10.0, "the sampler took no samples"
                time.sleep(0.02)
        labels = set(sampler.samples[-1].procs)
        child = next(label for label in labels if label.startswith("parent/"))
        span = around(sampler.samples, sampler.samples[0].at, sampler.samples[-1].at)
        assert span is not None and span["procs"][child]["cores"] > 0.1
        assert set(span["cpus"]) == {f"cpu{i}" for i in range(os.cpu_count() or 1)}
    finally:
        for pid in host_trace.process_labels({"parent": parent.pid}).values():
            if pid != parent.pid:
                os.kill(pid, 9)
        parent.kill()
        parent.wait(timeout=10)
