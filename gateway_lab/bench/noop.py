"""The floor: a do-nothing ext_proc server (grpc.aio + uvloop) that answers every message with
an empty response and never answers observability-mode messages. Whatever it costs is the price
of gRPC in Python; our service is judged against it.

`--mimic` answers the request phases the way our service does, without deciding anything: the
headers reply sets the gateway's headers, the body reply adds `include_usage` to the body
(with its content-length), sets the pool header, clears the route cache and carries the
response headers as dynamic metadata, and the stream ends there. Side by side with the plain
floor it shows what the shape of our replies costs Envoy; side by side with our service, what
our Python costs (gateway_lab.bench.phases).

`--one-round-trip` (with `--mimic`, for an admission filter in STREAMED body mode with
`send_body_without_waiting_for_header_response`): Envoy sends the headers and the body back to
back, and the server answers the headers only once the body is in (the pool chosen, the
route cache cleared), then the body: one wait instead of two.

`--sync` serves the do-nothing servicer on grpc's synchronous server (a thread per stream from a
pool, no event loop): the floor without asyncio, for the `noop-sync` arm of the low-load
benchmark.

`python -m gateway_lab.bench.noop --grpc 127.0.0.1:50051 [--mimic POOL [--one-round-trip]] [--sync]`
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.envoy_config import admission_response_headers
from extproc.service import responses
from extproc.service.main import install_event_loop_policy
from extproc.service.roles import ADMISSION_METADATA
from extproc.service.server import GRPC_SERVER_OPTIONS
from extproc.types import GATEWAY_REQUEST_ID_HEADER, POOL_HEADER, TENANT_HEADER, TIER_HEADER

_EMPTY = {
    "request_headers": ProcessingResponse(request_headers=HeadersResponse()),
    "request_body": ProcessingResponse(request_body=BodyResponse()),
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
}


def _empty_reply(request: ProcessingRequest) -> ProcessingResponse | None:
    """The floor's answer to `request`: an empty one for its phase, none in observability mode."""
    if request.observability_mode:
        return None
    return _EMPTY.get(request.WhichOneof("request") or "")


class NoopProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: object
    ) -> AsyncIterator[ProcessingResponse]:
        async for request in request_iterator:
            reply = _empty_reply(request)
            if reply is not None:
                yield reply


class SyncNoopProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """NoopProcessor for grpc's synchronous server: the same replies from a pool thread."""

    def Process(
        self, request_iterator: Iterator[ProcessingRequest], context: object
    ) -> Iterator[ProcessingResponse]:
        for request in request_iterator:
            reply = _empty_reply(request)
            if reply is not None:
                yield reply


SYNC_THREADS = 64
"""Each open stream holds a thread of the synchronous server: at the benchmark's 1 request/s a
few admission and accounting streams are open at once."""


def serve_sync(address: str) -> None:
    """The do-nothing servicer on grpc's synchronous server, until SIGTERM or SIGINT."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = grpc.server(ThreadPoolExecutor(max_workers=SYNC_THREADS), options=GRPC_SERVER_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(SyncNoopProcessor(), server)
    server.add_insecure_port(address)
    server.start()
    print(f"noop ext_proc (synchronous grpc) on {address}", flush=True)
    stop.wait()
    server.stop(1.0).wait()


_GATEWAY_HEADERS = [
    (TENANT_HEADER, "bench"), (TIER_HEADER, "standard"), (GATEWAY_REQUEST_ID_HEADER, "mimic"),
]  # fmt: skip
_RESPONSE_HEADERS = {name: "1" for name in admission_response_headers()[:6]}


def _with_usage(raw: bytes) -> bytes:
    """The request body as the service rewrites it: the stream reports its usage."""
    body = orjson.loads(raw)
    body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


class MimicProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Replies shaped like the admission stream's (module docstring); the pool header names
    `pool`, the first pool of the policy it fronts."""

    def __init__(self, pool: str) -> None:
        self.pool = pool

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: object
    ) -> AsyncIterator[ProcessingResponse]:
        async for request in request_iterator:
            if request.observability_mode:
                continue
            if request.HasField("request_headers"):
                yield responses.continue_request_headers(_GATEWAY_HEADERS)
            elif request.HasField("request_body"):
                data = _with_usage(request.request_body.body)
                values = [*_GATEWAY_HEADERS, (POOL_HEADER, self.pool),
                          ("content-length", str(len(data)))]  # fmt: skip
                reply = responses.continue_request_body(values, clear_route_cache=True, body=data)
                responses.fill_metadata(reply, ADMISSION_METADATA, _RESPONSE_HEADERS)
                yield reply
                return


class OneTripMimic(MimicProcessor):
    """The mimic for a filter that streams the body without waiting for the headers reply
    (module docstring): every reply goes once the whole body is in."""

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: object
    ) -> AsyncIterator[ProcessingResponse]:
        chunks: list[bytes] = []
        async for request in request_iterator:
            if request.observability_mode or not request.HasField("request_body"):
                continue
            chunks.append(request.request_body.body)
            if not request.request_body.end_of_stream:
                continue
            data = _with_usage(b"".join(chunks))
            headers = [*_GATEWAY_HEADERS, (POOL_HEADER, self.pool)]
            # Envoy drops content-length itself in STREAMED mode (the upstream gets chunked).
            yield responses.continue_request_headers(headers, clear_route_cache=True)
            for _ in chunks[:-1]:
                earlier = responses.continue_request_body()
                earlier.request_body.response.body_mutation.clear_body = True
                yield earlier
            reply = responses.continue_request_body(body=data)
            responses.fill_metadata(reply, ADMISSION_METADATA, _RESPONSE_HEADERS)
            yield reply
            return


async def serve(
    address: str, mimic_pool: str | None = None, one_trip: bool = False, on_grpclib: bool = False
) -> None:
    servicer: ext_proc_grpc.ExternalProcessorServicer = NoopProcessor()
    if mimic_pool is not None:
        servicer = OneTripMimic(mimic_pool) if one_trip else MimicProcessor(mimic_pool)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if on_grpclib:
        from gateway_lab.bench.grpclib_front import start_grpclib_server  # the bench extra

        host, _, port = address.rpartition(":")
        grpclib_server, _ = await start_grpclib_server(servicer, host.strip("[]"), int(port))
        print(f"noop ext_proc (grpclib) on {address}", flush=True)
        await stop.wait()
        grpclib_server.close()
        await grpclib_server.wait_closed()
        return
    server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    print(f"noop ext_proc on {address}", flush=True)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--grpc", default="127.0.0.1:50051")
    parser.add_argument(
        "--mimic", metavar="POOL", help="answer like the admission stream, routing to POOL"
    )
    parser.add_argument(
        "--one-round-trip", action="store_true",
        help="with --mimic: answer the headers once the body is in (STREAMED body mode)",
    )  # fmt: skip
    parser.add_argument(
        "--grpclib", action="store_true", help="serve on grpclib instead of grpc.aio"
    )
    parser.add_argument(
        "--sync", action="store_true",
        help="serve the do-nothing servicer on grpc's synchronous server (not with --mimic)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.sync:
        if args.mimic or args.grpclib:
            parser.error("--sync serves the do-nothing servicer only, on grpc")
        serve_sync(args.grpc)
        return
    install_event_loop_policy()
    asyncio.run(serve(args.grpc, args.mimic, args.one_round_trip, args.grpclib))


if __name__ == "__main__":
    main()
