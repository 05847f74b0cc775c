"""`extproc up` accounts responses in a child process by default (one worker), on the port
after the service's gRPC port, or on a free one when that is taken."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_lab.up import ACCOUNTING_OFF, StackConfig, accounting_address, add_arguments


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


def test_one_worker_accounts_in_a_child_on_the_next_port_when_free() -> None:
    for _ in range(50):
        with socket.socket() as grpc_port:  # held, as the service's own port would be
            grpc_port.bind(("127.0.0.1", 0))
            base = grpc_port.getsockname()[1]
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
            assert accounting_address(None, f"127.0.0.1:{base}", 1) == f"127.0.0.1:{base + 1}"
            return
    pytest.fail("no free pair of ports found")


def test_a_taken_next_port_gives_another_free_one(taken_pair: int) -> None:
    address = accounting_address(None, f"127.0.0.1:{taken_pair}", 1)
    assert port(address) not in (taken_pair, taken_pair + 1)
    with socket.socket() as check:
        check.bind(("127.0.0.1", port(address)))  # free, so the child can bind it


def test_ipv6_addresses_keep_their_brackets() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        address = accounting_address(None, "[::1]:0", 1)
    except RuntimeError:
        pytest.skip("::1 cannot be bound here")
    assert address is not None and address.startswith("[::1]:")


def test_workers_and_off_account_in_process_and_an_address_is_kept() -> None:
    assert accounting_address(None, "127.0.0.1:50051", 2) is None
    assert accounting_address(ACCOUNTING_OFF, "127.0.0.1:50051", 1) is None
    assert accounting_address("127.0.0.1:7001", "127.0.0.1:50051", 1) == "127.0.0.1:7001"


def test_the_command_line_default_reaches_the_stack(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, "policy.yaml")
    default = StackConfig.from_args(parser.parse_args(["--grpc", "127.0.0.1:50051"]), tmp_path)
    assert default.accounting is not None
    off = parser.parse_args(["--accounting-grpc", "off"])
    assert StackConfig.from_args(off, tmp_path).accounting is None
    workers = parser.parse_args(["--workers", "2"])
    assert StackConfig.from_args(workers, tmp_path).accounting is None
