"""Percentiles and summaries."""

from __future__ import annotations

import pytest
from sim_support import req, run

from gateway_lab.sim.slo import Slo
from gateway_lab.sim.stats import distribution, percentile, report


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0.5) == 2.5
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 1.0) == 4.0
    assert percentile(values, 0.9) == pytest.approx(3.7)
    assert percentile([5.0], 0.99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_distribution_in_milliseconds() -> None:
    assert distribution([0.001, 0.002, 0.003]) == {
        "count": 3,
        "mean": 2.0,
        "p50": 2.0,
        "p90": 2.8,
        "p99": 2.98,
        "max": 3.0,
    }
    assert distribution([])["p99"] is None


def test_report_groups_and_slo_attainment() -> None:
    result = run([req(0.0, 100, 3), req(0.0, 100, 300)], slo=Slo(ttft_s=1.0, e2e_s=0.5))
    data = report(result)
    overall = data["overall"]
    assert overall["requests"] == 2 and overall["completed"] == 2
    assert overall["slo_attainment"] == {"ttft": 1.0, "tpot": 1.0, "e2e": 0.5, "all": 0.5}
    assert set(data["by_tenant"]) == {"a"}
    assert set(data["by_pool"]) == {"p"}
    assert data["engines"]["p"]["replicas"] == 1
    assert 0 < data["engines"]["p"]["utilisation"] <= 1.0
