"""Smoke run of the vllm-priority benchmark (--quick, four arms): the real Envoy, the service
and a real vLLM (CPU) engine started with each scheduling policy in turn; it must leave
well-formed outputs (figures are not checked: numbers are noisy on shared cores), and the
arm with an objective relative to alone must have learned alone from the real engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from tests.vllm.test_gateway_vllm import _vllm_missing

pytestmark = [pytest.mark.vllm, pytest.mark.dataplane, pytest.mark.smoke, pytest.mark.plots]


def test_vllm_priority_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = _vllm_missing()
    if missing is not None:
        pytest.skip(missing)
    from gateway_lab.bench import vllm_priority

    parser = argparse.ArgumentParser()
    vllm_priority.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(
        ["--quick", "--arms", "solo,priority-static,fcfs-static,priority-first-2x",
         "--out", str(out), "--workdir", str(tmp_path / "w"), "--vllm-python", sys.executable]
    )  # fmt: skip
    assert vllm_priority.main(args) == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["arms"]) == {"solo", "priority-static", "fcfs-static", "priority-first-2x"}
    relative = data["arms"]["priority-first-2x"]
    assert relative["latency_delta"] == "{first_token: 2x}"
    pool = vllm_priority.POOL
    learned = [(s.get("alone_ttft_samples") or {}).get(pool) or 0 for s in relative["timeseries"]]
    assert max(learned) >= 3  # the priming requests taught the alone TTFT: the objective steers
    assert [data["arms"][a]["engine_policy"] for a in ("priority-static", "fcfs-static")] == [
        "priority",
        "fcfs",
    ]
    for name, arm in data["arms"].items():
        assert arm["quiet"]["ttft"]["count"] >= 1, name
        assert set(arm["quiet"]["status"]) == {"200"}, name  # nothing failed or was refused
        assert arm["output_tokens_per_s"] > 0
    for name in ("priority-static", "fcfs-static"):  # the flooder is served, not starved
        flood = data["arms"][name]["flood"]
        assert flood["status_whole_run"].get("200", 0) >= 1, name
        assert flood["output_tokens_per_s"] > 0, name
    # each engine really ran with its policy: vLLM logs its non-default arguments at start-up
    # (fcfs is its default)
    logs = {
        policy: (tmp_path / "w" / f"vllm-{policy}" / "vllm-main-0.log").read_text()
        for policy in ("priority", "fcfs")
    }
    assert "'scheduling_policy': 'priority'" in logs["priority"]
    assert "non-default args" in logs["fcfs"] and "'scheduling_policy'" not in logs["fcfs"]
    assert (out / "vllm-priority.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "quiet p50" in capsys.readouterr().out
