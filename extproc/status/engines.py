"""Each engine's running, waiting and KV-cache use for the status page.

The engine watcher keeps only per-pool sums of its adaptive pools, and not where the admin
server can reach them; so the page reads every engine itself, as one more subscriber of the
gateway's engine poller (one HTTP client, fetches shared with the other subscribers' when due
together). It asks for readings only while someone watches the page (a status request in
the last `watch_s`), so an unwatched page costs the engines nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.service.engine_metrics import EngineReading
from extproc.service.engine_poller import Readings

Endpoints = Callable[[], Mapping[str, Sequence[str]]]
"""Pool name -> its engine endpoints, read at every poll (policy reloads)."""

_IDLE_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class EngineSeen:
    reading: EngineReading | None
    """None: the engine did not answer in time, or is not a vLLM engine."""
    at: float
    """time.monotonic() of the poll."""


class EngineReader:
    """A subscriber of `EnginePoller` (extproc.service.engine_poller): last reading per engine."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        watch_s: float = 15.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoints = endpoints
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.watch_s = watch_s
        self.now = now
        self.seen: dict[str, EngineSeen] = {}
        self._watched_at: float | None = None
        self._polled_at: float | None = None

    def watched(self) -> None:
        """Someone asked for the status: keep reading the engines for `watch_s`."""
        self._watched_at = self.now()

    def _watching(self) -> bool:
        return self._watched_at is not None and self.now() - self._watched_at <= self.watch_s

    # -- MetricsSubscriber -------------------------------------------------------------------------

    def due_in(self) -> float:
        if not self._watching():
            return _IDLE_CHECK_S
        if self._polled_at is None:
            return 0.0
        return self._polled_at + self.interval_s - self.now()

    def wanted(self) -> dict[str, float]:
        if not self._watching():
            return {}  # and the next watch reads at once
        self._polled_at = self.now()
        return {e: self.timeout_s for found in self.endpoints().values() for e in found}

    def deliver(self, readings: Readings) -> None:
        at = self.now()
        for endpoint, reading in readings.items():
            self.seen[endpoint] = EngineSeen(reading, at)

    # -- the view ----------------------------------------------------------------------------------

    def pool_engines(self, endpoints: Sequence[str]) -> list[dict[str, Any]]:
        """One row per endpoint of a pool; `age_s` None: not read yet."""
        now = self.now()
        rows: list[dict[str, Any]] = []
        for endpoint in endpoints:
            seen = self.seen.get(endpoint)
            row: dict[str, Any] = {"endpoint": endpoint, "age_s": None, "answered": False}
            if seen is not None:
                row["age_s"] = round(now - seen.at, 2)
                reading = seen.reading
                if reading is not None:
                    row.update(
                        answered=True,
                        running=reading.running,
                        waiting=reading.waiting,
                        kv_usage=round(reading.kv_usage, 4),
                    )
            rows.append(row)
        return rows
