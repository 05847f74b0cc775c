"""The JSON view behind the status page: rates, recent quantiles, rejections, limit history,
fair-share places and engine rows, from the scheduler snapshot and the metrics registry."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from extproc.policy import load_policy
from extproc.reload import PolicyReloader
from extproc.service.composition import compose
from extproc.service.engine_metrics import EngineReading
from extproc.service.gateway import Gateway
from extproc.status.engines import EngineReader
from extproc.status.readings import Percentiles, quantile, subtract_buckets
from extproc.status.view import FairPlaces, StatusView
from tests.conftest import policy_yaml


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def gateway(tmp_path: Path) -> Gateway:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    return compose(load_policy(path))


def make_view(clock: FakeClock, **settings: Any) -> StatusView:
    return StatusView(now=clock, wall=lambda: clock.t + 1.7e9, **settings)


def build(view: StatusView, gateway: Gateway, **extra: Any) -> dict[str, Any]:
    return view.build(gateway.policy, gateway.scheduler.snapshot(), gateway.metrics, **extra)


def tenant(status: dict[str, Any], name: str) -> dict[str, Any]:
    rows = [row for tier in status["tiers"] for row in tier["tenants"] if row["name"] == name]
    assert len(rows) == 1, status["tiers"]
    return rows[0]


# -- quantiles of Prometheus buckets ---------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket_it_falls_in() -> None:
    buckets = ((0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (math.inf, 20.0))
    assert quantile(0.5, buckets) == pytest.approx(0.2)
    assert quantile(0.25, buckets) == pytest.approx(0.15)
    assert quantile(0.75, buckets) == pytest.approx(0.3)


def test_quantile_in_the_open_bucket_reads_as_the_largest_bound_and_empty_is_none() -> None:
    assert quantile(0.99, ((1.0, 1.0), (math.inf, 10.0))) == 1.0
    assert quantile(0.5, ((1.0, 0.0), (math.inf, 0.0))) is None
    assert quantile(0.5, ()) is None
    assert Percentiles.of(()).as_json() == {"p50_ms": None, "p99_ms": None, "count": 0}


def test_subtracting_an_earlier_reading_leaves_the_observations_since() -> None:
    now = ((0.1, 5.0), (1.0, 9.0), (math.inf, 9.0))
    before = ((0.1, 5.0), (1.0, 5.0), (math.inf, 5.0))
    assert subtract_buckets(now, before) == ((0.1, 0.0), (1.0, 4.0), (math.inf, 4.0))
    assert subtract_buckets(now, None) == now


# -- tenants ---------------------------------------------------------------------------------------


def test_tenants_are_grouped_by_tier_in_policy_order(gateway: Gateway) -> None:
    status = build(make_view(FakeClock()), gateway)
    assert [tier["name"] for tier in status["tiers"]] == ["premium", "standard"]
    assert [t["name"] for t in status["tiers"][1]["tenants"]] == ["globex", "initech"]
    acme = tenant(status, "acme")
    assert (acme["queued"], acme["inflight"], acme["admitted"], acme["rejected"]) == (0, 0, 0, 0)
    assert acme["tokens_per_s"] is None  # no earlier reading to take a rate from
    assert status["windows"] == {"rates_s": None, "latency_s": None}


def test_outcomes_are_summed_over_pools_and_rejections_split_from_admissions(
    gateway: Gateway,
) -> None:
    requests = gateway.metrics.requests_of
    requests("globex", "standard", "short", "admitted").inc(4)
    requests("globex", "standard", "long", "admitted").inc(2)
    requests("globex", "standard", "short", "rejected_rate").inc(3)
    requests("globex", "standard", "none", "unauthorized").inc(1)
    requests("globex", "standard", "short", "cancelled").inc(5)
    row = tenant(build(make_view(FakeClock()), gateway), "globex")
    assert row["admitted"] == 6
    assert row["rejected"] == 4  # cancelled is the client's doing, not a rejection
    assert row["outcomes"] == {
        "admitted": 6, "rejected_rate": 3, "unauthorized": 1, "cancelled": 5,
    }  # fmt: skip


def test_token_rates_are_differences_over_the_rate_window(gateway: Gateway) -> None:
    clock = FakeClock()
    view = make_view(clock, rate_window_s=10.0, readings_every_s=1.0)
    tokens = gateway.metrics.tokens_of
    tokens("acme", "input").inc(1000)
    build(view, gateway)
    clock.t += 2.0
    tokens("acme", "input").inc(100)
    tokens("acme", "output").inc(500)
    status = build(view, gateway)
    assert tenant(status, "acme")["tokens_per_s"] == {"input": 50.0, "output": 250.0}
    assert tenant(status, "globex")["tokens_per_s"] == {"input": 0.0, "output": 0.0}
    assert status["windows"]["rates_s"] == 2.0
    # Past the window the old reading is no baseline any more; the one at +2 s is.
    clock.t += 9.0
    status = build(view, gateway)
    assert tenant(status, "acme")["tokens_per_s"] == {"input": 0.0, "output": 0.0}
    assert status["windows"]["rates_s"] == 9.0


def test_latency_percentiles_cover_the_latency_window_only(gateway: Gateway) -> None:
    clock = FakeClock()
    view = make_view(clock, latency_window_s=60.0, rate_window_s=10.0)
    ttft = gateway.metrics.ttft_of
    for _ in range(50):
        ttft("acme", "short").observe(0.03)
    first = tenant(build(view, gateway), "acme")["ttft"]
    assert first["count"] == 50  # since start, with no earlier reading
    assert 20.0 <= first["p50_ms"] <= 40.0
    clock.t += 30.0
    build(view, gateway)
    clock.t += 31.0
    for _ in range(10):
        ttft("acme", "long").observe(2.0)  # another pool: summed per tenant
    recent = tenant(build(view, gateway), "acme")["ttft"]
    # The reading at +30 s is the baseline: only the ten slow ones are in the window.
    assert recent["count"] == 10
    assert 1000.0 < recent["p50_ms"] <= 2500.0


def test_fair_share_place_follows_the_fairness_policy() -> None:
    states = {
        "a": {"tier": "standard", "fair_share": {"short": 5.0}},
        "b": {"tier": "standard", "fair_share": {"short": 1.0}},
        "c": {"tier": "standard", "fair_share": {"short": 3.0}},
        "p": {"tier": "premium", "fair_share": {"short": 100.0}},
    }
    # DRR: the largest deficit (credit) goes next.
    drr = FairPlaces(states, "drr")
    assert drr.of("a", "standard") == [{"pool": "short", "level": 5.0, "position": 1, "of": 3}]
    assert drr.of("c", "standard")[0]["position"] == 2
    assert drr.of("b", "standard")[0]["position"] == 3
    # VTC: the smallest counter (least served) goes next.
    vtc = FairPlaces(states, "vtc")
    assert vtc.of("b", "standard")[0]["position"] == 1
    assert vtc.of("a", "standard")[0]["position"] == 3
    assert vtc.of("p", "premium")[0] == {"pool": "short", "level": 100.0, "position": 1, "of": 1}


def test_tenants_level_with_each_other_share_a_place() -> None:
    states = {name: {"tier": "standard", "fair_share": {"short": 0.0}} for name in "abc"}
    for fairness in ("drr", "vtc"):
        places = FairPlaces(states, fairness)
        assert [places.of(name, "standard")[0]["position"] for name in "abc"] == [1, 1, 1]


# -- rejections ------------------------------------------------------------------------------------


def test_rejections_are_the_services_own_records_with_their_reason(gateway: Gateway) -> None:
    """The page shows the service's ring as it is (newest first), each with how the page names
    its reason; nothing is derived from the counters any more."""
    clock = FakeClock()
    view = make_view(clock)
    assert build(view, gateway)["rejections"] == []
    ring = [
        {
            "at": 1.7e9 + 2, "tenant": "acme", "tier": "premium", "pool": "short",
            "outcome": "rejected_rate", "status": 429, "retry_after_s": 7,
            "code": "rate_limit_exceeded", "message": "rate limit reached",
        },
        {
            "at": 1.7e9 + 1, "tenant": None, "tier": None, "pool": None,
            "outcome": "unauthorized", "status": 401, "retry_after_s": None,
            "code": "invalid_api_key", "message": "invalid API key",
        },
        {
            "at": 1.7e9, "tenant": "globex", "tier": "standard", "pool": "short",
            "outcome": "shed_overload", "status": 429, "retry_after_s": 2, "code": "shed_overload",
            "message": "the gateway is overloaded and tenant 'globex' is above its fair share",
        },
        {
            "at": 1.7e9 - 1, "tenant": "acme", "tier": "premium", "pool": "short",
            "outcome": "shed", "status": 503, "retry_after_s": 4, "code": "shed",
            "message": "the request's deadline passed while queued",
        },
    ]  # fmt: skip
    gateway.metrics.requests_of("globex", "standard", "short", "rejected_queue_full").inc(2)
    status = build(view, gateway, rejections=ring)
    assert status["rejections"] == [
        {**ring[0], "reason": "rate limit"},
        {**ring[1], "reason": "unknown API key"},
        {**ring[2], "reason": "shed: the gateway is overloaded and this tenant is above its share"},
        {**ring[3], "reason": "shed: cannot start before its deadline"},
    ]
    assert tenant(status, "globex")["rejected"] == 2  # the tenant rows still count them


def test_the_overload_state_is_shown_as_the_service_gives_it(gateway: Gateway) -> None:
    view = make_view(FakeClock())
    assert build(view, gateway)["overload"] is None
    shown = gateway.overload.describe()
    assert build(view, gateway, overload=shown)["overload"] == shown
    assert shown["shedding"] is False and shown["shed_tenants"] == []


def test_inter_token_percentiles_cover_the_latency_window_only(gateway: Gateway) -> None:
    clock = FakeClock()
    view = make_view(clock, latency_window_s=60.0, rate_window_s=10.0)
    inter_token = gateway.metrics.inter_token
    for _ in range(40):
        inter_token("acme", "short").observe(0.012)
    first = tenant(build(view, gateway), "acme")
    assert first["inter_token"]["count"] == 40
    assert 10.0 <= first["inter_token"]["p50_ms"] <= 15.0
    assert tenant(build(view, gateway), "globex")["inter_token"] == {
        "p50_ms": None, "p99_ms": None, "count": 0,
    }  # fmt: skip
    clock.t += 30.0
    build(view, gateway)
    clock.t += 31.0
    for _ in range(10):
        inter_token("acme", "long").observe(0.2)  # another pool: summed per tenant
    recent = tenant(build(view, gateway), "acme")["inter_token"]
    assert recent["count"] == 10
    assert 150.0 < recent["p50_ms"] <= 250.0


# -- pools -----------------------------------------------------------------------------------------


def test_limit_history_is_spaced_and_bounded(gateway: Gateway) -> None:
    clock = FakeClock()
    view = make_view(clock, history_points=4, history_every_s=1.0)
    for _ in range(3):
        build(view, gateway)
        clock.t += 0.4
    short = next(p for p in build(view, gateway)["pools"] if p["name"] == "short")
    assert len(short["history"]) == 2  # readings 0.4 s apart: one point a second
    for _ in range(10):
        clock.t += 1.0
        status = build(view, gateway)
    short = next(p for p in status["pools"] if p["name"] == "short")
    assert len(short["history"]) == 4
    wall, soft, hard, inflight, queued = short["history"][-1]
    assert (soft, hard, inflight, queued) == (64, 64, 0, 0)
    assert wall == pytest.approx(clock.t + 1.7e9)
    assert (short["soft_limit"], short["hard_limit"], short["adaptive"]) == (64, 64, False)


def test_engine_rows_show_each_endpoints_last_reading(gateway: Gateway) -> None:
    clock = FakeClock()
    reader = EngineReader(
        lambda: {name: list(pool.endpoints) for name, pool in gateway.policy.pools.items()},
        now=clock,
        watch_s=15.0,
        interval_s=1.0,
    )
    assert reader.due_in() > 0  # nobody watches: nothing to read
    assert reader.wanted() == {}
    reader.watched()
    assert reader.due_in() <= 0  # the first watch reads at once
    assert set(reader.wanted()) == {"127.0.0.1:8001", "127.0.0.1:8002"}
    assert reader.due_in() == pytest.approx(1.0)
    reader.deliver({"127.0.0.1:8001": EngineReading(2, 5, 0.42), "127.0.0.1:8002": None})
    clock.t += 0.5
    status = build(make_view(clock), gateway, engines=reader)
    pools = {p["name"]: p for p in status["pools"]}
    assert pools["short"]["engines"] == [
        {
            "endpoint": "127.0.0.1:8001", "age_s": 0.5, "answered": True,
            "running": 5, "waiting": 2, "kv_usage": 0.42,
        }
    ]  # fmt: skip
    assert pools["long"]["engines"] == [
        {"endpoint": "127.0.0.1:8002", "age_s": 0.5, "answered": False}
    ]
    clock.t += 16.0
    assert reader.wanted() == {}  # the page was closed: the engines are left alone


# -- policy ----------------------------------------------------------------------------------------


def test_policy_version_and_last_reload_result(gateway: Gateway, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    reloader = PolicyReloader(str(path), gateway.apply_policy, gateway.metrics, interval_s=0)
    reloader.mark_loaded(path.read_text())
    view = make_view(FakeClock())
    policy = build(view, gateway, reloader=reloader)["policy"]
    assert policy["fingerprint"] == reloader.fingerprint
    assert policy["last_reload"] is None
    assert (policy["fairness"], policy["tenants"]) == ("drr", 3)
    path.write_text("version: 1\ntiers: []\n")
    assert not reloader.reload("admin").ok
    last = build(view, gateway, reloader=reloader)["policy"]["last_reload"]
    assert (last["result"], last["trigger"]) == ("error", "admin")
    assert last["errors"]
    assert last["at"] is not None and last["at"] > 0
