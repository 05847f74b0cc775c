"""Hermetic tests: play Envoy's side of the ext_proc protocol against the real gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.policy import policy_from_text
from extproc.service import request as request_record
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.processor import http_headers
from extproc.service.roles import ACCOUNTING_ROLE, ADMISSION_METADATA, ROLE_METADATA
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc_support import served_stub


def headers_message(
    method: str,
    path: str,
    key: str | None,
    extra: Iterable[tuple[str, str]] = (),
    eos: bool = False,
) -> ProcessingRequest:
    pairs = [(":method", method), (":path", path), (":authority", "gw"), *extra]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    return ProcessingRequest(request_headers=http_headers(pairs, end_of_stream=eos))


def body_message(body: bytes) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))


def chat_body(content: str = "hello", max_tokens: int = 16) -> bytes:
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    )


def set_headers(response: ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(response, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


class EnvoyPeer:
    """Drives one ext_proc stream the way Envoy does: send a message, read the reply."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub) -> None:
        self.outbox: asyncio.Queue[ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[ProcessingRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def send(self, message: ProcessingRequest) -> ProcessingResponse:
        await self.outbox.put(message)
        return await asyncio.wait_for(self.call.read(), 5)

    async def read(self) -> ProcessingResponse:
        return await asyncio.wait_for(self.call.read(), 5)

    async def close(self) -> None:
        await self.outbox.put(None)


async def response_ends(
    stub: ext_proc_grpc.ExternalProcessorStub,
    forward: ProcessingResponse,
    usage: tuple[int, int] | None = None,
    phase: str = "request_body",
) -> None:
    """What Envoy does once a forwarded request's response ends: the admission stream has
    already ended (right after `forward`); the accounting stream sees the request headers
    (with the gateway's request id) and the whole response, then closes, which settles.
    `usage` (prompt, completion tokens): a JSON response that reports them; None: a response
    without a body. `phase`: the reply that set the gateway's headers (`request_headers` with
    one round trip)."""
    request_id = set_headers(forward, phase)["x-gateway-request-id"]
    linked = [("x-gateway-request-id", request_id)]
    messages = [headers_message("POST", "/v1/chat/completions", None, linked)]
    if usage is None:
        end = http_headers([(":status", "200")], end_of_stream=True)
        messages.append(ProcessingRequest(response_headers=end))
    else:
        json_response = [(":status", "200"), ("content-type", "application/json")]
        counts = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
        body = orjson.dumps({"choices": [], "usage": counts})
        messages.append(ProcessingRequest(response_headers=http_headers(json_response)))
        messages.append(ProcessingRequest(response_body=HttpBody(body=body, end_of_stream=True)))
    accounting = stub.Process(iter(messages), metadata=((ROLE_METADATA, ACCOUNTING_ROLE),))
    assert await asyncio.wait_for(accounting.code(), 5) == grpc.StatusCode.OK


@pytest.fixture
async def service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    gateway = compose(policy_from_text(policy_yaml(short_inflight=1)))
    async with served_stub(gateway) as stub:
        yield gateway, stub


async def test_missing_and_wrong_key_get_401(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    for key in (None, "wrong"):
        peer = EnvoyPeer(stub)
        reply = await peer.send(headers_message("POST", "/v1/chat/completions", key))
        assert reply.WhichOneof("response") == "immediate_response"
        assert reply.immediate_response.status.code == 401
        error = orjson.loads(reply.immediate_response.body)["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        await peer.close()


async def test_get_passes_with_gateway_headers_and_strips_client_copies(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    spoofed = [("x-tenant-id", "acme"), ("x-llm-pool", "long"), ("x-tier", "premium")]
    reply = await peer.send(
        headers_message("GET", "/v1/models", TEST_KEYS["globex"], spoofed, eos=True)
    )
    assert reply.request_headers.response.clear_route_cache
    values = set_headers(reply, "request_headers")
    assert values["x-tenant-id"] == "globex" and values["x-tier"] == "standard"
    assert "x-llm-pool" in reply.request_headers.response.header_mutation.remove_headers
    await peer.close()


async def test_chat_is_routed_by_budget(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    for content, max_tokens, pool in (
        ("hi", 16, "short"),
        ("word " * 4000, 16, "long"),
        ("hi", 4000, "long"),
    ):
        peer = EnvoyPeer(stub)
        await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"],
                                        [("x-llm-pool", "short")]))  # fmt: skip
        reply = await peer.send(body_message(chat_body(content, max_tokens)))
        assert reply.WhichOneof("response") == "request_body"
        values = set_headers(reply, "request_body")
        assert values["x-llm-pool"] == pool and values["x-tenant-id"] == "globex"
        assert reply.request_body.response.clear_route_cache
        await peer.close()
        await peer.call.code()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"model": "m"}', "missing_field"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            "invalid_request",
        ),
        (chat_body("x", 100_000), "context_length_exceeded"),
    ],
)
async def test_bad_bodies_get_400(service, body: bytes, code: str) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["acme"]))
    reply = await peer.send(body_message(body))
    assert reply.immediate_response.status.code == 400
    assert orjson.loads(reply.immediate_response.body)["error"]["code"] == code
    await peer.close()


