"""The service decides every request that reaches its admission stream by itself, as if the
Envoy in front had no allowlist: paths normalised and allowlisted, body-less inference calls
refused, budgets that no bucket can hold refused as the request's fault, queries and client
claims kept out of its log. Hermetic: these tests play Envoy's side of the gRPC stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from extproc.errors import GatewayError
from extproc.openai_request import normalise_path
from extproc.policy import policy_from_text
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import (
    EnvoyPeer,
    body_message,
    chat_body,
    headers_message,
    response_ends,
    set_headers,
)
from tests.grpc_support import served_stub

GLOBEX = TEST_KEYS["globex"]
# globex's whole token bucket holds 500 tokens: a larger budget can never pass.
_SMALL_BUCKET = "{requests_per_minute: 600, tokens_per_minute: 500, max_queued: 64}"


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    gateway = compose(policy_from_text(policy_yaml(globex_limits=_SMALL_BUCKET)))
    async with served_stub(gateway) as stub:
        yield gateway, stub


def answer_of(reply: ProcessingResponse, status: int, code: str) -> dict[str, str]:
    """The immediate answer's headers, after checking its status and OpenAI error body."""
    assert reply.WhichOneof("response") == "immediate_response", reply
    answer = reply.immediate_response
    assert answer.status.code == status
    error = orjson.loads(answer.body)["error"]
    assert {"message", "type", "code", "param"} <= set(error) and error["code"] == code
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    assert headers["content-type"] == "application/json"
    return headers


def requests_counted(gateway: Gateway, tenant: str, outcome: str) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "extproc_requests_total",
        {"tenant": tenant, "tier": "standard" if tenant != "unknown" else "unknown",
         "pool": "none", "outcome": outcome},
    )  # fmt: skip
    return value or 0.0


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1//chat///completions", "/v1/chat/completions"),
        ("/v1/./chat/completions?x=1", "/v1/chat/completions"),
        ("/v1/models/../chat/completions", "/v1/chat/completions"),
        ("/../../v1/completions", "/v1/completions"),
        ("/v1/chat/%63ompletions", "/v1/chat/completions"),
        ("/v1\\chat\\completions", "/v1/chat/completions"),
        ("/V1/Chat/Completions", "/V1/Chat/Completions"),
        ("/v1/chat/completions/", "/v1/chat/completions/"),
        ("", "/"),
    ],
)
def test_paths_are_normalised_as_envoy_reads_them(raw: str, normalised: str) -> None:
    assert normalise_path(raw) == normalised


@pytest.mark.parametrize("raw", ["/v1%2Fchat/completions", "/v1/chat%2fcompletions", "/v1%5Cx"])
def test_encoded_slashes_are_refused(raw: str) -> None:
    with pytest.raises(GatewayError) as caught:
        normalise_path(raw)
    assert caught.value.status == 400


@pytest.mark.parametrize(
    "path",
    [
        "/metrics",
        "/health",
        "/tokenize",
        "/v1/embeddings/",
        "/v2/rerank",  # vLLM's other spellings of rerank and score: not the gateway's
        "/score",
        "/v1/chat/completions/../../metrics",
        "/V1/chat/completions",
        "/v1/chat/completions/",
        "/",
    ],
)
async def test_anything_but_the_endpoints_gets_404(served, path: str) -> None:  # type: ignore[no-untyped-def]
    _, stub = served
    for eos in (True, False):
        peer = EnvoyPeer(stub)
        reply = await peer.send(headers_message("POST", path, GLOBEX, eos=eos))
        answer_of(reply, 404, "not_found")
        await peer.close()


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1//completions", "POST"),
        ("DELETE", "/v1/models", "GET"),
        ("POST", "/v1/models", "GET"),
    ],
)
async def test_a_wrong_method_gets_405(served, method: str, path: str, allowed: str) -> None:  # type: ignore[no-untyped-def]
    _, stub = served
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message(method, path, GLOBEX, eos=True))
    assert answer_of(reply, 405, "method_not_allowed")["allow"] == allowed
    await peer.close()


async def test_an_encoded_slash_gets_400(served) -> None:  # type: ignore[no-untyped-def]
    _, stub = served
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message("POST", "/v1%2Fchat/completions", GLOBEX))
    answer_of(reply, 400, "invalid_path")
    await peer.close()


async def test_a_normalised_inference_path_is_admitted(served) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = served
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1//chat/./%63ompletions", GLOBEX))
    reply = await peer.send(body_message(chat_body()))
    assert reply.WhichOneof("response") == "request_body"
    assert set_headers(reply, "request_body")["x-tenant-id"] == "globex"
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 1
    await peer.close()
    await peer.call.code()


async def test_models_is_still_answered_with_a_key(served) -> None:  # type: ignore[no-untyped-def]
    _, stub = served
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message("GET", "/v1/models?x=1", GLOBEX, eos=True))
    assert reply.WhichOneof("response") == "request_headers"
    assert set_headers(reply, "request_headers")["x-tenant-id"] == "globex"
    await peer.close()
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message("GET", "/v1/models", None, eos=True))
    answer_of(reply, 401, "invalid_api_key")
    await peer.close()


