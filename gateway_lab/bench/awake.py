"""Keep CPUs from going idle, to price what waking an idle CPU costs a request.

At 1 request/s every process of the path sleeps between messages, and the virtual CPU it runs
on halts; each message then waits for a halted CPU to be woken (in a virtual machine, an exit
to the hypervisor and back). Kernels on such hosts can poll before halting instead
(`cpuidle-haltpoll`, `idle=poll`); this machine's cannot be changed, so `kept_awake(cpus)`
does the same from user space: one spinning process per CPU at `SCHED_IDLE`, the lowest
priority there is, which the scheduler preempts the moment any other task on that CPU wakes.
The CPU never halts, and no other process waits for it. It burns the whole CPU, so it is a
measurement, not a setting.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Collection, Iterator, Sequence

__all__ = ["SPINNER", "kept_awake", "pinned_processes"]

SPINNER = (
    "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True:\n    pass\n"
)
"""The spinning process: it lowers itself to SCHED_IDLE before it spins."""


@contextlib.contextmanager
def pinned_processes(program: str, cpus: Sequence[int]) -> Iterator[list[int]]:
    """One `python -c program` per entry of `cpus`, pinned to that CPU, while the block
    runs (killed at its end); their pids."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        for cpu in cpus:
            process = subprocess.Popen([sys.executable, "-c", program])
            started.append(process)
            os.sched_setaffinity(process.pid, {cpu})
        yield [p.pid for p in started]
    finally:
        for process in started:
            process.kill()
            process.wait(timeout=10)


def kept_awake(cpus: Collection[int]) -> contextlib.AbstractContextManager[list[int]]:
    """One SCHED_IDLE spinner pinned to each of `cpus` while the block runs; their pids."""
    return pinned_processes(SPINNER, sorted(cpus))
