"""`gateway_stack` (Envoy + `extproc serve`) starts again on fresh ports when the service's gRPC
port was taken between `free_port` and its bind: the service exits saying the address is in
use (it used to hang in its shutdown instead), and the second start serves."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from gateway_lab.bench import stack as bench_stack
from gateway_lab.bench.stack import gateway_stack
from tests.conftest import policy_yaml

pytestmark = pytest.mark.dataplane


def test_a_taken_grpc_port_gives_a_second_start_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_free_port = bench_stack.free_port
    picked: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = int(taken.getsockname()[1])

        def grpc_port_taken_once() -> int:
            # The second port of the first start is the service's gRPC address.
            port = taken_port if len(picked) == 1 else real_free_port()
            picked.append(port)
            return port

        monkeypatch.setattr(bench_stack, "free_port", grpc_port_taken_once)
        text = policy_yaml("127.0.0.1:1", "127.0.0.1:2")
        with gateway_stack(tmp_path, text, "extproc") as gateway:
            assert gateway.admin_url is not None
            with urllib.request.urlopen(gateway.admin_url + "/readyz", timeout=5) as answer:
                assert answer.status == 200
    assert picked[1] == taken_port
    # Two starts of four ports each; a third (the most there may be) only when a port the
    # second start picked was taken by another process before it bound it (seen in CI).
    assert len(picked) in (8, 12)
    assert "a port was taken before its server bound it" in capsys.readouterr().err
    log = (tmp_path / "extproc.log").read_text()
    assert str(taken_port) not in log  # the log is the second start's
