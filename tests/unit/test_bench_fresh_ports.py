"""Benchmark stacks start again on fresh ports when a port `free_port` picked was taken before
its server bound it (only then), a bounded number of times."""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_lab.bench import stack as bench_stack
from gateway_lab.bench.stack import PORT_ATTEMPTS, Check, engine_set, running_on_fresh_ports
from gateway_lab.processes import Child, Stack


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_an_engine_whose_port_was_taken_starts_again_on_a_fresh_one(
    tmp_path: Path,
    taken_port: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    picked: list[int] = []
    real_free_port = bench_stack.free_port

    def first_one_taken() -> int:
        port = taken_port if not picked else real_free_port()
        picked.append(port)
        return port

    monkeypatch.setattr(bench_stack, "free_port", first_one_taken)
    with engine_set(tmp_path, {"short": 1}, profile="fast") as engines:
        (endpoint,) = engines.endpoints["short"]
        assert picked[0] == taken_port and len(picked) == 2
        assert endpoint == f"127.0.0.1:{picked[1]}"
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=5) as answer:
            assert answer.status == 200
    assert "a port was taken before its server bound it" in capsys.readouterr().err


def exiting_child(tmp_path: Path, message: str) -> Child:
    return Child(
        name="server",
        command=[sys.executable, "-c", f"import sys; print({message!r}); sys.exit(1)"],
        log_path=tmp_path / "server.log",
    )


def test_any_other_start_failure_is_raised_at_once(tmp_path: Path) -> None:
    builds: list[Stack] = []

    def build() -> tuple[Stack, list[Check], None]:
        stack = Stack([exiting_child(tmp_path, "OSError: permission denied")])
        builds.append(stack)
        return stack, [(lambda: False, "server")], None

    with (
        pytest.raises(RuntimeError, match="permission denied"),
        running_on_fresh_ports(build),
    ):
        pass
    assert len(builds) == 1


def test_a_port_taken_every_time_gives_up_after_the_attempts(tmp_path: Path) -> None:
    builds: list[Stack] = []

    def build() -> tuple[Stack, list[Check], None]:
        stack = Stack([exiting_child(tmp_path, "OSError: [Errno 98] Address already in use")])
        builds.append(stack)
        return stack, [(lambda: False, "server")], None

    with (
        pytest.raises(RuntimeError, match="Address already in use"),
        running_on_fresh_ports(build),
    ):
        pass
    assert len(builds) == PORT_ATTEMPTS
    assert all(not child.alive() for stack in builds for child in stack.children)
