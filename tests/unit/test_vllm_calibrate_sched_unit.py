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
    configs = calibrate_sched.parse_configs("fcfs:0, priority:256,priority")
    assert [(c.policy, c.threshold) for c in configs] == [
        ("fcfs", 0),
        ("priority", 256),
        ("priority", 0),
    ]
    assert configs[1].label == "priority, threshold 256"
