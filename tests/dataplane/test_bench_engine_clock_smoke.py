"""Smoke run of `extproc bench engine-clock` (--quick, one round): two real emulated engine
processes (one per step clock), the load generator over real HTTP, the simulator's arm; the
outputs must be well formed (the figures are not checked: they are noisy on shared cores)."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from gateway_lab.bench import engine_clock

pytestmark = [pytest.mark.smoke, pytest.mark.dataplane, pytest.mark.plots]


def test_engine_clock_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    engine_clock.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--quick", "--rounds", "1", "--out", str(out)])
    cores = os.sched_getaffinity(0)
    assert engine_clock.main(args) == 0
    assert os.sched_getaffinity(0) == cores  # pinned apart while it ran, not after
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert list(data["arms"]) == ["sim", "wake", "model"]
    for name, arm in data["arms"].items():
        assert arm["alone"]["quiet"]["p50_ms"] > 0
        assert arm["room"]["flooder_tok_s"] > 0  # the flooder was served in every arm
        assert all(math.isfinite(value) for value in arm["ratios"].values()), name
    for clock in ("wake", "model"):
        assert len(data["arms"][clock]["rounds"]) == 1
        assert data["arms"][clock]["rounds"][0]["clock"] == clock
    assert "| model |" in printed and "| wake |" in printed
    assert (out / "engine-clock.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_must_be_positive(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    engine_clock.add_arguments(parser)
    with pytest.raises(SystemExit):
        engine_clock.main(parser.parse_args(["--rounds", "0", "--out", str(tmp_path)]))
