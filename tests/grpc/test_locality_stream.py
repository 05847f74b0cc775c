"""D²LPM over the real gRPC server: the admission stream names the replica holding a
conversation's prefix (x-llm-replica), and a client's copy of that header never passes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc.policy import policy_from_text
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.types import REPLICA_HEADER
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, headers_message, set_headers
from tests.grpc_support import served_stub

_TWO_REPLICAS = '127.0.0.1:8001", "127.0.0.1:8003'


@pytest.fixture
async def service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    text = policy_yaml(short_endpoint=_TWO_REPLICAS, extra="fairness: {policy: dlpm}\n")
    gateway = compose(policy_from_text(text))
    async with served_stub(gateway) as stub:
        yield gateway, stub


def _conversation(topic: str, turns: int) -> bytes:
    messages: list[dict[str, str]] = [{"role": "system", "content": f"{topic} " * 200}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} about {topic}"})
        messages.append({"role": "assistant", "content": f"answer {turn} " * 20})
    messages.append({"role": "user", "content": "and then?"})
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 16})


async def _admit(
    stub: ext_proc_grpc.ExternalProcessorStub, body: bytes, peers: list[EnvoyPeer]
) -> dict[str, str]:
    """One request through admission, left in flight (its stream stays open)."""
    peer = EnvoyPeer(stub)
    peers.append(peer)
    spoofed = [(REPLICA_HEADER, "7")]
    headers = headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"], spoofed)
    await peer.send(headers)
    reply = await peer.send(body_message(body))
    assert reply.WhichOneof("response") == "request_body"
    values = set_headers(reply, "request_body")
    removed = reply.request_body.response.header_mutation.remove_headers
    assert (REPLICA_HEADER in removed) == (REPLICA_HEADER not in values)  # the client's copy
    return values


async def test_turns_of_a_conversation_go_to_the_replica_holding_its_prefix(service) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    peers: list[EnvoyPeer] = []
    try:
        first_a = await _admit(stub, _conversation("apples", 1), peers)
        first_b = await _admit(stub, _conversation("boats", 1), peers)
        assert first_a["x-llm-pool"] == first_b["x-llm-pool"] == "short"
        replica_a, replica_b = first_a[REPLICA_HEADER], first_b[REPLICA_HEADER]
        assert {replica_a, replica_b} == {"0", "1"}  # no match yet: the less loaded
        for turns in (2, 3):
            assert (await _admit(stub, _conversation("apples", turns), peers))[
                REPLICA_HEADER
            ] == replica_a
            assert (await _admit(stub, _conversation("boats", turns), peers))[
                REPLICA_HEADER
            ] == replica_b
        rows = gateway.scheduler.snapshot()["locality"]["pools"]["short"]
        assert [row["routed"] for row in rows] == [3, 3]
        assert all(row["predicted_hit_tokens"] > 0 for row in rows)
    finally:
        for peer in peers:
            await peer.close()
            peer.call.cancel()


async def test_a_pool_without_dlpm_leaves_the_choice_to_envoy() -> None:
    gateway = compose(policy_from_text(policy_yaml(short_endpoint=_TWO_REPLICAS)))
    async with served_stub(gateway) as stub:
        peers: list[EnvoyPeer] = []
        try:
            values = await _admit(stub, _conversation("apples", 1), peers)
            assert REPLICA_HEADER not in values
            assert "locality" not in gateway.scheduler.snapshot()
        finally:
            for peer in peers:
                await peer.close()
                peer.call.cancel()
