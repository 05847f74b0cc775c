"""Benchmark (simulated): the Mooncake conversation trace replayed under VTC, DRR and DLPM.

The offline simulator runs the service's own scheduler on a simulated clock in front of
simulated replicas whose prefix caches are keyed by the trace's `hash_ids` (512-token blocks).
Under `dlpm` the tickets carry those ids as their block names, so the gateway's locality index
sees what the engines cache (a block is 512 tokens: `block_bytes` 2048 at 4 bytes per token)
and chooses the replica (D²LPM); under `vtc` and `drr` the replicas are taken round robin, as
Envoy does by default. The trace has no tenants: its requests are dealt to `--tenants` tenants
of one tier at random.

Reported per arm: completed requests/s and output tokens/s over the simulated time, the prefix
hit rate from the replicas' counters, each tenant's dispatched service (1 x input + 2 x
max_tokens at admission), the largest gap between two tenants' dispatched service over any
interval (an upper bound of the gap while both are backlogged) against the DLPM bound 2Q + 2U,
and TTFT percentiles. Ratios are against the vtc arm.

`extproc bench locality-sim --trace PATH [--duration S] [--replicas N] [--out DIR]`
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extproc.policy import policy_from_text
from gateway_lab.bench import scenario
from gateway_lab.bench.locality_report import summarize_arms
from gateway_lab.bench.records import percentile
from gateway_lab.bench.stats import fmt
from gateway_lab.engine.profiles import get_profile
from gateway_lab.sim.fleet import PoolEngines, derive_capacity
from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.simulator import SimConfig, simulate
from gateway_lab.sim.tenants import assign_tenants
from gateway_lab.sim.trace import read_trace, shape_trace

NAME = "locality-sim"
DEFAULT_OUT = Path("results/locality-sim")
POOL = "main"
ARMS = ("vtc", "drr", "dlpm")
QUANTUM = 64


def policy_text(arm: str, tenants: Sequence[str]) -> str:
    rows = "\n".join(f"  {name}: {{tier: standard}}" for name in tenants)
    return f"""\
version: 1
tiers: [standard]
tenants:
{rows}
pools:
  {POOL}: {{max_total_tokens: 131072, max_inflight: 1, max_inflight_tokens: 1,
          endpoints: ["sim:0"]}}
fairness: {{policy: {arm}, input_weight: 1, output_weight: 2, quantum: {QUANTUM},
           locality: {{block_bytes: 2048}}}}
