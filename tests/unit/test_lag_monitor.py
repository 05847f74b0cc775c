"""LagMonitor: samples slowly while there is nothing to protect and the loop is on time, and
goes back to its short interval the moment work arrives or a sample comes late. Driven by the
loop's clock and the samples themselves, never by sleeping until something happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from extproc.policy.model import Gateway, Overload
from extproc.service.overload import IDLE_INTERVAL_S, LagMonitor, OverloadDetector

INTERVAL_S = 0.01
EPSILON_S = 1e-6


@dataclass
class Probe:
    """A monitor with an `idle` answer the test sets, and each sample's loop time."""

    detector: OverloadDetector
    monitor: LagMonitor
    samples: asyncio.Queue[float]
    holding: list[bool] = field(default_factory=lambda: [False])

    async def next_sample(self) -> float:
        return await asyncio.wait_for(self.samples.get(), 10.0)

    def due_in(self) -> float:
        return self.monitor.next_sample_at - asyncio.get_running_loop().time()


def probe(
    lag_threshold_ms: float, interval_s: float = INTERVAL_S
) -> tuple[OverloadDetector, LagMonitor, Probe]:
    detector = OverloadDetector(
        Gateway(
            overload=Overload(interval_ms=interval_s * 1000, lag_threshold_ms=lag_threshold_ms)
        ),
        set,
    )
    samples: asyncio.Queue[float] = asyncio.Queue()
    holding = [False]
    loop = asyncio.get_running_loop()

    def on_sample(shedding: bool) -> None:
        del shedding
        samples.put_nowait(loop.time())

    idle: Callable[[], bool] = lambda: not holding[0]  # noqa: E731
    monitor = LagMonitor(detector, on_sample, idle)
    return detector, monitor, Probe(detector, monitor, samples, holding)


@pytest.fixture
async def idle_probe() -> AsyncIterator[Probe]:
    # A threshold no loop on a busy test host misses: every sample counts as on time.
    _, monitor, running = probe(lag_threshold_ms=5_000)
    monitor.start()
    try:
        await running.next_sample()  # the first one comes at the short interval
        yield running
    finally:
        await monitor.stop()


async def test_an_idle_monitor_samples_at_the_long_interval(idle_probe: Probe) -> None:
    assert idle_probe.monitor.idle
    assert idle_probe.due_in() > IDLE_INTERVAL_S - 0.05
    sampled = await idle_probe.next_sample()
    assert idle_probe.monitor.idle
    assert idle_probe.monitor.next_sample_at == pytest.approx(sampled + IDLE_INTERVAL_S, abs=0.01)


async def test_the_first_stream_brings_the_short_interval_back_at_once(idle_probe: Probe) -> None:
    loop = asyncio.get_running_loop()
    opened_at = loop.time()
    idle_probe.detector.stream_opened("stream")
    assert not idle_probe.monitor.idle
    assert idle_probe.monitor.next_sample_at <= opened_at + INTERVAL_S + 0.005
    # While the stream waits, sample after sample stays short.
    for _ in range(3):
        sampled = await idle_probe.next_sample()
        assert not idle_probe.monitor.idle
        assert idle_probe.due_in() <= INTERVAL_S + EPSILON_S
        assert idle_probe.monitor.next_sample_at == pytest.approx(sampled + INTERVAL_S, abs=0.005)
    idle_probe.detector.stream_answered("stream")
    await idle_probe.next_sample()
    assert idle_probe.monitor.idle
    assert idle_probe.due_in() > INTERVAL_S


async def test_work_held_keeps_the_short_interval(idle_probe: Probe) -> None:
    idle_probe.holding[0] = True  # queued or in flight, though no stream is open
    idle_probe.detector.activity()
    for _ in range(3):
        await idle_probe.next_sample()
        assert not idle_probe.monitor.idle
        assert idle_probe.due_in() <= INTERVAL_S + EPSILON_S
    idle_probe.holding[0] = False
    await idle_probe.next_sample()
    assert idle_probe.monitor.idle


async def test_a_late_idle_sample_brings_the_short_interval_back() -> None:
    detector, monitor, running = probe(lag_threshold_ms=50)
    loop = asyncio.get_running_loop()
    monitor.start()
    try:
        while not monitor.idle:  # a host busy enough to make the first samples late
            await running.next_sample()
        # Hold the loop across the moment the idle sample is due: it runs >= 80 ms late.
        due = monitor.next_sample_at
        loop.call_at(due - 0.001, time.sleep, 0.081)
        sampled = await running.next_sample()
        assert sampled - due > 0.05
        assert detector.lag_s > 0.05
        assert not monitor.idle
        assert monitor.next_sample_at == pytest.approx(sampled + INTERVAL_S, abs=0.005)
    finally:
        await monitor.stop()


async def test_stop_cancels_the_timer_and_the_wake(idle_probe: Probe) -> None:
    await idle_probe.monitor.stop()
    assert idle_probe.detector.wake is None
    idle_probe.detector.stream_opened("after the stop")  # wakes nothing
    loop = asyncio.get_running_loop()
    past_any_sample = loop.create_future()
    loop.call_at(loop.time() + 3 * INTERVAL_S, past_any_sample.set_result, None)
    await past_any_sample
    assert idle_probe.samples.empty()


async def test_a_disabled_detector_runs_no_monitor() -> None:
    detector = OverloadDetector(Gateway(overload=Overload(enabled=False)), set)
    monitor = LagMonitor(detector, lambda shedding: None)
    monitor.start()
    assert detector.wake is None
    assert not monitor.idle
    assert monitor.next_sample_at == 0.0  # never scheduled
    await monitor.stop()


async def test_a_busy_interval_longer_than_the_idle_one_is_kept_when_idle() -> None:
    _, monitor, running = probe(lag_threshold_ms=5_000, interval_s=0.4)
    monitor.start()
    try:
        sampled = await running.next_sample()
        assert monitor.idle
        assert monitor.next_sample_at == pytest.approx(sampled + 0.4, abs=0.01)
    finally:
        await monitor.stop()
