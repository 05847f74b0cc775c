"""Embeddings, rerank and score through the real gRPC server, Envoy's side played by a stub:
routed to the pooling pool with no output reserved and the body untouched, settled from the
JSON response's usage, and a class no pool serves answered with the OpenAI 404."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    CommonResponse,
    HttpBody,
    ProcessingRequest,
)

from extproc.policy import policy_from_text
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.processor import AdmissionProcessor, http_headers
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, headers_message, set_headers
from tests.grpc.test_stream_ports import FakeAdmission
from tests.grpc_support import served_stub
from tests.pooling_support import (
    EMBED_POOL,
    embeddings_body,
    pooling_policy_yaml,
    rerank_body,
    score_body,
)


def forwarded_as(response: CommonResponse, sent: dict[str, Any]) -> dict[str, Any]:
    """The body the engine gets: the client's, changed (if at all) only in its engine
    `priority` (the scheduler's engine priority, or the pool's pooling_priority); never
    `stream_options`, which is for streamed generation."""
    if not response.HasField("body_mutation"):
        return sent
    forwarded: dict[str, Any] = orjson.loads(response.body_mutation.body)
    assert "stream_options" not in forwarded or "stream_options" in sent
    assert {k: v for k, v in forwarded.items() if k != "priority"} == {
        k: v for k, v in sent.items() if k != "priority"
    }
    return forwarded


POOLING_CALLS = [
    ("/v1/embeddings", embeddings_body(["first text", "second text"]), "embeddings"),
    ("/v1/embeddings", embeddings_body([[1, 2, 3], [4, 5]]), "embeddings"),
    ("/v1/rerank", rerank_body("what is a cat", ["a cat is an animal", "paris"]), "rerank"),
    ("/v1/score", score_body("what is a cat", ["a cat is an animal", "paris"]), "rerank"),
]


@pytest.mark.parametrize(("path", "body", "endpoint"), POOLING_CALLS)
async def test_the_ticket_names_the_class_and_reserves_no_output(
    path: str, body: dict[str, object], endpoint: str
) -> None:
    """Per-class limits key on Ticket.endpoint: /v1/score is a rerank call."""
    port = FakeAdmission(policy_from_text(pooling_policy_yaml()))
    processor = AdmissionProcessor(port)
    headers = [
        (":method", "POST"),
        (":path", path),
        ("authorization", f"Bearer {TEST_KEYS['acme']}"),
    ]
    processor.on_request_headers(http_headers(headers))
    message = HttpBody(body=orjson.dumps(body), end_of_stream=True)
    [reply] = [r async for r in processor.on_request_body(message)]
    assert reply.HasField("request_body")
    [ticket] = port.tickets
    assert ticket.endpoint == endpoint and ticket.pool == EMBED_POOL
    assert ticket.max_output_tokens == 0 and ticket.budget == ticket.input_tokens
    forwarded_as(reply.request_body.response, body)


@pytest.fixture
async def service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    gateway = compose(policy_from_text(pooling_policy_yaml()))
    async with served_stub(gateway) as stub:
        yield gateway, stub


def counted_input(gateway: Gateway, tenant: str) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "extproc_tokens_total", {"tenant": tenant, "direction": "input"}
    )
    return value or 0.0


async def call_and_account(
    gateway: Gateway,
    stub: ext_proc_grpc.ExternalProcessorStub,
    path: str,
    body: dict[str, object],
    response: dict[str, object],
) -> dict[str, str]:
    """One pooling call through both streams, as Envoy runs them: the admission stream (the
    service ends it at its forward), then the accounting stream with the JSON response body
    in two chunks. Returns the headers the admission stream set upstream."""
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", path, TEST_KEYS["globex"], [("x-llm-pool", "short")]))
    forward = await peer.send(body_message(orjson.dumps(body)))
    assert forward.WhichOneof("response") == "request_body"
    forwarded_as(forward.request_body.response, body)
    upstream = set_headers(forward, "request_body")
    assert forward.request_body.response.clear_route_cache
    json_headers = http_headers([(":status", "200"), ("content-type", "application/json")])
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK
    raw = orjson.dumps(response)
    request_id = [("x-gateway-request-id", upstream["x-gateway-request-id"])]
    accounting = stub.Process(
        iter([
            headers_message("POST", path, TEST_KEYS["globex"], request_id),
            ProcessingRequest(response_headers=json_headers),
            ProcessingRequest(response_body=HttpBody(body=raw[:20])),
            ProcessingRequest(response_body=HttpBody(body=raw[20:], end_of_stream=True)),
        ]),
        metadata=((ROLE_METADATA, ACCOUNTING_ROLE),),
    )  # fmt: skip
    assert await asyncio.wait_for(accounting.code(), 5) == grpc.StatusCode.OK
    await peer.close()
    return upstream


@pytest.mark.parametrize(("path", "body", "endpoint"), POOLING_CALLS)
async def test_pooling_calls_are_routed_and_accounted_from_json_usage(
    service: tuple[Gateway, ext_proc_grpc.ExternalProcessorStub],
    path: str,
    body: dict[str, object],
    endpoint: str,
) -> None:
    gateway, stub = service
    before = counted_input(gateway, "globex")
    # vLLM's bodies: embeddings and score carry UsageInfo, rerank {prompt_tokens, total_tokens}.
    usage = {"prompt_tokens": 37, "total_tokens": 37}
    response = {"id": "x", "model": "m", "data": [], "usage": usage}
    upstream = await call_and_account(gateway, stub, path, body, response)
    assert upstream["x-llm-pool"] == EMBED_POOL and upstream["x-tenant-id"] == "globex"
    assert counted_input(gateway, "globex") - before == 37
    snapshot = gateway.scheduler.snapshot()
    assert snapshot["pools"][EMBED_POOL]["inflight"] == 0
    assert gateway.metrics.registry.get_sample_value(
        "extproc_tokens_total", {"tenant": "globex", "direction": "output"}
    ) in (None, 0.0)


async def test_a_batch_larger_than_the_pool_context_is_routed_by_its_longest_input(
    service: tuple[Gateway, ext_proc_grpc.ExternalProcessorStub],
) -> None:
    """2,000 inputs of a few tokens: far above the pool's max_total_tokens (8192) together,
    each well inside it; one input above it is refused."""
    gateway, stub = service
    batch = [f"input number {i} of a large embedding batch" for i in range(2000)]
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/embeddings", TEST_KEYS["globex"]))
    reply = await peer.send(body_message(orjson.dumps(embeddings_body(batch))))
    assert set_headers(reply, "request_body")["x-llm-pool"] == EMBED_POOL
    assert gateway.scheduler.snapshot()["pools"][EMBED_POOL]["inflight_tokens"] > 8192
    await peer.close()
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/embeddings", TEST_KEYS["globex"]))
    reply = await peer.send(body_message(orjson.dumps(embeddings_body(["x", "word " * 9000]))))
    assert reply.immediate_response.status.code == 400
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["code"] == "context_length_exceeded" and "longest input" in error["message"]
    await peer.close()


async def test_a_chat_request_never_goes_to_the_pooling_pool(
    service: tuple[Gateway, ext_proc_grpc.ExternalProcessorStub],
) -> None:
    _, stub = service
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}
    reply = await peer.send(body_message(orjson.dumps(chat)))
    assert set_headers(reply, "request_body")["x-llm-pool"] == "long"  # not embed (8192)
    await peer.close()


async def test_embeddings_without_a_pooling_pool_get_the_openai_404() -> None:
    gateway = compose(policy_from_text(policy_yaml()))
    async with served_stub(gateway) as stub:
        peer = EnvoyPeer(stub)
        await peer.send(headers_message("POST", "/v1/embeddings", TEST_KEYS["globex"]))
        reply = await peer.send(body_message(orjson.dumps(embeddings_body("hello"))))
        assert reply.WhichOneof("response") == "immediate_response"
        assert reply.immediate_response.status.code == 404
        error = orjson.loads(reply.immediate_response.body)["error"]
        assert error["code"] == "endpoint_not_served" and "embeddings" in error["message"]
        assert error["type"] == "invalid_request_error"
        await peer.close()
    await gateway.close()


async def test_a_bad_embeddings_body_gets_the_openai_400(
    service: tuple[Gateway, ext_proc_grpc.ExternalProcessorStub],
) -> None:
    _, stub = service
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/embeddings", TEST_KEYS["globex"]))
    reply = await peer.send(body_message(orjson.dumps({"model": "m", "input": [[1], ["x"]]})))
    assert reply.immediate_response.status.code == 400
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["type"] == "invalid_request_error" and "input" in error["message"]
    await peer.close()


async def test_a_pools_pooling_priority_is_written_into_the_forwarded_body() -> None:
    """So an engine scheduling by priority serves chat (priority 0) before a batch's inputs."""
    text = pooling_policy_yaml().replace(
        "serves: [embeddings, rerank]", "serves: [embeddings, rerank]\n    pooling_priority: 5"
    )
    gateway = compose(policy_from_text(text))
    async with served_stub(gateway) as stub:
        for body in (embeddings_body(["a", "b"]), {**rerank_body("q", ["d"]), "priority": -9}):
            peer = EnvoyPeer(stub)
            await peer.send(headers_message("POST", "/v1/rerank" if "query" in body else
                                            "/v1/embeddings", TEST_KEYS["globex"]))  # fmt: skip
            reply = await peer.send(body_message(orjson.dumps(body)))
            mutation = reply.request_body.response.body_mutation
            forwarded = orjson.loads(mutation.body)
            assert forwarded == {**body, "priority": 5}  # the client's own is replaced
            headers = set_headers(reply, "request_body")
            assert headers["content-length"] == str(len(mutation.body))
            await peer.close()
        # Chat keeps the scheduler's engine priority, not the pooling pool's.
        peer = EnvoyPeer(stub)
        await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = await peer.send(body_message(orjson.dumps(chat)))
        forwarded = forwarded_as(reply.request_body.response, chat)
        assert forwarded.get("priority") != 5  # the pooling pool's priority is not chat's
        await peer.close()
    await gateway.close()
