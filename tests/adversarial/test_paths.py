"""Path and method tricks through the real Envoy: whatever the spelling, a request reaches an
engine only through admission, and anything else is answered by Envoy in the OpenAI shape."""

from __future__ import annotations

import re
import time

import orjson
import pytest
import urllib3

from tests.adversarial.raw_http import assert_openai_error, build_request, send_raw
from tests.conftest import TEST_KEYS
from tests.dataplane.harness import RunningGateway

pytestmark = pytest.mark.dataplane

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=30), retries=False)
CHAT_BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)

# Spellings Envoy normalises to an inference path: each must be admitted (the engines decode
# `%69` themselves, so before normalisation these reached them with no admission).
SAME_AS_CHAT = [
    "/v1/chat/complet%69ons",
    "/%76%31/chat/completions",
    "/v1//chat/completions",
    "//v1/chat/completions",
    "/v1/chat/./completions",
    "/v1/x/../chat/completions",
    "/v1/chat/completions?api_key=x",
    "/v1/chat/completions#frag",
]
ENCODED_SLASHES = ["/v1%2Fchat%2Fcompletions", "/v1/chat%2fcompletions", "/v1%5Cchat/completions"]
NOT_SERVED = [
    "/metrics", "/health", "/tokenize", "/detokenize", "/version", "/ping", "/load", "/",
    "/v1", "/rerank", "/v2/rerank", "/score", "/v1/embeddings/", "/v1/chat", "/V1/chat/completions",
    "/v1/chat/completions/", "/v1/chat/completionsX", "/v1/models/../../metrics",
    "/v1/chat/completions/../../../metrics", "/%6detrics", "/v1/audio/transcriptions",
]  # fmt: skip


def upstream_requests(gateway: RunningGateway) -> int:
    """Requests Envoy sent to the pools' clusters, from its admin stats."""
    stats = HTTP.request(
        "GET", f"http://{gateway.config.envoy_admin}/stats?filter=upstream_rq_total"
    )
    counts = re.findall(r"cluster\.pool_\w+\.upstream_rq_total: (\d+)", stats.data.decode())
    return sum(int(c) for c in counts)


def post(gateway: RunningGateway, path: str, key: str | None) -> urllib3.BaseHTTPResponse:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return HTTP.request("POST", gateway.base_url + path, body=CHAT_BODY, headers=headers)


@pytest.mark.parametrize("path", SAME_AS_CHAT)
def test_normalised_spellings_go_through_admission(gateway: RunningGateway, path: str) -> None:
    refused = post(gateway, path, key=None)
    assert refused.status == 401, (path, refused.data)
    assert orjson.loads(refused.data)["error"]["type"] == "authentication_error"
    admitted = post(gateway, path, key=TEST_KEYS["globex"])
    assert admitted.status == 200, (path, admitted.data)
    assert "x-ratelimit-remaining-requests" in admitted.headers  # set by admission


@pytest.mark.parametrize("path", ENCODED_SLASHES)
def test_encoded_slashes_are_refused(gateway: RunningGateway, path: str) -> None:
    before = upstream_requests(gateway)
    answer = send_raw(gateway, build_request("POST", path, [], CHAT_BODY, chunked=False))
    assert answer.status == 400
    assert_openai_error(answer)
    assert upstream_requests(gateway) == before


def test_unserved_paths_get_envoys_404_and_never_reach_an_engine(gateway: RunningGateway) -> None:
    before = upstream_requests(gateway)
    for path in NOT_SERVED:
        for method, key in (("GET", None), ("POST", TEST_KEYS["globex"])):
            headers = [("authorization", f"Bearer {key}")] if key else []
            body = CHAT_BODY if method == "POST" else None
            answer = send_raw(gateway, build_request(method, path, headers, body, chunked=False))
            assert answer.status == 404, (method, path, answer)
            assert assert_openai_error(answer)["code"] == "not_found"
            assert answer.headers["server"] == "envoy"
    assert upstream_requests(gateway) == before


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("PATCH", "/v1/completions", "POST"),
        ("OPTIONS", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/v1/models", "GET"),
    ],
)
def test_wrong_method_gets_405(
    gateway: RunningGateway, method: str, path: str, allowed: str
) -> None:
    before = upstream_requests(gateway)
    auth = [("authorization", f"Bearer {TEST_KEYS['globex']}")]
    answer = send_raw(gateway, build_request(method, path, auth, None, chunked=False), method)
    assert answer.status == 405
    assert assert_openai_error(answer)["code"] == "method_not_allowed"
    assert answer.headers["allow"] == allowed
    assert upstream_requests(gateway) == before


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"post /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}", 400),
        (b"\x00\x01GARBAGE\r\n\r\n", 400),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
            b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nbad header: 1\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/9.9\r\nhost: x\r\n\r\n", 426),
    ],
    ids=["lower-case method", "garbage", "length and chunked", "space in header name", "version"],
)
def test_codec_errors_get_an_openai_answer(
    gateway: RunningGateway, request_bytes: bytes, status: int
) -> None:
    """These used to get no answer at all: the codec error's reply waited on the ext_proc
    filters, which the closing connection cut."""
    answer = send_raw(gateway, request_bytes)
    assert answer.status == status
    assert_openai_error(answer)


def test_access_log_has_no_query_string(gateway: RunningGateway) -> None:
    response = post(gateway, "/v1/chat/completions?api_key=sk-leaked-secret", TEST_KEYS["globex"])
    assert response.status == 200
    # Envoy flushes its access log about once a second.
    deadline = time.monotonic() + 10
    while not has_line(log := gateway.log_of("envoy")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert has_line(log)
    assert "sk-leaked-secret" not in log


def has_line(log: str) -> bool:
    return any(logged(line) == ("/v1/chat/completions", 200) for line in log.splitlines())


def logged(line: str) -> tuple[str, int] | None:
    if not line.startswith("{"):
        return None
    entry = orjson.loads(line)
    return entry["path"], entry["status"]


def test_access_log_never_names_the_tenant_a_client_claimed(gateway: RunningGateway) -> None:
    """A rejected request (an unknown key) is logged without a tenant, not under the one its
    client put in x-tenant-id: Envoy strips the gateway's own headers before anything reads
    them."""
    response = HTTP.request(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        body=CHAT_BODY,
        headers={
            "content-type": "application/json",
            "authorization": "Bearer not-a-key",
            "x-tenant-id": "claimed-acme",
            "x-tier": "premium",
        },
    )
    assert response.status == 401
    deadline = time.monotonic() + 10
    while not (lines := rejected_lines(gateway.log_of("envoy"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lines, "no access log line for the 401"
    assert all(entry["tenant"] in (None, "-", "") for entry in lines), lines
    assert "claimed-acme" not in gateway.log_of("envoy")


def rejected_lines(log: str) -> list[dict[str, object]]:
    entries = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [e for e in entries if e["status"] == 401 and e["path"] == "/v1/chat/completions"]
