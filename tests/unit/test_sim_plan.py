"""Replica search and capacity planning on synthetic cases with a known answer."""

from __future__ import annotations

import pytest
from sim_support import req

from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.sim.fleet import profile_for_context
from gateway_lab.sim.plan import PlanConfig, next_power_of_two, plan_capacity
from gateway_lab.sim.search import smallest_passing
from gateway_lab.sim.slo import Slo
from gateway_lab.sim.throughput import saturation_throughput

# Every step takes exactly 10 ms whatever it holds; 4096 KV tokens per engine.
FLAT = EngineProfile(
    name="flat",
    step_base_s=0.010,
    step_per_decode_s=0.0,
    step_per_prefill_token_s=0.0,
    step_per_context_token_s=0.0,
    max_num_seqs=16,
    max_num_batched_tokens=8192,
    kv_blocks=256,
    block_size=16,
    max_model_len=4096,
)


@pytest.mark.parametrize("answer", [1, 2, 3, 7, 8, 9, 50, 1000])
@pytest.mark.parametrize("start", [1, 5, 64, 2000])
def test_smallest_passing_finds_the_threshold_testing_each_count_once(
    answer: int, start: int
) -> None:
    tested: list[int] = []

    def passes(n: int) -> bool:
        tested.append(n)
        return n >= answer

    assert smallest_passing(passes, start, maximum=1024) == answer
    assert len(tested) == len(set(tested))
    assert len(tested) <= 2 * (abs(answer - start).bit_length() + 2) + 2


def test_smallest_passing_gives_up_at_the_maximum() -> None:
    assert smallest_passing(lambda n: n > 10, 1, maximum=10) is None
    assert smallest_passing(lambda n: True, 7, maximum=10) == 1


def test_profile_for_context_sizes_concurrency_by_kv() -> None:
    assert profile_for_context(FLAT, 2048).max_num_seqs == 2
    assert profile_for_context(FLAT, 256).max_num_seqs == 16  # capped by the base's 16
    assert profile_for_context(FLAT, 256, seq_cap=64).max_num_seqs == 16  # 4096 / 256
    assert profile_for_context(FLAT, 1024, kv_provision=0.5).max_num_seqs == 8
    assert profile_for_context(FLAT, 1024).max_model_len == 1024
    with pytest.raises(ValueError):
        profile_for_context(FLAT, 8192)


def test_saturation_throughput_of_a_flat_engine() -> None:
    requests = [req(0.0, 10, 1) for _ in range(200)]
    two = saturation_throughput(profile_for_context(FLAT, 2048), requests)
    sixteen = saturation_throughput(profile_for_context(FLAT, 256), requests)
    assert two.requests_per_s == pytest.approx(2 / 0.010)
    assert sixteen.requests_per_s == pytest.approx(16 / 0.010)


def test_plan_finds_the_known_minimum() -> None:
    """8 short and 2 long single-token requests arrive together and must all get their token
    in the first 10 ms step. Homogeneous engines (max_model_len 2048) run 2 sequences each:
    5 replicas. Split at 256: short engines run 16 sequences (1 replica), long ones 2 (1)."""
    requests = [req(0.0, 100, 1) for _ in range(8)] + [req(0.0, 1400, 1) for _ in range(2)]
    config = PlanConfig(
        base_profile=FLAT, slo=Slo(ttft_s=0.015), attainment=1.0, thresholds=(256, 4096)
    )
    result = plan_capacity(requests, config)
    assert result.long_context == 2048 == next_power_of_two(1401)
    assert result.homogeneous.max_num_seqs == 2
    assert result.homogeneous.replicas == 5
    (split,) = result.splits  # 4096 >= the long context: skipped
    assert split.threshold == 256
    assert split.alpha == pytest.approx(0.8)
    # short requests take 4 of the 5 homogeneous steps' worth of work, then 1/8 of it
    assert split.alpha_time == pytest.approx(0.8)
    assert split.short is not None and split.long is not None
    assert (split.short.replicas, split.long.replicas) == (1, 1)
    assert result.saving(split) == pytest.approx(1 - 2 / 5)
    assert result.best() is split
    # every trial below the answer failed, the answer passed
    for pool in (result.homogeneous, split.short, split.long):
        for trial in pool.trials:
            assert trial.feasible == (trial.replicas >= (pool.replicas or 0))


def test_plan_with_attainment_slack_tolerates_misses() -> None:
    requests = [req(0.0, 100, 1) for _ in range(10)]
    common = {
        "base_profile": FLAT,
        "slo": Slo(ttft_s=0.015),
        "thresholds": (),
        "long_context": 2048,
    }
    strict = plan_capacity(requests, PlanConfig(attainment=1.0, **common))  # type: ignore[arg-type]
    loose = plan_capacity(requests, PlanConfig(attainment=0.8, **common))  # type: ignore[arg-type]
    assert strict.homogeneous.max_num_seqs == 2
    assert strict.homogeneous.replicas == 5
    assert loose.homogeneous.replicas == 4  # two of ten may wait for the second step
