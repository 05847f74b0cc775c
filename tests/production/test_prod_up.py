"""`extproc up` stops the service first (it drains), the engines next and Envoy last; a second
Ctrl-C kills everything at once. Children here are small Python processes, not the real stack."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from extproc.policy import load_policy
from gateway_lab.processes import STOP_FIRST, STOP_LAST, Child, Stack
from gateway_lab.up import StackConfig, build_stack
from tests.conftest import policy_yaml
from tests.production.support import wait_for

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
