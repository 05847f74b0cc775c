"""Envoy's arrival time through the real binary: the admission filter sends `request.time`,
the service measures how late each request's first message reached its handler
(`extproc_envoy_to_handler_seconds`), and a request that waited longer than the message-age
limit before the service was handed it (the process frozen meanwhile) makes it shed, although
its event loop is on time again and no stream it holds is old."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from tests.conftest import TEST_KEYS
from tests.dataplane.harness import RunningGateway, running_gateway, standard_policy

pytestmark = pytest.mark.dataplane

FROZEN_S = 2.6
"""Longer than the age limit (0.5 x the 4 s message_timeout), and short enough that the
service, thawed, still answers within the timeout on a loaded machine."""


def arrival_policy(short: str, long_: str) -> str:
    # The loop-lag signal is out of reach (5 s): only the arrival can make the service shed.
    overload = "{lag_threshold_ms: 5000, interval_ms: 10, recover_ms: 600000}"
    return standard_policy(short, long_, f"{{message_timeout: 4s, overload: {overload}}}")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path_factory.mktemp("arrival"), arrival_policy) as running:
        yield running


async def complete(session: aiohttp.ClientSession, gateway: RunningGateway) -> int:
    async with session.post(
        gateway.base_url + "/v1/completions",
        json={"model": "m", "prompt": "hello", "max_tokens": 4},
        headers={"authorization": f"Bearer {TEST_KEYS['globex']}"},
    ) as response:
        await response.read()
        return response.status


async def scrape(session: aiohttp.ClientSession, gateway: RunningGateway) -> dict[str, float]:
    async with session.get(gateway.admin_url + "/metrics") as response:
        text = await response.text()
    wanted = (
        "extproc_envoy_to_handler_seconds_count", "extproc_envoy_to_handler_seconds_sum",
        "extproc_overload_shedding",
    )  # fmt: skip
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name] = float(value)
    return found


async def until_envoy_holds_a_request(
    session: aiohttp.ClientSession, gateway: RunningGateway, timeout_s: float = 10.0
) -> None:
    """Until Envoy's listener has a request in progress (its own stats, not a guess)."""
    url = f"http://{gateway.config.envoy_admin}/stats?filter=downstream_rq_active"

    async def active() -> bool:
        async with session.get(url) as response:
            for line in (await response.text()).splitlines():
                name, _, value = line.partition(": ")
                if name.startswith("http.") and "admin" not in name and int(value) >= 1:
                    return True
        return False

    async with asyncio.timeout(timeout_s):
        while not await active():
            await asyncio.sleep(0.01)


async def test_a_request_that_reached_the_service_late_makes_it_shed(
    gateway: RunningGateway,
) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(3):
            assert await complete(session, gateway) == 200
        before = await scrape(session, gateway)
        assert before["extproc_envoy_to_handler_seconds_count"] == 3  # one per request
        assert 0 < before["extproc_envoy_to_handler_seconds_sum"] < 3 * 1.0
        assert before["extproc_overload_shedding"] == 0

        extproc = next(c for c in gateway.stack.children if c.name == "extproc")
        assert extproc.process is not None
        pid = extproc.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            late = asyncio.create_task(complete(session, gateway))
            await until_envoy_holds_a_request(session, gateway)
            await asyncio.sleep(FROZEN_S)  # the freeze itself (the stimulus): Envoy waits
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await asyncio.wait_for(late, 20) == 200  # answered within Envoy's timeout
        after = await scrape(session, gateway)
        assert after["extproc_envoy_to_handler_seconds_count"] == 4
        assert (
            after["extproc_envoy_to_handler_seconds_sum"]
            - before["extproc_envoy_to_handler_seconds_sum"]
            >= FROZEN_S - 0.3
        )
        # The detector weighs the arrival at the monitor's next sample (10 ms once a request is
        # in, or the idle 250 ms): the 200 can reach us first. Shedding then lasts recover_ms.
        deadline = asyncio.get_running_loop().time() + 5.0
        while after["extproc_overload_shedding"] != 1:
            assert asyncio.get_running_loop().time() < deadline, "the service never shed"
            await asyncio.sleep(0.05)
            after = await scrape(session, gateway)
