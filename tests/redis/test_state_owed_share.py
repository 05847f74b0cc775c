"""A waiting tenant keeps the fair share it is owed while its request is being proposed.

A process proposes its local scheduler's choice to the shared gate; until Redis answers, the
request is out of the process's queue. If that took the tenant out of the shared backlog
registry, a refused proposal (the pool filled up meanwhile) would register it again, and
registering lifts a tenant's counter to the least counter of the others waiting: the quiet
tenant would forget what it is owed on every refused proposal, tie with the flooder, and the
flooder's process, which hears of its own releases first, would win every tie. (Seen in CI as
a quiet request served after an 18-request flooder backlog in test_scaleout_fairness.)

The other processes here are a second Redis client running operations directly; the quiet
tenant's process is a real `RedisGate` behind a real admission controller.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from extproc.metrics import Metrics
from extproc.policy.loader import parse_policy
from extproc.policy.runtime import compile_policy
from extproc.scheduler import MonotonicClock, Ticket
from extproc.state import build_admission, ops
from extproc.state.backend import RedisBackend
from extproc.state.gate import RedisGate
from tests.redis.support import RedisServer

pytestmark = pytest.mark.redis

RANK = 0  # the only tier


def policy_text(url: str) -> str:
    return (
        "version: 1\n"
        "tiers: [standard]\n"
        "tenants:\n"
        "  quiet: {tier: standard, api_keys: []}\n"
        "  flood: {tier: standard, api_keys: []}\n"
        "  third: {tier: standard, api_keys: []}\n"
        "pools:\n"
        "  short: {max_inflight: 1, max_inflight_tokens: 100000, max_total_tokens: 100000,\n"
        "          endpoints: ['127.0.0.1:1'], headroom: 0}\n"
        "fairness: {policy: vtc}\n"
        f"state: {{backend: redis, url: '{url}', timeout: 2s}}\n"
    )


def other_gate(rid: str, tenant: str) -> ops.Gate:
    return ops.Gate(
        request_id=rid, tenant=tenant, pool="short", tier_rank=RANK, budget=100,
        input_tokens=50, max_output_tokens=50, weight=1.0, fair_cost=150.0, input_weight=1.0,
        output_weight=2.0, max_concurrency=0, pool_max_inflight=1, pool_max_tokens=100_000,
        fair_slack=0.0,
    )  # fmt: skip


@pytest.fixture
async def others(redis_server: RedisServer) -> AsyncIterator[RedisBackend]:
    """Another gateway process, as the operations it sends to Redis."""
    policy = compile_policy(parse_policy(policy_text(redis_server.url)))
    backend = RedisBackend(policy.source.state, "other-process")
    try:
        yield backend
    finally:
        await backend.close()


async def counters(backend: RedisBackend) -> dict[str, float]:
    raw = await backend.client.hgetall(f"{backend.prefix}vtc:short:{RANK}")
    return {key.decode(): float(value) for key, value in raw.items()}


def refusals(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "extproc_state_gate_refusals_total", {"reason": reason}
    )
    return value or 0.0


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.005)
    assert await check(), what


async def test_a_refused_proposal_does_not_lift_the_waiting_tenants_counter(
    redis_server: RedisServer, others: RedisBackend
) -> None:
    policy = compile_policy(parse_policy(policy_text(redis_server.url)))
    metrics = Metrics()
    _, controller = build_admission(policy, MonotonicClock(), metrics, replica="quiet-process")
    await controller.start()
    turn = None
    try:
        # The flooder holds the only slot and waits for more, in another process.
        await others.run([ops.Backlog(add=(("short", RANK, "flood"),))])
        (granted,) = await others.run([other_gate("f1", "flood")])
        assert granted["ok"] == 1

        # The quiet tenant's request is refused for capacity and waits in its process.
        turn = controller.submit(Ticket("q1", "quiet", "short", 50, 50))

        async def waiting_and_listening() -> bool:
            numsub = await others.client.pubsub_numsub(others.channel)
            return bool(numsub) and numsub[0][1] >= 1 and "quiet" in await counters(others)

        await until(waiting_and_listening, "the quiet tenant registered, events subscribed")
        assert not turn.done()
        owed = (await counters(others))["quiet"]

        # The flooder's request used far more than its estimate: the quiet tenant is owed.
        await others.run([ops.ChargeOutput("f1", 2000)])
        assert (await counters(others))["flood"] > owed

        # The slot is freed and, in the same atomic batch, taken by a third tenant: the release
        # event says there is room, so the quiet process proposes, and is refused (capacity).
        before = refusals(metrics, "capacity")
        released, third = await others.run([ops.Release("f1"), other_gate("t1", "third")])
        assert released["ok"] == 1 and third["ok"] == 1

        async def proposal_refused() -> bool:
            return refusals(metrics, "capacity") > before

        await until(proposal_refused, "the quiet process proposed and was refused")
        gate = controller.gate
        assert isinstance(gate, RedisGate)
        await gate.batcher.submit(ops.Peek("short"))  # runs after all the process sent before
        assert not turn.done()
        # Still owed: when the slot frees, the flooder's process (first to know, in the same
        # batch as the release) is refused in the quiet tenant's favour.
        assert (await counters(others))["quiet"] == owed
        _, flood = await others.run([ops.Release("t1"), other_gate("f2", "flood")])
        assert flood["why"] == "fair"
        grant = await asyncio.wait_for(turn, 5)
        assert grant.pool == "short"
    finally:
        if turn is not None and not turn.done():
            turn.cancel()
        await controller.close()
