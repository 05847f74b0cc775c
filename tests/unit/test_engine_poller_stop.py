"""EnginePoller.stop ends its task even when the wake-up and the cancel land together (Python
3.11's wait_for swallows such a cancel): `extproc serve` failing to bind its gRPC port stopped
the engine watcher, then the poller, and hung there instead of exiting."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from extproc.service.engine_poller import EnginePoller, Readings


class NeverDue:
    def due_in(self) -> float:
        return 3600.0

    def wanted(self) -> Mapping[str, float]:
        return {}

    def deliver(self, readings: Readings) -> object:
        return readings


async def stopped_within(poller: EnginePoller, timeout_s: float) -> None:
    """`stop` returns by itself (asyncio.wait does not cancel it at the timeout, as wait_for
    would, and a second cancel does end the task)."""
    stopping = asyncio.ensure_future(poller.stop())
    done, _ = await asyncio.wait({stopping}, timeout=timeout_s)
    if not done:
        stopping.cancel()
    assert done, "the poller's task did not end"


async def test_stop_right_after_a_wake_up_ends_the_task() -> None:
    poller = EnginePoller()
    poller.subscribe(NeverDue())  # subscribing wakes the task up
    await asyncio.sleep(0)  # one turn: the task starts its wait, which the wake-up ends
    await stopped_within(poller, 5.0)


async def test_a_stopped_poller_polls_again_once_subscribed() -> None:
    poller = EnginePoller()
    first = NeverDue()
    poller.subscribe(first)
    await stopped_within(poller, 5.0)
    delivered = asyncio.get_running_loop().create_future()

    class Due(NeverDue):
        def due_in(self) -> float:
            return 0.0

        def deliver(self, readings: Readings) -> object:
            if not delivered.done():
                delivered.set_result(readings)
            return readings

    poller.subscribe(Due())
    assert await asyncio.wait_for(delivered, 5.0) == {}
    await poller.stop()
