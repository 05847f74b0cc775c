"""The simulator feeds a trace's `hash_ids` (Mooncake: one id per 512-token prompt block) to the
engines' prefix caches: shared prefixes skip their prefill, and the report gives the hit rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_support import HAND, run

from gateway_lab.sim.output import format_report
from gateway_lab.sim.stats import report
from gateway_lab.sim.trace import TraceError, TraceRequest, read_trace, write_trace


def conversation() -> list[TraceRequest]:
    """Three turns of one conversation (each resends the history) and one unrelated prompt."""
    return [
        TraceRequest(0.0, 1100, 2, "a", hash_ids=(0, 1, 2)),  # 2 full 512-token blocks + 76
        TraceRequest(1.0, 1600, 2, "a", hash_ids=(0, 1, 3, 4)),  # shares blocks 0 and 1
        TraceRequest(2.0, 2100, 2, "a", hash_ids=(0, 1, 3, 6, 7)),  # shares 0, 1, 3
        TraceRequest(3.0, 1100, 2, "a", hash_ids=(9, 10, 11)),  # fresh
    ]


def prefill_step(prefill_tokens: int, context: int) -> float:
    return 0.010 + 0.0001 * prefill_tokens + 0.00001 * context


def test_turns_of_a_conversation_skip_the_prefill_of_their_shared_blocks() -> None:
    result = run(conversation())
    first, second, third, fresh = result.records
    # HAND: 16-token blocks, 512-token chunks. Turn 1 prefills 1100 tokens in three chunks;
    # turn 2 finds 1024 tokens cached and prefills 576 (512 + 64); turn 3 finds 1536 and
    # prefills 564 (512 + 52). Context counts the cached tokens too (attention reads them).
    frontend = HAND.frontend_s
    whole = prefill_step(512, 512) + prefill_step(512, 1024) + prefill_step(76, 1100)
    assert first.ttft == pytest.approx(frontend + whole, abs=1e-12)
    turn2 = prefill_step(512, 1024 + 512) + prefill_step(64, 1600)
    assert second.ttft == pytest.approx(frontend + turn2, abs=1e-12)
    turn3 = prefill_step(512, 1536 + 512) + prefill_step(52, 2100)
    assert third.ttft == pytest.approx(frontend + turn3, abs=1e-12)
    assert fresh.ttft == pytest.approx(first.ttft, abs=1e-12)
    (replica,) = result.replicas
    assert replica.prefix_cache_queries == 1100 + 1600 + 2100 + 1100
    # 1024 (turn 2) + 1536 (turn 3): whole 512-token id blocks map onto 16-token engine blocks.
    assert replica.prefix_cache_hits == 1024 + 1536
    assert [record.cached_tokens for record in result.records] == [0, 1024, 1536, 0]
    summary = report(result)
    assert summary["overall"]["cached_input_tokens"] == 2560
    assert summary["by_tenant"]["a"]["prefix_cache_hit_rate"] == pytest.approx(2560 / 5900)
    engines = summary["engines"]["p"]
    assert engines["prefix_cache_hit_rate"] == pytest.approx(2560 / 5900, abs=1e-6)
    assert "prefix cache hit rate 43.39%" in format_report(report(result))


def test_the_second_turn_ttft_is_the_uncached_chunks_only() -> None:
    # One turn, then a resend of the same 1100 tokens: 68 of its 69 blocks hit (not the
    # partial last one), leaving 1100 - 1088 = 12 tokens to prefill in one step.
    trace = [
        TraceRequest(0.0, 1100, 1, "a", hash_ids=(0, 1, 2)),
        TraceRequest(1.0, 1100, 1, "a", hash_ids=(0, 1, 2)),
    ]
    _, again = run(trace).records
    assert again.ttft == pytest.approx(HAND.frontend_s + prefill_step(12, 1100), abs=1e-12)


def test_without_hash_ids_or_with_caching_off_every_prompt_is_fresh() -> None:
    plain = [TraceRequest(r.at, r.input_tokens, r.output_tokens, r.tenant) for r in conversation()]
    for result in (
        run(plain),
        run(conversation(), profile=HAND.with_overrides({"enable_prefix_caching": False})),
    ):
        ttfts = [record.ttft for record in result.records]
        assert ttfts[1] is not None and ttfts[0] is not None and ttfts[1] > ttfts[0]
        assert result.replicas[0].prefix_cache_hits == 0
    off = run(conversation(), profile=HAND.with_overrides({"enable_prefix_caching": False}))
    assert report(off)["engines"]["p"]["prefix_cache_hit_rate"] is None


def test_hash_ids_are_read_and_written(tmp_path: Path) -> None:
    mooncake = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 300, "output_length": 5},
    ]
    mooncake.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    first, second = read_trace(mooncake)
    assert first.hash_ids == (0, 1) and second.hash_ids == ()
    copy = tmp_path / "copy.jsonl"
    write_trace(copy, [first, second])
    assert read_trace(copy) == [first, second]
    csv = tmp_path / "trace.csv"
    csv.write_text('time,input_tokens,output_tokens,hash_ids\n0,10,1,"[4, 5]"\n', encoding="utf-8")
    assert read_trace(csv)[0].hash_ids == (4, 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "hash_ids": ["x"]}) + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: .*hash_ids must be a list of integers"):
        read_trace(bad)
