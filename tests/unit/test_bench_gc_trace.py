"""`--gc-trace` (gateway_lab.bench.gc_trace): the garbage collections of a run's Python
processes, children included, summed per process over a measured window."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from gateway_lab.bench.gc_trace import pauses

PARENT = """
import subprocess, sys
from pathlib import Path
from gateway_lab.bench import gc_trace
gc_trace.enable(Path(sys.argv[1]))
import gc
gc.collect()
child = "import gc; kept = [[i] for i in range(200_000)]; gc.collect()"
subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
"""


def test_a_traced_run_logs_its_own_and_its_childrens_full_collections(tmp_path: Path) -> None:
    trace = tmp_path / "gc-trace.jsonl"
    trace.write_bytes(_event(1, 1.0, 2, 5.0) + b"\n")  # an earlier run's, into the same file
    subprocess.run([sys.executable, "-c", PARENT, str(trace)], check=True, timeout=60)
    rows = pauses(trace, 0.0, float("inf"))
    assert 1 not in {row["pid"] for row in rows}  # the run's trace is its own
    assert len({row["pid"] for row in rows}) == 2  # the parent and the child it started
    assert all(row["full"] >= 1 for row in rows)
    assert max(row["longest_ms"] for row in rows) > 0.0


def test_an_untraced_run_logs_nothing(tmp_path: Path) -> None:
    child = "import gc; gc.collect()"
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _event(pid: int, at: float, generation: int, wall_ms: float) -> bytes:
    return orjson.dumps({"pid": pid, "process": f"p{pid}", "at": at, "generation": generation,
                         "wall_ms": wall_ms, "cpu_ms": wall_ms / 2, "collected": 0})  # fmt: skip


def test_pauses_are_summed_per_process_inside_the_window_only(tmp_path: Path) -> None:
    trace = tmp_path / "gc-trace.jsonl"
    trace.write_bytes(b"\n".join([
        _event(1, 9.0, 2, 90.0),  # before the window
        _event(1, 10.0, 1, 3.0),
        _event(1, 12.0, 2, 40.0),
        _event(2, 15.0, 0, 1.5),
        _event(2, 20.0, 2, 80.0),  # the window is [10, 20)
    ]) + b"\n")  # fmt: skip
    rows = pauses(trace, 10.0, 20.0)
    assert rows == [
        {"pid": 1, "process": "p1", "pauses": 2, "full": 1, "longest_ms": 40.0,
         "longest_cpu_ms": 20.0, "total_ms": 43.0},
        {"pid": 2, "process": "p2", "pauses": 1, "full": 0, "longest_ms": 1.5,
         "longest_cpu_ms": 0.75, "total_ms": 1.5},
    ]  # fmt: skip
    assert pauses(tmp_path / "absent.jsonl", 0.0, 1.0) == []
