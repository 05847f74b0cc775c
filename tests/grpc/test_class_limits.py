"""Limits per endpoint class through the real gRPC server: a class's bucket answers 429 with
an honest Retry-After and x-ratelimit-* headers that name it, while another class of the same
tenant passes; a budget above a class's burst is the request's fault (400)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from extproc.envoy_config import admission_response_headers
from extproc.policy import policy_from_text
from extproc.scheduler import ManualClock
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.roles import ADMISSION_METADATA
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, headers_message
from tests.grpc_support import served_stub

ACME = TEST_KEYS["acme"]
ACME_LIMITS = (
    "{requests_per_minute: 600, tokens_per_minute: 1000000, max_queued: 64, per_endpoint: "
    "{completions: {requests_per_minute: 30, requests_burst: 2, tokens_per_minute: 6000, "
    "tokens_burst: 300}}}"
)


@pytest.fixture
async def served() -> AsyncIterator[
    tuple[Gateway, ManualClock, ext_proc_grpc.ExternalProcessorStub]
]:
    gateway = compose(policy_from_text(policy_yaml(acme_limits=ACME_LIMITS)))
    # The scheduler runs on an injected clock: a manual one lets the test wait exactly the
    # advertised Retry-After.
    clock = ManualClock(gateway.scheduler.clock.now())
    gateway.scheduler.clock = clock
    async with served_stub(gateway, close_gateway=True) as stub:
        yield gateway, clock, stub


def completion_body(max_tokens: int = 16) -> bytes:
    return orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": max_tokens})


def chat_body(max_tokens: int = 16) -> bytes:
    messages = [{"role": "user", "content": "hello"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens})


async def ask(
    stub: ext_proc_grpc.ExternalProcessorStub, path: str, body: bytes
) -> tuple[EnvoyPeer, ProcessingResponse]:
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", path, ACME))
    reply = await peer.send(body_message(body))
    if reply.HasField("override_message_timeout"):
        reply = await peer.read()
    return peer, reply


def answer(reply: ProcessingResponse) -> tuple[int, dict[str, str], dict[str, str]]:
    assert reply.WhichOneof("response") == "immediate_response", reply
    immediate = reply.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, headers, orjson.loads(immediate.body)["error"]


def response_headers(forward: ProcessingResponse) -> dict[str, str]:
    """The headers the service asks Envoy to add to the client's response (the admitted
    request's): the forward's dynamic metadata, each of which Envoy's header-mutation filter
    adds (extproc.envoy_config.admission_response_headers)."""
    fields = forward.dynamic_metadata.fields[ADMISSION_METADATA].struct_value.fields
    sent = {name: value.string_value for name, value in fields.items()}
    assert set(sent) <= set(admission_response_headers())
    return sent


async def test_a_class_bucket_rejects_its_class_while_another_passes(served) -> None:  # type: ignore[no-untyped-def]
    _gateway, clock, stub = served
    peers = []
    for _ in range(2):
        peer, reply = await ask(stub, "/v1/completions", completion_body())
        assert reply.WhichOneof("response") == "request_body", reply
        peers.append(peer)
    sent = response_headers(reply)
    assert sent["x-ratelimit-limit-requests-completions"] == "2"
    assert sent["x-ratelimit-remaining-requests-completions"] == "0"
    assert sent["x-ratelimit-limit-requests"] == "600"
    peer, reply = await ask(stub, "/v1/completions", completion_body())
    status, headers, error = answer(reply)
    assert status == 429 and error["code"] == "rejected_rate"
    assert headers["retry-after"] == "2"  # one request at 30/min
    assert "per_endpoint.completions.requests_per_minute" in error["message"]
    assert headers["x-ratelimit-limit-requests-completions"] == "2"
    assert headers["x-ratelimit-remaining-requests-completions"] == "0"
    assert headers["x-ratelimit-reset-requests-completions"] == "4s"
    assert headers["x-ratelimit-remaining-requests"] == "598"  # all or nothing: not taken
    await peer.close()
    chat_peer, reply = await ask(stub, "/v1/chat/completions", chat_body())
    assert reply.WhichOneof("response") == "request_body", reply
    sent = response_headers(reply)
    assert "x-ratelimit-limit-requests-completions" not in sent
    assert sent["x-ratelimit-remaining-requests"] == "597"
    clock.advance(2.0)  # the advertised Retry-After: the class bucket holds one request again
    again, reply = await ask(stub, "/v1/completions", completion_body())
    assert reply.WhichOneof("response") == "request_body", reply
    for open_peer in [*peers, chat_peer, again]:
        await open_peer.close()


async def test_a_budget_above_a_class_burst_is_400_and_other_classes_pass(served) -> None:  # type: ignore[no-untyped-def]
    _gateway, _clock, stub = served
    peer, reply = await ask(stub, "/v1/completions", completion_body(max_tokens=400))
    status, headers, error = answer(reply)
    assert status == 400 and error["code"] == "budget_exceeds_rate_limit"
    assert "retry-after" not in headers
    assert "per_endpoint.completions.tokens_burst 300: it can never pass" in error["message"]
    await peer.close()
    peer, reply = await ask(stub, "/v1/chat/completions", chat_body(max_tokens=400))
    assert reply.WhichOneof("response") == "request_body", reply
    await peer.close()
