"""The self-overload bench's flooder in a process of its own
(gateway_lab/bench/self_overload_load.py): it sends from a child on the parent's clock, and its
records come back to the parent's load."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway_lab.bench.loadgen import Load
from gateway_lab.bench.records import Meter
from gateway_lab.bench.self_overload_load import Flood, Workload, begin_flood

TOKENS = 3


async def _stream(request: web.Request) -> web.StreamResponse:
    """A streamed completion of TOKENS tokens, the process that answered in a header."""
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(TOKENS):
        await response.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[str]]]:
    """A loopback server; the second element lists each request's tenant header."""
    tenants: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        tenants.append(request.headers.get("x-tenant-id", ""))
        return await _stream(request)

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}/v1/completions", tenants
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("in_child", [False, True])
async def test_the_flood_sends_on_the_parents_clock_and_its_records_come_back(
    server: tuple[str, list[str]], in_child: bool
) -> None:
    url, tenants = server
    work = Workload(over_rate=40.0, over_output=TOKENS)
    async with (
        Load(url, Meter(bin_s=0.5), request_timeout_s=30.0) as load,
        Flood(load, "over", work, seed=3, usage=False, apart=in_child) as flood,
    ):
        assert (flood.pid is not None) is in_child
        assert flood.pid != os.getpid()
        start = load.now() + 0.2
        until = start + 1.0
        await asyncio.wait_for(flood.run(start, until), timeout=60.0)
        child = flood.child
    records = [r for r in load.records if r.tenant == "flooder"]
    assert len(records) == len(tenants) >= 10  # 40/s for a second, Poisson
    assert set(tenants) == {"flooder"}
    assert all(start <= r.start <= until for r in records)  # the parent's clock
    assert all(r.status == 200 and r.output_tokens == TOKENS and r.complete for r in records)
    if child is not None:
        assert child.returncode == 0


async def test_the_alone_load_has_no_flood(server: tuple[str, list[str]]) -> None:
    url, tenants = server
    async with (
        Load(url, Meter(bin_s=0.5), request_timeout_s=30.0) as load,
        Flood(load, "alone", Workload(), seed=3, usage=False, apart=True) as flood,
    ):
        assert not flood.active and flood.pid is None
    assert tenants == []


async def test_a_failed_run_kills_the_flooders_process(server: tuple[str, list[str]]) -> None:
    """No child outlives a run that failed mid-flood."""
    url, _tenants = server
    child = None
    with pytest.raises(RuntimeError, match="the run failed"):
        async with (
            Load(url, Meter(bin_s=0.5), request_timeout_s=30.0) as load,
            Flood(load, "over", Workload(over_rate=5.0), seed=3, usage=False, apart=True) as flood,
        ):
            child = flood.child
            assert child is not None
            await begin_flood(child, load.now(), load.now() + 600.0)
            raise RuntimeError("the run failed")
    assert child is not None and child.returncode == -signal.SIGKILL