async def test_a_post_without_body_is_refused_and_counted(served, caplog) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = served
    caplog.set_level(logging.INFO, logger="extproc.request")
    for path in ("/v1/chat/completions", "/v1/completions"):
        peer = EnvoyPeer(stub)
        reply = await peer.send(headers_message("POST", path, GLOBEX, eos=True))
        answer_of(reply, 400, "missing_body")
        await peer.close()
        await peer.call.code()
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0
    assert requests_counted(gateway, "globex", "bad_request") == 2
    logged = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "extproc.request"]
    assert [(e["outcome"], e["status"], e["tenant"]) for e in logged] == [
        ("bad_request", 400, "globex")
    ] * 2


async def test_a_budget_above_the_token_bucket_is_400_not_429(served) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = served
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", GLOBEX))
    reply = await peer.send(body_message(chat_body(max_tokens=600)))
    headers = answer_of(reply, 400, "budget_exceeds_rate_limit")
    assert "retry-after" not in headers
    message = orjson.loads(reply.immediate_response.body)["error"]["message"]
    assert "tokens_per_minute 500" in message and "can never pass" in message
    await peer.close()
    await peer.call.code()
    # Within the bucket, the same tenant still passes.
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", GLOBEX))
    reply = await peer.send(body_message(chat_body(max_tokens=100)))
    assert reply.WhichOneof("response") == "request_body"
    await peer.close()
    await peer.call.code()
    await response_ends(stub, reply)
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0


async def test_log_has_no_query_and_the_identified_tenant(served, caplog) -> None:  # type: ignore[no-untyped-def]
    _, stub = served
    caplog.set_level(logging.INFO, logger="extproc.request")
    spoofed = [("x-tenant-id", "acme"), ("x-tier", "premium")]
    peer = EnvoyPeer(stub)
    reply = await peer.send(
        headers_message("POST", "/v1/chat/completions?api_key=sekrit-1", GLOBEX, spoofed)
    )
    # Envoy's access log reads the request's tenant header: the client's claim is replaced
    # by the identified tenant before any later rejection.
    assert set_headers(reply, "request_headers")["x-tenant-id"] == "globex"
    reply = await peer.send(body_message(chat_body(max_tokens=600)))
    answer_of(reply, 400, "budget_exceeds_rate_limit")
    await peer.close()
    await peer.call.code()
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message("GET", "/metrics?token=sekrit-2", None, spoofed))
    answer_of(reply, 404, "not_found")
    await peer.close()
    await peer.call.code()
    lines = [r.getMessage() for r in caplog.records if r.name == "extproc.request"]
    assert len(lines) == 2 and not any("sekrit" in line for line in lines), lines
    entries = [orjson.loads(line) for line in lines]
    assert [(e["path"], e["tenant"]) for e in entries] == [
        ("/v1/chat/completions", "globex"),
        ("/metrics", None),
    ]


@pytest.fixture
async def door_only() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    """No correction from the engines' counters: what the door charges stands."""
    policy = policy_from_text(policy_yaml(extra="gateway: {reconcile_cut_short: false}"))
    gateway = compose(policy)
    assert gateway.ledger is None
    async with served_stub(gateway) as stub:
        yield gateway, stub


async def test_a_client_gone_before_any_response_is_not_charged_its_prompt(door_only) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = door_only
    tokens_before = gateway.scheduler.snapshot()["tenants"]["globex"]["buckets"]["tokens"]
    admission = EnvoyPeer(stub)
    await admission.send(headers_message("POST", "/v1/chat/completions", GLOBEX))
    forward = await admission.send(body_message(chat_body("a longer prompt " * 40)))
    request_id = set_headers(forward, "request_body")["x-gateway-request-id"]
    # The accounting stream sees the request go upstream; then the client leaves before the
    # engine sends its response headers: the stream ends with no response at all.
    accounting = stub.Process(
        iter([headers_message("POST", "/v1/chat/completions", GLOBEX,
                              [("x-gateway-request-id", request_id)])]),
        metadata=((ROLE_METADATA, ACCOUNTING_ROLE),),
    )  # fmt: skip
    assert await accounting.code() == grpc.StatusCode.OK
    await admission.close()
    await admission.call.code()
    get = gateway.metrics.registry.get_sample_value
    labels = {"tenant": "globex", "direction": "input"}
    assert (get("extproc_tokens_total", labels) or 0.0) == 0.0
    snapshot = gateway.scheduler.snapshot()
    assert snapshot["pools"]["short"]["inflight"] == 0
    # The bucket got back the prompt it reserved; the output it reserved too, since no
    # token was seen (a refill during the test only adds).
    assert snapshot["tenants"]["globex"]["buckets"]["tokens"] >= tokens_before
