"""What the machine was doing while a benchmark's quiet requests were slow.

`HostSampler` reads, every `interval_s` from a thread of the load generator, each CPU's time by
state (`/proc/stat`: busy, idle, and the time the hypervisor gave the virtual CPU to someone
else, "steal") and, for each process of the run and the processes below it, its time on a CPU
and its time *runnable but waiting for one* (the sum over its threads of
`/proc/PID/task/TID/schedstat`). A second of slow requests then reads as one of: the host took
the CPU (steal), the front's core was oversubscribed (our processes waited to run), or neither
(the time went elsewhere: the engine, a lock, a timer).

`around(samples, start, end)` gives those rates (ms per second) over a span, `slow_requests`
the span of each of a tenant's slowest requests beside the whole window's, and `timeline` one
row per second for a plot.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from extproc.service.cpu_wait import read_schedstat as read_thread_schedstat
from gateway_lab.bench.cores import descendants

__all__ = ["HostSampler", "Sample", "around", "print_slow", "slow_requests", "timeline"]

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class Sample:
    """Cumulative counters at wall-clock time `at`: per CPU, ms by state (`_CPU_FIELDS`); per
    process, [ms on a CPU, ms runnable but waiting]."""

    at: float
    cpus: dict[str, dict[str, float]]
    procs: dict[str, tuple[float, float]]

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.at, "cpus": self.cpus, "procs": self.procs}


def read_cpus(text: str) -> dict[str, dict[str, float]]:
    """Per CPU (`cpu0`, `cpu1`, ...), ms spent in each state, from /proc/stat's text."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        out[name] = {f: int(v) * _TICK_MS for f, v in zip(_CPU_FIELDS, values, strict=False)}
    return out


def process_schedstat(pid: int) -> tuple[float, float]:
    """[ms on a CPU, ms runnable but waiting] summed over the process's threads (0, 0 once it
    is gone; a thread that ended between samples takes its share with it)."""
    run_ns = wait_ns = 0
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            reading = read_thread_schedstat(task / "schedstat")
            if reading is not None:
                run_ns += reading[0]
                wait_ns += reading[1]
    return run_ns / 1e6, wait_ns / 1e6


def process_labels(pids: Mapping[str, int]) -> dict[str, int]:
    """Each named process, and each process below one that is not named itself (an accounting
    child, workers) as `name/comm`."""
    out = dict(pids)
    named = set(pids.values())
    for name, pid in pids.items():
        for child in descendants(pid, stop_at=named):
            comm = ""
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                comm = Path(f"/proc/{child}/comm").read_text().strip()
            out[f"{name}/{comm or 'child'}-{child}"] = child
    return out


