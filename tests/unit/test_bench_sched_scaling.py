"""Smoke run of `extproc bench scheduler-scaling --quick`: the pure scheduler at two queue
depths, over few and many tenants, in a worker process; the table, JSON and plot must be
well formed (the figures themselves are not checked: shared cores)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gateway_lab.bench import sched_scaling

pytestmark = [pytest.mark.smoke, pytest.mark.plots]


def test_scheduler_scaling_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    sched_scaling.add_arguments(parser)
    out = tmp_path / "out"
    assert sched_scaling.main(parser.parse_args(["--quick", "--out", str(out)])) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["scenario"] == "scheduler-scaling"
    rows = data["summary"]["rows"]
    assert {(r["tenants_mode"], r["depth"]) for r in rows} == {
        (mode, depth) for mode in sched_scaling.TENANT_MODES for depth in (10, 100)
    }
    for row in rows:
        assert row["arm"] == "after"
        assert row["cpu_us"] > 0
        assert row["cpu_us"] >= row["submit_us"] + row["dispatch_us"] - 1e-6
        assert row["vs_shallowest"] > 0
    png = out / "scheduler-scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert "vs d10" in printed and "results:" in printed
