"""The service's real gRPC server on a loopback port, and a stub that plays Envoy to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc.service.gateway import Gateway
from extproc.service.server import start_grpc_server


@contextlib.asynccontextmanager
async def served_stub(
    gateway: Gateway, *, close_gateway: bool = False, tracked: bool = False
) -> AsyncIterator[ext_proc_grpc.ExternalProcessorStub]:
    """Serve `gateway` on 127.0.0.1 for the block; stopped (and closed if asked) on exit.
    `tracked`: as `extproc serve` does, the server tells the overload detector which
    admission streams Envoy waits on."""
    overload = gateway.overload if tracked else None
    server, port = await start_grpc_server(gateway, "127.0.0.1:0", overload)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield ext_proc_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        if close_gateway:
            await gateway.close()
