"""The do-nothing floor's `--mimic` mode (gateway_lab.bench.noop) answers like the admission
stream without deciding anything: the low-load benchmark's `mimic` arm is only a fair
reference if its replies carry what ours do."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

from extproc.service.roles import ADMISSION_METADATA
from extproc.service.server import GRPC_SERVER_OPTIONS
from gateway_lab.bench.noop import MimicProcessor, NoopProcessor, OneTripMimic
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, headers_message, set_headers


async def _stub(servicer: object) -> AsyncIterator[ext_proc_grpc.ExternalProcessorStub]:
    server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield ext_proc_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def test_mimic_answers_like_the_admission_stream() -> None:
    async for stub in _stub(MimicProcessor("main")):
        peer = EnvoyPeer(stub)
        headers = await peer.send(headers_message("POST", "/v1/completions", "key"))
        assert set(set_headers(headers, "request_headers")) == {
            "x-tenant-id", "x-tier", "x-gateway-request-id",
        }  # fmt: skip
        body = orjson.dumps({"model": "m", "prompt": "hi", "stream": True})
        reply = await peer.send(body_message(body))
        common = reply.request_body.response
        assert common.clear_route_cache
        forwarded = orjson.loads(common.body_mutation.body)
        assert forwarded["stream_options"] == {"include_usage": True}
        values = set_headers(reply, "request_body")
        assert values["x-llm-pool"] == "main"
        assert values["content-length"] == str(len(common.body_mutation.body))
        assert reply.dynamic_metadata.fields[ADMISSION_METADATA].struct_value.fields
        # The stream ends at the forward, as the admission stream's does.
        assert await peer.read() == grpc.aio.EOF
        await peer.close()


async def test_plain_floor_leaves_the_request_alone() -> None:
    async for stub in _stub(NoopProcessor()):
        peer = EnvoyPeer(stub)
        headers = await peer.send(headers_message("POST", "/v1/completions", "key"))
        assert set_headers(headers, "request_headers") == {}
        reply = await peer.send(body_message(b'{"prompt": "hi"}'))
        assert reply.HasField("request_body")
        assert not reply.request_body.response.HasField("body_mutation")
        assert not reply.request_body.response.clear_route_cache
        await peer.close()


async def test_one_trip_mimic_answers_the_headers_once_the_body_is_in() -> None:
    async for stub in _stub(OneTripMimic("main")):
        peer = EnvoyPeer(stub)
        body = orjson.dumps({"model": "m", "prompt": "hi", "stream": True})
        first, rest = body[:10], body[10:]
        await peer.outbox.put(headers_message("POST", "/v1/completions", "key"))
        await peer.outbox.put(ProcessingRequest(request_body=HttpBody(body=first)))
        last = ProcessingRequest(request_body=HttpBody(body=rest, end_of_stream=True))
        headers = await peer.send(last)  # nothing was answered before the body's end
        assert headers.request_headers.response.clear_route_cache
        assert set_headers(headers, "request_headers")["x-llm-pool"] == "main"
        earlier = await peer.read()
        assert earlier.request_body.response.body_mutation.clear_body
        reply = await peer.read()
        forwarded = orjson.loads(reply.request_body.response.body_mutation.body)
        assert forwarded["stream_options"] == {"include_usage": True}
        assert reply.dynamic_metadata.fields[ADMISSION_METADATA].struct_value.fields
        assert await peer.read() == grpc.aio.EOF
        await peer.close()
