"""Where `extproc up` counts response tokens: by default (one worker) in Envoy, telling the
service's events listener on the port after its gRPC port, or on a free one when that is taken;
the accounting filter's child process or the service's own process when asked or with
workers."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_lab.up import OFF, ResponseCounting, StackConfig, add_arguments, response_counting


@pytest.fixture
def taken_pair() -> Iterator[int]:
    """A gRPC port whose next port is bound (listening) by someone else."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", base + 1))
        except OSError:
            holder.close()
            continue
        holder.listen()
        try:
            yield base
        finally:
            holder.close()
        return
    pytest.fail("no pair of ports found")


def port(address: str | None) -> int:
    assert address is not None
    return int(address.rpartition(":")[2])


def default_address(grpc: str) -> str | None:
    return response_counting(None, None, grpc, 1).envoy_events


def test_one_worker_counts_in_envoy_on_the_next_port_when_free() -> None:
    for _ in range(50):
        with socket.socket() as grpc_port:  # held, as the service's own port would be
            grpc_port.bind(("127.0.0.1", 0))
            base = grpc_port.getsockname()[1]
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
            counting = response_counting(None, None, f"127.0.0.1:{base}", 1)
            assert counting == ResponseCounting(envoy_events=f"127.0.0.1:{base + 1}")
            return
    pytest.fail("no free pair of ports found")


def test_a_taken_next_port_gives_another_free_one(taken_pair: int) -> None:
    address = default_address(f"127.0.0.1:{taken_pair}")
    assert port(address) not in (taken_pair, taken_pair + 1)
    with socket.socket() as check:
        check.bind(("127.0.0.1", port(address)))  # free, so the listener can bind it


def test_ipv6_addresses_keep_their_brackets() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        address = default_address("[::1]:0")
    except RuntimeError:
        pytest.skip("::1 cannot be bound here")
    assert address is not None and address.startswith("[::1]:")


def test_each_flag_picks_its_layout() -> None:
    grpc = "127.0.0.1:50051"
    assert response_counting(None, "127.0.0.1:7002", grpc, 1) == ResponseCounting(
        envoy_events="127.0.0.1:7002"
    )
    assert response_counting("127.0.0.1:7001", None, grpc, 1) == ResponseCounting(
        accounting="127.0.0.1:7001"
    )
    assert response_counting(OFF, None, grpc, 1) == ResponseCounting()
    child = response_counting(None, OFF, grpc, 1)  # the accounting child on a free port
    assert child.envoy_events is None and child.accounting is not None
    assert response_counting("127.0.0.1:7001", OFF, grpc, 1).accounting == "127.0.0.1:7001"
    with pytest.raises(ValueError, match="exclude each other"):
        response_counting("127.0.0.1:7001", "127.0.0.1:7002", grpc, 1)


def test_workers_on_their_own_ports_count_in_envoy_after_their_grpc_ports() -> None:
    for _ in range(50):
        with socket.socket() as grpc_port:  # worker 0's port, held as the service would
            grpc_port.bind(("127.0.0.1", 0))
            base = grpc_port.getsockname()[1]
            try:
                for offset in (1, 2, 3):  # worker 1's gRPC port, then the two events ports
                    with socket.socket() as probe:
                        probe.bind(("127.0.0.1", base + offset))
            except OSError:
                continue
            counting = response_counting(None, None, f"127.0.0.1:{base}", 2, "distinct")
            assert counting == ResponseCounting(envoy_events=f"127.0.0.1:{base + 2}")
            break
    else:
        pytest.fail("no four free ports in a row found")
    taken = response_counting(None, None, "127.0.0.1:50051", 3, "distinct").envoy_events
    first = port(taken)
    for events_port in range(first, first + 3):  # each worker's events port can be bound
        with socket.socket() as check:
            check.bind(("127.0.0.1", events_port))


def test_workers_on_one_shared_port_count_in_process() -> None:
    grpc = "127.0.0.1:50051"
    assert response_counting(None, None, grpc, 2, "shared") == ResponseCounting()
    assert response_counting(None, OFF, grpc, 2, "distinct") == ResponseCounting()


def test_the_command_line_default_reaches_the_stack(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, "policy.yaml")
    default = StackConfig.from_args(parser.parse_args(["--grpc", "127.0.0.1:50051"]), tmp_path)
    assert default.envoy_events is not None and default.accounting is None
    child = StackConfig.from_args(parser.parse_args(["--count-in-envoy", "off"]), tmp_path)
    assert child.envoy_events is None and child.accounting is not None
    off = parser.parse_args(["--accounting-grpc", "off"])
    assert StackConfig.from_args(off, tmp_path) == StackConfig(
        policy_path="policy.yaml", workdir=tmp_path
    )
    workers = StackConfig.from_args(parser.parse_args(["--workers", "2"]), tmp_path)
    assert workers.accounting is None and workers.envoy_events is not None
    shared = parser.parse_args(["--workers", "2", "--worker-ports", "shared"])
    assert StackConfig.from_args(shared, tmp_path).envoy_events is None


def test_both_addresses_are_refused_at_start_up(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "extproc", "up", "--policy", str(tmp_path / "never-read.yaml"),
        "--count-in-envoy", "127.0.0.1:7002", "--accounting-grpc", "127.0.0.1:7001",
    ]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "--count-in-envoy and --accounting-grpc exclude each other" in refused.stderr
