"""The grpc.aio ExternalProcessor servicer: it only dispatches phases to a processor."""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.service.accounting import AccountingProcessor
from extproc.service.arrival import envoy_received_at
from extproc.service.overload import OverloadDetector
from extproc.service.ports import AccountingPort, StreamPorts
from extproc.service.processor import AdmissionProcessor
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA

log = logging.getLogger("extproc.server")

# Defaults that break under a burst of held requests (ARCHITECTURE.md, "Envoy facts").
GRPC_SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_concurrent_streams", 100_000),
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class ExternalProcessorService(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, ports: StreamPorts, overload: OverloadDetector | None = None) -> None:
        self.ports = ports
        self.overload = overload
        """Told which admission streams Envoy waits on (their age is an overload signal)."""

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        if (ROLE_METADATA, ACCOUNTING_ROLE) in (context.invocation_metadata() or ()):
            await self._account(request_iterator)
            return
        processor = AdmissionProcessor(self.ports)
        overload = self.overload
        if overload is not None:
            overload.stream_opened(processor)
        try:
            # Once the request is forwarded or answered nothing more is asked of this stream
            # (the response phases are not sent to it): end it then with OK, which Envoy takes
            # as "processing complete". Left open, a crash of this process would make Envoy
            # reset the response in flight, streamed or not.
            async for request in request_iterator:
                if request.HasField("protocol_config"):
                    processor.take_protocol(request.protocol_config)
                if overload is not None and request.HasField("request_headers"):
                    received_at = envoy_received_at(request)
                    if received_at is not None:
                        overload.arrived(time.time() - received_at)
                if request.HasField("request_body"):
                    if overload is not None and request.request_body.end_of_stream:
                        overload.stream_opened(processor)  # Envoy waits on us again
                    async for response in processor.on_request_body(request.request_body):
                        if overload is not None:
                            overload.stream_answered(processor)  # answered or held
                        yield response
                    if not processor.one_trip or processor.state.outcome is not None:
                        return
                elif request.HasField("request_headers"):
                    reply = processor.on_request_headers(request.request_headers)
                    # Answered, or the body comes next (one trip): either way Envoy now waits
                    # on the client, and a slow upload is not our lag.
                    if overload is not None:
                        overload.stream_answered(processor)
                    if reply is not None:
                        yield reply
                        answered = processor.state.outcome is not None
                        if request.request_headers.end_of_stream or answered:
                            return
                else:
                    log.warning("unexpected ext_proc phase %s", request.WhichOneof("request"))
        except Exception:
            # Never let an exception become an opaque failure without a trace in the log.
            log.exception("ext_proc stream failed (request %s)", processor.request_id)
            raise
        finally:
            if overload is not None:
                overload.stream_answered(processor)
            processor.finish()

    async def _account(self, request_iterator: AsyncIterator[ProcessingRequest]) -> None:
        await account_stream(self.ports, request_iterator)


async def account_stream(
    port: AccountingPort, request_iterator: AsyncIterator[ProcessingRequest]
) -> None:
    """Observability-mode stream: Envoy does not wait for replies, so we send none."""
    processor = AccountingProcessor(port)
    try:
        async for request in request_iterator:
            if request.HasField("response_body"):
                processor.on_response_body(request.response_body)
            elif request.HasField("response_headers"):
                processor.on_response_headers(request.response_headers)
            elif request.HasField("request_headers"):
                processor.on_request_headers(request.request_headers)
    except Exception:
        log.exception("accounting stream failed")
        raise
    finally:
        processor.finish()


class AccountingService(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The accounting process's servicer (extproc.service.accounting_process): every stream
    is an accounting stream, whatever its role metadata says."""

    def __init__(self, port: AccountingPort) -> None:
        self.port = port

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> None:
        # A coroutine handler (not a generator): grpc.aio ends the stream when it returns.
        del context
        await account_stream(self.port, request_iterator)


async def start_grpc_server(
    ports: StreamPorts,
    address: str,
    overload: OverloadDetector | None = None,
    also: Callable[[grpc.aio.Server], None] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """`also` adds more services to the server (the access-log sink of counting in Envoy)."""
    return await _serve(ExternalProcessorService(ports, overload), address, also)


async def start_accounting_server(
    port: AccountingPort, address: str
) -> tuple[grpc.aio.Server, int]:
    return await _serve(AccountingService(port), address)


async def _serve(
    servicer: ext_proc_grpc.ExternalProcessorServicer,
    address: str,
    also: Callable[[grpc.aio.Server], None] | None = None,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    if also is not None:
        also(server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc says only "Failed to bind"
        port = 0
    if port == 0:
        raise bind_error(address)
    await server.start()
    return server, port


def bind_error(address: str) -> OSError:
    """Why gRPC could not bind `address`: EADDRINUSE when another socket holds it (a caller
    that picked a port may then pick another), else a plain OSError."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, int(port)))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return OSError(
                errno.EADDRINUSE,
                f"cannot bind the gRPC server to {address}: address already in use",
            )
    except ValueError:
        pass
    return OSError(f"cannot bind the gRPC server to {address}")
