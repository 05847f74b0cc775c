"""Client -> real Envoy -> ext_proc service -> emulated engines, over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
import urllib3

from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import LAYOUTS, RunningGateway, running_in_layout

pytestmark = pytest.mark.dataplane

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=30), retries=False)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    """Both ways the admission filter can take the body: one round trip and two."""
    workdir = tmp_path_factory.mktemp("gateway")
    with running_in_layout(request.param, workdir, policy_yaml) as running:
        yield running


def post(
    gateway: RunningGateway,
    body: bytes | dict[str, object],
    key: str | None = TEST_KEYS["globex"],
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> urllib3.BaseHTTPResponse:
    sent = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    payload = body if isinstance(body, bytes) else orjson.dumps(body)
    return HTTP.request("POST", gateway.base_url + path, body=payload, headers=sent)


def chat(content: str = "hello there", max_tokens: int = 8, **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def error_of(response: urllib3.BaseHTTPResponse) -> dict[str, object]:
    error = orjson.loads(response.data)["error"]
    assert {"message", "type", "code"} <= set(error)
    return error  # type: ignore[no-any-return]


def test_non_streamed_chat(gateway: RunningGateway) -> None:
    response = post(gateway, chat(max_tokens=5))
    assert response.status == 200
    body = orjson.loads(response.data)
    assert body["usage"]["completion_tokens"] == 5
    assert response.headers["x-engine-id"].startswith("short")
    assert "x-ratelimit-remaining-requests" in response.headers
    # Envoy adds the admission's headers (its dynamic metadata) and removes the engine address
    # the accounting filter read.
    assert float(response.headers["x-gateway-queue-ms"]) >= 0.0
    assert "x-gateway-upstream" not in response.headers


def test_streamed_chat_with_usage(gateway: RunningGateway) -> None:
    response = post(
        gateway, chat(max_tokens=6, stream=True, stream_options={"include_usage": True})
    )
    assert response.status == 200
    assert response.headers["x-ratelimit-limit-requests"]
    assert "x-gateway-upstream" not in response.headers
    events = [line[6:] for line in response.data.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = orjson.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 6


def test_completions_endpoint(gateway: RunningGateway) -> None:
    response = post(
        gateway, {"model": "m", "prompt": "once upon", "max_tokens": 3}, path="/v1/completions"
    )
    assert response.status == 200
    assert orjson.loads(response.data)["usage"]["completion_tokens"] == 3


def test_long_request_goes_to_long_pool(gateway: RunningGateway) -> None:
    short = post(gateway, chat("short one", max_tokens=4))
    long_ = post(gateway, chat("lorem ipsum " * 1500, max_tokens=4))
    assert short.status == 200 and long_.status == 200
    assert short.headers["x-engine-id"].startswith("short")
    assert long_.headers["x-engine-id"].startswith("long")


def test_client_sent_gateway_headers_are_ignored(gateway: RunningGateway) -> None:
    spoof = {"x-llm-pool": "long", "x-tenant-id": "acme", "x-tier": "premium"}
    response = post(gateway, chat("tiny", max_tokens=2), headers=spoof)
    assert response.status == 200
    assert response.headers["x-engine-id"].startswith("short")
    snapshot = orjson.loads(HTTP.request("GET", gateway.admin_url + "/v1/tenants").data)
    assert snapshot["tenants"]["acme"]["served_requests"] == 0
    assert snapshot["tenants"]["globex"]["served_requests"] >= 1


def test_missing_and_wrong_key(gateway: RunningGateway) -> None:
    for key in (None, "not-a-key"):
        response = post(gateway, chat(), key=key)
        assert response.status == 401
        assert error_of(response)["type"] == "authentication_error"


def test_x_api_key_header_identifies(gateway: RunningGateway) -> None:
    response = post(
        gateway, chat(max_tokens=2), key=None, headers={"x-api-key": TEST_KEYS["initech"]}
    )
    assert response.status == 200


def test_malformed_json_and_over_limit(gateway: RunningGateway) -> None:
    bad = post(gateway, b"{this is not json")
    assert bad.status == 400 and error_of(bad)["code"] == "invalid_json"
    # Not admitted: no metadata, so no empty rate-limit or queue headers either.
    assert not [
        name for name in bad.headers if name.lower().startswith(("x-ratelimit-limit", "x-gateway-"))
    ]
    huge = post(gateway, chat(max_tokens=1_000_000))
    assert huge.status == 400 and error_of(huge)["code"] == "context_length_exceeded"
    assert "16384" in str(error_of(huge)["message"])


def test_oversized_body_gets_413(gateway: RunningGateway) -> None:
    big = orjson.dumps(chat("x" * (9 << 20)))
    response = post(gateway, big)
    assert response.status == 413
    assert error_of(response)["code"] == "body_too_large"


def test_models_endpoint_needs_a_key(gateway: RunningGateway) -> None:
    assert HTTP.request("GET", gateway.base_url + "/v1/models").status == 401
    response = HTTP.request(
        "GET",
        gateway.base_url + "/v1/models",
        headers={"authorization": f"Bearer {TEST_KEYS['acme']}"},
    )
    assert response.status == 200 and orjson.loads(response.data)["data"]
