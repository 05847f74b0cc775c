"""`python -m gateway_lab.sim` / `extproc simulate [plan]` on small synthetic files."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from gateway_lab.sim.cli import add_arguments, main, run

POLICY = """version: 1
tiers: [gold, silver]
tenants:
  acme: {tier: gold}
  globex: {tier: silver, limits: {requests_per_minute: 600}}
pools:
  short: {max_total_tokens: 2048, max_inflight: 32, max_inflight_tokens: 400000, endpoints: ["a:1"]}
  long: {max_total_tokens: 16384, max_inflight: 4, max_inflight_tokens: 400000, endpoints: ["b:1"]}
"""


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    rng = random.Random(1)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    at = 0.0
    for _ in range(120):
        at += rng.expovariate(4.0)
        minutes, seconds = divmod(at, 60.0)
        prompt = rng.choice([200, 600, 1500, 5000])
        lines.append(
            f"2023-11-16 18:{int(minutes):02d}:{seconds:010.7f},{prompt},{rng.randint(5, 80)}"
        )
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join(lines) + "\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    return trace, policy


@pytest.mark.plots
def test_simulate_writes_report_and_plots(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, policy = files
    out = tmp_path / "out"
    argv = ["--trace", str(trace), "--policy", str(policy), "--out", str(out)]
    argv += ["--replicas", "short=2", "--capacity", "derived", "--save-requests"]
    assert run(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["requests"] == 120
    assert set(report["by_tenant"]) == {"acme", "globex"}
    assert set(report["by_pool"]) == {"short", "long"}
    assert report["engines"]["short"]["replicas"] == 2
    assert (
        report["config"]["pools"]["short"]["max_inflight"] == 2 * 210
    )  # 2 x 2048-token engines: 432k KV / 2048
    for name in ("latency_cdf.png", "utilisation.png", "requests.csv"):
        assert (out / name).stat().st_size > 0
    captured = capsys.readouterr()
    assert "by tenant" in captured.out
    assert "[simulate]" in captured.err  # the progress line


def test_plan_prints_savings_and_closed_form(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, _policy = files
    out = tmp_path / "plan"
    argv = ["plan", "--trace", str(trace), "--out", str(out), "--rate-scale", "4"]
    argv += ["--thresholds", "1024,2048", "--profile", "a100-llama3-8b", "--no-plots"]
    assert run(argv) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["homogeneous"]["max_model_len"] == 8192
    assert [s["threshold"] for s in plan["splits"]] == [1024, 2048]
    for split in plan["splits"]:
        assert 0 < split["alpha"] < 1
        assert split["predicted_saving"] == pytest.approx(split["alpha"] * (1 - 1 / split["rho"]))
    captured = capsys.readouterr()
    assert "a(1-1/rho)" in captured.out
    assert "[plan] homogeneous@8192" in captured.err


def test_wiring_through_a_parent_parser(files: tuple[Path, Path], tmp_path: Path) -> None:
    """How the lead wires it: `extproc simulate ...` and `extproc simulate plan ...`."""
    trace, policy = files
    parser = argparse.ArgumentParser(prog="extproc")
    commands = parser.add_subparsers(dest="command", required=True)
    simulate = commands.add_parser("simulate")
    add_arguments(simulate)
    simulate.set_defaults(func=main)
    args = parser.parse_args(
        ["simulate", "plan", "--trace", str(trace), "--thresholds", "2048", "--quiet",
         "--no-plots", "--out", str(tmp_path / "p"), "--duration", "10"]
    )  # fmt: skip
    assert args.sim_command == "plan"
    assert args.func(args) == 0
    args = parser.parse_args(
        ["simulate", "--trace", str(trace), "--policy", str(policy), "--quiet", "--no-plots",
         "--out", str(tmp_path / "s"), "--duration", "10"]
    )  # fmt: skip
    assert args.sim_command is None
    assert args.func(args) == 0


def test_usage_errors(files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    trace, policy = files
    assert run(["--policy", str(policy)]) == 2
    assert "--trace" in capsys.readouterr().err
    assert run(["--trace", str(trace), "--policy", str(policy), "--replicas", "nope=2"]) == 2
    assert run(["--trace", "/nonexistent.csv", "--policy", str(policy)]) == 1


def test_same_seed_same_report(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, policy = files
    reports = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        out = tmp_path / name
        argv = ["--trace", str(trace), "--policy", str(policy), "--out", str(out), "--quiet"]
        argv += ["--no-plots", "--tenants", "random", "--seed", str(seed), "--sample", "0.7"]
        assert run(argv) == 0
        report = json.loads((out / "report.json").read_text())
        report.pop("wall_s")
        report["config"].pop("seed")
        reports.append(report)
    assert reports[0] == reports[1]
    assert reports[0] != reports[2]
