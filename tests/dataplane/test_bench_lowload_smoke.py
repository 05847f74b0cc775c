"""Smoke run of `extproc bench low-load` (--quick): the real Envoy, the floor, the mimic, the
service (in process and with its accounting child) and a `before` service from a source tree
(this one) in front of a pinned emulated engine for a few seconds each (the floor and the
mimic also on grpclib, the floor also on the synchronous grpc server) must leave well-formed
outputs. Figures are not checked (shared cores)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from extproc.envoy_routes import ACCOUNTING_FILTER
from gateway_lab.bench import lowload

pytestmark = [pytest.mark.smoke, pytest.mark.dataplane, pytest.mark.plots]
SOURCE = Path(__file__).resolve().parents[2]


def test_low_load_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    lowload.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(
        ["--quick", "--out", str(out), "--workdir", str(tmp_path / "w"),
         "--before-src", str(SOURCE)]
    )  # fmt: skip
    cores = os.sched_getaffinity(0)
    assert lowload.main(args) == 0
    assert os.sched_getaffinity(0) == cores  # the engine was pinned apart, the caller is not
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert list(data["arms"]) == [
        "straight", "noop", "noop-one-trip", "noop-grpclib", "noop-sync", "noop-no-acct",
        "mimic", "mimic-grpclib", "one-trip", "service", "service-one-trip", "service-child",
        "static", "before",
    ]  # fmt: skip
    for arm, result in data["arms"].items():
        assert result["requests"] >= 1, f"{arm} answered nothing"
        assert result["failed"] == 0, arm
        assert result["phases"]["requests"] >= 1, f"Envoy logged no {arm} request"
    assert data["arms"]["straight"]["front_cores"] == 0.0
    filters = {
        arm: json.dumps(json.loads((tmp_path / "w" / f"{arm}-0" / "envoy.json").read_text()))
        for arm in ("noop", "noop-no-acct", "one-trip", "noop-one-trip", "service-one-trip")
    }
    assert ACCOUNTING_FILTER in filters["noop"]
    assert ACCOUNTING_FILTER not in filters["noop-no-acct"]
    one_trip = "sendBodyWithoutWaitingForHeaderResponse"
    assert one_trip not in filters["noop"]
    assert all(
        one_trip in filters[arm] for arm in ("one-trip", "noop-one-trip", "service-one-trip")
    )
    assert data["arms"]["service"]["front_cores"] > 0.0
    child = json.loads((tmp_path / "w" / "service-child-0" / "envoy.json").read_text())
    clusters = {c["name"] for c in child["staticResources"]["clusters"]}
    assert "extproc_accounting" in clusters  # the accounting filter has the child's cluster
    assert data["arms"]["before"]["front_cores"] > 0.0
    steps = data["arms"]["mimic"]["phases"]["steps_ms"]
    assert "  of which: Envoy waits for the request-body reply" in steps
    assert data["added"]["straight"]["added_p50_ms"] == 0.0
    assert (out / "low-load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per-phase medians" in printed and "service: added p50" in printed


def test_before_arm_needs_a_source_tree(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    lowload.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--arms", "straight,before"])
    with pytest.raises(SystemExit, match="before"):
        lowload.main(args)
