"""gateway_lab.bench.calibrate_prefix without vLLM: its workload against in-process emulators."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from gateway_lab.bench import calibrate_prefix
from gateway_lab.engine.server import running_engine


def test_counter_sums_add_every_label_set() -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0\n'
        "vllm:prefix_cache_queries_total 900\n"
        'vllm:prefix_cache_hits_created{engine="0"} 5.0\n'
    )
    assert calibrate_prefix.counter_sums(text) == {
        "vllm:prefix_cache_queries_total": 900.0,
        "vllm:prefix_cache_hits_total": 384.0,
    }


@pytest.mark.parametrize("caching", [True, False])
async def test_pairs_move_the_counters_only_with_caching_on(caching: bool) -> None:
    # cpu-tiny: 128-token blocks; a 300-token prompt's repeat hits 2 blocks (256 tokens).
    async with running_engine(
        profile="cpu-tiny", enable_prefix_caching=caching, strict_model=False
    ) as engine:
        fresh, repeated, moved = await calibrate_prefix.fresh_and_repeated(
            engine.base_url, 2, 300, random.Random(1)
        )
    assert len(fresh) == len(repeated) == 2
    queries, hits = (moved[name] for name in calibrate_prefix.PREFIX_COUNTERS)
    assert (queries, hits) == ((4 * 300, 2 * 256) if caching else (0, 0))
    # The emulator publishes no engine-side prefill time: the row shows none.
    row = calibrate_prefix._row("emulated", caching, 300, fresh, repeated, moved)
    assert row.repeat_engine_prefill_ms is None and row.pairs == 2
    assert row.prefix_cache_hits == hits
    assert "emulated  " in calibrate_prefix.format_rows([row])


def test_main_refuses_a_prompt_beyond_the_preset(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    calibrate_prefix.add_arguments(parser)
    args = parser.parse_args(["--engines", "emulated", "--prompt-tokens", "300,5000"])
    args.out = tmp_path
    assert calibrate_prefix.main(args) == 2
    assert not (tmp_path / "calibration-prefix.json").exists()
