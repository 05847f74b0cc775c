"""Redis going away and coming back; a process dying with capacity in hand."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import TEST_KEYS, policy_yaml
from tests.redis.support import (
    Endpoint,
    RedisServer,
    ServeProcess,
    admit,
    attach_accounting,
    await_for,
    chat_body,
    finish,
    serve_processes,
)

pytestmark = pytest.mark.redis

RPM = 20


def policy(url: str, on_failure: str = "local", extra: str = "") -> str:
    return policy_yaml(
        acme_limits=f"{{requests_per_minute: {RPM}, max_queued: 64}}",
        short_inflight=2,
        extra=f"state: {{backend: redis, url: '{url}', timeout: 200ms, replicas: 2, "
        f"on_failure: {on_failure}, lease_ttl: 1500ms, backlog_ttl: 1500ms}}\n{extra}",
    )


async def request(endpoint: Endpoint, tenant: str) -> tuple[bool, int, float]:
    """One complete request (settled on the same process): admitted?, status, seconds."""
    began = time.monotonic()
    outcome = await admit(endpoint, TEST_KEYS[tenant], tenant, chat_body(), timeout=10)
    took = time.monotonic() - began
    if outcome.admitted:
        await attach_accounting(endpoint, outcome)
        await finish(outcome, 3, 16)
    return outcome.admitted, outcome.status, took


def mode_is(process: ServeProcess, mode: str) -> bool:
    return process.metric("extproc_state_mode", f'mode="{mode}"') == 1


async def test_redis_outage_enforces_local_shares_then_recovers(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with serve_processes(policy(redis_server.url), tmp_path, 2) as processes:
        endpoints = [Endpoint(p.grpc_address) for p in processes]
        try:
            for endpoint in endpoints:  # shared mode works
                assert (await request(endpoint, "globex"))[0]
            redis_server.stop()
            admitted = []
            for endpoint in endpoints:
                results = [await request(endpoint, "acme") for _ in range(15)]
                # nobody hangs on the dead store: every answer comes within the timeout
                assert max(took for _, _, took in results) < 1.5
                admitted.append(sum(ok for ok, _, _ in results))
                assert {status for ok, status, _ in results if not ok} <= {429}
            # each process enforces its share: 20 rpm over 2 replicas -> 10 each (+ refill)
            assert all(8 <= count <= RPM // 2 + 1 for count in admitted), admitted
            for process in processes:
                assert mode_is(process, "local")
                assert process.metric("extproc_state_transitions_total", 'mode="local"') >= 1
                assert process.metric("extproc_state_errors_total") >= 1

            redis_server.start()  # an empty server on the same port
            await await_for(lambda: all(mode_is(p, "shared") for p in processes), 15, "recovery")
            # what was consumed during the outage was debited to the shared bucket
            results = [await request(endpoints[i % 2], "acme") for i in range(4)]
            assert sum(ok for ok, _, _ in results) <= 2, results
            assert (await request(endpoints[0], "globex"))[0]
        finally:
            for endpoint in endpoints:
                await endpoint.close()


@pytest.mark.parametrize("on_failure", ["closed", "local"])
async def test_a_hung_redis_never_hangs_a_request(
    redis_server: RedisServer, tmp_path: Path, on_failure: str
) -> None:
    with serve_processes(policy(redis_server.url, on_failure), tmp_path, 1) as (process,):
        endpoint = Endpoint(process.grpc_address)
        try:
            assert (await request(endpoint, "globex"))[0]
            redis_server.pause()  # SIGSTOP: connections stay open, nothing answers
            try:
                ok, status, took = await request(endpoint, "globex")
                assert took < 1.5
                if on_failure == "closed":
                    assert (ok, status) == (False, 503)
                    assert process.metric("extproc_state_closed_rejections_total") >= 1
                else:
                    assert ok
                assert mode_is(process, on_failure)
            finally:
                redis_server.resume()
            await await_for(lambda: mode_is(process, "shared"), 15, "recovery")
            assert (await request(endpoint, "globex"))[0]
        finally:
            await endpoint.close()


async def test_capacity_of_a_killed_process_comes_back_when_its_leases_expire(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with serve_processes(policy(redis_server.url), tmp_path, 2) as (doomed, survivor):
        first, second = Endpoint(doomed.grpc_address), Endpoint(survivor.grpc_address)
        try:
            held = [await admit(first, TEST_KEYS["globex"], "globex", chat_body()) for _ in "ab"]
            assert all(o.admitted for o in held), [(o.status, o.message) for o in held]
            waiting = asyncio.create_task(
                admit(second, TEST_KEYS["initech"], "initech", chat_body(), timeout=20)
            )
            done, _ = await asyncio.wait({waiting}, timeout=0.5)
            assert not done, "the pool was full: the request must wait"
            doomed.kill()  # SIGKILL: no release, no drain
            killed_at = time.monotonic()
            outcome = await asyncio.wait_for(waiting, 20)
            waited = time.monotonic() - killed_at
            assert outcome.admitted
            # the leases were renewed every 0.5 s and live 1.5 s: back after 1-1.5 s
            assert 0.4 <= waited <= 3.0, waited
            assert survivor.metric("extproc_state_reclaimed_leases_total") >= 1
        finally:
            for endpoint in (first, second):
                await endpoint.close()


async def test_leases_survive_a_redis_restart_that_lost_the_data(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis restarts empty while requests run: their holders register the leases again (the
    store's epoch changed), so the pool stays full instead of being handed out twice."""
    store = redis.Redis.from_url(redis_server.url)
    with serve_processes(policy(redis_server.url), tmp_path, 2) as (holder, other):
        first, second = Endpoint(holder.grpc_address), Endpoint(other.grpc_address)
        try:
            held = [await admit(first, TEST_KEYS["globex"], "globex", chat_body()) for _ in "ab"]
            assert all(o.admitted for o in held)
            # Running: Envoy opens each one's accounting stream right after the forward (the
            # admission stream has ended then).
            for outcome in held:
                await attach_accounting(first, outcome)
            await await_for(lambda: holder.tenants()["inflight"] == 2, 5, "two leases")
            await await_for(lambda: store.exists("extproc:epoch") == 1, 5, "an epoch")
            redis_server.stop()
            redis_server.start()  # empty
            await await_for(
                lambda: store.zcard("extproc:pl:short") == 2, 10, "leases registered again"
            )
            # During the outage each process admits from its local share (on_failure: local);
            # the claim here is about both processes back on the shared store: each has had a
            # heartbeat answered by the restarted store (its new epoch), not merely not yet
            # noticed the restart on a pooled connection the restart closed.
            await await_for(lambda: store.exists("extproc:epoch") == 1, 15, "a new epoch")
            epoch = store.get("extproc:epoch")
            assert isinstance(epoch, bytes)
            for process in (holder, other):
                await await_for(
                    lambda p=process: (
                        p.tenants()["state"]["mode"] == "shared"
                        and p.tenants()["state"]["epoch"] == epoch.decode()
                    ),
                    15,
                    "both processes back on the restarted Redis",
                )
            waiting = asyncio.create_task(
                admit(second, TEST_KEYS["initech"], "initech", chat_body(), timeout=20)
            )
            done, _ = await asyncio.wait({waiting}, timeout=0.8)
            assert not done, "the pool is still full: the request must wait"
            for outcome in held:
                await finish(outcome, 3, 16)
            assert (await asyncio.wait_for(waiting, 20)).admitted
        finally:
            for endpoint in (first, second):
                await endpoint.close()
            store.close()
