"""The events listener's HTTP/1.1 (extproc/service/events_http.py) over real loopback sockets:
what Envoy's Lua filter sends is answered on a kept-alive connection, whatever the framing;
anything else gets a 4xx with an OpenAI error body and the connection is closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from extproc.service.events_http import MAX_HEAD_BYTES, EventsHttpServer

TIMEOUT_S = 5.0


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bytes]] = []

    def __call__(self, verb: str, request_id: str, body: bytes) -> int:
        self.calls.append((verb, request_id, body))
        if verb not in ("attach", "first", "output"):
            return 404
        return 204 if body.isdigit() or not body else 400


Served = tuple[EventsHttpServer, Recorder, int]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    recorder = Recorder()
    server = EventsHttpServer(recorder, max_body=64)
    port = await server.start("127.0.0.1:0")
    try:
        yield server, recorder, port
    finally:
        await server.stop()


def _post(path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: extproc-events\r\ncontent-length: {len(body)}\r\n"
        f"{extra}\r\n"
    ).encode() + body


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, _, value in (line.partition(":") for line in lines[1:] if line)
    )
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), TIMEOUT_S) if length else b""
    return status, headers, body


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), TIMEOUT_S) == b""


async def test_calls_on_one_connection_pipelined_and_split_anywhere(served: Served) -> None:
    _, recorder, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_post("/attach/ab-1_c"))
        assert (await _answer(reader))[0] == 204
        # two requests in one write, then one cut inside its head and inside its body
        writer.write(_post("/first/ab-1_c", b"1") + _post("/output/ab-1_c", b"16"))
        assert [(await _answer(reader))[0] for _ in range(2)] == [204, 204]
        third = _post("/output/ab-1_c", b"32")
        for piece in (third[:7], third[7:-1], third[-1:]):
            writer.write(piece)
            await writer.drain()
        assert (await _answer(reader))[0] == 204
        assert recorder.calls == [
            ("attach", "ab-1_c", b""),
            ("first", "ab-1_c", b"1"),
            ("output", "ab-1_c", b"16"),
            ("output", "ab-1_c", b"32"),
        ]
    finally:
        writer.close()


async def test_a_malformed_count_or_unknown_event_is_refused_and_the_connection_stays(
    served: Served,
) -> None:
    _, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_post("/output/r1", b"x"))
        status, headers, body = await _answer(reader)
        assert status == 400 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        writer.write(_post("/nonsense/r1", b"1"))
        assert (await _answer(reader))[0] == 404
        writer.write(_post("/output/r1", b"3"))
        assert (await _answer(reader))[0] == 204
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /attach/r1 HTTP/1.1\r\nhost: x\r\n\r\n", 405),
        (_post("/attach/r1", b"", "transfer-encoding: chunked\r\n"), 501),
        (_post("/output/r1", b"1" * 65), 413),
        (_post("/output/r%2F1", b"1"), 404),
        (_post("/output/r1/x", b"1"), 404),
        (b"POST /output/r1 HTTP/1.1\r\ncontent-length: -1\r\n\r\n", 400),
        (b"POST /output/r1 HTTP/1.1\r\nbroken\r\n\r\n", 400),
        (b"POST /output/r1\r\n\r\n", 400),
        (b"POST /output/r1 HTTP/1.1\r\nx: " + b"y" * MAX_HEAD_BYTES, 431),
        (b"POST /output/r1 HTTP/1.1\r\nx: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
    ],
)
async def test_what_the_filter_never_sends_is_answered_and_closed(
    served: Served, request_bytes: bytes, status: int
) -> None:
    _, recorder, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes)
        got, headers, body = await _answer(reader)
        assert got == status and headers["connection"] == "close"
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        assert await _closed(reader)
        assert recorder.calls == []
    finally:
        writer.close()


async def test_connection_close_is_honoured_and_stop_closes_kept_connections(
    served: Served,
) -> None:
    server, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post("/attach/r1", b"", "connection: close\r\n"))
    assert (await _answer(reader))[0] == 204
    assert await _closed(reader)
    writer.close()
    kept_reader, kept_writer = await asyncio.open_connection("127.0.0.1", port)
    kept_writer.write(_post("/attach/r2"))
    assert (await _answer(kept_reader))[0] == 204
    await asyncio.wait_for(server.stop(), TIMEOUT_S)
    assert await _closed(kept_reader)
    kept_writer.close()
