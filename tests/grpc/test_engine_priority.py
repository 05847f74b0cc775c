"""Hermetic: the forwarded body carries the engine priority the scheduler chose, and a
backlogged request paced at the door goes when the accounting stream sees the first token of
the request ahead of it (not only when that one ends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

from extproc.policy import policy_from_text
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.processor import http_headers
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, headers_message, set_headers
from tests.grpc_support import served_stub

Served = tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]


def _policy(short_keys: str) -> str:
    return policy_yaml().replace(
        'endpoints: ["127.0.0.1:8001"]', f'endpoints: ["127.0.0.1:8001"]\n    {short_keys}'
    )


@pytest.fixture(params=["engine_priority: true", "engine_priority: false"])
async def service(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Served, bool]]:
    gateway = compose(policy_from_text(_policy(request.param)))
    async with served_stub(gateway) as stub:
        yield (gateway, stub), request.param.endswith("true")


def _chat(**extra: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    return orjson.dumps({**body, **extra})


async def _forward(stub: ext_proc_grpc.ExternalProcessorStub, tenant: str, body: bytes):  # type: ignore[no-untyped-def]
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS[tenant]))
    reply = await peer.send(body_message(body))
    return peer, reply


async def test_the_forwarded_body_carries_the_engine_priority(service) -> None:  # type: ignore[no-untyped-def]
    (_gateway, stub), on = service
    cases = [
        ("acme", _chat(stream=True), 1),  # premium (rank 0), alone: not within a share
        ("globex", _chat(), 3),  # standard (rank 1); non-streamed too
        ("initech", _chat(priority=-100), 3),  # the client's own value is replaced
    ]
    peers = []
    for tenant, body, expected in cases:
        peer, reply = await _forward(stub, tenant, body)
        peers.append(peer)
        assert reply.WhichOneof("response") == "request_body"
        mutation = reply.request_body.response.body_mutation
        sent = orjson.loads(body)
        if not on and not sent.get("stream"):
            assert not mutation.HasField("body")  # nothing to change: no mutation at all
            continue
        forwarded = orjson.loads(mutation.body)
        assert set_headers(reply, "request_body")["content-length"] == str(len(mutation.body))
        if on:
            assert forwarded["priority"] == expected
        else:
            assert forwarded.get("priority") == sent.get("priority")
        if sent.get("stream"):
            assert forwarded["stream_options"] == {"include_usage": True}
    for peer in peers:
        await peer.close()
        await peer.call.code()


class _AccountingStream:
    """An accounting stream kept open until `end`: Envoy's observability filter."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub, request_id: str) -> None:
        self.outbox: asyncio.Queue[ProcessingRequest | None] = asyncio.Queue()
        upstream = [("x-gateway-request-id", request_id)]
        self.outbox.put_nowait(
            headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"], upstream)
        )
        status = [(":status", "200"), ("content-type", "text/event-stream")]
        self.outbox.put_nowait(ProcessingRequest(response_headers=http_headers(status)))
        self.call = stub.Process(self._messages(), metadata=((ROLE_METADATA, ACCOUNTING_ROLE),))

    async def _messages(self) -> AsyncIterator[ProcessingRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message

    def chunk(self, data: bytes) -> None:
        self.outbox.put_nowait(ProcessingRequest(response_body=HttpBody(body=data)))

    async def end(self) -> None:
        self.outbox.put_nowait(None)
        assert await asyncio.wait_for(self.call.code(), 5) == grpc.StatusCode.OK


async def test_a_paced_request_goes_at_the_first_token_of_the_one_ahead() -> None:
    gateway = compose(policy_from_text(_policy("prefill_budget_tokens: 5")))
    async with served_stub(gateway) as stub:
        first, forward = await _forward(stub, "globex", _chat(stream=True))
        request_id = set_headers(forward, "request_body")["x-gateway-request-id"]
        second, held = await _forward(stub, "globex", _chat(stream=True))
        assert held.HasField("override_message_timeout")  # paced: the first is prefilling
        pool = gateway.scheduler.snapshot()["pools"]["short"]
        assert pool["inflight"] == 1 and pool["prefilling_tokens"] > 5
        accounting = _AccountingStream(stub, request_id)
        await first.send(ProcessingRequest(response_headers=http_headers([(":status", "200")])))
        assert gateway.scheduler.snapshot()["tenants"]["globex"]["queued"] == 1
        accounting.chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        reply = await second.read()
        assert reply.WhichOneof("response") == "request_body"
        snapshot = gateway.scheduler.snapshot()
        assert snapshot["pools"]["short"]["inflight"] == 2  # the first has not ended
        await accounting.end()
        for peer in (first, second):
            await peer.close()
            await peer.call.code()
