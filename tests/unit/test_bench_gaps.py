"""Every inter-token gap of the load generator's records: chunks kept per response (for the
tenants asked), the gap of a chunk of n tokens, the pooled P50/P99 against the per-response
time per output token, and the noisy-neighbour row built from them."""

from __future__ import annotations

import math
import random

import pytest

from gateway_lab.bench.loadgen import Load, TokenEvents
from gateway_lab.bench.noisy_table import inter_token_row
from gateway_lab.bench.records import Chunks, Meter, Record, Spec, prompt_text
from gateway_lab.bench.stats import gap_stats, tpot_stats
from gateway_lab.engine.server import running_engine


def _record(times: list[float], tokens: list[int], *, status: int = 200) -> Record:
    """An answered, complete response whose first data chunk is its first output chunk."""
    chunks = Chunks()
    for at, n in zip(times, tokens, strict=True):
        chunks.add(at, n)
    record = Record("quiet", 0.0, status, times[0], times[-1], 10, sum(tokens), None, sum(tokens))
    record.complete = True
    record.chunks = chunks
    return record


def test_a_chunk_of_n_tokens_is_n_gaps_and_the_first_chunk_none() -> None:
    chunks = Chunks()
    for at, n in ((5.0, 3), (5.01, 1), (5.11, 5)):
        chunks.add(at, n)
    gaps = chunks.gaps()
    # the 5 s to the first chunk is the TTFT and its 3 tokens came with the first one
    assert gaps == pytest.approx([0.01, 0.02, 0.02, 0.02, 0.02, 0.02])
    assert sum(gaps) == pytest.approx(5.11 - 5.0)
    single = Chunks()
    single.add(1.0, 4)
    assert single.gaps() == []


def test_one_slow_gap_per_response_shows_in_the_every_gap_p99_not_in_tpot() -> None:
    # ten responses of 21 tokens, one per chunk: 19 gaps of 10 ms and one of 200 ms each,
    # so 5% of all gaps are slow while each response's mean stays under 20 ms
    records = []
    for k in range(10):
        steps = [0.010] * 19
        steps.insert(k % 19, 0.200)
        times = [1.0]
        for step in steps:
            times.append(times[-1] + step)
        records.append(_record(times, [1] * 21))
    gaps = gap_stats(records)
    tpot = tpot_stats(records)
    assert (gaps["count"], gaps["responses"]) == (200, 10)
    assert gaps["p99_ms"] == pytest.approx(200.0)
    assert gaps["p50_ms"] == pytest.approx(10.0)
    assert tpot["p99_ms"] == pytest.approx((19 * 10.0 + 200.0) / 20)
    assert gaps["p99_ms"] > 10 * tpot["p99_ms"]


def test_gap_stats_skip_refused_and_unrecorded_responses_and_never_count_the_ttft() -> None:
    slow_start = _record([30.0, 30.01, 30.02], [1, 1, 1])  # a 30 s TTFT
    refused = _record([0.0, 5.0], [1, 1], status=429)
    unrecorded = _record([0.0, 5.0], [1, 1])
    unrecorded.chunks = None
    stats = gap_stats([slow_start, refused, unrecorded])
    assert stats["count"] == 2 and stats["responses"] == 1
    assert stats["max_ms"] == pytest.approx(10.0)
    empty = gap_stats([unrecorded])
    assert empty["count"] == 0 and math.isnan(empty["p99_ms"])


def test_token_events_count_only_output_events_across_reads() -> None:
    events = TokenEvents()
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'
    assert events.feed(role + token[:10]) == 0  # the token event is not complete yet
    assert events.feed(token[10:] + token + token) == 3
    assert events.feed(usage + b"data: [DONE]\n\n") == 0


def test_inter_token_row_takes_both_ratios_against_the_reference() -> None:
    arm = {"quiet_gaps": {"p50_ms": 11.0, "p99_ms": 60.0}, "quiet_tpot": {"p99_ms": 24.0}}
    alone = {"quiet_gaps": {"p50_ms": 10.0, "p99_ms": 20.0}, "quiet_tpot": {"p99_ms": 12.0}}
    row = inter_token_row(arm, alone)
    assert row["gap_p99_ratio"] == pytest.approx(3.0)
    assert row["tpot_p99_ratio"] == pytest.approx(2.0)
    assert row["quiet_gap_p99_ms"] == 60.0 and row["quiet_gap_p50_ms"] == 11.0
    assert math.isnan(inter_token_row(arm, None)["gap_p99_ratio"])


async def test_load_keeps_every_output_chunk_of_the_gap_tenants_only() -> None:
    async with running_engine(profile="fast", model="bench") as engine:
        url = f"{engine.base_url}/v1/chat/completions"
        text = prompt_text(40, random.Random(1))
        async with Load(
            url, Meter(bin_s=0.5), request_timeout_s=30.0, gap_tenants={"quiet"}
        ) as load:
            quiet = await load.send(Spec("quiet", "k", text, 40, 24))
            other = await load.send(Spec("flooder", "k", text, 40, 24))
    assert quiet.status == 200 and quiet.complete and quiet.output_tokens == 24
    assert other.status == 200 and other.output_tokens == 24 and other.chunks is None
    chunks = quiet.chunks
    assert chunks is not None and sum(chunks.tokens) == 24
    times = list(chunks.times)
    assert times == sorted(times)
    assert quiet.ttft is not None and times[0] >= quiet.start + quiet.ttft
    gaps = chunks.gaps()
    assert len(gaps) == 24 - chunks.tokens[0]
    assert sum(gaps) == pytest.approx(times[-1] - times[0])
