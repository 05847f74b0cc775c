"""The events listener's HTTP/1.1 (counting in Envoy, extproc.service.envoy_counts): a small
server for the one kind of request the Lua filter sends, `POST /<verb>/<id>` with a body of a
few bytes, answered 204.

Why not aiohttp: a call through aiohttp's server cost ~166 us of CPU against ~34 us here (the
same keep-alive loop of 10,000 POSTs on this host), and a streamed response makes two or three
calls, which at the gateway's request rates made them the largest part of the service's CPU
per request in this layout (docs/benchmarks.md, "Counting in Envoy"). What is left out is
what the caller never sends: chunked bodies, `Expect`, upgrades, anything but POST. Such a
request gets a 4xx with an OpenAI error body and the connection is closed; a malformed count
gets a 400 and the connection stays (the request itself was framed correctly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

import orjson

log = logging.getLogger("extproc.events_http")

Handler = Callable[[str, str, bytes], int]
"""(verb, request id, body) -> HTTP status; 404 for an unknown verb."""

MAX_HEAD_BYTES = 8192
MAX_ID_BYTES = 256
IDLE_CLOSE_S = 7200.0
"""A connection silent this long is closed: longer than Envoy's default idle timeout of an
upstream connection (1 h), so Envoy closes first and never sends on a connection being closed."""
SWEEP_S = 60.0

_NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
_REASONS = {
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
}
_MESSAGES = {404: "unknown event", 500: "the event could not be taken"}


def _answer(status: int, message: str, close: bool) -> bytes:
    """A 4xx/5xx with an OpenAI error body."""
    reason = _REASONS[status]
    error = {"message": message, "type": "invalid_request_error" if status < 500 else
             "server_error", "param": None, "code": reason.lower().replace(" ", "_")}  # fmt: skip
    body = orjson.dumps({"error": error})
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}"]  # fmt: skip
    if close:
        head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class _Refused(Exception):
    """The request cannot be framed or is not one the Lua filter sends: answer and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Connection(asyncio.Protocol):
    __slots__ = ("_buffer", "_handle", "_max_body", "_server", "_transport", "heard_at")

    def __init__(self, server: EventsHttpServer, handle: Handler, max_body: int) -> None:
        self._server = server
        self._handle = handle
        self._max_body = max_body
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self.heard_at = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._transport = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        self.heard_at = time.monotonic()
        buffer = self._buffer
        buffer += data
        transport = self._transport
        while transport is not None and not transport.is_closing():
            end = buffer.find(b"\r\n\r\n")
            if end > MAX_HEAD_BYTES or (end < 0 and len(buffer) > MAX_HEAD_BYTES):
                self._refuse(_Refused(431, "request head too large"))
                return
            if end < 0:
                return  # the head is still on its way
            try:
                verb, request_id, length, close = self._head(bytes(buffer[:end]))
            except _Refused as refused:
                self._refuse(refused)
                return
            start = end + 4
            if len(buffer) < start + length:
                return  # the body is still on its way
            body = bytes(buffer[start : start + length])
            del buffer[: start + length]
            try:
                status = self._handle(verb, request_id, body)
            except Exception:
                log.exception("events: the %s call failed", verb)
                status = 500
            if status == 204:
                transport.write(_NO_CONTENT)
            else:
                message = _MESSAGES.get(status, "malformed event body")
                transport.write(_answer(status, message, close))
            if close:
                transport.close()

    def _refuse(self, refused: _Refused) -> None:
        if self._transport is not None:
            self._transport.write(_answer(refused.status, str(refused), close=True))
            self._transport.close()

    def _head(self, head: bytes) -> tuple[str, str, int, bool]:
        """(verb, request id, content length, close after) of a request head."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise _Refused(400, "not an HTTP/1.1 request line")
        method, target, version = parts
        if method != b"POST":
            raise _Refused(405, "only POST /<event>/<request id>")
        length: int | None = None
        close = version == b"HTTP/1.0"
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                raise _Refused(400, "malformed header line")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                if length is not None or not value.isdigit() or len(value) > 9:
                    raise _Refused(400, "malformed content-length")
                length = int(value)
            elif name == b"transfer-encoding":
                raise _Refused(501, "chunked bodies are not taken: send content-length")
            elif name == b"connection":
                close = value.lower() == b"close" or (close and value.lower() != b"keep-alive")
            elif name == b"expect":
                raise _Refused(400, "expect is not taken")
        if length is None:
            length = 0
        if length > self._max_body:
            raise _Refused(413, f"an event body is at most {self._max_body} bytes")
        empty, slash, rest = target.partition(b"/")
        verb, _, request_id = rest.partition(b"/")
        if empty or not slash or not request_id or len(request_id) > MAX_ID_BYTES:
            raise _Refused(404, "unknown event")
        if not request_id.replace(b"-", b"").replace(b"_", b"").isalnum():
            raise _Refused(404, "unknown event")  # the filter sends [A-Za-z0-9_-]+ ids only
        return verb.decode("ascii", "replace"), request_id.decode("ascii"), length, close


class EventsHttpServer:
    """Listens on one address; each framed request goes to `handle`."""

    def __init__(self, handle: Handler, max_body: int) -> None:
        self._handle = handle
        self._max_body = max_body
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, address: str) -> int:
        """Listens on `address` (HOST:PORT, [v6]:PORT); returns the bound port."""
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self, self._handle, self._max_body), host.strip("[]"), int(port)
        )
        self._sweeper = asyncio.create_task(self._close_idle())
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for connection in list(self.connections):
                connection.close()
            await self._server.wait_closed()

    async def _close_idle(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            cutoff = time.monotonic() - IDLE_CLOSE_S
            for connection in [c for c in self.connections if c.heard_at < cutoff]:
                connection.close()
