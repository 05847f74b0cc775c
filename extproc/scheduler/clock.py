"""Time as the scheduler sees it: injected, never read from the wall by the core itself."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences matter."""
        ...


class ManualClock:
    """A clock that moves only when told to: tests and the discrete-event simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        return self._now

    def set(self, at: float) -> None:
        if at < self._now:
            raise ValueError("a clock cannot go backwards")
        self._now = float(at)


class MonotonicClock:
    """The live service's clock (the adapter injects it; the core never calls time itself)."""

    def now(self) -> float:
        return time.monotonic()
