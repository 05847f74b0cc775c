"""The simulator and the live service make the same admission decisions for the same arrivals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc.openai_request import CHAT_PATH, parse_inference_request
from extproc.policy import Policy, policy_from_text
from extproc.scheduler import Ticket
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from gateway_lab.sim.replay import ReplayArrival, replay_admissions
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, headers_message, response_ends
from tests.grpc_support import served_stub

LIMITS = "{requests_per_minute: 100000, tokens_per_minute: 100000000, max_queued: 100}"
# (tenant, prompt words, max_tokens, x-priority): a mix of tiers, sizes and priorities.
ARRIVALS = [
    ("globex", 400, 200, 0),
    ("globex", 10, 20, 0),
    ("initech", 50, 50, 0),
    ("globex", 30, 300, 5),
    ("initech", 900, 100, 0),
    ("acme", 20, 20, 0),
    ("initech", 10, 10, 3),
    ("globex", 200, 40, 0),
    ("acme", 300, 200, 1),
    ("initech", 60, 500, 0),
]


def body_of(words: int, max_tokens: int) -> bytes:
    content = " ".join(f"w{i % 97}" for i in range(words))
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    )


def sim_order(policy: Policy, gateway: Gateway) -> list[int]:
    """The same arrivals replayed through the simulator's adapter, on a simulated clock."""
    tickets = []
    for index, (tenant, words, max_tokens, priority) in enumerate([("acme", 5, 5, 0), *ARRIVALS]):
        request = parse_inference_request(CHAT_PATH, body_of(words, max_tokens))
        spec = policy.tenants[tenant]
        tickets.append(
            ReplayArrival(
                at=0.001 * index,
                ticket=Ticket(
                    request_id=str(index),
                    tenant=tenant,
                    pool="short",
                    input_tokens=gateway.estimator.estimate_prompt(request.prompt),
                    max_output_tokens=max_tokens,
                    priority=policy.clamp_priority(spec, priority),
                ),
                hold_s=1.0 if index == 0 else 0.001,  # the first one blocks until all arrived
            )
        )
    result = replay_admissions(policy, tickets)
    return [int(request_id) - 1 for request_id in result.order[1:]]


@pytest.fixture
async def live() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    text = policy_yaml(
        acme_limits=LIMITS, globex_limits=LIMITS, initech_limits=LIMITS, short_inflight=1
    )
    gateway = compose(policy_from_text(text))
    async with served_stub(gateway) as stub:
        yield gateway, stub


async def test_live_service_admits_in_the_simulators_order(live) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = live
    # Before the live run: each response settles below with its estimates as its usage
    # (what the simulator releases with), and the estimator learns from settlements.
    expected = sim_order(gateway.policy, gateway)
    estimates = [
        gateway.estimator.estimate_prompt(parse_inference_request(CHAT_PATH, body).prompt)
        for body in (body_of(5, 5), *(body_of(words, tokens) for _, words, tokens, _ in ARRIVALS))
    ]
    blocker = EnvoyPeer(stub)
    await blocker.send(headers_message("POST", CHAT_PATH, TEST_KEYS["acme"]))
    admitted = await blocker.send(body_message(body_of(5, 5)))
    assert admitted.WhichOneof("response") == "request_body"

    peers = []
    for tenant, words, max_tokens, priority in ARRIVALS:
        peer = EnvoyPeer(stub)
        extra = [("x-priority", str(priority))]
        await peer.send(headers_message("POST", CHAT_PATH, TEST_KEYS[tenant], extra))
        held = await peer.send(body_message(body_of(words, max_tokens)))
        assert held.HasField("override_message_timeout")
        peers.append(peer)

    live_order: list[int] = []
    reads = {asyncio.ensure_future(peer.read()): index for index, peer in enumerate(peers)}
    # The blocker's response ends: the queue drains.
    await response_ends(stub, admitted, (estimates[0], 5))
    while reads:
        done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "capacity is 1: one admission at a time"
        [future] = done
        index = reads.pop(future)
        forward = future.result()
        assert forward.WhichOneof("response") == "request_body"
        live_order.append(index)
        # This response ends too, letting the next one in.
        await response_ends(stub, forward, (estimates[index + 1], ARRIVALS[index][2]))
    assert live_order == expected
    assert sorted(live_order) == list(range(len(ARRIVALS)))
