"""The admission service misses Envoy's message_timeout (here: frozen with SIGSTOP): the
client gets a 503 with Retry-After and an OpenAI body, not a 504 "upstream timed out", and
nothing reaches an engine."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from tests.conftest import TEST_KEYS
from tests.dataplane.harness import RunningGateway, running_gateway, standard_policy

pytestmark = pytest.mark.dataplane

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(total=15), retries=False)


def short_timeout_policy(short: str, long_: str) -> str:
    return standard_policy(short, long_, "{message_timeout: 500ms}")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path_factory.mktemp("message-timeout"), short_timeout_policy) as gw:
        yield gw


def complete(gateway: RunningGateway) -> urllib3.BaseHTTPResponse:
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    return HTTP.request(
        "POST", gateway.base_url + "/v1/completions", body=json.dumps(body),
        headers={"authorization": f"Bearer {TEST_KEYS['globex']}",
                 "content-type": "application/json"},
    )  # fmt: skip


def engine_requests(gateway: RunningGateway) -> float:
    """Requests the short pool's engine finished, whatever the reason."""
    (endpoint,) = gateway.policy.source.pools["short"].endpoints
    text = HTTP.request("GET", f"http://{endpoint}/metrics").data.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_a_late_admission_answer_is_a_503_with_retry_after(
    gateway: RunningGateway, tmp_path: Path
) -> None:
    assert complete(gateway).status == 200
    served = engine_requests(gateway)
    extproc = next(c for c in gateway.stack.children if c.name == "extproc")
    assert extproc.process is not None
    os.kill(extproc.process.pid, signal.SIGSTOP)
    try:
        late = complete(gateway)
    finally:
        os.kill(extproc.process.pid, signal.SIGCONT)
    assert late.status == 503, late.data
    assert int(late.headers["retry-after"]) >= 1
    assert late.headers["content-type"] == "application/json"
    error = json.loads(late.data)["error"]
    assert error["code"] == "overloaded" and error["type"] == "service_unavailable"
    assert complete(gateway).status == 200  # thawed, it admits again
    assert engine_requests(gateway) == served + 1  # the late one never reached the engine
