"""Busy processes for tests that need a CPU crowded: each spins for at most `SPIN_S` (so one
left behind by a killed test run stops by itself) and is killed when its block ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

SPIN_S = 60
SPIN = f"import time\nend = time.monotonic() + {SPIN_S}\nwhile time.monotonic() < end: pass\n"
"""A busy process's program."""


@contextlib.contextmanager
def spinners(count: int, cpu: int | None = None) -> Iterator[list[int]]:
    """`count` busy processes, pinned to `cpu` if given; their pids."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            spinner = subprocess.Popen([sys.executable, "-c", SPIN])
            started.append(spinner)
            if cpu is not None:
                os.sched_setaffinity(spinner.pid, {cpu})
        yield [s.pid for s in started]
    finally:
        for spinner in started:
            spinner.kill()
            spinner.wait(timeout=10)
