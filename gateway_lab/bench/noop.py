"""The floor: a do-nothing ext_proc server (grpc.aio + uvloop) that answers every message with
an empty response and never answers observability-mode messages. Whatever it costs is the price
of gRPC in Python; our service is judged against it.

`python -m gateway_lab.bench.noop --grpc 127.0.0.1:50051`
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.service.main import install_event_loop_policy
from extproc.service.server import GRPC_SERVER_OPTIONS

_EMPTY = {
    "request_headers": ProcessingResponse(request_headers=HeadersResponse()),
    "request_body": ProcessingResponse(request_body=BodyResponse()),
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
}


class NoopProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: object
    ) -> AsyncIterator[ProcessingResponse]:
        async for request in request_iterator:
            if request.observability_mode:
                continue
            reply = _EMPTY.get(request.WhichOneof("request") or "")
            if reply is not None:
                yield reply


async def serve(address: str) -> None:
    server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
    server.add_insecure_port(address)
    await server.start()
    print(f"noop ext_proc on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--grpc", default="127.0.0.1:50051")
    args = parser.parse_args()
    install_event_loop_policy()
    asyncio.run(serve(args.grpc))


if __name__ == "__main__":
    main()
