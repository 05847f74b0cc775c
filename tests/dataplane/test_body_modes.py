"""How the admission filter takes the body, through the real Envoy: in either layout a body
sent in many pieces is admitted whole, and an admission filter set to a body mode the service
cannot admit by (Envoy says which in each stream's first message) refuses every request with
a body instead of letting it upstream unadmitted."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway_lab.bench.trips import WITHOUT_WAITING, admission_configs
from gateway_lab.up import StackConfig
from tests.adversarial.raw_http import (
    TIMEOUT_S,
    address_of,
    assert_openai_error,
    build_request,
    send_raw,
)
from tests.adversarial.test_paths import upstream_requests
from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import LAYOUTS, RunningGateway, running_gateway, running_in_layout

pytestmark = pytest.mark.dataplane

AUTH = [("authorization", f"Bearer {TEST_KEYS['globex']}")]
MAX_BODY = 8 * 1024 * 1024  # the policy's default max_body_bytes


MESSAGE_TIMEOUT_S = 1.0


def _policy(short: str, long_: str) -> str:
    # A short message timeout, so an upload slower than it is quick to show.
    return policy_yaml(short, long_, extra=f"gateway: {{message_timeout: {MESSAGE_TIMEOUT_S}s}}")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    workdir = tmp_path_factory.mktemp("body-modes")
    with running_in_layout(request.param, workdir, _policy) as running:
        yield running


@pytest.mark.parametrize(
    ("size", "chunked"),
    [(200_000, False), (200_000, True), (MAX_BODY - 1024, True)],
    ids=["content-length", "chunked", "chunked-just-under-the-limit"],
)
def test_a_body_of_many_pieces_is_admitted_whole(
    gateway: RunningGateway, size: int, chunked: bool
) -> None:
    """The body reaches Envoy in many reads (a STREAMED body in many messages), up to just
    under Envoy's buffer limit (the policy's max_body_bytes); a field the gateway does not
    count keeps the budget small. The engine gets it all, rewritten once (`include_usage`),
    and parses it."""
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "user": "",
        }
    )
    body = body.replace(b'"user":""', b'"user":"' + b"u" * (size - len(body)) + b'"')
    request = build_request("POST", "/v1/chat/completions", AUTH, body, chunked=chunked)
    answer = send_raw(gateway, request)
    assert answer.status == 200, answer
    events = [line for line in answer.body.split(b"\n") if line.startswith(b"data: {")]
    usage = orjson.loads(events[-1][len(b"data: ") :])["usage"]
    assert usage["completion_tokens"] == 4


def test_a_chunked_body_with_trailers_is_admitted(gateway: RunningGateway) -> None:
    """The body's end comes with trailers, not with its last piece (the filter skips
    trailers): the service still gets the end of the body, in either layout."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2})  # fmt: skip
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
        f"authorization: Bearer {TEST_KEYS['globex']}\r\ntransfer-encoding: chunked\r\n"
        "trailer: x-client-trailer\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n%s\r\n" % (len(body), body)
    answer = send_raw(gateway, head + chunk + b"0\r\nx-client-trailer: 1\r\n\r\n")
    assert answer.status == 200, answer
    assert orjson.loads(answer.body)["usage"]["completion_tokens"] == 2


def test_a_pause_mid_body_longer_than_the_message_timeout(gateway: RunningGateway) -> None:
    """A client pausing 2.5x the message timeout in the middle of its body: served with two
    round trips (Envoy waits on the client, no timer runs); with one, Envoy has passed on the
    first piece and waits on the service, whose timer ends it: the documented cost of that
    layout (docs/deploy.md), answered in the OpenAI shape, never forwarded."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2})  # fmt: skip
    request = build_request("POST", "/v1/chat/completions", AUTH, body, chunked=False)
    split = len(request) - len(body) // 2
    before = upstream_requests(gateway)
    with socket.create_connection(address_of(gateway), timeout=TIMEOUT_S) as sock:
        sock.sendall(request[:split])
        time.sleep(MESSAGE_TIMEOUT_S * 2.5)  # the client's pause, not a synchronisation
        sock.sendall(request[split:])
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        data = response.read()
    if gateway.layout == "two-trips":
        assert response.status == 200, data
        assert orjson.loads(data)["usage"]["completion_tokens"] == 2
    else:
        assert response.status == 503, data
        assert orjson.loads(data)["error"]["code"] == "overloaded"
        assert upstream_requests(gateway) == before


def _body_mode(mode: str, without_waiting: bool) -> Any:
    def edit(bootstrap: dict[str, Any], _: StackConfig) -> dict[str, Any]:
        for config in admission_configs(bootstrap):
            config["processingMode"]["requestBodyMode"] = mode
            config[WITHOUT_WAITING] = without_waiting
        return bootstrap

    return edit


@pytest.mark.parametrize(
    ("mode", "without_waiting"),
    [("NONE", False), ("STREAMED", False), ("BUFFERED_PARTIAL", False)],
    ids=["none", "streamed-waiting", "buffered-partial"],
)
def test_an_admission_filter_that_cannot_admit_refuses_with_500(
    tmp_path_factory: pytest.TempPathFactory, mode: str, without_waiting: bool
) -> None:
    workdir = tmp_path_factory.mktemp("misconfigured")
    edit = _body_mode(mode, without_waiting)
    with running_gateway(workdir, _policy, envoy_bootstrap=edit) as gateway:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        before = upstream_requests(gateway)
        for chunked in (False, True):
            request = build_request("POST", "/v1/chat/completions", AUTH, body, chunked=chunked)
            answer = send_raw(gateway, request)
            assert answer.status == 500, answer
            error = assert_openai_error(answer)
            assert error["code"] == "gateway_misconfigured"
            assert "request_body_mode" in error["message"]
        assert upstream_requests(gateway) == before
        # A request without a body has nothing to admit by: it passes as in any layout.
        models = send_raw(gateway, build_request("GET", "/v1/models", AUTH, None, chunked=False))
        assert models.status == 200
