"""`extproc bench frontier` (gateway_lab/bench/frontier.py): the noisy-neighbour trade-off
traced in the simulator."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from extproc.policy import policy_from_text
from gateway_lab.bench.frontier import (
    DELTA_PREFILL_BUDGET,
    KVWARDEN,
    KVWARDEN_BUCKET,
    OVER,
    Point,
    Workload,
    arrival_groups,
    engine_profile,
    kvwarden_points,
    measure,
    over_points,
    points,
    policy_text,
    ratios,
    run,
    tokens_within,
)
from gateway_lab.sim.records import RequestRecord


def _record(first: float | None, last: float | None, generated: int) -> RequestRecord:
    record = RequestRecord(0, "r0", "t", 0.0, 10, generated, generated)
    record.first_token_at, record.finished_at, record.generated = first, last, generated
    return record


def test_tokens_are_spread_over_each_responses_own_span() -> None:
    records = [
        _record(0.0, 10.0, 100),  # half of it in [5, 15)
        _record(6.0, None, 40),  # still running at 16: 9 of its 10 s are in the window
        _record(2.0, 2.0, 7),  # one instant, before the window
        _record(None, None, 0),  # no token yet
    ]
    assert tokens_within(records, 5.0, 15.0, now=16.0) == pytest.approx(50.0 + 36.0)


def test_every_kind_of_point_is_a_valid_policy_and_fifo_has_no_door() -> None:
    every = points([8, 64], 1024, [512], ["300ms"], ["100ms"])
    names = [p.name for p in every]
    assert names[0] == "fifo" and "paced-64" in names and "steps512-8" in names
    assert {"delta-300ms", "tail-100ms"} <= set(names)
    for point in every:
        policy = policy_from_text(policy_text(point), f"{point.name}.yaml")
        pool = policy.source.pools["p"]
        if point.limit is None:
            assert not pool.engine_priority
            assert engine_profile(point).scheduling_policy == "fcfs"
        else:
            assert pool.engine_priority and pool.max_inflight == point.limit + 8
            assert engine_profile(point).scheduling_policy == "priority"
    tail = next(p for p in every if p.name == "tail-100ms")
    delta = policy_from_text(policy_text(tail)).source.tier_options["standard"].latency_delta
    assert delta is not None and delta.quantile == 0.99 and delta.every_token == 0.1
    assert engine_profile(Point("s", "s", 8, step_tokens=512)).max_num_batched_tokens == 512


def test_the_delta_points_take_the_paced_budget_a_fallback_or_none() -> None:
    def budgets(prefill_budget: int, delta_budget: int | None) -> set[int | None]:
        every = points([8], prefill_budget, [], ["300ms"], ["100ms"], delta_budget)
        return {
            policy_from_text(policy_text(p)).source.pools["p"].prefill_budget_tokens
            for p in every
            if p.latency_delta is not None
        }

    assert budgets(1024, None) == {1024}
    assert budgets(0, None) == {DELTA_PREFILL_BUDGET}
    assert budgets(1024, 0) == {0}  # none: a δ cut paces by prompts


def test_a_door_limit_trades_throughput_for_the_quiet_tail(tmp_path: Path) -> None:
    """A short simulated run: FIFO queues the quiet tenant behind the flood in the engine;
    a limit of 8 at the door keeps it near alone and costs throughput."""
    work = Workload(flooder_start_s=2.0, warmup_s=8.0, measure_s=15.0)
    report = run(tmp_path, work, points([8], 0, []), seed=3)
    rows = {row["point"]: row for row in report["rows"]}
    assert set(rows) == {"fifo", "door-8"}
    fifo, door = rows["fifo"], rows["door-8"]
    assert door["ttft_p99_ms"] < fifo["ttft_p99_ms"] / 3
    assert door["output_tok_s"] < 0.8 * fifo["output_tok_s"]
    assert door["of_fifo"] == pytest.approx(door["output_tok_s"] / fifo["output_tok_s"])
    assert report["solo"]["quiet_requests"] == door["quiet_requests"] > 30
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"]["met"] is False and (tmp_path / "frontier.png").exists()


def test_kvwardens_bucket_is_a_flooder_rate_limit_and_its_target_reads_the_flooder() -> None:
    swept = kvwarden_points([16], ["20ms"], [14])
    names = ["fifo", "bucket", "door-16", "default", "paced-14", "first-20ms"]
    assert [p.name for p in swept] == names
    paced = policy_from_text(policy_text(swept[4])).source.pools["p"]
    assert paced.adaptive_enabled and paced.effective_prefill_budget == 14
    assert policy_from_text(policy_text(swept[3])).source.pools["p"].effective_prefill_budget == 0
    bucket = policy_from_text(policy_text(swept[1])).source.tenants["flooder"].limits
    assert bucket.requests_per_minute == 600 and bucket.requests_burst == 10
    assert swept[1].flooder_limits == KVWARDEN_BUCKET and KVWARDEN.flooder_rate == 32.0

    def row(point: str, p99: float, flooder: float) -> dict[str, object]:
        return {"point": point, "ttft_p50_ms": 40.0, "ttft_p99_ms": p99, "tpot_p99_ms": 12.0,
                "output_tok_s": flooder + 64.0, "flooder_tok_s": flooder}  # fmt: skip

    solo = {"ttft_p50_ms": 40.0, "ttft_p99_ms": 50.0, "tpot_p99_ms": 12.0}
    rows = [row("fifo", 70.0, 2000.0), row("bucket", 52.0, 640.0),
            row("door-16", 54.0, 1300.0), row("door-8", 53.0, 900.0)]  # fmt: skip
    summary = ratios(rows, solo)  # type: ignore[arg-type]
    assert summary["flooder_tok_s_needed"] == 1280.0
    assert summary["met"]  # door-16: 1.08x with 1,300 tok/s
    assert summary["best_p99_with_enough_flooder_tokens"] == "door-16"
    rows[2] = row("door-16", 56.0, 1300.0)  # 1.12x: the tail misses
    assert not ratios(rows, solo)["met"]  # type: ignore[arg-type]


def test_the_over_points_run_the_services_default_capacity() -> None:
    """`--workload over`: the default point is the default policy (the adaptive limit, no
    `adaptive: {enabled: false}`), the objectives sit on it; fcfs engines get no priority."""
    swept = over_points(["20ms"])
    assert [p.name for p in swept] == ["fifo", "default", "first-20ms"]
    for point in swept[1:]:
        pool = policy_from_text(policy_text(point)).source.pools["p"]
        assert pool.adaptive_enabled and pool.max_inflight == 512 and pool.engine_priority
        assert engine_profile(point).scheduling_policy == "priority"
        fcfs = replace(point, engine_policy="fcfs")
        assert not policy_from_text(policy_text(fcfs)).source.pools["p"].engine_priority
        assert engine_profile(fcfs).scheduling_policy == "fcfs"
    objective = policy_from_text(policy_text(swept[2])).source.tier_options["standard"]
    assert objective.latency_delta is not None and objective.latency_delta.first_token == 0.02
    assert OVER.flooder_rate == 48.0 and OVER.flooder_output == (256, 256)


def test_above_capacity_the_default_policy_keeps_the_quiet_tenant_out_of_the_queue(
    tmp_path: Path,
) -> None:
    """A short `over` run: FIFO leaves the quiet tenant behind seconds of flood; the adaptive
    limit keeps it within a few times alone, and the target reads the default point."""
    work = replace(OVER, measure_s=20.0)
    report = run(tmp_path, work, over_points([]), seed=3, workload="over")
    rows = {row["point"]: row for row in report["rows"]}
    assert rows["fifo"]["ttft_p99_x"] > 50
    assert rows["default"]["ttft_p99_x"] < 5
    summary = report["summary"]
    assert summary["met"] == (rows["default"]["ttft_p99_x"] <= 2.0)
    assert ("default" in summary["points_within"]) == summary["met"]


def test_arrival_groups_count_the_flooder_requests_reaching_the_engine_together() -> None:
    def at(engine_at: float | None) -> RequestRecord:
        record = RequestRecord(0, "r", "flooder", 0.0, 14, 64, 64)
        record.engine_at = engine_at
        return record

    # a group of 4 and one of 3 at the same instants, 3 alone, one outside the window, one
    # that never reached the engine
    times = [1.0] * 4 + [2.5] * 3 + [3.0, 3.1, 3.2, 9.0, None]
    found = arrival_groups([at(t) for t in times], 0.0, 5.0)
    assert found == {"flooder_grouped_share": 0.7, "flooder_largest_group": 4}
    assert arrival_groups([at(t) for t in times], 0.0, 5.0, least=4)["flooder_grouped_share"] == 0.4
    assert arrival_groups([], 0.0, 5.0) == {
        "flooder_grouped_share": 0.0,
        "flooder_largest_group": 0,
    }


def test_a_binding_door_limit_groups_the_flooder_and_pacing_does_not() -> None:
    """kvwarden's workload, 40 simulated seconds: with a door limit of 24 the requests that
    finish in one engine step free their slots together and the queued ones go in together;
    paced at one prompt they go one by one."""
    work = replace(KVWARDEN, flooder_start_s=2.0, warmup_s=10.0, measure_s=30.0, grace_s=2.0)
    fifo = measure(Point("fifo", "fifo", None), work, 7)
    door = measure(Point("door-24", "door limit", 24), work, 7)
    paced = measure(Point("paced-1", "paced", None, 1, adaptive=True), work, 7)
    assert fifo["flooder_grouped_share"] == 0.0  # Poisson arrivals
    assert door["flooder_grouped_share"] > 0.05 and door["flooder_largest_group"] >= 3
    assert paced["flooder_largest_group"] == 1
