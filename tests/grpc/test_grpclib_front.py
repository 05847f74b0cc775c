"""The grpclib front of the low-load benchmark serves Envoy's ExternalProcessor protocol to a
real gRPC client (grpc-core, as Envoy's own is), with held streams beyond h2's default 100."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
)

pytest.importorskip("grpclib")  # the bench extra

from gateway_lab.bench.grpclib_front import MAX_CONCURRENT_STREAMS, start_grpclib_server
from gateway_lab.bench.noop import MimicProcessor, NoopProcessor

HEADERS = ProcessingRequest(
    request_headers=HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/v1/completions")])
    )
)
BODY = ProcessingRequest(
    request_body=HttpBody(body=b'{"prompt": "hi", "stream": true}', end_of_stream=True)
)


async def test_a_stream_gets_each_phase_answered() -> None:
    server, port = await start_grpclib_server(MimicProcessor("short"), "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
            await asyncio.wait_for(call.write(HEADERS), 10)
            first = await asyncio.wait_for(call.read(), 10)
            assert first.HasField("request_headers")
            await asyncio.wait_for(call.write(BODY), 10)
            second = await asyncio.wait_for(call.read(), 10)
            body = second.request_body.response.body_mutation.body
            assert b'"include_usage":true' in body
            assert second.request_body.response.clear_route_cache
            assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF  # ended by the server
            assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 10)


async def test_more_open_streams_than_h2s_default_limit() -> None:
    """150 streams stay open on one connection, each answered: with h2's default limit of
    100 concurrent streams the client would hold back the last 50 until others end."""
    assert MAX_CONCURRENT_STREAMS > 150
    server, port = await start_grpclib_server(NoopProcessor(), "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ext_proc_grpc.ExternalProcessorStub(channel)
            calls = [stub.Process() for _ in range(150)]
            for call in calls:
                await asyncio.wait_for(call.write(HEADERS), 10)
            replies = await asyncio.wait_for(asyncio.gather(*(c.read() for c in calls)), 20)
            assert all(reply.HasField("request_headers") for reply in replies)
            for call in calls:
                call.cancel()
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 10)


def test_serves_on_uvloop_as_the_noop_server_runs() -> None:
    """`python -m gateway_lab.bench.noop --grpclib` runs on uvloop, whose server type is not
    asyncio's: the port must still be found."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> int:
        server, port = await start_grpclib_server(NoopProcessor(), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
                await asyncio.wait_for(call.write(HEADERS), 10)
                reply = await asyncio.wait_for(call.read(), 10)
                assert reply.HasField("request_headers")
                call.cancel()
        finally:
            server.close()
            await asyncio.wait_for(server.wait_closed(), 10)
        return port

    assert uvloop.run(main()) > 0