async def test_declared_oversized_body_gets_413(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    reply = await peer.send(
        headers_message(
            "POST", "/v1/chat/completions", TEST_KEYS["acme"], [("content-length", str(9 << 20))]
        )
    )
    assert reply.immediate_response.status.code == 413
    await peer.close()


async def test_held_request_gets_override_then_admission_after_release(service) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    first = EnvoyPeer(stub)
    await first.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
    admitted = await first.send(body_message(chat_body()))
    assert admitted.WhichOneof("response") == "request_body"

    second = EnvoyPeer(stub)
    await second.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["initech"]))
    held = await second.send(body_message(chat_body()))
    assert held.HasField("override_message_timeout")
    assert held.override_message_timeout.seconds >= 30
    assert gateway.scheduler.snapshot()["tenants"]["initech"]["queued"] == 1

    # The service ended the first stream after its forward; its response then ends.
    assert await asyncio.wait_for(first.call.code(), 5) == grpc.StatusCode.OK
    await response_ends(stub, admitted)
    reply = await second.read()
    assert reply.WhichOneof("response") == "request_body"
    await second.close()
    await second.call.code()


async def test_disconnect_while_held_leaves_nothing_queued(service) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    first = EnvoyPeer(stub)
    await first.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
    forward = await first.send(body_message(chat_body()))
    second = EnvoyPeer(stub)
    await second.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["initech"]))
    held = await second.send(body_message(chat_body()))
    assert held.HasField("override_message_timeout")
    second.call.cancel()
    for _ in range(200):  # the server sees the cancellation within milliseconds
        if gateway.scheduler.snapshot()["tenants"]["initech"]["queued"] == 0:
            break
        await asyncio.sleep(0.005)
    assert gateway.scheduler.snapshot()["tenants"]["initech"]["queued"] == 0
    assert await asyncio.wait_for(first.call.code(), 5) == grpc.StatusCode.OK
    await response_ends(stub, forward)
    snapshot = gateway.scheduler.snapshot()
    assert snapshot["pools"]["short"]["inflight"] == 0


async def test_the_service_ends_the_admission_stream_right_after_the_forward(service) -> None:  # type: ignore[no-untyped-def]
    """So a crash of the service cannot cut the response that follows, streamed or not (Envoy
    takes an OK end as "processing complete"); the capacity stays taken until the accounting
    stream, which may attach a moment later, settles the request. The client's response
    headers ride on the forward as dynamic metadata (Envoy adds them to the response)."""
    gateway, stub = service
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
    forward = await peer.send(body_message(chat_body()))
    assert forward.WhichOneof("response") == "request_body"
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK
    metadata = forward.dynamic_metadata.fields[ADMISSION_METADATA].struct_value.fields
    assert metadata["x-ratelimit-limit-requests"].string_value == "600"
    assert float(metadata["x-gateway-queue-ms"].string_value) >= 0.0
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 1
    await response_ends(stub, forward)
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0
    await peer.close()


async def test_a_bodyless_request_s_stream_ends_after_its_headers(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message("GET", "/v1/models", TEST_KEYS["globex"], eos=True))
    assert reply.WhichOneof("response") == "request_headers"
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK
    await peer.close()


async def test_capacity_is_freed_when_no_accounting_stream_attaches(service, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 0.05)
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
    await peer.send(body_message(chat_body()))
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK
    for _ in range(200):  # the grace is 50 ms here
        if gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0:
            break
        await asyncio.sleep(0.005)
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0
    await peer.close()
