"""The engine watcher: parse vLLM metrics pages, poll real (emulated) engines, feed limits;
the engine poller its readings come from, shared with the reconciler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

import pytest
from aiohttp import web

from extproc.policy import policy_from_text
from extproc.scheduler import ManualClock, Scheduler
from extproc.scheduler.adaptive import AdaptiveSettings, EngineCapacities
from extproc.service.engine_metrics import EngineReading, parse_engine_metrics
from extproc.service.engine_poller import EnginePoller
from extproc.service.engine_watch import EngineWatcher, pool_sample
from gateway_lab.engine.server import running_engine

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m a"} 3.0
vllm:num_requests_running{engine="1",model_name="m a"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m a"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m a"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m a"} 0.5
vllm:num_requests_waiting_by_reason{reason="x"} 9.0
"""


def test_parse_sums_requests_and_takes_the_largest_kv_usage() -> None:
    reading = parse_engine_metrics(PAGE)
    assert reading is not None
    assert (reading.waiting, reading.running, reading.kv_usage) == (4.0, 5.0, 0.5)
    legacy = parse_engine_metrics("vllm:gpu_cache_usage_perc 0.7\nvllm:num_requests_waiting 1")
    assert legacy is not None and legacy.kv_usage == 0.7 and legacy.waiting == 1.0
    assert parse_engine_metrics("process_cpu_seconds_total 1.0\n") is None


def test_pool_sample_aggregates_engines() -> None:
    readings = [r for r in (parse_engine_metrics(PAGE), parse_engine_metrics(PAGE)) if r]
    sample = pool_sample(5.0, readings)
    assert sample is not None and sample.waiting == 8.0 and sample.engines == 2
    assert pool_sample(5.0, []) is None


async def test_watcher_polls_an_engine_and_raises_the_limit() -> None:
    async with running_engine(profile="fast") as engine:
        endpoint = f"127.0.0.1:{engine.port}"
        policy = policy_from_text(
            f"""\
version: 1
tiers: [gold]
tenants:
  t: {{tier: gold}}
pools:
  p: {{max_total_tokens: 8192, max_inflight: 32, max_inflight_tokens: 1000000,
       endpoints: ["{endpoint}"]}}
"""
        )
        settings = AdaptiveSettings(initial_inflight=4, smoothing=1.0, cooldown_s=0.0)
        capacities = EngineCapacities({"p": settings})
        clock = ManualClock(0.0)
        Scheduler(policy, clock, capacity_factory=capacities.factory)
        capacity = capacities.adaptive["p"]
        for _ in range(4):
            capacity.acquire(10)  # the limit binds
        changes: list[int] = []
        poller = EnginePoller()
        watcher = EngineWatcher(
            capacities,
            lambda: {"p": [endpoint], "static": ["127.0.0.1:1"]},
            clock,
            lambda: changes.append(capacity.soft_limit()),
            poller,
        )
        samples = await watcher.poll_once()
        await poller.stop()
        assert samples["p"].waiting == 0 and samples["p"].engines == 1
        assert changes == [5]
        assert watcher.failures == 0


async def test_watcher_skips_engines_that_do_not_answer() -> None:
    policy = policy_from_text(
        """\
version: 1
tiers: [gold]
tenants:
  t: {tier: gold}
pools:
  p: {max_total_tokens: 8192, max_inflight: 32, max_inflight_tokens: 1000000,
      endpoints: ["127.0.0.1:9"]}
"""
    )
    capacities = EngineCapacities({"p": AdaptiveSettings(initial_inflight=4)})
    clock = ManualClock(0.0)
    Scheduler(policy, clock, capacity_factory=capacities.factory)
    poller = EnginePoller()
    watcher = EngineWatcher(
        capacities, lambda: {"p": ["127.0.0.1:9"]}, clock, lambda: None, poller, timeout_s=0.5
    )
    assert await watcher.poll_once() == {}
    await poller.stop()
    assert watcher.failures == 1 and capacities.adaptive["p"].soft_limit() == 4


