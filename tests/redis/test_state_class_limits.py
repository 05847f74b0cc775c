"""Limits per endpoint class and bursts in the shared store: the script counts a class's
concurrency in a set of its own (freed on release and on expiry, renewed with the lease),
settles every token bucket a lease took, and two gateway processes on one Redis share a
class's bucket: its 429 names it while another class passes."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

from extproc.policy import policy_from_text
from extproc.scheduler.limits import Bucket, Take
from extproc.service.composition import compose
from extproc.state import local_share, ops
from extproc.state.backend import RedisBackend
from tests.conftest import policy_yaml
from tests.grpc.test_class_limits import answer, ask, chat_body, completion_body
from tests.grpc_support import served_stub
from tests.redis.support import RedisServer
from tests.redis.test_state_script import T0, backend, gate, one

pytestmark = pytest.mark.redis
__all__ = ["backend"]  # the fixture, shared with the script's own tests


def completions(rid: str, **overrides: object) -> ops.Gate:
    return dataclasses.replace(
        gate(rid, "acme"), endpoint="completions", class_concurrency=1, **overrides
    )


async def test_a_class_concurrency_limit_counts_its_class_only(backend: RedisBackend) -> None:
    assert (await one(backend, completions("c1")))["ok"] == 1
    refused = await one(backend, completions("c2"))
    assert refused["ok"] == 0 and refused["why"] == "concurrency"
    assert (await one(backend, gate("chat1", "acme")))["ok"] == 1  # pool max_inflight is 2
    assert await backend.client.zrange("extproc:tl:acme:completions", 0, -1) == [b"c1"]
    await one(backend, ops.Release("c1"))
    assert await backend.client.zcard("extproc:tl:acme:completions") == 0
    await one(backend, ops.Release("chat1"))
    assert (await one(backend, completions("c2")))["ok"] == 1


async def test_an_expired_class_lease_frees_its_slot_and_a_renewed_one_keeps_it(
    backend: RedisBackend,
) -> None:
    assert (await one(backend, completions("c1")))["ok"] == 1
    backend.time_override = T0 + 8.0
    assert ops.reply_list((await one(backend, ops.Renew(("c1",))))["gone"]) == []
    backend.time_override = T0 + 12.0  # past the first expiry (ttl 10 s), not the renewed one
    assert (await one(backend, completions("c2")))["why"] == "concurrency"
    backend.time_override = T0 + 30.0  # its holder stopped renewing: expired
    assert (await one(backend, completions("c2")))["ok"] == 1
    assert await backend.client.zrange("extproc:tl:acme:completions", 0, -1) == [b"c2"]


async def test_release_settles_every_token_bucket_the_lease_took(backend: RedisBackend) -> None:
    wide = Bucket("acme:tokens", 10_000.0, 10_000 / 60)
    own = Bucket("acme:tokens-completions", 1000.0, 2000 / 60)
    await one(backend, ops.TakeBuckets((Take(wide, 100.0), Take(own, 100.0))))
    op = completions("c1", settled_buckets=(wide, own))
    assert (await one(backend, op))["ok"] == 1
    await one(backend, ops.Release("c1", input_tokens=200, output_tokens=150))  # 250 more
    assert (await one(backend, ops.BucketLevel(wide)))["l"] == pytest.approx(10_000 - 350)
    assert (await one(backend, ops.BucketLevel(own)))["l"] == pytest.approx(1000 - 350)


async def test_a_lowered_burst_clamps_the_shared_level(backend: RedisBackend) -> None:
    before = Bucket("acme:requests-chat", 60.0, 1.0)
    await one(backend, ops.TakeBuckets((Take(before, 10.0),)))
    after = Bucket("acme:requests-chat", 5.0, 2.0)
    assert (await one(backend, ops.BucketLevel(after)))["l"] == 5.0
    taken = await one(backend, ops.TakeBuckets((Take(after, 6.0),)))
    assert taken["ok"] == 0 and taken["w"] == -1  # above the new capacity: never


ACME_LIMITS = (
    "{requests_per_minute: 600, max_queued: 64, per_endpoint: "
    "{completions: {requests_per_minute: 30, requests_burst: 3}}}"
)


@pytest.fixture
async def two_processes(redis_server: RedisServer) -> AsyncIterator[list[ExternalProcessorStub]]:
    """Two gateways (as two processes would be) on one Redis."""
    extra = f"state: {{backend: redis, url: '{redis_server.url}', timeout: 2s}}\n"
    policy = policy_from_text(policy_yaml(acme_limits=ACME_LIMITS, extra=extra))
    async with (
        served_stub(compose(policy), close_gateway=True) as first,
        served_stub(compose(policy), close_gateway=True) as second,
    ):
        yield [first, second]


async def test_two_processes_share_a_class_bucket(
    two_processes: list[ExternalProcessorStub],
) -> None:
    stubs = two_processes
    peers = []
    for index in range(3):
        peer, reply = await ask(stubs[index % 2], "/v1/completions", completion_body())
        assert reply.WhichOneof("response") == "request_body", reply
        peers.append(peer)
    for stub in stubs:  # the class bucket is empty for both processes
        peer, reply = await ask(stub, "/v1/completions", completion_body())
        status, headers, error = answer(reply)
        assert status == 429 and headers["retry-after"] == "2"
        assert headers["x-ratelimit-remaining-requests-completions"] == "0"
        assert headers["x-ratelimit-limit-requests-completions"] == "3"
        assert "per_endpoint.completions.requests_per_minute" in error["message"]
        await peer.close()
        chat, reply = await ask(stub, "/v1/chat/completions", chat_body())
        assert reply.WhichOneof("response") == "request_body", reply
        peers.append(chat)
    for peer in peers:
        await peer.close()


def test_the_local_fallback_shares_bursts_and_class_limits_too() -> None:
    limits = (
        "{requests_per_minute: 25, requests_burst: 9, per_endpoint: {completions: "
        "{tokens_per_minute: 1000, tokens_burst: 301, max_concurrency: 3}}}"
    )
    policy = policy_from_text(policy_yaml(acme_limits=limits))
    shared = local_share(policy, 4).tenants["acme"].limits
    assert (shared.requests_per_minute, shared.requests_burst) == (7, 3)
    block = shared.per_endpoint["completions"]
    assert (block.tokens_per_minute, block.tokens_burst, block.max_concurrency) == (250, 76, 1)
    assert local_share(policy, 1) is policy
