"""How much of the time a thread was ready to run but had no CPU: the front's cores are
oversubscribed.

The event loop answers Envoy's messages, so every moment its thread is runnable but not
running is a moment added to each answer, and to Envoy's and the client's own work on the
same cores. Linux counts it per thread (`/proc/<pid>/task/<tid>/schedstat`: time on a CPU,
time waiting on a run queue, in ns); `CpuWait` turns it into the share of wall time spent
waiting over the last `window_s`. Where the file does not exist (not Linux, or a kernel
without schedstats) the reading is None and the signal is off.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

__all__ = ["CpuWait", "read_schedstat", "schedstat_path"]


def schedstat_path(pid: int | None = None, tid: int | None = None) -> Path:
    """The schedstat file of thread `tid` of process `pid` (default: the calling thread)."""
    pid = os.getpid() if pid is None else pid
    tid = threading.get_native_id() if tid is None else tid
    return Path(f"/proc/{pid}/task/{tid}/schedstat")


def read_schedstat(path: Path) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting) from one schedstat file; None if it cannot be
    read (the thread ended, or the kernel keeps no schedstats)."""
    try:
        fields = path.read_bytes().split()
        return int(fields[0]), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


class CpuWait:
    """The share of wall time one thread waited to run over about the last `window_s`,
    sampled on demand (the overload monitor's timer)."""

    def __init__(
        self,
        path: Path,
        window_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._window_s = window_s
        self._clock = clock
        self._readings: deque[tuple[float, float]] = deque()
        self.available = self._waited_s() is not None

    def _waited_s(self) -> float | None:
        reading = read_schedstat(self._path)
        return None if reading is None else reading[1] / 1e9

    def sample(self) -> float | None:
        """The share (0..1) of the time since the oldest reading still in the window that the
        thread spent runnable but not running; None until two readings exist or if the
        counter cannot be read."""
        if not self.available:
            return None
        waited = self._waited_s()
        if waited is None:
            self.available = False
            return None
        now = self._clock()
        readings = self._readings
        readings.append((now, waited))
        while len(readings) > 2 and now - readings[1][0] >= self._window_s:
            readings.popleft()
        since, waited_then = readings[0]
        if now <= since:
            return None
        return min(1.0, max(0.0, (waited - waited_then) / (now - since)))