estimation: {{mode: flat, default_bytes_per_token: 4.0}}
"""


def largest_gap(records: Sequence[RequestRecord], tenants: Sequence[str]) -> float:
    """max over tenant pairs and intervals of |S_a(t1, t2) - S_b(t1, t2)|, S the cost
    dispatched (at admission)."""
    admitted = sorted(
        (r.admitted_at, r.tenant, r.input_tokens + 2.0 * r.max_tokens)
        for r in records
        if r.admitted_at is not None
    )
    widest = 0.0
    for a, b in itertools.combinations(tenants, 2):
        level = low = high = 0.0
        for _at, tenant, cost in admitted:
            if tenant == a:
                level += cost
            elif tenant == b:
                level -= cost
            else:
                continue
            low, high = min(low, level), max(high, level)
        widest = max(widest, high - low)
    return widest


def run_arm(arm: str, requests: Sequence[Any], args: argparse.Namespace) -> dict[str, Any]:
    tenants = [f"t{i}" for i in range(args.tenants)]
    profile = get_profile(args.profile)
    fleet = {POOL: PoolEngines(POOL, profile, args.replicas)}
    policy = derive_capacity(policy_from_text(policy_text(arm, tenants)), fleet)
    # round robin as Envoy; under dlpm each admission names its replica (D²LPM) instead
    config = SimConfig(policy=policy, fleet=fleet, balance="round-robin")
    began = time.perf_counter()
    result = simulate(requests, config)
    wall = time.perf_counter() - began
    done = [r for r in result.records if r.finished_at is not None]
    seconds = max(1e-9, result.end_time)
    queries = sum(r.prefix_cache_queries for r in result.replicas)
    hits = sum(r.prefix_cache_hits for r in result.replicas)
    ttft = [r.first_token_at - r.arrival for r in done if r.first_token_at is not None]
    largest = max((r.input_tokens + 2.0 * r.max_tokens for r in result.records), default=0.0)
    service = {
        t: sum(
            r.input_tokens + 2.0 * r.max_tokens
            for r in result.records
            if r.tenant == t and r.admitted_at is not None
        )
        / seconds
        for t in tenants
    }
    return {
        "arm": arm,
        "completed_per_s": len(done) / seconds,
        "prompt_tokens_per_s": sum(r.input_tokens for r in done) / seconds,
        "output_tokens_per_s": sum(r.generated for r in done) / seconds,
        "simulated_s": result.end_time,
        "wall_s": wall,
        "prefix_hit_rate": hits / queries if queries else math.nan,
        "service_per_s": service,
        "max_gap": largest_gap(result.records, tenants),
        "bound": 2 * QUANTUM + 2 * largest,
        "quiet_ttft": {  # every tenant here: the TTFT of all requests
            "p50_ms": percentile(ttft, 50) * 1000.0,
            "p99_ms": percentile(ttft, 99) * 1000.0,
        },
        "locality": result.snapshot.get("locality"),
    }


def main(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    shaped = shape_trace(trace, duration=args.duration, rate_scale=args.rate_scale)
    tenants = [f"t{i}" for i in range(args.tenants)]
    requests = assign_tenants(shaped, tenants, "random", seed=args.seed)
    print(f"[{NAME}] {len(requests)} requests, {args.replicas} replicas, profile {args.profile}")
    results = {arm: run_arm(arm, requests, args) for arm in ARMS}
    summary = summarize_arms(results)
    report = {
        "scenario": NAME,
        "trace": Path(args.trace).name,
        "requests": len(requests),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out", "trace")},
        "summary": summary,
        "arms": results,
    }
    scenario.save_results(args.out, report, "locality-sim.png", lambda p: _plot(results, p),
                          lambda: _table(results, summary))  # fmt: skip
    return 0


def _table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    print(f"{'arm':6} {'req/s':>7} {'x vtc':>6} {'hit rate':>8} {'gap (any)':>9} {'bound':>8} "
          f"{'TTFT p50':>9} {'TTFT p99':>9}")  # fmt: skip
    for name, arm in results.items():
        row = summary["rows"][name]
        print(
            f"{name:6} {fmt(arm['completed_per_s'], 2):>7} {fmt(row['throughput_vs_vtc'], 2):>6} "
            f"{fmt(arm['prefix_hit_rate'] * 100, 1):>7}% {fmt(arm['max_gap'], 0):>9} "
            f"{fmt(arm['bound'], 0):>8} {fmt(arm['quiet_ttft']['p50_ms'], 0):>9} "
            f"{fmt(arm['quiet_ttft']['p99_ms'], 0):>9}"
        )


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in (
        (axes[0], "completed_per_s", "completed requests/s (simulated)"),
        (axes[1], "prefix_hit_rate", "prefix cache hit rate"),
    ):
        ax.bar(names, [results[n][key] for n in names], color=["#d62728", "#ff7f0e", "#2ca02c"])
        ax.set_title(title)
    axes[2].bar(names, [results[n]["quiet_ttft"]["p99_ms"] for n in names])
    axes[2].set_title("TTFT P99 (ms)")
    save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="a trace with hash_ids (Mooncake JSONL)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--duration", type=float, default=600.0, help="trace seconds kept")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--profile", default="a100-llama3-8b")
    parser.add_argument("--seed", type=int, default=0)


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.locality_sim", __doc__, add_arguments, main)
    )
