"""The accounting process through the real Envoy (`serve --accounting-grpc`, Envoy's own
accounting cluster): a stalled accounting side never reaches a client, and a dead one is
restarted with nothing left taken."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from gateway_lab.bench.cores import descendants
from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.dataplane.test_accounting import scrape, usage_of_stream
from tests.dataplane.test_admission import settled, wait_for_view

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    def make(short: str, long_: str) -> str:
        return policy_yaml(short, long_, short_inflight=4)

    workdir = tmp_path_factory.mktemp("accounting-process")
    with running_gateway(workdir, make, accounting_process=True) as running:
        yield running


def accounting_pid(gateway: RunningGateway) -> int:
    extproc = next(c for c in gateway.stack.children if c.name == "extproc")
    assert extproc.process is not None
    (pid,) = descendants(extproc.process.pid)
    return pid


async def stream(session: aiohttp.ClientSession, gateway: RunningGateway, tenant: str) -> bytes:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 12,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {TEST_KEYS[tenant]}"}
    async with session.post(
        gateway.base_url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        raw = await response.read()
        assert response.status == 200, raw
        return raw


def output_counted(values: dict[tuple[str, ...], float], tenant: str) -> float:
    return values.get(("extproc_tokens_total", ("direction", "output"), ("tenant", tenant)), 0.0)


async def test_a_frozen_accounting_process_delays_no_client(gateway: RunningGateway) -> None:
    """Frozen, the accounting side queues its messages; admission and the responses go on,
    and once it runs again every token is counted and every slot freed."""
    pid = accounting_pid(gateway)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await scrape(session, gateway.admin_url + "/metrics")
        os.kill(pid, signal.SIGSTOP)
        try:
            # Admitted, forwarded and streamed to the end while nothing is accounted.
            async with asyncio.timeout(10):
                first = await asyncio.gather(*(stream(session, gateway, "acme") for _ in range(4)))
        finally:
            os.kill(pid, signal.SIGCONT)
        await wait_for_view(session, gateway, settled)
        after = await scrape(session, gateway.admin_url + "/metrics")
    reported = sum(usage["completion_tokens"] for usage in map(usage_of_stream, first) if usage)
    assert reported == 4 * 12
    assert output_counted(after, "acme") - output_counted(before, "acme") == reported


async def test_a_killed_accounting_process_is_restarted_and_frees_its_requests(
    gateway: RunningGateway,
) -> None:
    pid = accounting_pid(gateway)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await wait_for_view(session, gateway, settled)
        os.kill(pid, signal.SIGKILL)
        # The responses do not depend on it (observability mode): they keep coming while it
        # restarts, and nothing they took stays taken.
        await asyncio.gather(*(stream(session, gateway, "globex") for _ in range(3)))
        await wait_for_view(session, gateway, settled)
        async with asyncio.timeout(15):
            while (restarted := descendants(_service_pid(gateway))) in ([], [pid]):
                await asyncio.sleep(0.05)
        assert restarted != [pid]
        # Accounted again, exactly, once it serves: wait until a response is counted.
        before = await scrape(session, gateway.admin_url + "/metrics")
        async with asyncio.timeout(20):
            while True:
                raw = await stream(session, gateway, "initech")
                await wait_for_view(session, gateway, settled)
                after = await scrape(session, gateway.admin_url + "/metrics")
                if output_counted(after, "initech") > output_counted(before, "initech"):
                    break
                before = after
        usage = usage_of_stream(raw)
        assert usage is not None
        assert (
            output_counted(after, "initech") - output_counted(before, "initech")
            == (usage["completion_tokens"])
        )


def _service_pid(gateway: RunningGateway) -> int:
    extproc = next(c for c in gateway.stack.children if c.name == "extproc")
    assert extproc.process is not None
    return extproc.process.pid
