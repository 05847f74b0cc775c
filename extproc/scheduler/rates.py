"""Event rates as exponentially decaying averages over an injected clock."""

from __future__ import annotations

import math


class DecayingRate:
    """Events per second, an exponentially weighted moving average with a half-life.

    Each event adds 1/tau to a sum that decays as exp(-dt/tau); for a steady stream the sum
    tends to the rate. The estimate is bias-corrected for the time since the first event (like
    Adam's warm-up correction), so it is not too low right after start, and it is `None` until
    `min_samples` events have been seen: callers must not act on a guess.
    """

    __slots__ = ("_first", "_last", "_sum", "_tau", "count", "min_samples")

    def __init__(self, halflife_s: float = 10.0, min_samples: int = 8) -> None:
        if halflife_s <= 0:
            raise ValueError("halflife_s must be positive")
        self._tau = halflife_s / math.log(2.0)
        self._sum = 0.0
        self._first: float | None = None
        self._last = 0.0
        self.count = 0
        self.min_samples = min_samples

    def record(self, now: float, events: int = 1) -> None:
        if self._first is None:
            self._first = now
            self._last = now
        elif now > self._last:
            self._sum *= math.exp(-(now - self._last) / self._tau)
            self._last = now
        self._sum += events / self._tau
        self.count += events

    def rate(self, now: float) -> float | None:
        if self._first is None or self.count < self.min_samples:
            return None
        span = max(now, self._last) - self._first
        warmup = -math.expm1(-span / self._tau)
        if warmup <= 1e-12:
            return None
        decayed = self._sum * math.exp(-max(0.0, now - self._last) / self._tau)
        return decayed / warmup

    def level(self, now: float) -> float:
        """The decayed sum without the warm-up correction: it tends to the rate from below,
        so a stream that began lately reads low, never high (for comparing streams)."""
        if self._first is None:
            return 0.0
        return self._sum * math.exp(-max(0.0, now - self._last) / self._tau)
