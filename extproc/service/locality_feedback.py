"""How good the locality index is: the engines' own prefix-cache counters, per replica, set
beside what the index predicted (a subscriber of extproc.service.engine_poller).

Every `interval_s` it reads the endpoints of the pools the index covers (fairness `dlpm`),
and hands each replica the increments of `vllm:prefix_cache_queries_total` and
`vllm:prefix_cache_hits_total` since the previous reading; the scheduler snapshot (so
`/v1/tenants` and the `extproc_locality_*` metrics) shows both sides. At the same ticks it
hands the index the estimator's current bytes per token (what a byte block is worth in
tokens), rounded to 0.05 so that the caches are not resized for noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from extproc.scheduler.locality import LocalityIndex
from extproc.service.engine_poller import EnginePoller, Readings


class LocalityFeedback:
    def __init__(
        self,
        index: LocalityIndex,
        poller: EnginePoller,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 1.0,
        now: Callable[[], float] = time.monotonic,
        bytes_per_token: Callable[[], float] | None = None,
    ) -> None:
        self.index = index
        self.bytes_per_token = bytes_per_token
        self.poller = poller
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._now = now
        self._read_at: float | None = None
        self._last: dict[str, tuple[float, float]] = {}
        """Endpoint -> its (queries, hits) counters at the previous reading."""

    def start(self) -> None:
        self.poller.subscribe(self)

    def stop(self) -> None:
        self.poller.unsubscribe(self)

    def due_in(self) -> float:
        if self._read_at is None:
            return 0.0
        return self._read_at + self.interval_s - self._now()

    def wanted(self) -> Mapping[str, float]:
        self._read_at = self._now()
        if self.bytes_per_token is not None:
            self.index.set_bytes_per_token(round(self.bytes_per_token() * 20) / 20)
        return {
            endpoint: self.timeout_s
            for pool in self.index.pools.values()
            for endpoint in pool.endpoints
        }

    def deliver(self, readings: Readings) -> None:
        for pool in self.index.pools.values():
            for replica, endpoint in enumerate(pool.endpoints):
                reading = readings.get(endpoint)
                if reading is None or reading.prefix_queries is None:
                    continue
                counters = (reading.prefix_queries, reading.prefix_hits or 0.0)
                before = self._last.get(endpoint)
                self._last[endpoint] = counters
                if before is None or counters[0] < before[0]:
                    continue  # the first reading is the base; a restart starts a new one
                pool.engine_reported(replica, counters[0] - before[0], counters[1] - before[1])
