"""`extproc bench kvwarden-published`: kvwarden's per-request CSVs re-read, the tail over the
whole run against the tail after a warm-up cut."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gateway_lab.bench import kvwarden_published
from gateway_lab.bench.kvwarden_published import describe, percentile, read_tenant_csv

HEADER = "tenant,request_id,submit_time,ttft_ms,total_latency_ms,tokens_out,error\n"


def _write(path: Path, rows: list[tuple[float, float, str]]) -> None:
    lines = [
        f"quiet,{i},{1000.0 + at},{0.0 if error else ttft},900,64,{error}\n"
        for i, (at, ttft, error) in enumerate(rows)
    ]
    path.write_text(HEADER + "".join(reversed(lines)))  # kvwarden writes them out of order


def _cold_start_then_steady() -> list[tuple[float, float, str]]:
    cold = [(0.5 * i, 2000.0 - 300.0 * i, "") for i in range(5)]  # 2,000..800 ms, first 2 s
    steady = [(10.0 + i, 50.0 + (i % 10), "") for i in range(300)]  # 50..59 ms
    return [*cold, *steady, (20.5, 0.0, "timeout")]


def test_a_cold_start_is_the_whole_runs_tail_and_gone_after_the_cut(tmp_path: Path) -> None:
    path = tmp_path / "tenant_quiet.csv"
    _write(path, _cold_start_then_steady())
    sent, errors = read_tenant_csv(path)
    assert errors == 1 and len(sent) == 305
    assert [s.offset_s for s in sent] == sorted(s.offset_s for s in sent)
    assert sent[0].offset_s == 0.0 and sent[0].ttft_ms == 2000.0
    row = describe(sent, skip_s=10.0, slow_ms=200.0)
    assert row["whole_run"]["p99_ms"] > 700.0  # five of 305 slow: inside the top 1%
    assert row["after_skip"]["count"] == 300
    assert row["after_skip"]["p99_ms"] <= 59.0 and row["after_skip"]["max_ms"] == 59.0
    assert row["slow_count"] == 5 and row["slow_last_sent_s"] == 2.0


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([10.0], 0.99) == 10.0
    assert percentile([0.0, 100.0], 0.99) == pytest.approx(99.0)


@pytest.mark.plots
def test_the_command_prints_saves_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arm = tmp_path / "arm1_flooder"
    arm.mkdir()
    _write(arm / "tenant_quiet.csv", _cold_start_then_steady())
    (arm / "tenant_flooder.csv").write_text(HEADER)  # did not run: left out
    parser = argparse.ArgumentParser()
    kvwarden_published.add_arguments(parser)
    out = tmp_path / "out"
    assert kvwarden_published.main(parser.parse_args([str(arm), "--out", str(out)])) == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["directories"]["arm1_flooder"]) == {"quiet"}
    assert data["directories"]["arm1_flooder"]["quiet"]["errors"] == 1
    assert (out / "kvwarden-published.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "5, last sent at 2.0 s; 1 errors left out" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no tenant_"):
        kvwarden_published.main(parser.parse_args([str(tmp_path / "out")]))
