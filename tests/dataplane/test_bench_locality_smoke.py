"""Smoke run of the locality benchmark (--quick): two emulated replicas with prefix caching,
the real Envoy and the service, three arms; the outputs must be well formed (the figures are
not checked: they are noisy on shared cores)."""

from __future__ import annotations

import argparse
import json

import pytest

from gateway_lab.bench import locality

pytestmark = [pytest.mark.smoke, pytest.mark.dataplane, pytest.mark.plots]


def test_locality_quick(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    locality.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--quick", "--out", str(out), "--workdir", str(tmp_path / "w")])
    assert locality.main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert set(data["arms"]) == {"vtc", "drr", "dlpm"}
    for arm in data["arms"].values():
        assert arm["engine_prefix_query_tokens"] > 0  # the engines' own counters moved
        assert arm["bound"] == 2 * data["workload"]["quantum"] + 2 * arm["largest_request_cost"]
        assert {"max_gap", "max_gap_any_interval", "both_backlogged_s"} <= set(arm)
        assert set(arm["service_per_s"]) == {"chat", "docs"}
    dlpm = data["arms"]["dlpm"]["gateway_locality"]["pools"]["main"]
    assert sum(row["routed"] for row in dlpm) > 0 and len(dlpm) == 2
    assert data["arms"]["vtc"]["gateway_locality"] is None  # no index without dlpm
    assert "x vtc" in printed
    png = out / "locality.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
