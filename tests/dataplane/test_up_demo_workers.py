"""`extproc up --workers 2 --demo`: the real stack with two service workers, Envoy counting
for both (its default). The demo waits for every worker, sends through Envoy and finds the
streamed request's tokens settled in the worker that admitted it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway_lab.bench.stack import free_port, free_ports

pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_passes_with_two_workers_counting_in_envoy(tmp_path: Path) -> None:
    grpc, admin = free_ports(4), free_ports(2)  # the workers' gRPC ports, then their events'
    command = [
        sys.executable, "-m", "extproc", "up", "--workers", "2", "--allow-unshared-workers",
        "--demo", "--workdir", str(tmp_path / "up"),
        "--listen", f"127.0.0.1:{free_port()}", "--grpc", f"127.0.0.1:{grpc}",
        "--admin", f"127.0.0.1:{admin}", "--envoy-admin", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:  # stuck: stop the stack it started, its own group
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output[-4000:]
    assert "demo passed" in output  # the streamed request's tokens settled, every worker up
    assert f"Envoy counts response tokens and tells the service on 127.0.0.1:{grpc + 2}" in output
