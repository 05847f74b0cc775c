"""Envoy's own answers through the real Envoy: OpenAI-shaped JSON whatever the client sent,
a 413 that reaches clients writing the whole body first, and a listen port no second Envoy
can share."""

from __future__ import annotations

import http.client
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from gateway_lab.processes import envoy_binary
from tests.adversarial.raw_http import (
    BODY_LIMIT,
    Answer,
    address_of,
    assert_openai_error,
    build_request,
    send_raw,
)
from tests.conftest import TEST_KEYS, free_port
from tests.dataplane.harness import RunningGateway

pytestmark = pytest.mark.dataplane


def oversized(size: int = 2 * BODY_LIMIT) -> bytes:
    text = "x" * size
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def http_client_post(gateway: RunningGateway, body: bytes | Iterator[bytes], **kw: bool) -> Answer:
    """Python's http.client writes the whole body before it reads anything."""
    connection = http.client.HTTPConnection(*address_of(gateway), timeout=20)
    try:
        headers = {
            "authorization": f"Bearer {TEST_KEYS['globex']}",
            "content-type": "application/json",
        }
        connection.request("POST", "/v1/chat/completions", body=body, headers=headers, **kw)
        response = connection.getresponse()
        answer_headers = {k.lower(): v for k, v in response.getheaders()}
        return Answer(response.status, answer_headers, response.read())
    finally:
        connection.close()


def test_413_with_content_length_reaches_http_client(gateway: RunningGateway) -> None:
    answer = http_client_post(gateway, oversized())
    assert answer.status == 413
    assert assert_openai_error(answer)["code"] == "body_too_large"


@pytest.mark.parametrize("mib", [8, 8, 24])
def test_413_for_megabytes_with_content_length_reaches_http_client(
    gateway: RunningGateway, mib: int
) -> None:
    """Answered before the body had arrived, the 413 was followed by a close without reading
    the rest: past the socket buffers the client, still writing, got a connection reset (at
    8 MiB one run in two, at 24 MiB every run). Now Envoy reads the declared body whole first
    (extproc.envoy_routes, the drain route)."""
    answer = http_client_post(gateway, oversized(mib << 20))
    assert answer.status == 413
    error = assert_openai_error(answer)
    assert error["code"] == "body_too_large" and str(BODY_LIMIT) in str(error["message"])


def test_413_for_24_mib_reaches_a_raw_socket_client_that_reads_after_writing(
    gateway: RunningGateway,
) -> None:
    headers = [("authorization", f"Bearer {TEST_KEYS['globex']}"),
               ("content-type", "application/json")]  # fmt: skip
    request = build_request("POST", "/v1/chat/completions", headers, oversized(24 << 20), False)
    answer = send_raw(gateway, request)
    assert answer.status == 413
    assert assert_openai_error(answer)["code"] == "body_too_large"


def test_413_for_a_chunked_body_is_json_for_a_json_client(gateway: RunningGateway) -> None:
    """Envoy's own 413 (the buffer limit) was text/plain for clients sending JSON."""
    body = oversized()
    chunks = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    answer = http_client_post(gateway, chunks, encode_chunked=True)
    assert answer.status == 413
    assert assert_openai_error(answer)["code"] == "body_too_large"


def test_second_envoy_cannot_bind_the_same_port(gateway: RunningGateway, tmp_path: Path) -> None:
    """With SO_REUSEPORT a second Envoy started on the same config bound the port and took
    half the connections; now it must fail to start."""
    config = orjson.loads((gateway.config.workdir / "envoy.json").read_bytes())
    config["admin"]["address"]["socketAddress"]["portValue"] = free_port()
    second = tmp_path / "second.json"
    second.write_bytes(orjson.dumps(config))
    command = [envoy_binary(), "-c", str(second), "--use-dynamic-base-id", "--concurrency", "1"]
    log = tmp_path / "second.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            pytest.fail("a second Envoy started on the same listen port")
    assert code != 0
    assert "Address already in use" in log.read_text()
