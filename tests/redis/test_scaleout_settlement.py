"""Admission on one process, accounting on another: settled once, released once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import TEST_KEYS, policy_yaml
from tests.redis.support import (
    Endpoint,
    RedisServer,
    admit,
    attach_accounting,
    await_for,
    chat_body,
    finish,
    serve_processes,
)

pytestmark = pytest.mark.redis

TPM = 6000


def policy(url: str) -> str:
    return policy_yaml(
        globex_limits=f"{{tokens_per_minute: {TPM}, max_queued: 64}}",
        short_inflight=1,
        extra=f"state: {{backend: redis, url: '{url}', timeout: 500ms, replicas: 2}}\n"
        "fairness: {policy: vtc}\n",
    )


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


def bucket_level(store: redis.Redis, began: float) -> tuple[float, float]:
    """The tokens bucket's level now, and how much it may have refilled since `began`."""
    raw = store.hget("extproc:b:globex:tokens", "l")
    level = TPM if raw is None else float(raw)
    return level, TPM / 60 * (time.monotonic() - began)


async def test_accounting_on_another_process_settles_and_releases_once(
    redis_server: RedisServer, store: redis.Redis, tmp_path: Path
) -> None:
    with serve_processes(policy(redis_server.url), tmp_path, 2) as (admitting, accounting):
        first, second = Endpoint(admitting.grpc_address), Endpoint(accounting.grpc_address)
        try:
            began = time.monotonic()
            outcome = await admit(first, TEST_KEYS["globex"], "globex", chat_body("hi", 200))
            assert outcome.admitted
            await attach_accounting(second, outcome)
            # a second accounting stream for the same request, on the admitting process
            twin = type(outcome)(tenant="globex", admitted=True, request_id=outcome.request_id)
            await attach_accounting(first, twin)
            # the pool holds one request: another tenant waits for the slot
            waiting = asyncio.create_task(
                admit(first, TEST_KEYS["initech"], "initech", chat_body(), timeout=20)
            )
            await finish(outcome, 7, 50)
            await finish(twin, 7, 50)
            nxt = await asyncio.wait_for(waiting, 20)
            assert nxt.admitted
            assert store.zcard("extproc:pl:short") == 1  # the slot was freed exactly once
            await attach_accounting(second, nxt)
            await finish(nxt, 3, 16)
            await await_for(lambda: store.zcard("extproc:pl:short") == 0, 5, "all released")
            assert int(store.hget("extproc:pb:short", "_sum") or 0) == 0
            # the admitting process freed its own lease when it heard of the release
            await await_for(lambda: admitting.tenants()["inflight"] == 0, 5, "local release")
            # the tokens bucket holds the real usage (57), not the reservation (prompt + 200)
            level, refill = bucket_level(store, began)
            assert TPM - 57 - 1e-6 <= level <= TPM - 57 + refill + 1e-6
            # and the fair share was charged the real cost once: 1 x 7 + 2 x 50
            assert float(store.hget("extproc:vtc:short:1", "globex") or 0) == 107
            counts = [
                accounting.metric("extproc_state_remote_settlements_total", f'result="{r}"')
                for r in ("settled", "not_found")
            ]
            assert counts[1] + counts[0] == 2  # globex (maybe beaten by its twin) + initech
        finally:
            for endpoint in (first, second):
                await endpoint.close()


async def test_admission_without_accounting_is_released_after_the_grace(
    redis_server: RedisServer, store: redis.Redis, tmp_path: Path
) -> None:
    """No accounting stream anywhere (the request never reached an engine): the admitting
    process releases the lease itself, after waiting a moment for one."""
    with serve_processes(policy(redis_server.url), tmp_path, 1) as (process,):
        endpoint = Endpoint(process.grpc_address)
        try:
            outcome = await admit(endpoint, TEST_KEYS["globex"], "globex", chat_body())
            assert outcome.admitted
            await finish(outcome, 3, 16)  # the admission stream ends; nothing accounts
            ended = time.monotonic()
            await await_for(lambda: store.zcard("extproc:pl:short") == 0, 5, "released")
            assert time.monotonic() - ended < 2.0
            nxt = await asyncio.wait_for(
                admit(endpoint, TEST_KEYS["initech"], "initech", chat_body()), 10
            )
            assert nxt.admitted
            await finish(nxt, 3, 16)
        finally:
            await endpoint.close()
