"""The emulated engine's steps follow the model's timeline, not the event loop's lag."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from gateway_lab.engine.server import DEFAULT_MODEL, running_engine
from gateway_lab.engine.timeline import StepTimeline

STEP_S = 0.010
OUTPUT_TOKENS = 60


def test_a_step_after_a_step_starts_where_it_ended_however_late_the_loop() -> None:
    timeline = StepTimeline()
    assert timeline.start(100.0) == 100.0  # nothing before: now
    timeline.ended(100.010)
    assert timeline.start(100.013) == 100.010  # woke 3 ms late: the lag is not the model's


def test_a_request_that_arrived_during_the_lag_moves_the_start_to_its_arrival() -> None:
    timeline = StepTimeline()
    timeline.start(100.0)
    timeline.ended(100.010)
    timeline.arrived(100.012)
    assert timeline.start(100.013) == 100.012  # not before the engine could have seen it
    timeline.ended(100.022)
    assert timeline.start(100.025) == 100.022  # an older arrival no longer matters


def test_after_idle_the_next_step_starts_when_it_is_taken() -> None:
    timeline = StepTimeline()
    timeline.start(100.0)
    timeline.ended(100.010)
    timeline.idle()
    assert timeline.start(105.0) == 105.0


async def _hog_the_loop(busy_s: float, free_s: float) -> None:
    """CPU work in the engine's own event loop, as 20-30 streams' writes are under load."""
    while True:
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(free_s)


async def test_a_busy_event_loop_delays_deliveries_not_the_model_steps() -> None:
    """With the loop busy 8 ms of every 9, a response of 60 steps of 10 ms takes the model's
    ~600 ms (610-620 here); steps started at each late wake-up stretch it to ~850 ms."""
    async with (
        running_engine(profile="fast", step_base_s=STEP_S) as engine,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
    ):
        hog = asyncio.create_task(_hog_the_loop(busy_s=0.008, free_s=0.001))
        try:
            body = {
                "model": DEFAULT_MODEL,
                "prompt": "hello",
                "max_tokens": OUTPUT_TOKENS,
                "stream": True,
            }
            started = time.perf_counter()
            async with session.post(engine.base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            elapsed = time.perf_counter() - started
        finally:
            hog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hog
    model_s = OUTPUT_TOKENS * STEP_S
    assert engine.core.steps_total == OUTPUT_TOKENS
    assert elapsed < model_s + 0.080, (
        f"{elapsed * 1000:.0f} ms against the model's {model_s * 1000:.0f}"
    )
