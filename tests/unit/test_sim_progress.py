"""What `extproc simulate plan` shows while it works: each pool it sizes is a phase, its trials
go to the terminal's live line, and a pipe gets one line per pool and no trial lines."""

from __future__ import annotations

import io

from sim_support import req
from test_sim_plan import FLAT

from gateway_lab.progress import Progress
from gateway_lab.sim.plan import PlanConfig, plan_capacity
from gateway_lab.sim.slo import Slo


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _plan(stream: io.StringIO, interval_s: float = 0.5) -> tuple[Progress, list[str]]:
    # The case of test_plan_finds_the_known_minimum: 3 pools (homogeneous, short, long).
    requests = [req(0.0, 100, 1) for _ in range(8)] + [req(0.0, 1400, 1) for _ in range(2)]
    config = PlanConfig(
        base_profile=FLAT, slo=Slo(ttft_s=0.015), attainment=1.0, thresholds=(256, 4096)
    )
    logged: list[str] = []
    tracker = Progress("plan", 1, stream=stream, interval_s=interval_s)
    result = plan_capacity(requests, config, logged.append, tracker)
    assert result.homogeneous.replicas == 5
    return tracker, logged


def test_a_pipe_gets_one_line_per_pool_sized() -> None:
    stream = io.StringIO()
    tracker, logged = _plan(stream)
    assert tracker.total == 3 and tracker.phases == 3
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "[plan] homogeneous@2048",
        "[plan] short@256",
        "[plan] long@2048",
    ]
    assert "0% 0/3" in lines[0] and "33% 1/3" in lines[1] and "67% 2/3" in lines[2]
    assert logged == ["[plan] threshold 4096 >= long context 2048: skipped"]


def test_a_terminal_shows_the_trials_on_the_live_line() -> None:
    stream = Terminal()
    tracker, _ = _plan(stream, interval_s=0.0)  # every trial redraws
    frames = stream.getvalue().split("\r")[1:]
    assert "\n" not in stream.getvalue()  # the note went to the log, not to this stream
    homogeneous = [f for f in frames if f.startswith("[plan] homogeneous@2048")]
    assert any("  5 replicas meets the SLO" in f for f in homogeneous)
    assert any("  4 replicas misses the SLO" in f for f in homogeneous)
    tracker.finish()
    assert stream.getvalue().endswith("\x1b[K\n") and stream.getvalue().count("\n") == 1


def test_without_progress_the_trials_go_to_the_log() -> None:
    requests = [req(0.0, 100, 1) for _ in range(10)]
    config = PlanConfig(
        base_profile=FLAT, slo=Slo(ttft_s=0.015), attainment=1.0, thresholds=(), long_context=2048
    )
    logged: list[str] = []
    plan_capacity(requests, config, logged.append)
    assert logged and all(line.startswith("[plan] homogeneous@2048 (") for line in logged)
    assert any("meets the SLO" in line for line in logged)
