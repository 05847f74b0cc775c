"""Simulated D²LPM: under dlpm, tickets carry the trace's hash_ids and each admission names
the replica holding the prefix; the replay benchmark runs every arm on a small trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim_support import make_policy, run

from gateway_lab.bench import locality_sim
from gateway_lab.sim.trace import TraceRequest, write_trace

_DLPM = "fairness: {policy: dlpm, locality: {block_bytes: 2048}}\n"


def _two_conversations() -> list[TraceRequest]:
    out = [TraceRequest(0.5, 1100, 2, "a", hash_ids=(90, 91))]  # unrelated: shifts round robin
    for turn in range(4):
        out.append(
            TraceRequest(
                turn * 2.0, 1100 + 500 * turn, 2, "a", hash_ids=(1, 2, *range(10, 10 + turn))
            )
        )
        out.append(
            TraceRequest(
                turn * 2.0 + 1.0, 1100 + 500 * turn, 2, "a", hash_ids=(7, 8, *range(50, 50 + turn))
            )
        )
    return sorted(out, key=lambda r: r.at)


def _endpoints(count: int) -> str:
    return "[" + ", ".join(f'"127.0.0.1:{i + 1}"' for i in range(count)) + "]"


def test_each_conversation_stays_on_one_replica_under_dlpm() -> None:
    pools = {"p": {"max_inflight": 8, "endpoints": _endpoints(2)}}
    result = run(_two_conversations(), make_policy(pools=pools, extra=_DLPM), replicas={"p": 2},
                 balance="round-robin")  # fmt: skip
    by_conversation: dict[int, set[int | None]] = {}
    for record in result.records:
        by_conversation.setdefault(record.hash_ids[0], set()).add(record.replica)
    assert len(by_conversation[1]) == len(by_conversation[7]) == 1
    hits = sum(r.prefix_cache_hits for r in result.replicas)
    # round robin without the index alternates the replicas, so later turns miss
    plain = run(_two_conversations(), make_policy(pools=pools), replicas={"p": 2},
                balance="round-robin")  # fmt: skip
    assert hits > sum(r.prefix_cache_hits for r in plain.replicas)


def test_the_replay_benchmark_runs_every_arm(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, _two_conversations())
    args = argparse.Namespace(
        trace=str(trace), out=tmp_path / "out", duration=None, rate_scale=1.0, replicas=2,
        tenants=2, profile="fast", seed=0,
    )  # fmt: skip
    assert locality_sim.main(args) == 0
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(report["arms"]) == {"vtc", "drr", "dlpm"}
    assert report["arms"]["dlpm"]["prefix_hit_rate"] >= report["arms"]["vtc"]["prefix_hit_rate"]
    assert (tmp_path / "out" / "locality-sim.png").exists()
