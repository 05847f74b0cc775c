"""Trace readers on small synthetic files in the published formats, and trace shaping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway_lab.sim.tenants import assign_tenants, parse_weights
from gateway_lab.sim.trace import TraceError, TraceRequest, read_trace, shape_trace, write_trace

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,0
"""


def test_azure_csv_datetime_strings(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    trace = read_trace(path)
    assert [r.input_tokens for r in trace] == [374, 396, 879]
    assert [r.output_tokens for r in trace] == [44, 109, 1]  # at least one output token
    assert trace[0].at == 0.0
    assert trace[1].at == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert trace[2].at == pytest.approx(51.2224670 - 46.6805900, abs=1e-6)
    assert all(r.tenant is None for r in trace)


def test_azure_timestamps_across_midnight(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.5,10,1\n2023-11-17 00:00:00.25,10,1\n"
    )
    assert read_trace(path)[1].at == pytest.approx(0.75)


def test_mooncake_jsonl_milliseconds(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]},
        {"timestamp": 2500, "input_length": 2290, "output_length": 316, "hash_ids": [0]},
        {"timestamp": 1000, "input_length": 12, "output_length": 3, "hash_ids": []},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    trace = read_trace(path)
    assert [(r.at, r.input_tokens, r.output_tokens) for r in trace] == [
        (0.0, 6758, 500),
        (1.0, 12, 3),
        (2.5, 2290, 316),
    ]


def test_generic_csv_with_tenant_and_seconds(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,input_tokens,output_tokens,tenant\n10.5,100,20,acme\n11,50,5,\n")
    trace = read_trace(path)
    assert trace == [TraceRequest(0.0, 100, 20, "acme"), TraceRequest(0.5, 50, 5, None)]


def test_round_trip_through_write_trace(tmp_path: Path) -> None:
    requests = [TraceRequest(0.0, 10, 2, "a"), TraceRequest(1.25, 20, 3, None)]
    write_trace(tmp_path / "t.jsonl", requests)
    assert read_trace(tmp_path / "t.jsonl") == requests


def test_errors_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("time,input_tokens\n1,2\n")
    with pytest.raises(TraceError, match="output"):
        read_trace(path)
    path.write_text("time,input_tokens,output_tokens\n1,2,3\nx,2,3\n")
    with pytest.raises(TraceError, match=r"bad.csv:3"):
        read_trace(path)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.csv")


def test_shape_scales_cuts_and_samples() -> None:
    trace = [TraceRequest(float(t), 10, 1) for t in range(100)]
    scaled = shape_trace(trace, rate_scale=2.0, duration=10.0)
    assert [r.at for r in scaled] == [t / 2 for t in range(20)]
    started = shape_trace(trace, start=50.0, duration=5.0)
    assert [r.at for r in started] == [0.0, 1.0, 2.0, 3.0, 4.0]
    sampled = shape_trace(trace, sample=0.5, seed=3)
    assert 30 < len(sampled) < 70
    assert sampled == shape_trace(trace, sample=0.5, seed=3)
    with pytest.raises(ValueError):
        shape_trace(trace, rate_scale=0)


def test_tenant_assignment() -> None:
    trace = [TraceRequest(float(t), 10, 1, "x" if t == 0 else None) for t in range(6)]
    auto = assign_tenants(trace, ["a", "b"])
    assert [r.tenant for r in auto] == ["x", "a", "b", "a", "b", "a"]
    rr = assign_tenants(trace, ["a", "b"], "round-robin")
    assert [r.tenant for r in rr] == ["a", "b", "a", "b", "a", "b"]
    weighted = assign_tenants(trace * 100, [], "a=3,b=1", seed=1)
    share = sum(r.tenant == "a" for r in weighted) / len(weighted)
    assert 0.65 < share < 0.85
    assert weighted == assign_tenants(trace * 100, [], "a=3,b=1", seed=1)
    with pytest.raises(ValueError):
        assign_tenants(trace, ["a"], "trace")
    with pytest.raises(ValueError):
        parse_weights("a=x")
