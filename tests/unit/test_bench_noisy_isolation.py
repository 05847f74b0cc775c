"""The noisy-neighbour isolation arms: which arms run, the engine's flags, the policy each
arm writes, and the verdict against issue 15's targets."""

from __future__ import annotations

import argparse
import math

import pytest

from extproc.policy import policy_from_text
from extproc.policy.model import LatencyDelta
from gateway_lab.bench.noisy_arms import Timing, plan_arms, policy_text
from gateway_lab.bench.noisy_isolation import (
    Isolation,
    add_isolation_arguments,
    isolation_verdicts,
    with_warmup,
)
from gateway_lab.bench.noisy_table import unsteady_ok


def test_arms_and_their_policies() -> None:
    arms = {arm.name: arm for arm in plan_arms(Timing(), [24], 8, 1024, ("100ms", "1s"))}
    assert {"full-nopri", "full", "paced", "delta-100ms", "delta-1s"} <= set(arms)
    nopri = policy_from_text(policy_text("127.0.0.1:1", arms["full-nopri"]))
    assert nopri.pools["main"].engine_priority is False
    delta = policy_from_text(policy_text("127.0.0.1:1", arms["delta-1s"]))
    assert delta.pools["main"].engine_priority is True
    assert delta.pools["main"].effective_prefill_budget == 1024
    assert delta.source.tier_options["standard"].latency_delta == LatencyDelta(
        first_token=1.0, every_token=1.0
    )
    full = policy_from_text(policy_text("127.0.0.1:1", arms["full"]))
    assert full.source.tier_options == {}


def test_step_arms_run_the_full_policy_on_an_engine_with_smaller_steps() -> None:
    arms = {a.name: a for a in plan_arms(Timing(), [], 8, step_tokens=(512,))}
    step = arms["step-512"]
    assert step.step_tokens == 512 and step.kind == "full" and step.latency_delta is None
    assert arms["full"].step_tokens is None
    assert policy_text("127.0.0.1:1", step) == policy_text("127.0.0.1:1", arms["full"])
    chosen = Isolation.from_args(_parsed("--step-tokens", "256,512"))
    assert chosen.step_tokens == (256, 512)


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_isolation_arguments(parser)
    return parser.parse_args(list(argv))


def test_first_token_arms_watch_only_the_first_token_and_pace_as_delta_arms() -> None:
    arms = {a.name: a for a in plan_arms(Timing(), [], 8, 1024, (), ("50ms",))}
    assert "first-50ms" in arms and not any(name.startswith("delta-") for name in arms)
    first = policy_from_text(policy_text("127.0.0.1:1", arms["first-50ms"]))
    assert first.source.tier_options["standard"].latency_delta == LatencyDelta(first_token=0.05)
    assert first.pools["main"].effective_prefill_budget == 1024  # paced, as the delta arms
    assert first.pools["main"].engine_priority is True


def test_tail_arms_bound_every_token_at_a_quantile() -> None:
    isolation = Isolation.from_args(_parsed("--tail-deltas", "80ms", "--tail-quantile", "0.95"))
    arms = {
        a.name: a
        for a in plan_arms(
            Timing(), [], 8, 1024, (), (), (), isolation.tail_deltas, isolation.tail_quantile
        )
    }
    tail = policy_from_text(policy_text("127.0.0.1:1", arms["tail-80ms"]))
    assert tail.source.tier_options["standard"].latency_delta == LatencyDelta(
        every_token=0.08, quantile=0.95
    )
    assert tail.pools["main"].effective_prefill_budget == 1024


def test_selection_engine_flags_and_warmup() -> None:
    arms = plan_arms(Timing(), [], 8)
    chosen = Isolation(arms=("fifo", "full")).select(arms)
    assert [arm.name for arm in chosen] == ["fifo", "full"]
    with pytest.raises(SystemExit):
        Isolation(arms=("nope",)).select(arms)
    assert Isolation(prefill_threshold=256).engine_args() == [
        "--scheduling-policy", "priority", "--long-prefill-token-threshold", "256",
    ]  # fmt: skip
    short = with_warmup(Timing(), 5.0)
    assert short.warmup_fifo_s == short.warmup_full_s == short.warmup_alone_s == 5.0
    assert short.measure_s == Timing().measure_s


def test_the_verdict_needs_all_three_targets() -> None:
    # the inter-token target is on every gap's P99 (gap_p99_ratio), not the per-response TPOT
    rows = {
        "a": {"p99_ratio": 1.9, "gap_p99_ratio": 1.4, "tpot_p99_ratio": 1.2,
              "throughput_vs_fifo": 0.96},
        "b": {"p99_ratio": 1.9, "gap_p99_ratio": 1.6, "tpot_p99_ratio": 1.2,
              "throughput_vs_fifo": 0.96},
        "c": {"p99_ratio": 1.9, "gap_p99_ratio": 1.4, "tpot_p99_ratio": 1.2,
              "throughput_vs_fifo": 0.90},
        "d": {"p99_ratio": 2.1, "gap_p99_ratio": 1.4, "tpot_p99_ratio": 1.2,
              "throughput_vs_fifo": 0.96},
        "e": {"p99_ratio": 1.9, "gap_p99_ratio": 1.4, "tpot_p99_ratio": 1.6,
              "throughput_vs_fifo": 0.96},
        "fifo": {"p99_ratio": 100.0, "gap_p99_ratio": 9.0, "tpot_p99_ratio": 9.0,
                 "throughput_vs_fifo": 1.0},
    }  # fmt: skip
    verdict = isolation_verdicts(rows, {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
    assert verdict == {"a": True, "b": False, "c": False, "d": False, "e": True}


def test_an_arm_whose_window_halves_differ_is_not_steady() -> None:
    assert unsteady_ok(1000.0, 1200.0)
    assert not unsteady_ok(600.0, 1400.0)  # a controller still walking: a transient
    assert not unsteady_ok(1400.0, 1000.0)
    assert unsteady_ok(math.nan, 1000.0) and unsteady_ok(0.0, 0.0)
