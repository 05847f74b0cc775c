"""Feed the pools' adaptive capacity from the engines' `/metrics` (the asyncio side).

Every `poll_interval` the watcher has the engine poller (`extproc.service.engine_poller`) read
each endpoint of every pool whose capacity is adaptive, sums `vllm:num_requests_waiting` and
`vllm:num_requests_running`, takes the largest KV-cache usage, and hands the pool one
`EngineSample`. When a soft limit changes it calls `on_change` (the admission controller's
`pump`), since a larger limit can admit queued requests at once. An endpoint that does not
answer in time is left out of the sample; a pool none of whose engines answered gets no
sample, and its limit stays where it was.

The pure controller is `extproc.scheduler.adaptive`; this module only does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from extproc.scheduler.adaptive import EngineCapacities, EngineSample
from extproc.scheduler.clock import Clock
from extproc.service.engine_metrics import EngineReading
from extproc.service.engine_poller import EnginePoller, Readings


def pool_sample(at: float, readings: Sequence[EngineReading]) -> EngineSample | None:
    if not readings:
        return None
    return EngineSample(
        at=at,
        waiting=sum(r.waiting for r in readings),
        running=sum(r.running for r in readings),
        kv_usage=max(r.kv_usage for r in readings),
        engines=len(readings),
    )


Endpoints = Callable[[], Mapping[str, Sequence[str]]]
"""Pool name -> its engine endpoints (host:port), read at every poll (policy reloads)."""


class EngineWatcher:
    """A subscriber of the engine poller: samples for the adaptive pools."""

    def __init__(
        self,
        capacities: EngineCapacities,
        endpoints: Endpoints,
        clock: Clock,
        on_change: Callable[[], None],
        poller: EnginePoller,
        *,
        interval_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.capacities = capacities
        self.endpoints = endpoints
        self.clock = clock
        self.on_change = on_change
        self.poller = poller
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.polls = 0
        self.failures = 0
        self.last: dict[str, EngineSample] = {}
        self._polled_at: float | None = None
        self._pools: dict[str, list[str]] = {}
        """The adaptive pools' endpoints being read (between `wanted` and `deliver`)."""

    @property
    def interval(self) -> float:
        return self.interval_s or self.capacities.poll_interval_s()

    def start(self) -> None:
        self.poller.subscribe(self)

    def stop(self) -> None:
        self.poller.unsubscribe(self)

    def due_in(self) -> float:
        if self._polled_at is None:
            return 0.0
        return self._polled_at + self.interval - time.monotonic()

    def wanted(self) -> dict[str, float]:
        self._polled_at = time.monotonic()
        self._pools = {
            name: list(endpoints)
            for name, endpoints in self.endpoints().items()
            if name in self.capacities.adaptive
        }
        timeout_s = self.timeout_s or max(0.5, 3 * self.interval)
        return {endpoint: timeout_s for found in self._pools.values() for endpoint in found}

    def deliver(self, readings: Readings) -> dict[str, EngineSample]:
        """Feed the adaptive pools the samples of these readings."""
        pools, self._pools = self._pools, {}
        if not pools:
            return {}
        by_pool: dict[str, list[EngineReading]] = {name: [] for name in pools}
        for name, endpoints in pools.items():
            for endpoint in endpoints:
                reading = readings.get(endpoint)
                if reading is None:
                    self.failures += 1
                else:
                    by_pool[name].append(reading)
        self.polls += 1
        now = self.clock.now()
        changed = False
        samples: dict[str, EngineSample] = {}
        for name, found in by_pool.items():
            sample = pool_sample(now, found)
            if sample is None:
                continue
            samples[name] = sample
            self.last[name] = sample
            changed = self.capacities.observe(name, sample) or changed
        if changed:
            self.on_change()
        return samples

    async def poll_once(self) -> dict[str, EngineSample]:
        """Read every adaptive pool's engines now and feed the samples (without `start`: once
        subscribed, the poller's ticks feed it)."""
        return self.deliver(await self.poller.read(self.wanted()))
