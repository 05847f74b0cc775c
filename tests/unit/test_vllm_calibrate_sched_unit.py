"""gateway_lab.bench.calibrate_sched without vLLM: its workloads against in-process emulators."""

from __future__ import annotations

import argparse
import os
import random
import statistics
from pathlib import Path

import pytest

from gateway_lab.bench import calibrate_sched
from gateway_lab.engine.server import running_engine


async def test_priority_row_separates_fcfs_from_priority() -> None:
    medians = {}
    for policy in ("fcfs", "priority"):
        async with running_engine(
            profile="cpu-tiny",
            frontend_s=0.0,
            scheduling_policy=policy,
            long_prefill_token_threshold=0,
            strict_model=False,
        ) as engine:
            ttfts = await calibrate_sched.short_beside_longs(
                engine.base_url, 8, 1, random.Random(1), long_priority=1
            )
        medians[policy] = statistics.median(ttfts)
    assert medians["priority"] < 0.5 * medians["fcfs"], medians


async def test_budget_row_smaller_steps_shorten_the_decoding_gap() -> None:
    # The short request decodes while 4 long prompts prefill beside it in 256-token chunks:
    # with the whole 2,048-token budget a step carries 4 chunks (~150 ms in cpu-tiny), with a
    # 256-token budget one (~45 ms), so its long gaps shrink. p95 (the 4th longest of 63 gaps)
    # rather than the maximum: engine and client share this event loop, and sending the long
    # prompts can stall it once for ~10 ms.
    worst = {}
    for budget in (2048, 256):
        async with running_engine(
            profile="cpu-tiny",
            frontend_s=0.0,
            max_num_batched_tokens=budget,
            strict_model=False,
        ) as engine:
            samples = await calibrate_sched.decode_beside_longs(
                engine.base_url, 4, 1, random.Random(1)
            )
        (sample,) = samples
        assert len(sample.gaps_s) == calibrate_sched.DECODE_OUTPUT_TOKENS - 1
        assert len(sample.long_ttfts_s) == 4
        worst[budget] = calibrate_sched._pct(sample.gaps_s, 0.95)
    assert worst[256] < 0.7 * worst[2048], worst


def test_budget_summary_pools_the_gaps() -> None:
    samples = [
        calibrate_sched.DecodeSample(0.010, (0.005, 0.030), (0.2, 0.3)),
        calibrate_sched.DecodeSample(0.020, (0.006, 0.010), (0.4,)),
    ]
    config = calibrate_sched.EngineConfig("priority", 256, 512)
    row = calibrate_sched._decode_summary(config, 2, samples)
    assert row.config == "priority, threshold 256, budget 512"
    assert (row.samples, row.ttft_p50_ms, row.gap_max_ms) == (2, 15.0, 30.0)
    assert (row.gap_p50_ms, row.long_ttft_p50_ms) == (8.0, 300.0)


async def test_frontend_probe_reports_each_level() -> None:
    async with running_engine(profile="fast", strict_model=False) as engine:
        levels = await calibrate_sched.frontend_levels(engine.base_url, os.getpid(), [1, 4], 2)
    assert [level.concurrency for level in levels] == [1, 4]
    assert [level.requests for level in levels] == [2, 8]
    assert all(0 < level.ttft_p50_ms <= level.ttft_p99_ms for level in levels)
    # This process runs the engine and the clients: it used some CPU, at most both cores.
    assert all(0 < level.api_cpu_share <= (os.cpu_count() or 1) for level in levels)
    # 64 tokens per request ("fast" emulates ignore_eos).
    for level in levels:
        seconds = level.requests * 64 / level.output_tokens_per_s
        cpu_per_token = level.api_cpu_share * seconds / (level.requests * 64)
        assert level.api_cpu_us_per_token == pytest.approx(cpu_per_token * 1e6, rel=0.05)


def test_cpu_seconds_reads_this_process() -> None:
    before = calibrate_sched._cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert calibrate_sched._cpu_seconds(os.getpid()) > before


def test_cli_rejects_unknown_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    calibrate_sched.add_arguments(parser)
    args = parser.parse_args(["--engines", "gpu", "--out", str(tmp_path)])
    assert calibrate_sched.main(args) == 2
    assert "--engines" in capsys.readouterr().err


def test_configs_parse_policy_and_threshold() -> None:
    configs = calibrate_sched.parse_configs("fcfs:0, priority:256,priority,priority:256:512")
    assert [(c.policy, c.threshold, c.budget) for c in configs] == [
        ("fcfs", 0, 0),
        ("priority", 256, 0),
        ("priority", 0, 0),
        ("priority", 256, 512),
    ]
    assert configs[1].label == "priority, threshold 256"
    assert configs[3].label == "priority, threshold 256, budget 512"
