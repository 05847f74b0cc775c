"""The self-overload benchmark's per-request split: client records joined with Envoy's lines."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway_lab.bench import phases, quiet_path
from gateway_lab.bench.records import Record

WALL_T0 = 1_800_000_000.0


def record(start: float, ttft: float | None, status: int = 200, tenant: str = "quiet") -> Record:
    return Record(tenant, start, status, ttft, start + 1.0, 10, 64, None)


def line(
    start: float, door_us: float, first_us: float, tenant: str = "quiet", status: str = "200"
) -> dict[str, Any]:
    return {
        "tenant_header": tenant,
        "status": status,
        phases.START_FIELD: f"{WALL_T0 + start:.6f}",
        "upstream_start": str(door_us),
        "upstream_first_chunk": str(first_us),
    }


def test_parts_add_up_to_the_clients_time_to_first_chunk() -> None:
    records = [record(10.0, 0.050), record(11.0, 0.200)]
    rows = [
        # Envoy got the first request 1 ms after the client started it; door 2 ms, engine 40.
        line(10.001, 2_000, 42_000),
        line(11.002, 30_000, 150_000),
    ]
    joined = quiet_path.join(records, rows, WALL_T0, "quiet")
    assert len(joined) == 2
    first, second = joined
    assert first["in"] == pytest.approx(1.0, abs=1e-3)
    assert first["door"] == pytest.approx(2.0)
    assert first["engine"] == pytest.approx(40.0)
    assert first["out"] == pytest.approx(50.0 - 1.0 - 42.0, abs=1e-3)
    for parts in joined:
        total = sum(parts[name] for name in quiet_path.PARTS)
        assert total == pytest.approx(parts["ttft"], abs=1e-6)
    assert second["door"] == pytest.approx(30.0)
    assert second["engine"] == pytest.approx(120.0)


def test_each_record_takes_its_own_line_not_a_neighbours() -> None:
    # Two requests 30 ms apart (a flooder's pace): each must match the line nearest its start.
    records = [record(5.000, 0.100), record(5.030, 0.100)]
    rows = [line(5.031, 1_000, 80_000), line(5.001, 9_000, 60_000)]
    joined = quiet_path.join(records, rows, WALL_T0, "quiet")
    assert [round(j["door"]) for j in joined] == [9, 1]


def test_unmatched_failed_and_other_tenants_are_left_out() -> None:
    records = [
        record(1.0, 0.05),
        record(2.0, None, status=429),  # refused: no first chunk
        record(3.0, 0.05, tenant="flooder"),
        record(4.0, 0.05),  # Envoy has no line for it
    ]
    rows = [
        line(1.001, 1_000, 30_000),
        line(2.001, 1_000, 30_000, status="429"),
        line(3.001, 1_000, 30_000, tenant="flooder"),
        line(4.2, 1_000, 30_000),  # 200 ms off: another request, not this one
    ]
    joined = quiet_path.join(records, rows, WALL_T0, "quiet")
    assert len(joined) == 1
    assert joined[0]["ttft"] == pytest.approx(50.0)


def test_split_gives_the_median_and_the_slowest_first() -> None:
    joined = [
        {"ttft": t, "in": 0.1, "door": d, "engine": t - d - 1.1, "out": 1.0}
        for t, d in ((40.0, 1.0), (45.0, 2.0), (300.0, 80.0), (50.0, 3.0), (120.0, 30.0))
    ]
    result = quiet_path.split(joined, slowest=2)
    assert result["requests"] == 5
    assert result["median_ms"]["ttft"] == pytest.approx(50.0)
    assert [r["ttft"] for r in result["slowest_ms"]] == [300.0, 120.0]
    assert result["slowest_ms"][0]["door"] == 80.0
    empty = quiet_path.split([])
    assert empty["requests"] == 0 and empty["slowest_ms"] == []
    assert not math.isnan(result["median_ms"]["door"])
