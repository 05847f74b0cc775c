"""Four `extproc serve` processes, one Redis: limits hold across them, not four times over.

Clients play Envoy against random processes: the admission stream on one process, the
accounting stream (which settles the request) on another, as happens when Envoy's ext_proc
cluster has several endpoints. Client-side intervals (admitted -> response finished) lie inside
the server-side ones (grant -> release), so their overlap is a lower bound of the server's.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import TEST_KEYS, policy_yaml
from tests.redis.support import (
    Endpoint,
    Outcome,
    RedisServer,
    admit,
    attach_accounting,
    chat_body,
    finish,
    max_overlap,
    serve_processes,
)
from tests.redis.support import wait_for as await_until

pytestmark = pytest.mark.redis

PROCESSES = 4
DURATION_S = 4.0
MAX_TOKENS = 100
USAGE = (5, MAX_TOKENS)  # prompt, completion: never above the estimate, so refunds only
RPM_ACME, CONC_ACME = 30, 3
TPM_GLOBEX = 3000
POOL_INFLIGHT = 5


def policy(url: str) -> str:
    return policy_yaml(
        acme_limits=f"{{requests_per_minute: {RPM_ACME}, max_concurrency: {CONC_ACME}, "
        "max_queued: 64, max_queue_wait: 20s}",
        globex_limits=f"{{tokens_per_minute: {TPM_GLOBEX}, max_queued: 64, max_queue_wait: 20s}}",
        initech_limits="{max_queued: 64, max_queue_wait: 20s}",
        short_inflight=POOL_INFLIGHT,
        extra=f"state: {{backend: redis, url: '{url}', timeout: 500ms, replicas: {PROCESSES}}}\n"
        "estimation: {mode: flat, learn: false}\n",
    )


async def client(
    endpoints: list[Endpoint], tenant: str, rng: random.Random, until: float, out: list[Outcome]
) -> None:
    while time.monotonic() < until:
        first = rng.randrange(len(endpoints))
        second = rng.randrange(len(endpoints))
        outcome = await admit(
            endpoints[first], TEST_KEYS[tenant], tenant, chat_body("hello", MAX_TOKENS),
            process=first,
        )  # fmt: skip
        out.append(outcome)
        if not outcome.admitted:
            await asyncio.sleep(0.05)
            continue
        await attach_accounting(endpoints[second], outcome)
        await asyncio.sleep(rng.uniform(0.01, 0.06))  # the upstream works
        await finish(outcome, *USAGE)


async def test_limits_hold_across_four_processes(redis_server: RedisServer, tmp_path: Path) -> None:
    with serve_processes(policy(redis_server.url), tmp_path, PROCESSES) as processes:
        endpoints = [Endpoint(p.grpc_address) for p in processes]
        try:
            rng = random.Random(3)
            began = time.monotonic()
            until = began + DURATION_S
            outcomes: list[Outcome] = []
            tenants = ["acme"] * 8 + ["globex"] * 8 + ["initech"] * 8
            await asyncio.wait_for(
                asyncio.gather(
                    *(client(endpoints, t, random.Random(rng.random()), until, outcomes)
                      for t in tenants)
                ),
                timeout=60,
            )  # fmt: skip
            elapsed = time.monotonic() - began
        finally:
            for endpoint in endpoints:
                await endpoint.close()
        admitted = [o for o in outcomes if o.admitted]
        by_tenant = {t: [o for o in admitted if o.tenant == t] for t in ("acme", "globex")}
        # every process admitted some of the work
        assert {o.process for o in admitted} == set(range(PROCESSES))
        # requests per minute: the bucket (30) plus what refilled while the test ran
        acme = by_tenant["acme"]
        assert len(acme) <= RPM_ACME + RPM_ACME / 60 * elapsed + 1, len(acme)
        assert len(acme) >= RPM_ACME * 0.8  # and the limit was reached, not starved
        # concurrency, across processes
        intervals = [(o.admitted_at, o.finished_at) for o in acme]
        assert max_overlap(intervals) <= CONC_ACME
        # tokens per minute, counted in real usage (never above the reserved estimate)
        used = sum(USAGE) * len(by_tenant["globex"])
        assert used <= TPM_GLOBEX + TPM_GLOBEX / 60 * elapsed + sum(USAGE), used
        # pool capacity, across processes and tenants
        everyone = [(o.admitted_at, o.finished_at) for o in admitted]
        assert max_overlap(everyone) <= POOL_INFLIGHT
        # over limit means 429 with a Retry-After, never a silent wait
        rejected = [o for o in outcomes if not o.admitted]
        assert rejected and all(o.status == 429 and o.retry_after for o in rejected)
        # everything was settled and released: no lease left in Redis nor in any process
        leases = redis.Redis.from_url(redis_server.url)
        await_until(lambda: leases.zcard("extproc:pl:short") == 0, 5, "leases released")
        for process in processes:
            await_until(lambda p=process: p.tenants()["inflight"] == 0, 5, "local leases freed")
            assert process.metric("extproc_state_mode", 'mode="shared"') == 1
        leases.close()
