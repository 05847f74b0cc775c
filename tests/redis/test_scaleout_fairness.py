"""Fair share and tier priority hold across processes.

A flooder fills the pool through one process and queues many more requests there; a quiet
tenant of the same tier arrives through another process. Without shared fair-share state the
flooder's process would take every slot it frees itself (it proposes before anyone else hears
of the release). With it, the quiet tenant is served after a few flooder requests per quiet
request, long before the flooder's backlog drains. A premium tenant arriving through
a third process goes ahead of both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import TEST_KEYS, policy_yaml
from tests.redis.support import (
    Endpoint,
    Outcome,
    RedisServer,
    admit,
    attach_accounting,
    await_for,
    chat_body,
    finish,
    serve_processes,
)

pytestmark = pytest.mark.redis

HOLD_S = 0.12
FLOOD = 20


def policy(url: str) -> str:
    unlimited = "{max_queued: 100, max_queue_wait: 30s}"
    return policy_yaml(
        acme_limits=unlimited, globex_limits=unlimited, initech_limits=unlimited,
        short_inflight=2,
        extra=f"state: {{backend: redis, url: '{url}', timeout: 500ms, replicas: 3}}\n"
        "fairness: {policy: vtc}\n",
    )  # fmt: skip


async def one_request(endpoint: Endpoint, tenant: str, out: list[Outcome]) -> None:
    outcome = await admit(endpoint, TEST_KEYS[tenant], tenant, chat_body("hi", 32), timeout=30)
    assert outcome.admitted, outcome
    out.append(outcome)
    await attach_accounting(endpoint, outcome)
    await asyncio.sleep(HOLD_S)
    await finish(outcome, 3, 32)


def queued(process_tenants: dict[str, object], tenant: str) -> int:
    tenants = process_tenants["tenants"]
    assert isinstance(tenants, dict)
    return int(tenants[tenant]["queued"])


async def test_quiet_and_premium_tenants_go_first_across_processes(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with serve_processes(policy(redis_server.url), tmp_path, 3) as processes:
        flooder_in, quiet_in, premium_in = (Endpoint(p.grpc_address) for p in processes)
        try:
            done: list[Outcome] = []
            flood = [
                asyncio.create_task(one_request(flooder_in, "globex", done)) for _ in range(FLOOD)
            ]
            await await_for(
                lambda: queued(processes[0].tenants(), "globex") >= FLOOD - 6, 20, "a backlog"
            )
            quiet_began = len(done)
            quiet = [asyncio.create_task(one_request(quiet_in, "initech", done)) for _ in range(3)]
            await asyncio.wait_for(asyncio.gather(*quiet), 30)
            order = [o.tenant for o in sorted(done, key=lambda o: o.admitted_at)]
            last_quiet = max(i for i, t in enumerate(order) if t == "initech")
            flood_between = order[quiet_began : last_quiet + 1].count("globex")
            # They interleave: the quiet tenant is not served after the flooder's backlog (14+
            # requests). Alone this shows one or two flooder requests per quiet one; on a
            # loaded machine (CI) the backlog registry syncs later and up to three were seen.
            assert flood_between <= 3 * len(quiet) + 2, order
            assert queued(processes[0].tenants(), "globex") >= FLOOD // 2 - 2

            premium_began = len(done)
            premium = [asyncio.create_task(one_request(premium_in, "acme", done)) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*premium), 30)
            order = [o.tenant for o in sorted(done, key=lambda o: o.admitted_at)]
            after = order[premium_began:]
            last_premium = max(i for i, t in enumerate(after) if t == "acme")
            # strict priority: at most the requests already granted when it arrived go first
            assert after[: last_premium + 1].count("globex") <= 2, order
            await asyncio.wait_for(asyncio.gather(*flood), 60)
            assert sum(1 for o in done if o.tenant == "globex") == FLOOD
        finally:
            for endpoint in (flooder_in, quiet_in, premium_in):
                await endpoint.close()
