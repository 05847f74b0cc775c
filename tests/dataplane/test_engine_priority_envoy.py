"""Engine priority through the real Envoy, into an emulated engine on vLLM's `priority`
scheduling policy: a light tenant's request overtakes the flooder requests already waiting
inside the engine (the gateway forwards everything at once here, so the order is the
engine's), and with `engine_priority: false` it waits behind them (arrival order)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway_lab.engine.profiles import get_profile
from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway

pytestmark = pytest.mark.dataplane

PROFILE = "cpu-tiny"  # vLLM's priority policy, 32 sequences
SEQS = get_profile(PROFILE).max_num_seqs
FLOODERS = SEQS + 12
LIMITS = "{requests_per_minute: 60000, tokens_per_minute: 100000000, max_queued: 500}"


def _policy(engine_priority: str) -> str:
    text = policy_yaml(
        short_inflight=FLOODERS + 8, globex_limits=LIMITS, initech_limits=LIMITS
    ).replace(
        "    headroom: 0\n",
        f"    headroom: 0\n    engine_priority: {engine_priority}\n    prefill_budget_tokens: 0\n",
        1,
    )
    return text


@pytest.fixture(scope="module", params=["true", "false"])
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningGateway, bool]]:
    workdir: Path = tmp_path_factory.mktemp(f"engine-priority-{request.param}")

    def make(short: str, long_: str) -> str:
        return (
            _policy(request.param).replace("127.0.0.1:8001", short).replace("127.0.0.1:8002", long_)
        )

    with running_gateway(workdir, make, profile=PROFILE) as running:
        yield running, request.param == "true"


async def _stream(
    session: aiohttp.ClientSession,
    gateway: RunningGateway,
    tenant: str,
    max_tokens: int,
    firsts: list[float],
) -> None:
    """Stream one chat request; append the monotonic time of its first content chunk."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "word " * 150}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {TEST_KEYS[tenant]}"}
    seen = False
    timeout = aiohttp.ClientTimeout(total=60)
    async with session.post(
        gateway.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout
    ) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not seen and line.startswith(b"data: {") and b'"content"' in line:
                seen = True
                firsts.append(time.monotonic())
    assert seen


async def test_a_light_request_overtakes_flooders_waiting_in_the_engine(
    gateway: tuple[RunningGateway, bool],
) -> None:
    running, on = gateway
    flooders: list[float] = []
    quiet: list[float] = []
    async with aiohttp.ClientSession() as session:
        # Distinct lengths: running flooders finish one by one, each freeing one sequence.
        flood = [
            asyncio.create_task(_stream(session, running, "globex", 30 + 3 * i, flooders))
            for i in range(FLOODERS)
        ]
        deadline = time.monotonic() + 30
        while len(flooders) < SEQS:  # the engine runs all it can; the others wait inside it
            assert time.monotonic() < deadline, len(flooders)
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        assert len(flooders) == SEQS  # none of the waiting ones has started
        await _stream(session, running, "initech", 4, quiet)
        await asyncio.gather(*flood)
    waiting = sorted(at - sent for at in flooders if at > sent)
    assert len(waiting) == FLOODERS - SEQS
    overtaken = sum(at < quiet[0] - sent for at in waiting)
    if on:
        assert overtaken == 0, (quiet[0] - sent, waiting[:3])
    else:
        assert overtaken >= FLOODERS - SEQS - 2, (quiet[0] - sent, waiting[:3])
