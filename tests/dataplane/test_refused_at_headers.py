"""A request its tenant's full queue refuses whatever it asks for is refused at the request
headers, through the real Envoy: the client gets the same 429 (OpenAI body, Retry-After) as a
refusal at the body, but the service neither parses nor estimates the body, and the accounting
filter behind it (which Envoy runs for a local reply too) gets no request headers. With two
round trips Envoy also sends the admission stream no body message: two of the five messages a
flooder's refusal at the body costs the door; with one, Envoy has sent the body already."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import policy_yaml
from tests.dataplane.harness import LAYOUTS, RunningGateway, running_in_layout
from tests.dataplane.test_admission import chat, send, settled, wait_for_view

pytestmark = pytest.mark.dataplane

MAX_QUEUED = 2
_STAT = re.compile(r"^http\.[^.]+\.ext_proc\.(admission|accounting)\.(\w+): (\d+)$", re.M)


def full_queue_policy(short: str, long_: str) -> str:
    limits = f"{{requests_per_minute: 6000, tokens_per_minute: 10000000, max_queued: {MAX_QUEUED}}}"
    return policy_yaml(short, long_, globex_limits=limits, short_inflight=1, long_inflight=1)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    # 12 ms steps: the requests holding the pools stay in flight for seconds
    workdir = tmp_path_factory.mktemp("full-queue")
    with running_in_layout(request.param, workdir, full_queue_policy, "a100-llama3-8b") as running:
        yield running


async def ext_proc_stats(
    session: aiohttp.ClientSession, gateway: RunningGateway
) -> dict[tuple[str, str], int]:
    url = f"http://{gateway.config.envoy_admin}/stats"
    async with session.get(url, params={"filter": "ext_proc"}) as response:
        text = await response.text()
    return {(m[1], m[2]): int(m[3]) for m in _STAT.finditer(text)}


async def status_view(session: aiohttp.ClientSession, gateway: RunningGateway) -> Any:
    async with session.get(gateway.admin_url + "/v1/status") as response:
        return orjson.loads(await response.read())


async def test_a_full_queue_refuses_at_the_headers(gateway: RunningGateway) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Both pools full (one slot each): no request of globex, whatever its size, could
        # go straight through, so a full queue refuses it before its body is read.
        held = [
            asyncio.create_task(send(session, gateway, "globex", chat(max_tokens)))
            for max_tokens in (2000, 12000)  # the short pool, the long one
        ]
        await wait_for_view(
            session, gateway, lambda v: all(p["inflight"] == 1 for p in v["pools"].values())
        )
        held += [
            asyncio.create_task(send(session, gateway, "globex", chat(5)))
            for _ in range(MAX_QUEUED)
        ]
        await wait_for_view(
            session, gateway, lambda v: v["tenants"]["globex"]["queued"] == MAX_QUEUED
        )
        before = await ext_proc_stats(session, gateway)
        status, headers, body = await send(session, gateway, "globex", chat(5))
        after = await ext_proc_stats(session, gateway)
        assert status == 429
        error = orjson.loads(body)["error"]
        assert error["code"] == "rejected_queue_full" and "max_queued 2" in error["message"]
        assert int(headers["Retry-After"]) >= 1
        grew = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        assert grew[("admission", "streams_started")] == 1
        if gateway.layout == "two-trips":
            assert grew[("admission", "stream_msgs_sent")] == 1  # the headers, no body
        assert grew[("admission", "immediate_responses_sent")] == 1
        # refused before a pool was chosen from the body
        (last, *_) = (await status_view(session, gateway))["rejections"]
        assert last["code"] == "rejected_queue_full" and last["pool"] is None
        # the local reply's headers and body only (refused at the body: the request headers too)
        assert grew[("accounting", "streams_started")] == 1
        assert grew[("accounting", "stream_msgs_sent")] == 2
        # the queue it found full is served as before
        for task in held[:2]:
            task.cancel()
        results = await asyncio.gather(*held, return_exceptions=True)
        assert [r[0] for r in results[2:] if isinstance(r, tuple)] == [200] * MAX_QUEUED
        await wait_for_view(session, gateway, settled)
