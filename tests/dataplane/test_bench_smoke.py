"""Smoke runs of the tenant benchmarks (--quick): each drives the real Envoy, the service and
an emulated engine for a few seconds per arm and must leave well-formed outputs. The figures
themselves are not checked here (numbers are noisy on shared cores)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway_lab.bench import fairness, noisy, tiers

pytestmark = [pytest.mark.smoke, pytest.mark.dataplane, pytest.mark.plots]


def _run(module: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--quick", "--out", str(out), "--workdir", str(tmp_path / "w")])
    assert module.main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    return out, data, printed


def _png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _ttft_keys(stats: dict[str, Any]) -> None:
    assert {"count", "censored", "p50_ms", "p99_ms", "max_ms"} <= set(stats)


def test_noisy_neighbour_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data, printed = _run(noisy, tmp_path, capsys)
    _png(out / "noisy-neighbour.png")
    assert data["scenario"] == "noisy-neighbour"
    arms = data["arms"]
    assert {"alone-direct", "alone-service", "fifo", "token-bucket", "full"} <= set(arms)
    assert any(name.startswith("soft-") for name in arms)
    for result in arms.values():
        _ttft_keys(result["quiet"])
        assert {"flooder_tok_s", "quiet_tok_s", "total_tok_s", "timeseries"} <= set(result)
        assert len(result["total_tok_s_halves"]) == 2
        assert result["records"]["rows"], "no request was recorded"
    assert arms["token-bucket"]["flooder_rpm"] >= 1
    summary = data["summary"]
    assert set(summary["rows"]) == set(arms)
    for row in summary["rows"].values():
        assert {"p50_ratio", "p99_ratio", "throughput_vs_fifo"} <= set(row)
    assert isinstance(summary["target"]["full_policy_met"], bool)
    assert "quiet p99" in printed and "target:" in printed
    # issue 15's arms: engine priority off, pacing, the δ controller at two objectives
    assert {"full-nopri", "paced", "delta-100ms", "delta-300ms"} <= set(arms)
    assert arms["full-nopri"]["engine_priority"] is False and arms["full"]["engine_priority"]
    assert arms["delta-100ms"]["latency_delta"] == "100ms"
    assert arms["tail-100ms"]["latency_delta"] == "{every_token: 100ms, quantile: 0.99}"
    assert set(summary["isolation_target"]) >= {"full", "paced", "delta-100ms", "tail-100ms"}
    assert all("tpot_p99_ratio" in row for row in summary["rows"].values())
    # every inter-token gap of the quiet tenant's responses, beside the per-response TPOT
    assert all("gap_p99_ratio" in row for row in summary["rows"].values())
    for name in ("alone-service", "full"):
        gaps = arms[name]["quiet_gaps"]
        assert gaps["count"] > gaps["responses"] > 0, name
        assert gaps["p99_ms"] >= gaps["p50_ms"] > 0, name
    assert "gap99 x" in printed and "P99 inter-token gap" in printed


def test_token_fairness_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data, printed = _run(fairness, tmp_path, capsys)
    _png(out / "token-fairness.png")
    assert data["scenario"] == "token-fairness"
    assert set(data["arms"]) == {"requests", "drr", "vtc"}
    for result in data["arms"].values():
        for side in ("delivered", "dispatched"):
            figures = result[side]
            assert {"service_per_s", "jain", "max_gap", "gap_over_bound", "curves"} <= set(figures)
            assert set(figures["curves"]) == {"long", "short"}
        assert result["vtc_bound"] == 2 * result["largest_request_cost"]
    assert "VTC bound" in printed


def test_tiers_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data, printed = _run(tiers, tmp_path, capsys)
    _png(out / "tiers.png")
    assert data["scenario"] == "tiers"
    assert set(data["arms"]) == {"premium-solo", "fifo", "tiers"}
    together = data["arms"]["tiers"]["tenants"]
    assert {"acme", "globex", "initech", "hooli"} <= set(together)
    for tenant in together.values():
        _ttft_keys(tenant["ttft"])
        assert "queue_wait_max_ms" in tenant and "service_per_s" in tenant
    for row in data["summary"].values():
        assert {"premium_p99_ratio", "standard_jain_per_weight", "longest_wait_ms"} <= set(row)
    assert "premium p50" in printed


def test_overhead_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway_lab.bench import overhead

    out, data, printed = _run(overhead, tmp_path, capsys)
    _png(out / "overhead.png")
    arms = {run["arm"] for run in data["runs"]}
    assert arms == {"straight", "noop", "extproc", "extproc-child", "extproc-lua"}
    for run in data["runs"]:
        assert run["ok"] > 0, f"{run['arm']} served no request"
        assert {"rps", "ttfb_p50_ms", "ttfb_p99_ms", "extproc_cpu_us_per_request"} <= set(run)
    [figures] = data["summary"].values()
    assert {"cpu_per_request_us", "cpu_per_chunk_us", "rps_20_tokens"} <= set(figures)
    # Both layouts against the floor; the child's CPU counts both of its processes.
    assert {"ours_ratio", "ours_child_ratio", "ours_lua_ratio"} <= set(
        figures["cpu_per_request_us"]
    )
    # Counting in Envoy moves work into Envoy: it is compared with Envoy's CPU counted too.
    with_envoy = figures["cpu_per_request_with_envoy_us"]
    assert with_envoy["ours_lua"] > figures["cpu_per_request_us"]["ours_lua"] > 0
    child = next(r for r in data["runs"] if r["arm"] == "extproc-child")
    assert child["extproc_cpu_us_per_request"] > 0
    assert "in process: CPU/request" in printed and "with the child: CPU/request" in printed
    assert {row["arm"] for row in data["gateway_bound"]} == {
        "straight",
        "noop",
        "extproc",
        "extproc-child",
        "extproc-lua",
    }
    assert all(row["ok"] > 0 for row in data["gateway_bound"])
    assert "gateway-bound throughput" in printed
    in_process = data["in_process_us"]
    assert all(micros > 0 for micros in in_process.values())
    assert in_process["total"] == pytest.approx(
        sum(v for k, v in in_process.items() if k != "total")
    )
