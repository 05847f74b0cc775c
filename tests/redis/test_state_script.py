"""The Lua script against a real redis-server, operation by operation, on a controlled clock."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from extproc.policy.model import State
from extproc.scheduler.limits import Bucket, MemoryLimitStore, Take
from extproc.state import ops
from extproc.state.backend import RedisBackend
from tests.redis.support import RedisServer

pytestmark = pytest.mark.redis

T0 = 1_700_000_000.0


@pytest.fixture
async def backend(redis_server: RedisServer) -> AsyncIterator[RedisBackend]:
    settings = State(backend="redis", url=redis_server.url, timeout=2.0, lease_ttl=10.0)
    backend = RedisBackend(settings, "replica-a", time_override=T0)
    try:
        yield backend
    finally:
        await backend.close()


async def one(backend: RedisBackend, op: ops.Op) -> dict[str, Any]:
    return (await backend.run([op]))[0]


def gate(rid: str, tenant: str, **overrides: Any) -> ops.Gate:
    op = ops.Gate(
        request_id=rid, tenant=tenant, pool="short", tier_rank=1, budget=100, input_tokens=50,
        max_output_tokens=50, weight=1.0, fair_cost=150.0, input_weight=1.0, output_weight=2.0,
        max_concurrency=0, pool_max_inflight=2, pool_max_tokens=10_000, fair_slack=0.0,
    )  # fmt: skip
    return dataclasses.replace(op, **overrides)


def level(bucket: Bucket) -> ops.BucketLevel:
    return ops.BucketLevel(bucket)


async def test_bucket_math_matches_the_pure_functions(backend: RedisBackend) -> None:
    """Random takes, refunds and settlements: Redis and MemoryLimitStore agree exactly."""
    rng = random.Random(7)
    buckets = [Bucket("t:requests", 10.0, 10 / 60), Bucket("t:tokens", 5000.0, 5000 / 60)]
    memory = MemoryLimitStore()
    now = T0
    for _ in range(300):
        now += rng.choice([0.0, 0.01, 0.5, 3.0, 20.0])
        backend.time_override = now
        action = rng.random()
        if action < 0.6:
            takes = [Take(buckets[0], 1.0), Take(buckets[1], float(rng.randint(1, 6000)))]
            want = memory.try_take(takes, now)
            got = await one(backend, ops.TakeBuckets(tuple(takes)))
            assert bool(got["ok"]) == want.ok
            assert got["l"] == pytest.approx(list(want.levels), abs=1e-6)
            if want.wait_s is None:
                assert got["w"] == -1
            else:
                assert got["w"] == pytest.approx(want.wait_s, abs=1e-6)
        elif action < 0.8:
            bucket, amount = buckets[1], float(rng.randint(1, 500))
            memory.give_back(bucket, amount, now)
            await one(backend, ops.GiveBack(bucket, amount))
        else:
            bucket, delta = buckets[1], float(rng.randint(-300, 300))
            memory.adjust(bucket, delta, now)
            await one(backend, ops.AdjustBucket(bucket, delta))
        for bucket in buckets:
            got = await one(backend, level(bucket))
            assert got["l"] == pytest.approx(memory.level(bucket, now), abs=1e-6)


async def test_bucket_keys_expire_once_full_again(backend: RedisBackend) -> None:
    backend.time_override = None  # real server time: PEXPIRE runs on it
    await one(backend, ops.TakeBuckets((Take(Bucket("x:requests", 600.0, 10.0), 1.0),)))
    ttl = await backend.client.pttl("extproc:b:x:requests")
    assert 0 < ttl <= 1100  # 0.1 s to refill one request, plus one second of margin


async def test_gate_capacity_concurrency_and_exactly_once_release(backend: RedisBackend) -> None:
    assert (await one(backend, gate("r1", "acme", max_concurrency=2)))["ok"] == 1
    assert (await one(backend, gate("r2", "acme", max_concurrency=2, budget=200)))["ok"] == 1
    refused = await one(backend, gate("r3", "globex"))
    assert refused == {"ok": 0, "why": "capacity", "n": 2, "tok": 300, "rc": 0}
    # the same request id again from its owner is idempotent (a retried gate)
    assert (await one(backend, gate("r1", "acme", max_concurrency=2)))["again"] == 1
    released = await one(backend, ops.Release("r1"))
    assert released["done"] == 1 and released["n"] == 1 and released["tok"] == 200
    assert (await one(backend, ops.Release("r1")))["ok"] == 0  # exactly once
    assert (await one(backend, gate("r4", "acme", max_concurrency=1)))["why"] == "concurrency"
    assert (await one(backend, gate("r4", "acme", max_concurrency=2)))["ok"] == 1


async def test_gate_keeps_lower_tiers_out_while_a_higher_tier_waits(backend: RedisBackend) -> None:
    await one(backend, ops.Backlog(add=(("short", 0, "vip"),)))
    assert (await one(backend, gate("r1", "acme", tier_rank=1)))["why"] == "tier"
    assert (await one(backend, gate("r2", "vip", tier_rank=0)))["ok"] == 1
    await one(backend, ops.Backlog(remove=(("short", 0, "vip"),)))
    assert (await one(backend, gate("r1", "acme", tier_rank=1)))["ok"] == 1


async def test_gate_serves_the_least_served_waiting_tenant(backend: RedisBackend) -> None:
    wide = {"pool_max_inflight": 100}
    # the flooder is served twice while alone; then a quiet tenant starts waiting
    await one(backend, ops.Backlog(add=(("short", 1, "flood"),)))
    for rid in ("f1", "f2"):
        assert (await one(backend, gate(rid, "flood", **wide)))["ok"] == 1
    other = RedisBackend(backend.settings, "replica-b", time_override=T0)
    try:
        await one(other, ops.Backlog(add=(("short", 1, "quiet"),)))
        counters = await backend.client.hgetall("extproc:vtc:short:1")
        assert float(counters[b"quiet"]) == float(counters[b"flood"])  # lifted, not zero
        assert (await one(backend, gate("f3", "flood", **wide)))["ok"] == 1
        # now the flooder is one request ahead: it must let the quiet tenant go first
        assert (await one(backend, gate("f4", "flood", **wide)))["why"] == "fair"
        assert (await one(other, gate("q1", "quiet", **wide)))["ok"] == 1
        assert (await one(backend, gate("f4", "flood", **wide)))["ok"] == 1
        # a slack of one request lets the flooder run one ahead
        assert (await one(backend, gate("f5", "flood", fair_slack=150.0, **wide)))["ok"] == 1
    finally:
        await other.close()


async def test_expired_leases_are_reclaimed_and_announced(backend: RedisBackend) -> None:
    assert (await one(backend, gate("r1", "acme")))["ok"] == 1
    assert (await one(backend, gate("r2", "acme")))["ok"] == 1
    backend.time_override = T0 + 5
    renewed = await one(backend, ops.Renew(("r1", "zz")))
    assert renewed["gone"] == ["zz"]
    backend.time_override = T0 + 12  # r2 expired at T0 + 10, r1 (renewed) lives to T0 + 15
    pubsub = backend.client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("extproc:ev")
    peek = await one(backend, ops.Peek("short"))
    assert peek == {"ok": 1, "n": 1, "tok": 100, "rc": 1}
    message = None
    for _ in range(20):  # the subscribe confirmation comes first (and reads as None)
        message = await pubsub.get_message(timeout=0.5)
        if message is not None:
            break
    assert message is not None and message["data"] == b"short|acme|r2|replica-a|1|100"
    await pubsub.aclose()
    assert (await one(backend, ops.Renew(("r2",))))["gone"] == ["r2"]


async def test_settlement_moves_bucket_and_counter_to_actual_usage(backend: RedisBackend) -> None:
    bucket = Bucket("acme:tokens", 1000.0, 1000 / 60)
    await one(backend, ops.TakeBuckets((Take(bucket, 100.0),)))
    assert (await one(backend, gate("r1", "acme", settled_buckets=(bucket,))))["ok"] == 1
    await one(backend, ops.ChargeOutput("r1", 70))  # 20 above the 50 reserved
    counters = await backend.client.hgetall("extproc:vtc:short:1")
    assert float(counters[b"acme"]) == 150 + 40
    await one(backend, ops.Release("r1", input_tokens=30, output_tokens=70))
    counters = await backend.client.hgetall("extproc:vtc:short:1")
    assert float(counters[b"acme"]) == 30 + 2 * 70
    settled = await one(backend, level(bucket))
    assert settled["l"] == pytest.approx(1000 - 100, abs=1e-6)  # 100 estimated, 100 used


async def test_handoff_releases_unless_an_accounting_stream_attached(backend: RedisBackend) -> None:
    for rid in ("r1", "r2"):
        assert (await one(backend, gate(rid, "acme")))["ok"] == 1
    assert (await one(backend, ops.Attach("r1"))) == {"ok": 1, "t": "acme", "p": "short"}
    assert (await one(backend, ops.HandOff("r1")))["r"] == "attached"
    handed = await one(backend, ops.HandOff("r2"))
    assert handed["r"] == "released" and handed["n"] == 1
    assert (await one(backend, ops.HandOff("r2")))["r"] == "gone"
    assert (await one(backend, ops.Attach("r2")))["ok"] == 0


async def test_another_replicas_request_id_is_a_duplicate(backend: RedisBackend) -> None:
    assert (await one(backend, gate("r1", "acme")))["ok"] == 1
    other = RedisBackend(backend.settings, "replica-b", time_override=T0)
    try:
        assert (await one(other, gate("r1", "acme")))["why"] == "duplicate"
    finally:
        await other.close()


async def test_take_and_gate_in_one_round_trip(backend: RedisBackend) -> None:
    takes = (Take(Bucket("acme:requests", 2.0, 2 / 60), 1.0),)

    def fast(rid: str) -> ops.TakeAndGate:
        return ops.TakeAndGate(takes, gate(rid, "acme"))

    both = await one(backend, fast("r1"))
    assert both["t"]["ok"] == 1 and both["g"]["ok"] == 1 and both["g"]["n"] == 1
    await one(backend, fast("r2"))
    refused = await one(backend, fast("r3"))  # the bucket is empty: no lease taken
    assert refused["t"]["ok"] == 0 and "g" not in refused
    assert (await one(backend, ops.Peek("short")))["n"] == 2
