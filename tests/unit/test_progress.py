"""gateway_lab.progress: the ETA arithmetic on an injected clock, one rewritten line on a
terminal, one line per phase in a pipe."""

from __future__ import annotations

import io

import pytest

from gateway_lab.progress import Progress, eta_seconds, format_duration


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eta_is_the_rest_at_the_pace_so_far() -> None:
    assert eta_seconds(done=2, total=10, elapsed=4.0) == pytest.approx(16.0)
    assert eta_seconds(done=7.5, total=10, elapsed=30.0) == pytest.approx(10.0)
    assert eta_seconds(done=0, total=10, elapsed=4.0) is None  # no pace yet
    assert eta_seconds(done=3, total=10, elapsed=0.0) is None
    assert eta_seconds(done=10, total=10, elapsed=4.0) == 0.0
    assert eta_seconds(done=12, total=10, elapsed=4.0) == 0.0
    assert eta_seconds(done=0, total=0, elapsed=0.0) == 0.0


def test_durations_read_as_clock_times() -> None:
    assert format_duration(None) == "?"
    assert format_duration(0) == "0:00"
    assert format_duration(59.6) == "1:00"
    assert format_duration(75) == "1:15"
    assert format_duration(3725) == "1:02:05"
    assert format_duration(-3) == "0:00"


def test_the_eta_follows_the_injected_clock() -> None:
    clock = Clock()
    progress = Progress("job", 4, stream=io.StringIO(), clock=clock)
    assert progress.eta() is None
    clock.now += 10.0
    progress.update(1)
    assert progress.elapsed() == pytest.approx(10.0)
    assert progress.eta() == pytest.approx(30.0)
    clock.now += 50.0
    progress.update(3)
    assert progress.eta() == pytest.approx(20.0)
    assert progress.status() == "[job]  75% 3/4, elapsed 1:00, ETA 0:20"


def test_a_pipe_gets_one_line_per_phase_and_nothing_in_between() -> None:
    clock, stream = Clock(), io.StringIO()
    progress = Progress("bench tiers", 4, unit="arms", stream=stream, clock=clock)
    assert not progress.interactive  # StringIO is no terminal
    progress.phase("arm solo")
    for step in range(1, 50):
        clock.now += 0.2
        progress.update(step / 50, detail=f"{step} requests")
    progress.phase("arm fifo", done=1)
    clock.now += 30.0
    progress.update(2, detail="never shown")
    progress.phase("arm full")
    progress.finish("3 arms")
    lines = stream.getvalue().splitlines()
    assert lines == [
        "[bench tiers] arm solo (0% 0/4 arms, elapsed 0:00, ETA ?)",
        "[bench tiers] arm fifo (25% 1/4 arms, elapsed 0:10, ETA 0:29)",
        "[bench tiers] arm full (50% 2/4 arms, elapsed 0:40, ETA 0:40)",
        "[bench tiers] done in 0:40: 3 arms",
    ]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_a_terminal_gets_one_line_rewritten_in_place_at_most_once_per_interval() -> None:
    clock, stream = Clock(), Terminal()
    progress = Progress("simulate", 100, unit="requests", stream=stream, clock=clock)
    assert progress.interactive
    progress.phase("100 requests")
    for done in range(1, 9):
        clock.now += 0.125  # 1 s in all at an interval of 0.5 s: two redraws
        progress.update(done * 5, detail=f"t={done}s")
    out = stream.getvalue()
    assert "\n" not in out, "the live line must not scroll"
    frames = out.split("\r")[1:]
    assert len(frames) == 3  # the phase, then at 0.5 s and 1.0 s
    assert frames[-1] == (
        "[simulate] 100 requests  40% 40/100 requests, elapsed 0:01, ETA 0:02  t=8s\x1b[K"
    )
    progress.finish()
    out = stream.getvalue()
    assert out.count("\n") == 1 and out.endswith("\r[simulate] done in 0:01\x1b[K\n")


def test_a_note_stays_above_the_live_line_which_comes_back() -> None:
    clock, stream = Clock(), Terminal()
    progress = Progress("plan", 3, stream=stream, clock=clock)
    progress.phase("short@4096")
    clock.now += 1.0
    progress.update(1, detail="2 replicas meet the SLO")
    progress.note("[plan] threshold 9000: skipped")
    out = stream.getvalue()
    assert out.count("\n") == 1
    before, after = out.split("\n")
    assert before.endswith("\r[plan] threshold 9000: skipped\x1b[K")
    assert after.startswith("\r[plan] short@4096  33% 1/3") and "2 replicas meet" in after


def test_a_terminal_line_is_cut_to_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    stream = Terminal()
    progress = Progress("simulate", 10, stream=stream, clock=Clock())
    progress.phase("a phase with a long name " * 4)
    (frame,) = stream.getvalue().split("\r")[1:]
    assert len(frame.removesuffix("\x1b[K")) == 39


def test_bench_log_lines_stay_above_the_running_arms_live_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gateway_lab.bench.monitor import CURRENT_ARM, ArmProgress, log

    stream = Terminal()
    tracker = Progress("tiers", 2, unit="arms", stream=stream, clock=Clock())
    tracker.phase("arm solo")
    token = CURRENT_ARM.set(ArmProgress(tracker, 0))
    try:
        log("tiers", "arm solo: starting Envoy + service")
    finally:
        CURRENT_ARM.reset(token)
    kept, live = stream.getvalue().split("\n")
    assert kept.endswith("\r[tiers] arm solo: starting Envoy + service\x1b[K")
    assert live.startswith("\r[tiers] arm solo  0% 0/2 arms")
    log("tiers", "no arm running")  # outside a scenario's arm: a plain stderr line
    assert capsys.readouterr().err == "[tiers] no arm running\n"
