"""Smoke run of the embedding-flood benchmark (--quick, small batches): the real Envoy, the
service and an emulated engine serving chat and embeddings; it must leave well-formed outputs
(the figures are not checked: numbers are noisy on shared cores)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gateway_lab.bench import embedding_flood

pytestmark = [pytest.mark.smoke, pytest.mark.dataplane, pytest.mark.plots]


def test_embedding_flood_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    embedding_flood.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(
        ["--quick", "--batch-inputs", "100", "--out", str(out), "--workdir", str(tmp_path / "w")]
    )
    assert embedding_flood.main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["scenario"] == "embedding-flood" and data["workload"]["batch_inputs"] == 100
    assert set(data["arms"]) == {
        "chat-solo",
        "fifo",
        "gateway-admission",
        "gateway-priority",
        "gateway",
        "step-256",
        "step-384",
        "step-512",
        "weighted",
    }
    for name in ("fifo", "gateway-admission", "gateway-priority", "gateway", "step-384"):
        batch = data["arms"][name]["tenants"]["batch"]
        assert batch["batches"] >= 1, name  # embedding calls were answered
        assert batch["service_per_s"] > 0
        row = data["summary"][name]
        assert {"chat_p50_ratio", "chat_p99_ratio", "chat_share", "batch_share"} <= set(row)
    assert data["arms"]["chat-solo"]["tenants"]["chat"]["ttft"]["count"] >= 1
    # the step arms ran on engines of their own, started with the smaller step budget
    step_args = data["arms"]["step-256"]["engine_args"]
    assert step_args[-2:] == ["--max-num-batched-tokens", "256"]
    assert "--max-num-batched-tokens" not in data["arms"]["gateway"]["engine_args"]
    weighted = data["arms"]["weighted"]["tenants"]
    assert weighted["chat"]["weight"] == 3.0 and weighted["batch"]["weight"] == 1.0
    assert weighted["chat"]["service_per_s"] > 0
    png = out / "embedding-flood.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "chat share" in printed