class Recorder:
    """A poller subscriber due once: wants `endpoints`, keeps what it is handed."""

    def __init__(self, endpoints: list[str], fail: bool = False) -> None:
        self.endpoints = endpoints
        self.fail = fail
        self.asked = False
        self.got: asyncio.Future[dict[str, EngineReading | None]] = (
            asyncio.get_running_loop().create_future()
        )

    def due_in(self) -> float:
        return 3600.0 if self.asked else 0.0

    def wanted(self) -> dict[str, float]:
        self.asked = True
        if self.fail:
            raise RuntimeError("this subscriber is broken")
        return dict.fromkeys(self.endpoints, 2.0)

    def deliver(self, readings: Mapping[str, EngineReading | None]) -> None:
        self.got.set_result(dict(readings))


@contextlib.asynccontextmanager
async def metrics_server(
    hold: asyncio.Event | None = None,
) -> AsyncIterator[tuple[str, list[str], asyncio.Event]]:
    """An engine page at /metrics that counts its scrapes (and answers once `hold` is set)."""
    scrapes: list[str] = []
    arrived = asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        scrapes.append(request.path)
        arrived.set()
        if hold is not None:
            await hold.wait()
        return web.Response(text=PAGE)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"127.0.0.1:{port}", scrapes, arrived
    finally:
        await runner.cleanup()


async def test_poller_reads_an_engine_once_for_all_its_subscribers() -> None:
    async with metrics_server() as (endpoint, scrapes, _):
        poller = EnginePoller()
        watch, reconcile = Recorder([endpoint]), Recorder([endpoint, "127.0.0.1:9"])
        broken = Recorder([endpoint], fail=True)
        for subscriber in (broken, watch, reconcile):
            poller.subscribe(subscriber)
        got_watch = await asyncio.wait_for(watch.got, 10.0)
        got_reconcile = await asyncio.wait_for(reconcile.got, 10.0)
        await poller.stop()
    assert scrapes == ["/metrics"]  # one fetch served both subscribers
    assert got_watch == {endpoint: parse_engine_metrics(PAGE)}
    assert got_reconcile == {endpoint: parse_engine_metrics(PAGE), "127.0.0.1:9": None}
    assert broken.asked and not broken.got.done()


async def test_an_unsubscribed_subscriber_gets_no_reading_from_a_fetch_under_way() -> None:
    hold = asyncio.Event()
    async with metrics_server(hold) as (endpoint, _, arrived):
        poller = EnginePoller()
        leaving, staying = Recorder([endpoint]), Recorder([endpoint])
        poller.subscribe(leaving)
        poller.subscribe(staying)
        await asyncio.wait_for(arrived.wait(), 10.0)
        poller.unsubscribe(leaving)
        hold.set()
        await asyncio.wait_for(staying.got, 10.0)
        await poller.stop()
    assert leaving.asked and not leaving.got.done()


@contextlib.asynccontextmanager
async def page_server(text: str) -> AsyncIterator[str]:
    """A server whose /metrics answers `text`."""

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_a_default_pool_stays_static_until_its_engines_expose_vllm_metrics() -> None:
    """No `adaptive` key: engines that do not answer or are not vLLM's leave the static limit
    (max_inflight - default headroom); a vLLM page starts the adaptive limit from 16."""
    policy = policy_from_text(
        """\
version: 1
tiers: [gold]
tenants:
  t: {tier: gold}
pools:
  p: {max_total_tokens: 8192, max_inflight: 32, max_inflight_tokens: 1000000,
      endpoints: ["127.0.0.1:9"]}
"""
    )
    capacities = EngineCapacities()
    clock = ManualClock(0.0)
    Scheduler(policy, clock, capacity_factory=capacities.factory)
    capacity = capacities.adaptive["p"]
    assert (capacity.soft_limit(), capacity.hard_limit()) == (24, 32)
    async with page_server("process_cpu_seconds_total 1.0\n") as other, page_server(PAGE) as vllm:
        endpoints = {"p": ["127.0.0.1:9", other]}
        poller = EnginePoller()
        watcher = EngineWatcher(
            capacities, lambda: endpoints, clock, lambda: None, poller, timeout_s=0.5
        )
        assert await watcher.poll_once() == {}
        assert watcher.failures == 2 and capacity.soft_limit() == 24
        endpoints["p"] = [vllm]
        samples = await watcher.poll_once()
        await poller.stop()
    assert samples["p"].waiting == 4.0
    # Started at 16 and backed off at once: 4 waiting (smoothed 0.3 x 4 = 1.2 > 1) x 0.9.
    assert capacity.limit == pytest.approx(16 * 0.9)
    assert (capacity.soft_limit(), capacity.hard_limit()) == (14, 22)
