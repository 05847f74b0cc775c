"""`extproc up` stops the service first (it drains), the engines next and Envoy last; a second
Ctrl-C kills everything at once. Children here are small Python processes, not the real stack."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from extproc.policy import load_policy
from gateway_lab.processes import STOP_FIRST, STOP_LAST, Child, RestartLimits, Stack, Supervisor
from gateway_lab.up import StackConfig, build_stack
from tests.conftest import policy_yaml
from tests.serve_support import wait_for

# A child that records when it got SIGTERM, then takes `delay` seconds to exit.
_CHILD = """
import signal, sys, time
name, record, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
def stop(signum, frame):
    with open(record, "a") as f:
        f.write(name + "\\n")
    time.sleep(delay)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(record + "." + name + ".up", "w").close()
while True:
    time.sleep(0.05)
"""


def child(tmp_path: Path, name: str, rank: int, delay: float = 0.0, timeout: float = 10.0) -> Child:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    record = tmp_path / "stops.txt"
    return Child(
        name=name,
        command=[sys.executable, str(script), name, str(record), str(delay)],
        log_path=tmp_path / f"{name}.log",
        stop_rank=rank,
        stop_timeout=timeout,
    )


def started(stack: Stack, tmp_path: Path) -> None:
    for c in stack.children:
        c.start()
    for c in stack.children:
        marker = tmp_path / f"stops.txt.{c.name}.up"
        wait_for(marker.exists, f"{c.name} up")


def test_service_stops_first_engines_next_envoy_last(tmp_path: Path) -> None:
    # Start order as build_stack makes it: engines, extproc, envoy.
    stack = Stack([
        child(tmp_path, "engine-short", 1), child(tmp_path, "engine-long", 1),
        child(tmp_path, "extproc", STOP_FIRST, delay=0.3), child(tmp_path, "envoy", STOP_LAST),
    ])  # fmt: skip
    try:
        started(stack, tmp_path)
        assert [c.name for c in stack.stop_order()] == [
            "extproc", "engine-long", "engine-short", "envoy",
        ]  # fmt: skip
        stack.stop()
        assert (tmp_path / "stops.txt").read_text().split() == [
            "extproc", "engine-long", "engine-short", "envoy",
        ]  # fmt: skip
        assert all(not c.alive() for c in stack.children)
    finally:
        stack.kill()


def test_a_child_that_ignores_sigterm_is_killed_after_its_timeout(tmp_path: Path) -> None:
    slow = child(tmp_path, "extproc", STOP_FIRST, delay=60, timeout=0.5)
    stack = Stack([slow])
    try:
        started(stack, tmp_path)
        began = time.monotonic()
        stack.stop()
        assert time.monotonic() - began < 10
        assert slow.process is not None and slow.process.returncode == -signal.SIGKILL
    finally:
        stack.kill()


def test_kill_does_not_wait_and_stop_then_returns_at_once(tmp_path: Path) -> None:
    """What a second Ctrl-C does: SIGKILL to every child, even one being waited for."""
    stack = Stack([child(tmp_path, "extproc", STOP_FIRST, delay=60, timeout=60)])
    try:
        started(stack, tmp_path)
        stack.children[0].process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        stack.kill()
        began = time.monotonic()
        stack.stop()
        assert time.monotonic() - began < 5
        assert not stack.children[0].alive()
    finally:
        stack.kill()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def crash(stack: Stack, name: str, tmp_path: Path) -> Child:
    target = next(c for c in stack.children if c.name == name)
    (tmp_path / f"stops.txt.{name}.up").unlink()
    assert target.process is not None
    target.process.send_signal(signal.SIGKILL)
    target.process.wait(10)
    return target


def test_a_crashed_service_or_engine_is_restarted_after_a_growing_backoff(tmp_path: Path) -> None:
    stack = Stack([child(tmp_path, "engine-short", 1), child(tmp_path, "extproc", STOP_FIRST)])
    clock, said = FakeClock(), []
    limits = RestartLimits(limit=3, window_s=60.0, backoff_s=0.5, max_backoff_s=8.0)
    supervisor = Supervisor(stack, limits=limits, say=said.append, clock=clock)
    try:
        started(stack, tmp_path)
        (tmp_path / "extproc.log").write_text("the first run's last words\n")
        service = crash(stack, "extproc", tmp_path)
        assert supervisor.check() is None and not service.alive()
        assert "extproc exited" in said[-1] and "restarting in 0.5s" in said[-1]
        clock.now += 0.4
        assert supervisor.check() is None and not service.alive()  # still backing off
        clock.now += 0.1
        assert supervisor.check() is None and service.alive()
        wait_for((tmp_path / "stops.txt.extproc.up").exists, "extproc up again")
        assert "the first run's last words" in (tmp_path / "extproc.log").read_text()
        # The next crash waits twice as long; an engine is restarted the same way.
        crash(stack, "extproc", tmp_path)
        crash(stack, "engine-short", tmp_path)
        assert supervisor.check() is None
        notes = {line.split()[0]: line for line in said[-2:]}
        assert "restarting in 1.0s" in notes["extproc"]
        assert "restarting in 0.5s" in notes["engine-short"]
        clock.now += 1.0
        assert supervisor.check() is None and all(c.alive() for c in stack.children)
    finally:
        stack.kill()


def test_restarts_stop_at_the_limit_and_envoy_ends_the_stack(tmp_path: Path) -> None:
    stack = Stack([child(tmp_path, "extproc", STOP_FIRST), child(tmp_path, "envoy", STOP_LAST)])
    clock = FakeClock()
    limits = RestartLimits(limit=2, window_s=60.0, backoff_s=0.5, max_backoff_s=8.0)
    supervisor = Supervisor(
        stack, fatal=frozenset({"envoy"}), limits=limits, say=lambda _: None, clock=clock
    )
    try:
        started(stack, tmp_path)
        for _ in range(2):
            service = crash(stack, "extproc", tmp_path)
            assert supervisor.check() is None
            clock.now += 10.0
            assert supervisor.check() is None and service.alive()
            wait_for((tmp_path / "stops.txt.extproc.up").exists, "extproc up again")
        crash(stack, "extproc", tmp_path)
        assert supervisor.check() is service  # a third crash within the window: give up
        # Out of the window, the count starts again.
        clock.now += 60.0
        assert supervisor.check() is None
        clock.now += 0.5
        assert supervisor.check() is None and service.alive()
        crash(stack, "envoy", tmp_path)
        assert supervisor.check() is stack.children[1]
    finally:
        stack.kill()


class FakeWatch:
    """A liveness watch whose verdict the test sets."""

    url = "http://127.0.0.1:1/healthz"

    def __init__(self) -> None:
        self.silent: float | None = None
        self.restarts: list[float] = []

    def overdue(self, now: float) -> float | None:
        return self.silent

    def restarted(self, now: float) -> None:
        self.silent = None
        self.restarts.append(now)


def test_a_hung_child_with_a_watch_is_killed_and_restarted(tmp_path: Path) -> None:
    stack = Stack([child(tmp_path, "engine-short", 1), child(tmp_path, "extproc", STOP_FIRST)])
    clock, said, watch = FakeClock(), [], FakeWatch()
    supervisor = Supervisor(stack, say=said.append, clock=clock, watches={"extproc": watch})
    try:
        started(stack, tmp_path)
        engine, service = stack.children
        assert service.process is not None and engine.process is not None
        hung, engine_process = service.process, engine.process
        hung.send_signal(signal.SIGSTOP)  # alive, and answering nothing
        (tmp_path / "stops.txt.extproc.up").unlink()
        assert supervisor.check() is None and hung.poll() is None  # not overdue yet
        watch.silent = 12.5
        assert supervisor.check() is None
        assert said[-1] == f"extproc has not answered {watch.url} for 12.5s: killing it"
        assert hung.wait(10) == -signal.SIGKILL and watch.restarts == [clock.now]
        assert supervisor.check() is None and "restarting in 0.5s" in said[-1]
        clock.now += 0.5
        assert supervisor.check() is None and service.alive() and service.process is not hung
        assert watch.restarts == [clock.now - 0.5, clock.now]  # a start-up grace again
        wait_for((tmp_path / "stops.txt.extproc.up").exists, "extproc up again")
        assert engine.alive() and engine.process is engine_process  # left alone
    finally:
        stack.kill()


@pytest.mark.dataplane  # the stack's envoy child is the real binary
def test_build_stack_orders_the_real_children(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    config = StackConfig(policy_path=str(path), workdir=tmp_path, drain_grace=12.0)
    stack = build_stack(config, load_policy(path))
    order = [c.name for c in stack.stop_order()]
    assert order[0] == "extproc" and order[-1] == "envoy"
    service = stack.children[[c.name for c in stack.children].index("extproc")]
    at = service.command.index("--drain-grace")
    assert service.command[at + 1] == "12.0"
    assert service.stop_timeout > config.drain_grace
