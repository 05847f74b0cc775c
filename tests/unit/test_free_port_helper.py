"""The tests' `free_port`: ports a client connection cannot take before the server binds."""

from __future__ import annotations

import socket

from tests.conftest import _ephemeral_range, free_port


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 11_000:
        assert all(port < low for port in ports), (low, high, ports)
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
