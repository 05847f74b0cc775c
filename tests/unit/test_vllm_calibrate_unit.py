"""gateway_lab.bench.calibrate without vLLM: parsing, comparison, report, a tiny emulated run."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from gateway_lab.bench import calibrate, calibrate_report
from gateway_lab.bench.calibrate import EngineResult, InterferenceResult, LevelResult, Timing


def _level(c: int, ttft: float, itl: float, engine_ttft: float) -> LevelResult:
    return LevelResult(c, 10, 1.0, ttft, ttft * 2, itl, 100.0, engine_ttft)


def _result(engine: str, scale: float) -> EngineResult:
    return EngineResult(
        engine=engine,
        description=engine,
        levels=[_level(1, 12 * scale, 4 * scale, 10 * scale), _level(8, 50 * scale, 11, 40)],
        interference=[
            InterferenceResult(0, 0, 12 * scale, 20),
            InterferenceResult(1, 1800, 40, 50),
        ],
    )


def test_overrides_parse_numbers_and_reject_junk() -> None:
    assert calibrate._overrides(["max_num_seqs=32", "step_base_s=0.003", "x=1e-5"]) == {
        "max_num_seqs": 32,
        "step_base_s": 0.003,
        "x": 1e-5,
    }
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        calibrate._overrides(["step_base_s"])


def test_burst_delivered_streams_are_recognised() -> None:
    assert Timing(0.3, 0.0, 0.3, 64).burst
    assert not Timing(0.012, 0.004, 0.26, 64).burst
    assert not Timing(0.01, None, 0.01, 1).burst


def test_compare_checks_engine_ttft_when_alone_and_client_ttft_under_load() -> None:
    rows = {r.metric: r for r in calibrate.compare(_result("real", 1.0), _result("emulated", 1.2))}
    assert not rows["TTFT p50 @1 (ms)"].checked and rows["engine TTFT mean @1 (ms)"].checked
    assert rows["TTFT p50 @8 (ms)"].checked and not rows["engine TTFT mean @8 (ms)"].checked
    assert rows["ITL p50 @1 (ms)"].ratio == pytest.approx(1.2)
    table = calibrate.render_table(list(rows.values()), tolerance=0.3)
    assert "| ok" in table and "OUT" not in table
    tight = calibrate.render_table(list(rows.values()), tolerance=0.1)
    assert "OUT" in tight


def test_saved_results_load_back_with_nan_as_null(tmp_path: Path) -> None:
    result = _result("real", 1.0)
    result.levels[0].engine_ttft_mean_ms = math.nan
    text = json.dumps(calibrate_report.no_nan({"real": asdict(result)}))
    assert "NaN" not in text
    loaded = calibrate_report.load_engine(json.loads(text)["real"])
    assert math.isnan(loaded.levels[0].engine_ttft_mean_ms)
    assert loaded.interference == result.interference


def test_emulated_only_run_writes_json(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args(
        ["--engines", "emulated", "--levels", "1,4", "--rounds", "1", "--repeats", "1",
         "--out", str(tmp_path), "--set", "step_base_s=0.001", "--set", "step_per_decode_s=0",
         "--set", "step_per_prefill_token_s=0", "--set", "frontend_s=0"]
    )  # fmt: skip
    assert calibrate.main(args) == 0
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert report["real"] is None
    assert report["profile"]["step_base_s"] == 0.001
    levels = report["emulated"]["levels"]
    assert [x["concurrency"] for x in levels] == [1, 4]
    assert all(x["burst_delivered"] == 0 and x["ttft_p50_ms"] > 0 for x in levels)


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    for argv in (["--engines", "gpu"], ["--set", "no_such_field=1"]):
        assert calibrate.main(parser.parse_args([*argv, "--out", str(tmp_path)])) == 2
