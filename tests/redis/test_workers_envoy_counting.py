"""Counting in Envoy with `--workers 2`: the real Envoy, two service workers sharing Redis, and
emulated engines. Each request's counting calls and its end reach the worker that admitted it
(its id names the worker; extproc.envoy_lua renders one events cluster and one access log per
worker), so no response is accounted by another process, and every token is counted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis

from extproc.policy import load_policy
from gateway_lab.bench.stack import free_ports
from gateway_lab.up import StackConfig, build_stack, response_counting
from tests.conftest import TEST_KEYS, free_port, policy_yaml
from tests.dataplane.harness import RunningGateway, started
from tests.dataplane.test_accounting import envoy_stat, scrape, usage_of_stream
from tests.dataplane.test_admission import settled
from tests.redis.support import RedisServer, http_get, wait_for
from tests.serve_support import worker_pids

pytestmark = [pytest.mark.redis, pytest.mark.dataplane]

WORKERS = 2
LIMITS = "{requests_per_minute: 6000, tokens_per_minute: 10000000, max_queued: 500}"


def health_flags(gateway: RunningGateway, address: str) -> str:
    """What Envoy's /clusters says of the ext_proc cluster's endpoint at `address`."""
    status, body = http_get(f"http://{gateway.config.envoy_admin}/clusters", timeout=2)
    assert status == 200
    prefix = f"extproc::{address}::health_flags::"
    lines = [line for line in body.decode().splitlines() if line.startswith(prefix)]
    assert lines, f"no {prefix} in Envoy's /clusters"
    return lines[0][len(prefix) :]


@pytest.fixture
def gateway(redis_server: RedisServer, tmp_path: Path) -> Iterator[RunningGateway]:
    short, long_ = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    policy_path = tmp_path / "policy.yaml"
    state = f"state: {{backend: redis, url: '{redis_server.url}', replicas: {WORKERS}}}\n"
    policy_path.write_text(
        policy_yaml(short, long_, extra=state, acme_limits=LIMITS, globex_limits=LIMITS)
    )
    policy = load_policy(policy_path)
    grpc = f"127.0.0.1:{free_ports(WORKERS * 2)}"  # the workers' ports, then the events'
    counting = response_counting(None, None, grpc, WORKERS, "distinct")
    assert counting.envoy_events is not None and counting.accounting is None
    admin = free_ports(WORKERS)
    config = StackConfig(
        policy_path=str(policy_path),
        workdir=tmp_path,
        listen=f"127.0.0.1:{free_port()}",
        grpc=grpc,
        admin=f"127.0.0.1:{admin}",
        envoy_admin=f"127.0.0.1:{free_port()}",
        profile="fast",
        workers=WORKERS,
        worker_ports="distinct",
        envoy_events=counting.envoy_events,
    )
    with started(config, policy, build_stack(config, policy)) as running:
        for port in range(admin + 1, admin + WORKERS):  # `started` waits for worker 0's
            wait_for(
                lambda p=port: http_get(f"http://127.0.0.1:{p}/readyz")[0] == 200, 60, "workers"
            )
        base = int(grpc.rpartition(":")[2])
        for i in range(WORKERS):  # and Envoy's health check has seen each (`health_checked`)
            address = f"127.0.0.1:{base + i}"
            wait_for(lambda a=address: health_flags(running, a) == "healthy", 15, "healthy")
        yield running


def admin_urls(gateway: RunningGateway) -> list[str]:
    port = int(gateway.config.admin.rpartition(":")[2])
    return [f"http://127.0.0.1:{port + i}" for i in range(WORKERS)]


async def one_request(
    session: aiohttp.ClientSession, gateway: RunningGateway, tenant: str, kind: str, seed: int
) -> dict[str, int]:
    rng = random.Random(seed)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "count me " * rng.randint(1, 60)}],
        "max_tokens": rng.randint(3, 60),
        "stream": kind != "plain",
    }
    if kind == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {TEST_KEYS[tenant]}"}
    async with session.post(
        gateway.base_url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        raw = await response.read()
    usage = orjson.loads(raw)["usage"] if kind == "plain" else usage_of_stream(raw)
    assert usage is not None, "every stream ends with usage"
    return usage  # type: ignore[no-any-return]


async def all_settled(session: aiohttp.ClientSession, urls: list[str]) -> bool:
    for url in urls:
        async with session.get(url + "/v1/tenants") as response:
            if not settled(await response.json()):
                return False
    return True


async def test_each_workers_responses_are_counted_by_that_worker(
    gateway: RunningGateway,
) -> None:
    plan = [
        (tenant, kind)
        for tenant in ("acme", "globex")
        for kind in ("plain", "stream_usage", "stream_plain")
        for _ in range(8)
    ]
    urls = admin_urls(gateway)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        usages = await asyncio.gather(
            *(one_request(session, gateway, t, k, seed) for seed, (t, k) in enumerate(plan))
        )
        deadline = asyncio.get_running_loop().time() + 15
        while not await all_settled(session, urls):
            assert asyncio.get_running_loop().time() < deadline, "a worker did not settle"
            await asyncio.sleep(0.05)
        metrics = [await scrape(session, url + "/metrics") for url in urls]
    reported: dict[str, Counter[str]] = {"acme": Counter(), "globex": Counter()}
    for (tenant, _), usage in zip(plan, usages, strict=True):
        reported[tenant]["input"] += usage["prompt_tokens"]
        reported[tenant]["output"] += usage["completion_tokens"]

    def total(name: str, **labels: str) -> list[float]:
        key = (name, *sorted(labels.items()))
        return [values.get(key, 0.0) for values in metrics]

    admitted = [
        sum(v for k, v in values.items() if k[0] == "extproc_requests_total" and
            ("outcome", "admitted") in k)
        for values in metrics
    ]  # fmt: skip
    assert all(count > 0 for count in admitted), admitted  # Envoy spread them over both
    assert sum(admitted) == len(plan), admitted
    # Every response was accounted by the worker that admitted it, none through Redis.
    own = total("extproc_accounting_attached_total", process="admitting")
    assert total("extproc_accounting_attached_total", process="other") == [0.0] * WORKERS
    assert own == [float(count) for count in admitted], (own, admitted)
    for tenant, counts in reported.items():
        for direction in ("input", "output"):
            counted = sum(total("extproc_tokens_total", direction=direction, tenant=tenant))
            assert counted == counts[direction], (tenant, direction, counted, counts)


LONG = 8_000
"""Output tokens of the stream a crash interrupts: ~1 ms a token on the `fast` engine, so it
outlives the worker's restart."""


