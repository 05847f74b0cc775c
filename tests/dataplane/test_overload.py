"""Overload shedding through the real Envoy: the service process is frozen and thawed in turns
(SIGSTOP / SIGCONT) so its event loop lags; the tenant above its fair share gets 429 +
Retry-After with an OpenAI body, the light tenant is still served (never a 504)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from tests.conftest import TEST_KEYS
from tests.dataplane.harness import RunningGateway, running_gateway, standard_policy

pytestmark = pytest.mark.dataplane

FROZEN_S = 0.15
THAWED_S = 0.05
"""The lag source: the service is stopped this long, then runs this long, in turns."""


def overload_policy(short: str, long_: str) -> str:
    overload = "{overload: {lag_threshold_ms: 60, interval_ms: 10, recover_ms: 600000}}"
    return standard_policy(short, long_, overload, tenants=("globex", "initech"))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path_factory.mktemp("overload"), overload_policy) as running:
        yield running


@contextlib.contextmanager
def lagging(pid: int) -> Iterator[None]:
    """Freeze and thaw the process in turns until the block ends; it is left running."""
    stop = threading.Event()

    def cycle() -> None:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            stop.wait(FROZEN_S)
            os.kill(pid, signal.SIGCONT)
            stop.wait(THAWED_S)

    worker = threading.Thread(target=cycle, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join(timeout=5)
        os.kill(pid, signal.SIGCONT)


async def complete(
    session: aiohttp.ClientSession, gateway: RunningGateway, tenant: str
) -> tuple[int, dict[str, str], bytes]:
    async with session.post(
        gateway.base_url + "/v1/completions",
        json={"model": "m", "prompt": "hello", "max_tokens": 4},
        headers={"authorization": f"Bearer {TEST_KEYS[tenant]}"},
    ) as response:
        return response.status, dict(response.headers), await response.read()


async def metric(session: aiohttp.ClientSession, gateway: RunningGateway, line: str) -> bool:
    async with session.get(gateway.admin_url + "/metrics") as response:
        return line in (await response.text()).splitlines()


async def shed_total(session: aiohttp.ClientSession, gateway: RunningGateway) -> float:
    async with session.get(gateway.admin_url + "/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith('extproc_shed_total{reason="lag",tier="standard"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_frozen_service_sheds_the_flooder_and_serves_the_light_tenant(
    gateway: RunningGateway,
) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # initech is admitted ten times as often as globex: above its share of the rate. (On a
        # busy host the service may already shed some of initech's burst: what counts is
        # that most of it was admitted.)
        for _ in range(2):
            assert (await complete(session, gateway, "globex"))[0] == 200
        admitted = 0
        for _ in range(5):
            batch = await asyncio.gather(*(complete(session, gateway, "initech") for _ in range(5)))
            admitted += sum(1 for status, _, _ in batch if status == 200)
            assert {status for status, _, _ in batch} <= {200, 429}
        assert admitted >= 20
        shed_before = await shed_total(session, gateway)

        extproc = next(c for c in gateway.stack.children if c.name == "extproc")
        assert extproc.process is not None
        with lagging(extproc.process.pid):
            deadline = time.monotonic() + 20
            while not await metric(session, gateway, "extproc_overload_shedding 1.0"):
                assert time.monotonic() < deadline, "the service never noticed its lag"
            status, headers, body = await complete(session, gateway, "initech")
            assert status == 429, body
            assert int(headers["Retry-After"]) >= 1
            error = orjson.loads(body)["error"]
            assert error["code"] == "shed_overload" and error["type"] == "rate_limit_error"
            for _ in range(3):
                status, _, body = await complete(session, gateway, "globex")
                assert status == 200, body
        assert await shed_total(session, gateway) >= shed_before + 1