@dataclass
class HostSampler:
    """Samples the CPUs and `pids` (with the processes below them, listed at start) every
    `interval_s` in a thread, from entering to leaving; `samples` holds the result."""

    pids: Mapping[str, int]
    interval_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self, labels: Mapping[str, int]) -> Sample:
        cpus = read_cpus(Path("/proc/stat").read_text())
        procs = {label: process_schedstat(pid) for label, pid in labels.items()}
        return Sample(time.time(), cpus, procs)

    def __enter__(self) -> HostSampler:
        labels = process_labels(self.pids)
        self.samples.append(self.sample(labels))

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.samples.append(self.sample(labels))
            self.samples.append(self.sample(labels))

        self._thread = threading.Thread(target=loop, name="host-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def around(samples: Sequence[Sample], start: float, end: float) -> dict[str, Any] | None:
    """Rates over the smallest run of samples that covers [start, end] (as much of it as was
    sampled): per CPU, steal and idle in ms per second; per process, cores used and ms per
    second spent waiting to run. None if fewer than two samples bracket it."""
    first = next((s for s in reversed(samples) if s.at <= start), samples[0] if samples else None)
    last = next((s for s in samples if s.at >= end), samples[-1] if samples else None)
    if first is None or last is None or last.at <= first.at:
        return None
    span_s = last.at - first.at
    cpus = {
        name: {
            state: round((last.cpus[name][state] - before[state]) / span_s, 1)
            for state in ("steal", "idle")
        }
        for name, before in first.cpus.items()
        if name in last.cpus
    }
    procs = {
        label: {
            "cores": round((last.procs[label][0] - ran) / span_s / 1000.0, 3),
            "wait_ms_per_s": round((last.procs[label][1] - waited) / span_s, 1),
        }
        for label, (ran, waited) in first.procs.items()
        if label in last.procs
    }
    return {"from": first.at, "to": last.at, "cpus": cpus, "procs": procs}


def slow_requests(
    joined: Sequence[Mapping[str, float]],
    samples: Sequence[Sample],
    window: tuple[float, float],
    slowest: int = 5,
) -> dict[str, Any]:
    """The whole window's rates, and for each of the `slowest` requests of `joined`
    (quiet_path.join's rows: `sent` in wall-clock seconds, `ttft` and its parts in ms) the
    rates over its own span, with when in the window it was sent."""
    worst = sorted(joined, key=lambda r: r["ttft"], reverse=True)[:slowest]
    rows = []
    for request in worst:
        span = around(samples, request["sent"], request["sent"] + request["ttft"] / 1000.0)
        rows.append(
            {
                "at_s": round(request["sent"] - window[0], 2),
                "ms": {k: round(v, 1) for k, v in request.items() if k != "sent"},
                "host": span,
            }
        )
    return {"window": around(samples, *window), "slowest": rows}


def timeline(
    joined: Sequence[Mapping[str, float]],
    samples: Sequence[Sample],
    window: tuple[float, float],
    bin_s: float = 1.0,
) -> list[dict[str, Any]]:
    """One row per `bin_s` of the window: the slowest request sent in it (ms, NaN if none),
    steal summed over CPUs and each process's wait to run (ms per second)."""
    rows = []
    start = window[0]
    while start < window[1] - 1e-9:
        end = min(start + bin_s, window[1])
        sent = [r["ttft"] for r in joined if start <= r["sent"] < end]
        rates = around(samples, start, end)
        rows.append(
            {
                "at_s": round(start - window[0], 3),
                "slowest_ms": max(sent) if sent else math.nan,
                "steal_ms_per_s": sum(c["steal"] for c in rates["cpus"].values()) if rates else 0,
                "wait_ms_per_s": {n: p["wait_ms_per_s"] for n, p in rates["procs"].items()}
                if rates
                else {},
            }
        )
        start = end
    return rows


def print_slow(by_arm: Mapping[str, Mapping[str, Any]], front_cpus: Sequence[str]) -> None:
    """Per arm, the window's host rates, then each slow request's: steal over all CPUs, idle
    of the front's CPUs (ms/s) and the three processes that waited longest to run."""
    print("\nthe host while the slowest quiet requests ran (steal and idle in ms per second; "
          "'waited': ms per second runnable but not running):")  # fmt: skip
    print(f"{'arm':24} {'request':>16} {'ttft':>7} {'door':>6} {'engine':>7} {'steal':>6} "
          f"{'idle':>6}  waited (the three longest)")  # fmt: skip
    for arm, host in by_arm.items():
        rows = [("window", None, host.get("window"))]
        rows += [(f"at {r['at_s']:.1f} s", r["ms"], r["host"]) for r in host.get("slowest", [])]
        for i, (label, ms, rates) in enumerate(rows):
            if rates is None:
                continue
            steal = sum(c["steal"] for c in rates["cpus"].values())
            idle = sum(rates["cpus"][c]["idle"] for c in front_cpus if c in rates["cpus"])
            waits = sorted(rates["procs"].items(), key=lambda kv: -kv[1]["wait_ms_per_s"])[:3]
            waited = ", ".join(f"{name[:22]} {p['wait_ms_per_s']:.0f}" for name, p in waits)
            cells = (
                f"{ms['ttft']:>7.1f} {ms.get('door', math.nan):>6.1f} "
                f"{ms.get('engine', math.nan):>7.1f}"
                if ms
                else f"{'':>7} {'':>6} {'':>7}"
            )
            print(f"{arm if i == 0 else '':24} {label:>16} {cells} {steal:>6.0f} {idle:>6.0f}  "
                  f"{waited}")  # fmt: skip


def plot_timeline(by_arm: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> None:
    """One panel per arm, second by second: the slowest quiet request sent (dots, left axis);
    steal, and the time the engine's and the other processes spent waiting to run (lines,
    ms per second, right axis)."""
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(len(by_arm), 1, figsize=(12, 2.6 * len(by_arm)), squeeze=False)
    for i, (ax, (arm, rows)) in enumerate(zip(axes[:, 0], by_arm.items(), strict=True)):
        xs = [r["at_s"] for r in rows]
        ax.plot(xs, [r["slowest_ms"] for r in rows], "o", markersize=3, color="black")
        ax.set_ylabel("slowest quiet\nTTFT (ms)")
        ax.set_title(arm, fontsize=9)
        rates = ax.twinx()
        engine = [sum(w for n, w in r["wait_ms_per_s"].items() if n.startswith("engine"))
                  for r in rows]  # fmt: skip
        front = [sum(w for n, w in r["wait_ms_per_s"].items() if not n.startswith("engine"))
                 for r in rows]  # fmt: skip
        rates.plot(xs, [r["steal_ms_per_s"] for r in rows], label="steal (all CPUs)")
        rates.plot(xs, front, label="front processes waiting to run")
        rates.plot(xs, engine, label="engine waiting to run")
        rates.set_ylabel("ms per second")
        if i == 0:
            rates.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds into the measured window")
    save_figure(fig, path)
