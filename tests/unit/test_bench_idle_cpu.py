"""`extproc bench idle-cpu`: a one-second run writes every arm's CPU readings (the figures are
the benchmark's, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_writes_every_arm(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "bench", "idle-cpu", "--seconds", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["cpu_ms_per_s"]) == {"monitor-on", "monitor-off", "child"}
    for reading in results["raw"].values():
        assert reading["cpu_s_end"] >= reading["cpu_s_start"] > 0
        assert reading["window_s"] >= 1.0
    assert "monitor-on" in result.stdout and "over monitor-off" in result.stdout
