"""An ExternalProcessor servicer served on grpclib instead of grpc.aio (the `noop-grpclib`
and `mimic-grpclib` arms of `extproc bench low-load`).

grpc.aio hands every message across threads (grpc-core's completion queue is polled off the
event loop, which is woken through a file descriptor). grpclib runs HTTP/2 (the pure-Python
`h2` package) in the loop's own protocol callbacks, with no hop. The arms answer whether that
hop is what a Python ext_proc server's ~2 ms floor is made of (docs/benchmarks.md: it is not).
The servicers are grpc.aio's (`Process(request_iterator, context)`); this only adapts the
stream to them.
"""

from __future__ import annotations

import asyncio
import socket
from asyncio import BaseTransport
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from grpclib.const import Cardinality, Handler
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream
from h2.settings import SettingCodes

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
MAX_CONCURRENT_STREAMS = 100_000
"""As grpc.aio's `grpc.max_concurrent_streams` (server.GRPC_SERVER_OPTIONS): held requests are
open streams, and h2's default of 100 would make Envoy queue the 101st."""


class ProcessServicer(Protocol):
    def Process(self, request_iterator: AsyncIterator[ProcessingRequest], context: Any) -> Any: ...


class StreamContext:
    """What the servicers read of grpc.aio's ServicerContext."""

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata


async def _requests(
    stream: Stream[ProcessingRequest, ProcessingResponse],
) -> AsyncIterator[ProcessingRequest]:
    while True:
        request = await stream.recv_message()
        if request is None:
            return
        yield request


class ProcessHandler:
    """grpclib's handler mapping for one servicer. A servicer's `Process` is an async
    generator (admission: replies) or a coroutine (accounting: no replies)."""

    def __init__(self, servicer: ProcessServicer) -> None:
        self.servicer = servicer

    def __mapping__(self) -> dict[str, Handler]:
        return {
            PROCESS_METHOD: Handler(
                self._process, Cardinality.STREAM_STREAM, ProcessingRequest, ProcessingResponse
            )
        }

    async def _process(self, stream: Stream[ProcessingRequest, ProcessingResponse]) -> None:
        metadata = list((stream.metadata or {}).items())
        replies = self.servicer.Process(_requests(stream), StreamContext(metadata))
        if asyncio.iscoroutine(replies):
            await replies
            return
        async for reply in replies:
            await stream.send_message(reply)


class _ManyStreamsProtocol(H2Protocol):
    def connection_made(self, transport: BaseTransport) -> None:
        super().connection_made(transport)
        self.connection._connection.update_settings(  # the connection's h2 state machine
            {SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS}
        )
        self.connection.flush()


class _Server(Server):
    def _protocol_factory(self) -> H2Protocol:
        plain = super()._protocol_factory()
        return _ManyStreamsProtocol(plain.handler, plain.config, plain.h2_config)


async def start_grpclib_server(
    servicer: ProcessServicer, host: str, port: int
) -> tuple[Server, int]:
    """The server, started, and the port it listens on (`port` 0: one the kernel picked)."""
    server = _Server([ProcessHandler(servicer)])
    await server.start(host, port, reuse_address=True)
    # asyncio's and uvloop's servers both have `sockets` (typeshed's AbstractServer does not)
    sockets: list[socket.socket] = getattr(server._server, "sockets", [])
    return server, int(sockets[0].getsockname()[1])
