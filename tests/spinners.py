"""Busy processes for tests that need a CPU crowded: each spins for at most `SPIN_S` (so one
left behind by a killed test run stops by itself) and is killed when its block ends."""

from __future__ import annotations

import contextlib

from gateway_lab.bench.awake import pinned_processes

SPIN_S = 60
SPIN = f"import time\nend = time.monotonic() + {SPIN_S}\nwhile time.monotonic() < end: pass\n"
"""A busy process's program."""


def spinners(count: int, cpu: int) -> contextlib.AbstractContextManager[list[int]]:
    """`count` busy processes pinned to `cpu`; their pids."""
    return pinned_processes(SPIN, [cpu] * count)
