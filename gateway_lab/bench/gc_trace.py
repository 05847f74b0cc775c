"""Which garbage collections stopped a benchmark run's Python processes, and for how long.

`enable(path)` traces this process and every Python process it starts afterwards (the engine,
`extproc serve`, its accounting child, a flood client): a `gc.callbacks` hook, loaded in the
children through the `sitecustomize` of `gc_trace_site/` on PYTHONPATH, appends one JSON line
per collection that took at least `MIN_PAUSE_MS` (every full one) to `path`. `pauses(path,
start, end)` sums them per process over a window of wall-clock time. With it a run can tell
its own client's or engine's pauses from the gateway's.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import orjson

__all__ = [
    "ENV", "MIN_PAUSE_MS", "enable", "pauses", "print_pauses", "trace_from_environment",
    "traced_to",
]  # fmt: skip

ENV = "GATEWAY_LAB_GC_TRACE"
MIN_PAUSE_MS = 1.0
LABEL_CHARS = 40
SITE = Path(__file__).with_name("gc_trace_site")


def enable(path: Path) -> None:
    """Trace this process, and (through the environment) the Python processes it starts, to
    `path` (emptied first: a run's trace is its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    os.environ[ENV] = str(path)
    inherited = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), inherited]))
    trace_from_environment()


def traced_to() -> Path | None:
    """The trace file of this run, if `enable` was called (here or in a parent)."""
    path = os.environ.get(ENV)
    return Path(path) if path else None


def trace_from_environment() -> None:
    path = os.environ.get(ENV)
    if path and not any(isinstance(c, _Tracer) for c in gc.callbacks):
        gc.callbacks.append(_Tracer(open(path, "a", buffering=1)))  # noqa: SIM115 (process-long)


class _Tracer:
    """One process's `gc.callbacks` hook."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.began = 0.0
        self.began_cpu = 0.0
        self.label: str | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
            self.began_cpu = time.thread_time()
            return
        wall_ms = (time.perf_counter() - self.began) * 1000.0
        generation = info["generation"]
        if wall_ms < MIN_PAUSE_MS and generation < 2:
            return
        if self.label is None:  # sys.argv is complete only once the main module runs
            self.label = _label(sys.argv)
        line = {
            "pid": os.getpid(), "process": self.label, "at": time.time() - wall_ms / 1000.0,
            "generation": generation, "wall_ms": round(wall_ms, 3),
            "cpu_ms": round((time.thread_time() - self.began_cpu) * 1000.0, 3),
            "collected": info["collected"],
        }  # fmt: skip
        self.out.write(orjson.dumps(line).decode() + "\n")


def _label(argv: list[str]) -> str:
    """What the process is: its script or module and first arguments, e.g. `extproc
    --log-level WARNING serve` or `extproc engine --host 127.0.0.1`."""
    name = Path(argv[0]).name if argv else "python"
    if name == "__main__.py" and argv:
        name = Path(argv[0]).parent.name
    return " ".join([name, *argv[1:4]])[:LABEL_CHARS]


def pauses(path: Path, start: float, end: float) -> list[dict[str, Any]]:
    """Per process, the collections that began in [start, end) (wall-clock seconds): how
    many, full ones among them, the longest and the total, wall and CPU milliseconds."""
    rows: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return []
    for raw in path.read_bytes().splitlines():
        event = orjson.loads(raw)
        if not start <= event["at"] < end:
            continue
        row = rows.setdefault(event["pid"], {
            "pid": event["pid"], "process": event["process"], "pauses": 0, "full": 0,
            "longest_ms": 0.0, "longest_cpu_ms": 0.0, "total_ms": 0.0,
        })  # fmt: skip
        row["pauses"] += 1
        row["full"] += event["generation"] == 2
        if event["wall_ms"] > row["longest_ms"]:
            row["longest_ms"], row["longest_cpu_ms"] = event["wall_ms"], event["cpu_ms"]
        row["total_ms"] = round(row["total_ms"] + event["wall_ms"], 3)
    return sorted(rows.values(), key=lambda row: -row["longest_ms"])


def print_pauses(by_arm: dict[str, list[dict[str, Any]]]) -> None:
    """The measured windows' collections, per arm and process (the longest first)."""
    print("\ngarbage collections >= 1 ms in the measured window (wall ms; CPU of the longest):")
    print(f"{'arm':<28} {'process':<40} {'pauses':>6} {'full':>5} {'longest':>8} "
          f"{'its cpu':>8} {'total':>8}")  # fmt: skip
    for arm, rows in by_arm.items():
        for row in rows or [{"process": "-", "pauses": 0, "full": 0, "longest_ms": 0.0,
                             "longest_cpu_ms": 0.0, "total_ms": 0.0}]:  # fmt: skip
            print(f"{arm:<28} {row['process']:<40} {row['pauses']:>6} {row['full']:>5} "
                  f"{row['longest_ms']:>8.1f} {row['longest_cpu_ms']:>8.1f} "
                  f"{row['total_ms']:>8.1f}")  # fmt: skip