def workers_by_index(gateway: RunningGateway) -> dict[int, int]:
    """Worker index -> pid."""
    supervisor = next(c for c in gateway.stack.children if c.name == "extproc").process
    assert supervisor is not None
    base = int(gateway.config.grpc.rpartition(":")[2])
    return {port - base: pid for port, pid in worker_pids(supervisor.pid).items()}


def refuses(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) != 0


async def tenants(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/v1/tenants") as response:
        return await response.json()  # type: ignore[no-any-return]


async def test_a_crashed_worker_costs_no_request_and_leaks_nothing(
    gateway: RunningGateway, redis_server: RedisServer
) -> None:
    """kill -9 of the worker streaming a response: the response goes on to its end; requests
    sent while the worker is down are all served (Envoy opens their ext_proc stream on the
    other worker: `service_stream_retry`); the restarted worker counts what it admits, and
    the interrupted stream's tokens too; and nothing stays held, in either worker or in
    Redis."""
    urls = admin_urls(gateway)
    headers = {"authorization": f"Bearer {TEST_KEYS['acme']}"}
    url = gateway.base_url + "/v1/chat/completions"
    long_body = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                 "max_tokens": LONG, "stream": True}  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        streaming = await session.post(url, json=long_body, headers=headers)
        assert streaming.status == 200
        first = await streaming.content.readline()
        deadline = time.monotonic() + 10
        while True:  # which worker admitted it
            holding = [
                i
                for i, u in enumerate(urls)
                if (await tenants(session, u))["tenants"]["acme"]["inflight"]
            ]
            if holding:
                break
            assert time.monotonic() < deadline, "no worker holds the stream"
            await asyncio.sleep(0.02)
        (victim,) = holding
        pids = workers_by_index(gateway)
        assert len(pids) == WORKERS, pids
        victim_port = int(gateway.config.grpc.rpartition(":")[2]) + victim
        os.kill(pids[victim], signal.SIGKILL)
        wait_for(lambda: refuses(victim_port), 10, "the killed worker's port to close")
        failed_connects = await envoy_stat(gateway, "cluster.extproc.upstream_cx_connect_fail")

        # While the worker is down: every request is served.
        outage = await asyncio.gather(
            *(one_request(session, gateway, "globex", "plain", seed) for seed in range(8))
        )
        assert all(usage["completion_tokens"] > 0 for usage in outage)
        # ... and the dead port was tried, so the retry is what served them.
        assert refuses(victim_port), "the worker came back before the test could tell"
        later = await envoy_stat(gateway, "cluster.extproc.upstream_cx_connect_fail")
        assert later > failed_connects, (failed_connects, later)
        assert await envoy_stat(gateway, "cluster.extproc.upstream_rq_retry_success") >= 1

        # The response the dead worker admitted streams on to its end.
        raw = first + await streaming.content.read()
        streaming.release()
        usage = usage_of_stream(raw)
        assert usage is not None and usage["completion_tokens"] == LONG

        # The supervisor starts the worker again, on its ports; it serves and counts.
        wait_for(lambda: workers_by_index(gateway).get(victim, pids[victim]) != pids[victim], 30,
                 "a new worker")  # fmt: skip
        wait_for(lambda: http_get(urls[victim] + "/readyz")[0] == 200, 60, "the new worker")
        admitted = 0
        for seed in range(40):
            await one_request(session, gateway, "initech", "stream_usage", seed)
            values = await scrape(session, urls[victim] + "/metrics")
            admitted = int(sum(
                v for k, v in values.items()
                if k[0] == "extproc_requests_total" and ("outcome", "admitted") in k
            ))  # fmt: skip
            if admitted:
                break
        assert admitted, "the restarted worker admitted nothing in 40 requests"

        # Nothing stays held: not in a worker, not in Redis (the dead worker's leases expire).
        deadline = time.monotonic() + 15
        while not await all_settled(session, urls):
            assert time.monotonic() < deadline, [await tenants(session, u) for u in urls]
            await asyncio.sleep(0.05)
        metrics = [await scrape(session, u + "/metrics") for u in urls]
    own = metrics[victim].get(("extproc_accounting_attached_total", ("process", "admitting")), 0.0)
    assert own == admitted, (own, admitted)
    # The stream the dead worker admitted is counted whole all the same: its counting calls
    # and its end reach the worker's successor, which finds its lease in Redis (it restarts
    # well within the stream's ~8 s and `state.lease_ttl`).
    for direction, reported in (("input", "prompt_tokens"), ("output", "completion_tokens")):
        key = ("extproc_tokens_total", ("direction", direction), ("tenant", "acme"))
        assert sum(values.get(key, 0.0) for values in metrics) == usage[reported], direction
    store = redis.Redis.from_url(redis_server.url)
    try:
        leases = {key: store.zcard(key) for key in store.scan_iter("extproc:pl:*")}
    finally:
        store.close()
    assert all(count == 0 for count in leases.values()), leases


async def test_a_hung_worker_gets_no_new_stream(gateway: RunningGateway) -> None:
    """A stopped worker keeps its ports: a stream sent to it would wait for Envoy's message
    timeout and end in a 503. Envoy asks each worker's /healthz (`health_checked`) and, once
    the hung one misses two answers, sends every new request to the other."""
    base = int(gateway.config.grpc.rpartition(":")[2])
    victim = workers_by_index(gateway)[1]
    address = f"127.0.0.1:{base + 1}"
    assert health_flags(gateway, address) == "healthy"
    os.kill(victim, signal.SIGSTOP)
    try:
        wait_for(lambda: "failed_active_hc" in health_flags(gateway, address), 15, "the flag")
        started = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            served = await asyncio.gather(
                *(one_request(session, gateway, "globex", "plain", seed) for seed in range(8))
            )
        assert all(usage["completion_tokens"] > 0 for usage in served)
        # None waited for the message timeout (5 s) of a stream sent to the stopped worker.
        assert time.monotonic() - started < 4.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
