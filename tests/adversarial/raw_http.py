"""A raw HTTP/1.1 client for sending what well-behaved clients never send, and the checks
every answer must pass."""

from __future__ import annotations

import http.client
import socket
from dataclasses import dataclass

import orjson

from tests.dataplane.harness import RunningGateway

BODY_LIMIT = 1 << 20
TIMEOUT_S = 15.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def address_of(gateway: RunningGateway) -> tuple[str, int]:
    host, _, port = gateway.base_url.removeprefix("http://").rpartition(":")
    return host, int(port)


def send_raw(gateway: RunningGateway, request: bytes, method: str = "POST") -> Answer:
    """Write `request` as is and read one response; raises on a reset or a timeout."""
    with socket.create_connection(address_of(gateway), timeout=TIMEOUT_S) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        body = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return Answer(response.status, headers, body)


def build_request(
    method: str, path: str, headers: list[tuple[str, str]], body: bytes | None, chunked: bool
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: gateway", "connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body is not None and chunked:
        lines.append("transfer-encoding: chunked")
    elif body is not None:
        lines.append(f"content-length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    if body is None:
        return head
    if not chunked:
        return head + body
    step = 16 * 1024
    chunks = [body[i : i + step] for i in range(0, len(body), step)]
    encoded = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return head + encoded + b"0\r\n\r\n"


def assert_openai_error(answer: Answer) -> dict[str, object]:
    """An error answer has the OpenAI shape and says it is JSON."""
    assert answer.status >= 400, answer
    assert answer.headers.get("content-type", "").startswith("application/json"), answer
    error = orjson.loads(answer.body)["error"]
    assert {"message", "type", "code"} <= set(error), answer
    assert isinstance(error["message"], str) and error["message"], answer
    return error  # type: ignore[no-any-return]
