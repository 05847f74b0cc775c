"""CPU pinning for benchmarks on a small machine: the engine on a core of its own, the gateway,
Envoy and the load generator on the others, so the engine's timing does not depend on how
busy the gateway is. Every thread of a process is pinned (a process's affinity is per thread)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway_lab.bench.stack import cpu_seconds


@dataclass(frozen=True)
class CoreSplit:
    engine: frozenset[int]
    front: frozenset[int]

    def describe(self) -> str:
        return f"engine on cpu {sorted(self.engine)}, the rest on cpu {sorted(self.front)}"


def split_cores() -> CoreSplit | None:
    """The last allowed core for the engine, the others for the rest; None below two cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    return CoreSplit(frozenset(allowed[-1:]), frozenset(allowed[:-1]))


def pin(pid: int, cores: frozenset[int], keep: Collection[int] = ()) -> int:
    """Pin every thread of `pid` and of its descendants to `cores`, except the processes in
    `keep` and those below them (pinned elsewhere: the engines the load generator started);
    returns threads pinned. A thread or process that is gone by then is skipped."""
    pinned = 0
    for process in (pid, *descendants(pid, stop_at=keep)):
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{process}/task").iterdir():
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                    os.sched_setaffinity(int(task.name), cores)
                    pinned += 1
    return pinned


@contextlib.contextmanager
def engines_apart(split: CoreSplit | None, engine_pids: Collection[int]) -> Iterator[None]:
    """Pin the engines to the split's engine cores and this process (the load generator, and
    what it starts from now on) to the front's; on exit give this process its cores back, so
    a benchmark run in process (the smoke tests) does not leave its caller on one core."""
    if split is None:
        yield
        return
    allowed = frozenset(os.sched_getaffinity(0))
    for pid in engine_pids:
        pin(pid, split.engine)
    pin(os.getpid(), split.front, keep=engine_pids)
    try:
        yield
    finally:
        pin(os.getpid(), allowed, keep=engine_pids)


def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                found.extend(int(x) for x in (task / "children").read_text().split())
    return found


def descendants(pid: int, stop_at: Collection[int] = ()) -> list[int]:
    """Every process below `pid`, except those in `stop_at` and the processes below them."""
    out: list[int] = []
    pending = children(pid)
    while pending:
        child = pending.pop()
        if child in stop_at:
            continue
        out.append(child)
        pending.extend(children(child))
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and every process below it (workers, an accounting child); a
    process that is gone by then counts 0."""
    total = 0.0
    for process in (pid, *descendants(pid)):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError):
            total += cpu_seconds(process)
    return total


def group_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each named process with its descendants (workers), except those named
    themselves: the load generator's are the stacks it started, counted under their names."""
    out: dict[str, float] = {}
    named = set(pids.values())
    for name, pid in pids.items():
        total = 0.0
        for process in (pid, *descendants(pid, stop_at=named)):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError):
                total += cpu_seconds(process)
        out[name] = total
    return out
