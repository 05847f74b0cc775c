"""Admission at the door, through the real Envoy: limits, fair share, tiers, expiry, disconnects."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import LAYOUTS, RunningGateway, running_gateway, running_in_layout

pytestmark = pytest.mark.dataplane

LIMITS = "{requests_per_minute: 6000, tokens_per_minute: 10000000, max_queued: 500}"
RATE_LIMITED = "{requests_per_minute: 30, tokens_per_minute: 10000000, max_queued: 50}"
QUICK_EXPIRY = "{requests_per_minute: 6000, max_queued: 50, max_queue_wait: 400ms}"


def admission_policy(short: str, long_: str) -> str:
    return policy_yaml(
        short,
        long_,
        acme_limits=LIMITS,
        globex_limits=LIMITS,
        initech_limits=LIMITS,
        short_inflight=2,
        long_inflight=1,
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    """Both ways the admission filter can take the body: one round trip and two."""
    workdir = tmp_path_factory.mktemp("admission")
    with running_in_layout(request.param, workdir, admission_policy) as running:
        yield running


def chat(max_tokens: int, content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


async def send(
    session: aiohttp.ClientSession,
    gateway: RunningGateway,
    tenant: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    sent = {"authorization": f"Bearer {TEST_KEYS[tenant]}", **(headers or {})}
    async with session.post(
        gateway.base_url + "/v1/chat/completions", json=body, headers=sent
    ) as response:
        return response.status, dict(response.headers), await response.read()


async def tenants_view(session: aiohttp.ClientSession, gateway: RunningGateway) -> dict[str, Any]:
    async with session.get(gateway.admin_url + "/v1/tenants") as response:
        return orjson.loads(await response.read())  # type: ignore[no-any-return]


async def wait_for_view(
    session: aiohttp.ClientSession,
    gateway: RunningGateway,
    predicate: Any,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Poll the admin view until `predicate(view)` holds; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        view = await tenants_view(session, gateway)
        if predicate(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached; last view: {view}")
        await asyncio.sleep(0.02)


def settled(view: dict[str, Any]) -> bool:
    return all(p["inflight"] == 0 and p["queued"] == 0 for p in view["pools"].values()) and all(
        t["queued"] == 0 and t["inflight"] == 0 for t in view["tenants"].values()
    )


def queue_ms(headers: dict[str, str]) -> float:
    return float(headers["x-gateway-queue-ms"])


async def test_quiet_tenant_goes_ahead_of_a_flooders_backlog(gateway: RunningGateway) -> None:
    async with aiohttp.ClientSession() as session:
        flood = [
            asyncio.create_task(send(session, gateway, "globex", chat(120))) for _ in range(24)
        ]
        await wait_for_view(session, gateway, lambda v: v["tenants"]["globex"]["queued"] >= 15)
        quiet = []
        for _ in range(4):
            quiet.append(await send(session, gateway, "initech", chat(8)))
        flooded = await asyncio.gather(*flood)
        await wait_for_view(session, gateway, settled)
    assert all(status == 200 for status, _, _ in [*quiet, *flooded])
    quiet_wait = sum(queue_ms(h) for _, h, _ in quiet) / len(quiet)
    flood_wait = sum(queue_ms(h) for _, h, _ in flooded) / len(flooded)
    # The quiet tenant waits for about one flooder request, never for the whole backlog.
    assert quiet_wait < 0.25 * flood_wait, (quiet_wait, flood_wait)


async def test_premium_goes_before_a_queued_standard_backlog(gateway: RunningGateway) -> None:
    async with aiohttp.ClientSession() as session:
        backlog = [
            asyncio.create_task(send(session, gateway, "globex", chat(100))) for _ in range(10)
        ]
        await wait_for_view(session, gateway, lambda v: v["tenants"]["globex"]["queued"] >= 6)
        status, headers, _ = await send(session, gateway, "acme", chat(4))
        done_at_premium = sum(task.done() for task in backlog)
        results = await asyncio.gather(*backlog)
        await wait_for_view(session, gateway, settled)
    assert status == 200
    # It was admitted at the next free slot: at most the two running requests finished first.
    assert done_at_premium <= 4
    assert queue_ms(headers) < min(sorted(queue_ms(h) for _, h, _ in results)[-4:])


async def test_disconnect_while_queued_leaves_no_trace(gateway: RunningGateway) -> None:
    async with aiohttp.ClientSession() as session:
        running = [
            asyncio.create_task(send(session, gateway, "globex", chat(150))) for _ in range(2)
        ]
        await wait_for_view(session, gateway, lambda v: v["pools"]["short"]["inflight"] == 2)
        waiter = asyncio.create_task(send(session, gateway, "initech", chat(5)))
        await wait_for_view(session, gateway, lambda v: v["tenants"]["initech"]["queued"] == 1)
        waiter.cancel()
        view = await wait_for_view(
            session, gateway, lambda v: v["tenants"]["initech"]["queued"] == 0
        )
        assert view["tenants"]["initech"]["inflight"] == 0
        await asyncio.gather(*running)
        await wait_for_view(session, gateway, settled)


async def test_soak_of_random_disconnects_ends_at_zero(gateway: RunningGateway) -> None:
    rng = random.Random(7)

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        tenant = ("globex", "initech", "acme")[index % 3]
        body = chat(rng.randint(5, 80), stream=rng.random() < 0.5)
        task = asyncio.create_task(send(session, gateway, tenant, body))
        if rng.random() < 0.6:
            await asyncio.sleep(rng.uniform(0.0, 0.3))  # disconnect at a random moment
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i) for i in range(90)), return_exceptions=True)
        await wait_for_view(session, gateway, settled, timeout=20)


def limited_policy(short: str, long_: str) -> str:
    return policy_yaml(
        short,
        long_,
        globex_limits=RATE_LIMITED,
        initech_limits=QUICK_EXPIRY,
        short_inflight=1,
    )


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path_factory.mktemp("limited"), limited_policy) as running:
        yield running


async def test_rate_limit_429_with_honest_retry_after(limited: RunningGateway) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(60):  # the bucket holds 30 requests; the first 429 comes by then
            status, headers, body = await send(session, limited, "globex", chat(1))
            if status == 429:
                break
        assert status == 429, "never rate limited"
        error = orjson.loads(body)["error"]
        assert error["type"] == "rate_limit_error"
        retry_after = int(headers["Retry-After"])
        assert 1 <= retry_after <= 2  # 30/min refills one request every 2 s
        assert headers["x-ratelimit-limit-requests"] == "30"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        await asyncio.sleep(retry_after)  # waiting as told is the behaviour under test
        status, headers, _ = await send(session, limited, "globex", chat(1))
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "30"


async def test_expired_and_shed_requests_get_503(limited: RunningGateway) -> None:
    async with aiohttp.ClientSession() as session:
        busy = asyncio.create_task(send(session, limited, "acme", chat(1500)))
        await wait_for_view(session, limited, lambda v: v["pools"]["short"]["inflight"] == 1)
        started = time.monotonic()
        status, headers, body = await send(session, limited, "initech", chat(5))
        waited = time.monotonic() - started
        assert status == 503 and orjson.loads(body)["error"]["code"] == "expired"
        assert int(headers["Retry-After"]) >= 1
        assert 0.35 < waited < 3.0
        status, headers, body = await send(
            session, limited, "acme", chat(5), headers={"x-deadline-ms": "50"}
        )
        assert status == 503 and orjson.loads(body)["error"]["code"] == "shed"
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        await wait_for_view(session, limited, settled)
