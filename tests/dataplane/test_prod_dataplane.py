"""With the real Envoy: the dashboard's Envoy metric names exist, a streamed response in flight
survives the stack's stop (service drains first, Envoy last), and `extproc up` stops cleanly on
Ctrl-C and at once on a second Ctrl-C, and restarts a service that hangs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import urllib3

from tests.conftest import TEST_KEYS, free_port, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.serve_support import REPO, http, wait_for, worker_pids
from tests.unit.test_prod_dashboard import ENVOY_METRICS

pytestmark = pytest.mark.dataplane

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=30), retries=False)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path, lambda short, long_: policy_yaml(short, long_)) as running:
        yield running


def stream_request(base_url: str, max_tokens: int) -> urllib3.BaseHTTPResponse:
    body = {
        "model": "m", "stream": True, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "tell me a long story"}],
    }  # fmt: skip
    return HTTP.request(
        "POST", base_url + "/v1/chat/completions", body=orjson.dumps(body),
        headers={"authorization": f"Bearer {TEST_KEYS['globex']}",
                 "content-type": "application/json"},
        preload_content=False,
    )  # fmt: skip


def test_dashboard_envoy_metrics_exist_in_a_running_envoy(gateway: RunningGateway) -> None:
    status, _, body = http("GET", f"http://{gateway.config.envoy_admin}/stats/prometheus")
    assert status == 200
    # Names as Envoy writes them (a parser would append _total to its counters).
    published = {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in body.decode().splitlines()
        if line and not line.startswith("#")
    }
    assert published >= ENVOY_METRICS, ENVOY_METRICS - published


def test_stack_stop_lets_an_inflight_stream_finish(gateway: RunningGateway) -> None:
    response = stream_request(gateway.base_url, max_tokens=1500)
    assert response.status == 200
    first = response.read1(64)
    assert first
    stopper = threading.Thread(target=gateway.stack.stop)
    stopper.start()
    try:
        wait_for(lambda: "draining" in gateway.log_of("extproc"), "the service to drain", 15)
        rest = response.read()
    finally:
        stopper.join(60)
    text = (first + rest).decode()
    assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    assert '"usage"' in text
    log = [orjson.loads(line) for line in gateway.log_of("extproc").splitlines() if line.strip()]
    drained = next(e for e in log if e.get("message") == "drained")
    assert drained["inflight_cut"] == 0
    assert not stopper.is_alive()
    assert all(not child.alive() for child in gateway.stack.children)


@dataclass
class Up:
    """`extproc up` as a subprocess, its output in `out`."""

    process: subprocess.Popen[bytes]
    out: Path
    listen: str
    admin: str

    def said(self) -> str:
        return self.out.read_text()


@contextlib.contextmanager
def running_up(tmp_path: Path, *extra: str) -> Iterator[Up]:
    """`extproc up` on the fast emulated engines, ready; stopped with two Ctrl-C on exit (its
    children run in their own sessions, so killing `up` alone would leave them running)."""
    short, long_ = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(short, long_))
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "extproc", "up", "--policy", str(policy), "--listen", listen,
        "--grpc", f"127.0.0.1:{free_port()}", "--admin", admin,
        "--envoy-admin", f"127.0.0.1:{free_port()}", "--profile", "fast",
        "--workdir", str(tmp_path / "up"), *extra,
    ]  # fmt: skip
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
    up = Up(process, out, listen, admin)
    try:
        wait_for(lambda: "ready:" in up.said(), "extproc up to be ready", 60, every=0.1)
        yield up
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(AssertionError):  # two signals at once may merge into one
                wait_for(lambda: "Ctrl-C again" in up.said(), "the stop to begin", 5)
            process.send_signal(signal.SIGINT)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def test_extproc_up_stops_on_ctrl_c_and_kills_on_the_second(tmp_path: Path) -> None:
    with running_up(tmp_path, "--drain-grace", "60") as up:
        # A long stream keeps the service draining after the first Ctrl-C ...
        response = stream_request(
            f"http://{up.listen}", max_tokens=8000
        )  # fast profile: max_model_len 8192
        assert response.status == 200
        assert response.read1(64)
        up.process.send_signal(signal.SIGINT)
        wait_for(lambda: "Ctrl-C again" in up.said(), "the stop to begin", 15)
        wait_for(
            lambda: http("GET", f"http://{up.admin}/readyz")[0] == 503, "readyz to turn 503", 15
        )
        # ... until the second one kills everything.
        began = time.monotonic()
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(20) == 0
        assert time.monotonic() - began < 10
        assert "killing every child now" in up.said()
        response.release_conn()
    # Every child is gone: nothing answers on the service's admin port any more.
    assert http_refused(f"http://{up.admin}/healthz")


def test_extproc_up_restarts_a_hung_service(tmp_path: Path) -> None:
    """A stopped service (SIGSTOP: alive, holding its ports, answering nothing) is killed once
    its /healthz has been silent for --worker-liveness-timeout, then restarted, and the stack
    serves again; the engines and Envoy are left alone."""
    with running_up(tmp_path, "--worker-liveness-timeout", "2") as up:
        wait_for(lambda: "watching http://" in up.said(), "the watch to hear the service", 30)
        admin_port = int(up.admin.rpartition(":")[2])
        hung = worker_pids(up.process.pid, "--admin")[admin_port]
        others = children_of(up.process.pid) - {hung}  # the engines and Envoy
        os.kill(hung, signal.SIGSTOP)
        wait_for(lambda: "has not answered" in up.said(), "the hung service to be killed", 20)

        def replaced() -> bool:
            pid = worker_pids(up.process.pid, "--admin").get(admin_port)
            return pid not in (None, hung) and ready(f"http://{up.admin}/readyz")

        wait_for(replaced, "a new service to be ready", 60, every=0.1)
        response = stream_request(f"http://{up.listen}", max_tokens=16)
        assert response.status == 200
        assert response.read().decode().rstrip().endswith("data: [DONE]")
        assert "extproc exited (status -9)" in up.said()
        assert others <= children_of(up.process.pid)  # none of them restarted


def children_of(pid: int) -> set[int]:
    return set(map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()))


def ready(url: str) -> bool:
    try:
        return http("GET", url, timeout=2)[0] == 200
    except OSError:
        return False


def http_refused(url: str) -> bool:
    try:
        http("GET", url, timeout=2)
    except OSError:
        return True
    return False
