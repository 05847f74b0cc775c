"""Smoke run of `extproc bench self-overload` (--quick, four arms): the real Envoy, the
service and a pinned emulated engine for a few seconds per arm must leave well-formed
outputs, the phase breakdown and the reply probe among them. The figures are not checked
(shared cores)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from gateway_lab.bench import self_overload
from gateway_lab.bench.noisy_isolation import ALONE_PRIMING

pytestmark = [pytest.mark.smoke, pytest.mark.dataplane, pytest.mark.plots]


def test_self_overload_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    self_overload.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(
        [
            "--quick", "--out", str(out), "--workdir", str(tmp_path / "w"), "--no-kvwarden",
            "--probe", "--arms", "alone-straight,alone-service,room-full,room-first-30ms-apart",
        ]
    )  # fmt: skip
    cores = os.sched_getaffinity(0)
    assert self_overload.main(args) == 0
    assert os.sched_getaffinity(0) == cores  # the engine was pinned apart, the caller is not
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["scenario"] == "self-overload"
    assert set(data["arms"]) == {
        "alone-straight", "alone-service", "room-full", "room-first-30ms-apart"
    }  # fmt: skip
    for result in data["arms"].values():
        assert {"p50_ms", "p99_ms", "count"} <= set(result["quiet"])
        assert result["records"]["rows"], "no request was recorded"
        assert "envoy_details" in result
    phases = data["arms"]["alone-service"]["phases"]
    assert phases["requests"] >= 1
    assert "request -> upstream (ext_proc headers + body)" in phases["steps_ms"]
    assert "flooder" in json.dumps(data["arms"]["room-full"]["envoy_details"])
    # every answered quiet request of the window is found in Envoy's log, and its parts add up
    for name in ("alone-service", "room-full"):
        path = data["arms"][name]["quiet_path"]
        answered = [r for r in data["arms"][name]["records"]["rows"] if r[0] == "quiet"]
        assert 1 <= path["requests"] <= len(answered)
        quiet = data["arms"][name]["quiet"]
        assert path["requests"] == quiet["count"] - quiet["censored"]
        slowest = path["slowest_ms"][0]
        parts = sum(slowest[p] for p in ("in", "door", "engine", "out"))
        assert parts == pytest.approx(slowest["ttft"], abs=0.01)
        assert slowest["engine"] > 0 and slowest["door"] > 0 and slowest["in"] > -1
    assert isinstance(data["summary"]["targets"]["added_p50_ms<=1.0"], bool)
    # the probe timed the service's headers reply and read its loop lag; Envoy straight has
    # no ext_proc server to probe
    assert "reply_probe" not in data["arms"]["alone-straight"]
    # ... and its CPU figures still cover the whole window (the load generator's own work;
    # alone, four requests in a 4 s window can cost less than /proc's 10 ms tick)
    assert data["arms"]["alone-straight"]["cpu_cores"]["loadgen"] >= 0
    assert data["arms"]["room-full"]["cpu_cores"]["loadgen"] > 0
    probe = data["arms"]["room-full"]["reply_probe"]
    assert probe["failures"] == 0 and probe["headers_reply_ms"]["count"] >= 3
    assert 0 < probe["headers_reply_ms"]["p50"] < 10_000
    assert probe["event_loop_lag_ms"]["count"] >= 3
    waits = data["arms"]["room-full"]["quiet_ext_proc_waits_ms"]
    assert waits["ext_proc_request_header_latency_us"]["count"] >= 1
    # the δ arm primed the alone model before its load (six quiet requests before the window);
    # its flooder sent from a process of its own, whose records and CPU came back
    first = data["arms"]["room-first-30ms-apart"]
    assert first["flooder_output_tok_s"] > 0
    assert first["cpu_cores"]["loadgen-flood"] > 0
    assert "loadgen-flood" not in data["arms"]["room-full"]["cpu_cores"]
    rows = sorted(first["records"]["rows"], key=lambda row: row[1])  # by start
    before_flood = next(i for i, row in enumerate(rows) if row[0] == "flooder")
    assert before_flood >= ALONE_PRIMING and {row[0] for row in rows[:before_flood]} == {"quiet"}
    assert (out / "self-overload.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per-phase medians" in printed and "targets:" in printed
    assert "part by part" in printed
    assert "the door's replies" in printed
