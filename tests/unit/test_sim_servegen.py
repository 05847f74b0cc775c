"""ServeGen scenarios from a small synthetic per-client summary."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import pytest
from sim_support import make_policy

from gateway_lab.sim.servegen import generate, load_clients, pick_clients, scenario_policy

SUMMARY_HEADER = (
    "model,client_id,has_dataset,expected_requests_total,active_10min_windows,"
    "total_10min_windows,mean_rate_rps_when_active,peak_rate_rps,mean_cv_when_active,"
    "arrival_pattern_counts,in_mean_weighted,out_mean_weighted\n"
)
SUMMARY = (
    SUMMARY_HEADER
    + """m-large,0,True,1000.0,10,20,2.0,5.0,1.0,"{""Gamma"": 10}",500.0,100.0
m-large,1,True,5000.0,10,20,4.0,9.0,3.0,"{""Gamma"": 10}",2000.0,50.0
m-large,2,False,9000.0,10,20,9.0,9.0,1.0,"{""Gamma"": 10}",,
m-large,3,True,100.0,10,20,0.5,1.0,0.8,"{""Gamma"": 10}",300.0,30.0
m-small,9,True,99999.0,10,20,1.0,1.0,1.0,"{""Gamma"": 10}",100.0,10.0
"""
)
WINDOWS_HEADER = (
    "model,client_id,window_start_s,window_len_s,expected_requests,mean_rate_rps,in_mean,"
    "in_p50,in_p90,in_p99,in_max,out_mean,out_p50,out_p90,out_p99,out_max,"
    "frac_total_le_4096_comonotonic,frac_total_le_8192_comonotonic,reason_ratio_mean,"
    "img_tokens_mean,img_count_mean\n"
)
WINDOWS = (
    WINDOWS_HEADER
    + """m-large,0,0,21600,100,0.1,500,400,800,1000,2000,100,80,160,300,400,1,1,,,
m-large,0,21600,21600,300,0.1,500,400,1600,1000,2000,100,80,160,300,400,1,1,,,
"""
)


@pytest.fixture
def summary(tmp_path: Path) -> Path:
    (tmp_path / "servegen_client_summary.csv").write_text(SUMMARY)
    (tmp_path / "servegen_client_window_summary.csv").write_text(WINDOWS)
    return tmp_path / "servegen_client_summary.csv"


def test_load_keeps_clients_with_token_statistics_busiest_first(summary: Path) -> None:
    clients = load_clients(summary)
    assert [c.client_id for c in clients] == ["1", "0", "3"]
    zero = clients[1]
    # sigma from ln(p90/p50)/z90, request-weighted over the windows: (100*ln2 + 300*ln4)/400
    expected = (100 * math.log(2) + 300 * math.log(4)) / 400 / 1.2815515655446004
    assert zero.input_sigma == pytest.approx(expected)
    assert zero.output_sigma == pytest.approx(math.log(2) / 1.2815515655446004)
    assert clients[0].input_sigma == 1.0  # no windows: the default
    assert [c.client_id for c in pick_clients(clients, 2)] == ["1", "0"]
    assert [c.client_id for c in pick_clients(clients, 2, "spread")] == ["1", "3"]
    with pytest.raises(ValueError):
        pick_clients(clients, 4)
    assert len(load_clients(summary, None)) == 4


def test_generate_matches_rates_and_token_means(summary: Path) -> None:
    clients = pick_clients(load_clients(summary), 2)
    requests = generate(clients, 2000.0, seed=5)
    assert requests == generate(clients, 2000.0, seed=5)
    assert requests != generate(clients, 2000.0, seed=6)
    assert [r.at for r in requests] == sorted(r.at for r in requests)
    by_tenant = {c.tenant: [r for r in requests if r.tenant == c.tenant] for c in clients}
    steady = by_tenant["sg-m-large-0"]  # cv 1: Poisson, 2 rps, input mean 500
    assert len(steady) / 2000.0 == pytest.approx(2.0, rel=0.1)
    assert statistics.fmean(r.input_tokens for r in steady) == pytest.approx(500, rel=0.15)
    bursty = by_tenant["sg-m-large-1"]  # cv 3: 4 rps on average, bursty gaps
    gaps = [b.at - a.at for a, b in itertools.pairwise(bursty)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) > 2.0
    half = generate(clients, 2000.0, seed=5, rate_scale=0.5)
    assert len(half) < 0.7 * len(requests)
    assert all(r.total_tokens <= 131_072 for r in requests)


def test_scenario_policy_assigns_tiers_round_robin(summary: Path) -> None:
    clients = load_clients(summary)
    base = make_policy({"x": {"tier": "premium"}}, tiers=("premium", "standard"))
    policy = scenario_policy(base, clients)
    tiers = {name: spec.tier for name, spec in policy.tenants.items()}
    assert tiers == {
        "sg-m-large-1": "premium",
        "sg-m-large-0": "standard",
        "sg-m-large-3": "premium",
    }
    assert policy.pools == base.pools
