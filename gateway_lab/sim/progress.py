"""A one-line progress display on stderr, rewritten in place at most once per interval."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLine:
    """Callable as a simulator progress hook: (simulated time, resolved, total)."""

    def __init__(
        self,
        label: str = "simulate",
        horizon: float | None = None,
        stream: TextIO | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.label = label
        self.horizon = horizon
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._started = time.perf_counter()
        self._last = -float("inf")
        self._shown = False

    def __call__(self, sim_time: float, resolved: int, total: int) -> None:
        now = time.perf_counter()
        if now - self._last < self.interval_s and resolved < total:
            return
        self._last = now
        wall = now - self._started
        horizon = f"/{self.horizon:.0f}" if self.horizon else ""
        speed = f" ({sim_time / wall:.0f}x)" if wall > 0 else ""
        line = (
            f"\r[{self.label}] t={sim_time:.0f}{horizon}s  {resolved}/{total} requests  "
            f"{wall:.0f}s{speed}"
        )
        self.stream.write(line)
        self.stream.flush()
        self._shown = True

    def done(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False
