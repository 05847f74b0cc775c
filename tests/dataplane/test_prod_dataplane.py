"""With the real Envoy: the dashboard's Envoy metric names exist, a streamed response in flight
survives the stack's stop (service drains first, Envoy last), and `extproc up` stops cleanly on
Ctrl-C and at once on a second Ctrl-C."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import urllib3

from tests.conftest import TEST_KEYS, free_port, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.serve_support import REPO, http, wait_for
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


def test_extproc_up_stops_on_ctrl_c_and_kills_on_the_second(tmp_path: Path) -> None:
    short, long_ = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(short, long_))
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "extproc", "up", "--policy", str(policy), "--listen", listen,
        "--grpc", f"127.0.0.1:{free_port()}", "--admin", admin,
        "--envoy-admin", f"127.0.0.1:{free_port()}", "--profile", "fast",
        "--workdir", str(tmp_path / "up"), "--drain-grace", "60",
    ]  # fmt: skip
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        up = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(lambda: "ready:" in out.read_text(), "extproc up to be ready", 60, every=0.1)
        # A long stream keeps the service draining after the first Ctrl-C ...
        response = stream_request(
            f"http://{listen}", max_tokens=8000
        )  # fast profile: max_model_len 8192
        assert response.status == 200
        assert response.read1(64)
        up.send_signal(signal.SIGINT)
        wait_for(lambda: "Ctrl-C again" in out.read_text(), "the stop to begin", 15)
        wait_for(lambda: http("GET", f"http://{admin}/readyz")[0] == 503, "readyz to turn 503", 15)
        # ... until the second one kills everything.
        began = time.monotonic()
        up.send_signal(signal.SIGINT)
        assert up.wait(20) == 0
        assert time.monotonic() - began < 10
        assert "killing every child now" in out.read_text()
        response.release_conn()
    finally:
        if up.poll() is None:
            # Two Ctrl-C: `up` kills its children (they run in their own sessions, so killing
            # `up` alone would leave them running), then exits.
            up.send_signal(signal.SIGINT)
            with contextlib.suppress(AssertionError):  # two signals at once may merge into one
                wait_for(lambda: "Ctrl-C again" in out.read_text(), "the stop to begin", 5)
            up.send_signal(signal.SIGINT)
            try:
                up.wait(20)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(10)
    # Every child is gone: nothing answers on the service's admin port any more.
    assert http_refused(f"http://{admin}/healthz")


def http_refused(url: str) -> bool:
    try:
        http("GET", url, timeout=2)
    except OSError:
        return True
    return False
