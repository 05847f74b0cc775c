"""The simulator against hand-computed timings on a single engine with round step times.

Profile HAND: step = 10 ms + 1 ms per decode + 0.1 ms per prefill token + 0.01 ms per context
token; frontend 5 ms. A 100-token prompt's prefill step: 10 + 10 + 1 = 21 ms; the decodes that
follow: 10 + 1 + 0.01 * context (101, 102, ...) ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sim_support import HAND, make_policy, req, run

from extproc.types import Outcome
from gateway_lab.engine.model import EngineCore
from gateway_lab.sim.replicas import BALANCES
from gateway_lab.sim.simulator import SimResult

PREFILL_100 = 0.010 + 0.0001 * 100 + 0.00001 * 100  # 21 ms


def decode(context: int, decodes: int = 1) -> float:
    return 0.010 + 0.001 * decodes + 0.00001 * context


def test_one_request_ttft_is_frontend_plus_prefill_step() -> None:
    result = run([req(1.0, 100, 3)])
    (record,) = result.records
    assert record.outcome is Outcome.ADMITTED
    assert record.admitted_at == 1.0
    assert record.queue_wait == 0.0
    assert record.engine_at == pytest.approx(1.0 + HAND.frontend_s, abs=1e-12)
    assert record.ttft == pytest.approx(HAND.frontend_s + PREFILL_100, abs=1e-12)
    e2e = HAND.frontend_s + PREFILL_100 + decode(101) + decode(102)
    assert record.e2e == pytest.approx(e2e, abs=1e-12)
    assert record.tpot == pytest.approx((decode(101) + decode(102)) / 2, abs=1e-12)
    assert record.generated == 3 and record.charged == 3


def test_two_sequential_requests_see_the_same_idle_engine() -> None:
    result = run([req(1.0, 100, 3), req(2.0, 100, 3)])
    first, second = result.records
    assert first.finished_at is not None and first.finished_at < 2.0
    for record in (first, second):
        assert record.ttft == pytest.approx(HAND.frontend_s + PREFILL_100, abs=1e-12)
        assert record.queue_wait == 0.0
    assert second.e2e == pytest.approx(first.e2e, abs=1e-12)
    replica = result.replicas[0]
    busy = 2 * (PREFILL_100 + decode(101) + decode(102))
    assert replica.busy_s == pytest.approx(busy, abs=1e-12)
    assert replica.steps == 6


def test_simultaneous_requests_share_the_prefill_step() -> None:
    result = run([req(1.0, 100, 2), req(1.0, 100, 2)])
    step = 0.010 + 0.0001 * 200 + 0.00001 * 200  # both prompts in one step: 32 ms
    for record in result.records:
        assert record.ttft == pytest.approx(HAND.frontend_s + step, abs=1e-12)
        # then one decode step for both: context 101 each
        assert record.e2e == pytest.approx(
            HAND.frontend_s + step + decode(202, decodes=2), abs=1e-12
        )


def test_pool_capacity_one_queues_the_second_request_at_the_door() -> None:
    policy = make_policy(pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}})
    result = run([req(1.0, 100, 3), req(1.0, 100, 3)], policy)
    first, second = result.records
    assert first.queue_wait == 0.0
    assert first.finished_at is not None
    # admitted the instant the first one's lease is released
    assert second.admitted_at == first.finished_at
    assert second.queue_wait == pytest.approx(first.e2e, abs=1e-12)
    assert first.e2e is not None and first.ttft is not None
    assert second.ttft == pytest.approx(first.e2e + first.ttft, abs=1e-12)


def replica_names(result: SimResult) -> list[str]:
    return [result.replicas[r.replica].name for r in result.records if r.replica is not None]


def test_least_loaded_replica_gets_the_next_request() -> None:
    requests = [req(1.0, 100, 50), req(1.0, 100, 50), req(1.0, 100, 50)]
    for balance in BALANCES:
        result = run(requests, replicas={"p": 2}, balance=balance)
        assert replica_names(result) == ["p-0", "p-1", "p-0"], balance


def test_balance_by_tokens_counts_sizes_and_by_requests_does_not() -> None:
    requests = [req(1.0, 2000, 50), req(1.0, 100, 50), req(1.0, 100, 50), req(1.0, 100, 50)]
    by_tokens = run(requests, replicas={"p": 2}, balance="tokens")
    assert replica_names(by_tokens) == ["p-0", "p-1", "p-1", "p-1"]
    by_requests = run(requests, replicas={"p": 2}, balance="requests")
    assert replica_names(by_requests) == ["p-0", "p-1", "p-0", "p-1"]
    two_slots = HAND.with_overrides({"max_num_seqs": 2})
    # p-1 fills its two slots with small requests; the fourth goes to p-0's free slot even
    # though p-0 holds more tokens
    slot_aware = run(requests, replicas={"p": 2}, balance="tokens", profile=two_slots)
    assert replica_names(slot_aware) == ["p-0", "p-1", "p-1", "p-0"]
    rotating = run(requests, replicas={"p": 3}, balance="round-robin")
    assert replica_names(rotating) == ["p-0", "p-1", "p-2", "p-0"]


def test_engine_rejects_a_request_longer_than_max_model_len() -> None:
    policy = make_policy(pools={"p": {"max_inflight": 4, "max_total_tokens": 100_000}})
    result = run([req(0.0, 5000, 10)], policy)
    (record,) = result.records
    assert record.outcome is Outcome.BAD_REQUEST
    assert "max_model_len" in record.detail
    assert result.snapshot["leases"] == 0


def test_router_rejects_a_budget_no_pool_holds() -> None:
    result = run([req(0.0, 5000, 10)])
    assert result.records[0].outcome is Outcome.BAD_REQUEST
    assert result.records[0].pool is None


def test_engine_probe_sees_every_pool_each_interval_until_done() -> None:
    policy = make_policy(
        pools={"p": {"max_inflight": 4}, "q": {"max_inflight": 4, "max_total_tokens": 8192}}
    )
    calls: list[tuple[float, str, int, int]] = []

    def probe(now: float, pool: str, engines: Sequence[EngineCore]) -> None:
        calls.append((now, pool, len(engines), sum(e.num_running for e in engines)))

    result = run(
        [req(0.5, 100, 300), req(1.0, 100, 300)],
        policy,
        replicas={"p": 2},
        engine_probe=probe,
        probe_interval_s=0.25,
    )
    assert all(r.outcome is Outcome.ADMITTED for r in result.records)
    times = sorted({at for at, *_ in calls})
    assert times[0] == 0.5
    assert times[1] == pytest.approx(0.75)
    assert {(pool, n) for _at, pool, n, _running in calls} == {("p", 2), ("q", 1)}
    assert any(running > 0 for *_rest, running in calls)
    last = max(r.finished_at or 0.0 for r in result.records)
    assert times[-1] <= last + 0.25
