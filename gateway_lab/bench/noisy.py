"""Benchmark: the noisy neighbour (kvwarden's experiment), every arm side by side in one run.

A quiet tenant sends short chat requests at a low Poisson rate; a flooder keeps many long
requests going from a closed loop (more concurrent requests than the engine batches, so under
FIFO they queue inside the engine). One emulated A100 / Llama-3.1-8B engine
("a100-llama3-8b"), the real Envoy, and for the service arms our ext_proc service. Arms:

* alone-direct / alone-service: the quiet tenant alone, straight through Envoy and through
  the service: the reference of each path's ratios;
* fifo: both tenants, Envoy straight to the engine (no admission control; FCFS in the engine);
* token-bucket: our service with a per-tenant requests/min bucket on the flooder set to
  `--bucket-fraction` of the flooder's FIFO request rate, and no capacity limit at the door;
* full: tiers + DRR fair share + capacity at the door: a soft limit that follows the engine's
  vllm:num_requests_waiting / vllm:kv_cache_usage_perc (AIMD) plus headroom reserved for
  tenants below their fair share;
* plain: a plain policy, the pool with `max_inflight` (the engine's 256 sequences) and nothing
  else: the defaults (headroom sized from the pool, adaptive soft limit) against `full`'s tuning;
* soft-N: the same with a fixed soft limit N (and the same headroom): the trade-off curve;
* full-nopri: `full` with `engine_priority: false` (the engine's own order is arrival order);
  `full` itself runs the default, engine priority on (the engine is started with vLLM's
  `--scheduling-policy priority`, `--engine-policy`);
* paced: `full` with `prefill_budget_tokens: --prefill-budget` (backlogged tenants wait while
  that many prompt tokens await their first token);
* delta-D: `paced` with the tier objective `latency_delta: D` (`--deltas`): the δ controller
  scales the flooder's share of the pool and of the prefill budget. These arms begin with a
  few quiet requests sent one at a time, before the measured run: the gateway learns what a
  request gets alone only while the pool is nearly idle, which the flooder never allows;
* step-N: `full` on an engine of its own started with `--max-num-batched-tokens N`
  (`--step-tokens`): smaller steps, so a decode never shares one with more than N prompt
  tokens;
* first-D: `paced` with the first-token objective `latency_delta: {first_token: D}`
  (`--first-token-deltas`): as delta-D, but only the quiet tenant's time to first token
  steers;
* tail-D: `paced` with `latency_delta: {every_token: D, quantile: Q}` (`--tail-deltas`,
  `--tail-quantile`, default 0.99): the controller bounds the share of the quiet tenant's
  tokens later than D to 1 - Q instead of acting on a typical one.

For each arm: the quiet tenant's P50/P99 time to the first streamed SSE data chunk and their
ratio to "alone" on the same path, the P99 of every inter-token gap of its responses (gap99)
and of their per-response time per output token (TPOT) and those ratios, the flooder's and
the total output tokens/s and the total against FIFO. The target (docs/benchmarks.md) is a
full-policy P99 ratio <= 1.10 with a total throughput >= 95% of FIFO.

`extproc bench noisy-neighbour [--out results/noisy-neighbour] [--quick]`
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gateway_lab.bench import scenario
from gateway_lab.bench.loadgen import Load
from gateway_lab.bench.monitor import Monitor, log
from gateway_lab.bench.noisy_arms import (
    KEYS,
    PLAIN_RATIO_OF_FULL,
    PLAIN_THROUGHPUT_OF_FULL,
    Arm,
    Timing,
    plan_arms,
    policy_text,
)
from gateway_lab.bench.noisy_isolation import (
    DEFAULT_ISOLATION,
    Isolation,
    add_isolation_arguments,
    isolation_verdicts,
    prime_alone,
    with_warmup,
)
from gateway_lab.bench.noisy_plot import TARGET_RATIO, TARGET_THROUGHPUT, plot
from gateway_lab.bench.noisy_table import inter_token_row, print_table
from gateway_lab.bench.records import RECORD_COLUMNS, Meter, Spec, prompt_text
from gateway_lab.bench.stack import PROFILE, EngineSet, Gateway, engine_set
from gateway_lab.bench.stats import fmt, gap_stats, status_counts, tpot_stats, ttft_stats, within

NAME = "noisy-neighbour"
DEFAULT_OUT = Path("results/noisy-neighbour")


@dataclass(frozen=True)
class Workload:
    """Request shapes. The flooder's defaults follow the Azure LLM inference trace 2023
    (conversation): context p50 1,020 / mean 1,155 tokens, output mean 211, p90 424."""

    quiet_rate: float = 3.0
    quiet_prompt: int = 200
    quiet_output: int = 64
    flood_concurrency: int = 300
    flood_prompt: int = 1024
    flood_output: int = 256
    spread: float = 0.5
    """Flooder sizes are uniform in [(1 - spread) x, (1 + spread) x]: identical requests would
    start and finish in lockstep, which no real tenant does."""


def quiet_maker(work: Workload, seed: int) -> Callable[[int], Spec]:
    return scenario.fixed_maker("quiet", KEYS["quiet"], work.quiet_prompt, work.quiet_output, seed)


def flooder_maker(work: Workload, seed: int) -> Callable[[int], Spec]:
    return scenario.spread_maker(
        "flooder", KEYS["flooder"], work.flood_prompt, work.flood_output, work.spread, seed,
        vary_output=True,
    )  # fmt: skip


async def drain_bucket(load: Load, make: Callable[[int], Spec], limit: int) -> int:
    """Empty the flooder's requests/min bucket with 1-token requests, so that the measured
    window sees its sustained rate, not the minute of burst a fresh bucket holds."""
    sent = 0
    rejected = asyncio.Event()

    async def worker() -> None:
        nonlocal sent
        while not rejected.is_set() and sent < limit * 2 + 64:
            sent += 1
            record = await load.send(make(sent))
            if record.status == 429:
                rejected.set()

    await asyncio.gather(*(worker() for _ in range(16)))
    return sent


async def drive_arm(
    arm: Arm, gateway: Gateway, engines: EngineSet, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    meter = Meter(bin_s=0.5)
    async with Load(gateway.url, meter, gap_tenants=("quiet",)) as load:
        if arm.flooder_rpm is not None:
            tiny = Spec("drain", KEYS["flooder"], prompt_text(8, random.Random(seed)), 8, 1)
            drained = await drain_bucket(load, lambda _i: tiny, arm.flooder_rpm)
            log(NAME, f"{arm.name}: emptied the flooder's bucket with {drained} tiny requests")
        if arm.latency_delta is not None:
            await prime_alone(load, quiet_maker(work, seed + 5))
        load.records.clear()
        load.sent.clear()
        load.t0 = time.perf_counter()
        meter.tokens.clear()
        meter.service.clear()
        end = arm.warmup_s + timing.measure_s
        quiet = scenario.Foreground(quiet_maker(work, seed), work.quiet_rate, seed + 1)
        flooder = scenario.Background(
            flooder_maker(work, seed + 2), work.flood_concurrency, seed + 3
        )
        monitor = await scenario.contend(
            NAME, arm.name, load, engines, gateway, quiet, [flooder] if arm.flooder else [], end,
            grace_s=timing.grace_s, ramp_s=timing.ramp_s,
        )  # fmt: skip
        return summarize_arm(arm, load, meter, monitor, end)


def summarize_arm(
    arm: Arm, load: Load, meter: Meter, monitor: Monitor, end: float
) -> dict[str, Any]:
    start = arm.warmup_s
    quiet = within(load.records, "quiet", start, end)
    flooder = within(load.records, "flooder", start, end)
    quiet_tps = meter.rate("quiet", start, end)
    flooder_tps = meter.rate("flooder", start, end)
    middle = (start + end) / 2
    halves = [
        meter.rate("quiet", a, b) + meter.rate("flooder", a, b)
        for a, b in ((start, middle), (middle, end))
    ]
    window = [s for s in monitor.samples if start <= s["t"] < end]
    waiting = [s["waiting"] for s in window]
    limits = [
        s["limit"][scenario.POOL]
        for s in window
        if s.get("limit", {}).get(scenario.POOL) is not None
    ]
    factors = [
        s["delta_factor"][scenario.POOL]
        for s in window
        if (s.get("delta_factor") or {}).get(scenario.POOL) is not None
    ]
    return {
        "arm": arm.name,
        "kind": arm.kind,
        "engine_priority": arm.engine_priority,
        "prefill_budget": arm.prefill_budget,
        "latency_delta": arm.latency_delta,
        "quiet_tpot": tpot_stats(quiet),
        "quiet_gaps": gap_stats(quiet),
        "delta_factor_mean": sum(factors) / len(factors) if factors else None,
        "path": arm.path,
        "reference": arm.reference,
        "soft_limit": arm.soft_limit,
        "flooder_rpm": arm.flooder_rpm,
        "window_s": [start, end],
        "quiet": {**ttft_stats(quiet), "status": status_counts(quiet)},
        "flooder": {**ttft_stats(flooder), "status": status_counts(flooder)},
        "quiet_tok_s": quiet_tps,
        "flooder_tok_s": flooder_tps,
        "total_tok_s": quiet_tps + flooder_tps,
        "total_tok_s_halves": halves,
        "engine_waiting_mean": sum(waiting) / len(waiting) if waiting else math.nan,
        "engine_waiting_max": max(waiting) if waiting else math.nan,
        "gateway_limit_mean": sum(limits) / len(limits) if limits else None,
        "timeseries": monitor.samples,
        "records": {"columns": RECORD_COLUMNS, "rows": [r.as_row() for r in load.records]},
    }


def run_arm(
    arm: Arm,
    engines: EngineSet,
    workdir: Path,
    work: Workload,
    timing: Timing,
    seed: int,
) -> dict[str, Any]:
    endpoint = engines.endpoints[scenario.POOL][0]
    with scenario.arm_gateway(
        NAME, arm.name, workdir, engines, policy_text(endpoint, arm), arm.path, arm.capacity
    ) as gateway:
        started = time.perf_counter()
        result: dict[str, Any] = scenario.run_async(
            drive_arm(arm, gateway, engines, work, timing, seed)
        )
        result["wall_s"] = time.perf_counter() - started
    quiet = result["quiet"]
    log(
        NAME,
        f"arm {arm.name}: quiet p50 {fmt(quiet['p50_ms'])} ms p99 {fmt(quiet['p99_ms'])} ms, "
        f"total {result['total_tok_s']:.0f} tok/s",
    )
    return result


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    fifo = results.get("fifo")
    fifo_tps = fifo["total_tok_s"] if fifo else math.nan
    rows: dict[str, dict[str, float]] = {}
    for name, result in results.items():
        reference = results.get(result["reference"])
        ref_p50 = reference["quiet"]["p50_ms"] if reference else math.nan
        ref_p99 = reference["quiet"]["p99_ms"] if reference else math.nan
        rows[name] = {
            **inter_token_row(result, reference),
            "quiet_p50_ms": result["quiet"]["p50_ms"],
            "quiet_p99_ms": result["quiet"]["p99_ms"],
            "p50_ratio": result["quiet"]["p50_ms"] / ref_p50,
            "p99_ratio": result["quiet"]["p99_ms"] / ref_p99,
            "flooder_tok_s": result["flooder_tok_s"],
            "quiet_tok_s": result["quiet_tok_s"],
            "total_tok_s": result["total_tok_s"],
            "throughput_vs_fifo": result["total_tok_s"] / fifo_tps,
            "halves_tok_s": result.get("total_tok_s_halves", [math.nan, math.nan]),
        }
    kinds = ("full", "plain", "soft", "bucket", "paced", "delta")
    contenders = {n: r for n, r in rows.items() if results[n]["kind"] in kinds}
    at_target = {
        n: r for n, r in contenders.items() if r["throughput_vs_fifo"] >= TARGET_THROUGHPUT
    }
    full = rows.get("full")
    met = bool(
        full
        and full["p99_ratio"] <= TARGET_RATIO
        and full["throughput_vs_fifo"] >= TARGET_THROUGHPUT
    )

    plain = rows.get("plain")
    plain_met = bool(
        full
        and plain
        and plain["p99_ratio"] <= PLAIN_RATIO_OF_FULL * full["p99_ratio"]
        and plain["total_tok_s"] >= PLAIN_THROUGHPUT_OF_FULL * full["total_tok_s"]
    )

    def best(candidates: dict[str, dict[str, float]]) -> str | None:
        finite = {n: r for n, r in candidates.items() if not math.isnan(r["p99_ratio"])}
        return min(finite, key=lambda n: finite[n]["p99_ratio"]) if finite else None

    return {
        "rows": rows,
        "fifo_total_tok_s": fifo_tps,
        "target": {
            "p99_ratio_max": TARGET_RATIO,
            "throughput_vs_fifo_min": TARGET_THROUGHPUT,
            "full_policy_met": met,
            "plain_p99_ratio_of_full_max": PLAIN_RATIO_OF_FULL,
            "plain_throughput_of_full_min": PLAIN_THROUGHPUT_OF_FULL,
            "plain_policy_met": plain_met,
        },
        "best_at_95pct_throughput": best(at_target),
        "best_ratio_overall": best(contenders),
        "isolation_target": isolation_verdicts(rows, contenders),
    }


def run(
    out: Path,
    workdir: Path,
    work: Workload,
    timing: Timing,
    sweep: list[int],
    *,
    headroom: int = 8,
    bucket_fraction: float = 0.5,
    seed: int = 7,
    profile: str = PROFILE,
    isolation: Isolation = DEFAULT_ISOLATION,
) -> dict[str, Any]:
    planned = plan_arms(
        timing, sweep, headroom, isolation.budget, isolation.deltas, isolation.first_deltas,
        isolation.step_tokens, isolation.tail_deltas, isolation.tail_quantile,
    )  # fmt: skip
    arms = isolation.select(planned)

    def run_one(arm: Arm, engines: EngineSet, results: scenario.Results) -> dict[str, Any]:
        if arm.kind == "bucket":
            fifo = results.get("fifo")
            rate = fifo["flooder_tok_s"] / work.flood_output if fifo else 1.0
            rpm = max(1, round(bucket_fraction * rate * 60.0))
            arm = replace(arm, flooder_rpm=rpm)
            log(NAME, f"token bucket: flooder {rpm} requests/min "
                      f"({bucket_fraction:.0%} of its FIFO rate)")  # fmt: skip
        if arm.step_tokens is None:
            return run_arm(arm, engines, workdir, work, timing, seed)
        args = (*isolation.engine_args(), "--max-num-batched-tokens", str(arm.step_tokens))
        with engine_set(workdir / f"engines-{arm.name}", {scenario.POOL: 1}, profile, args) as own:
            return {**run_arm(arm, own, workdir, work, timing, seed), "engine_args": list(args)}

    def conclude(results: scenario.Results) -> scenario.Conclusion:
        summary = compare(results)
        return scenario.Conclusion(
            summary,
            lambda path: plot(results, summary, path),
            lambda: print_table(summary, arms),
        )

    settings = {
        "headroom": headroom, "bucket_fraction": bucket_fraction, "sweep": sweep,
        "isolation": isolation.__dict__,
    }  # fmt: skip
    return scenario.run_scenario(
        NAME, out, workdir, profile=profile, work=work, timing=timing, settings=settings,
        arms=arms, run_arm=run_one, conclude=conclude, figure="noisy-neighbour.png",
        engine_args=isolation.engine_args(),
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm")
    parser.add_argument(
        "--sweep", default=None, help="fixed soft limits to compare, comma separated (4,24,128)"
    )
    parser.add_argument("--headroom", type=int, default=8, help="requests above the soft limit")
    parser.add_argument("--bucket-fraction", type=float, default=0.5)
    parser.add_argument("--quiet-rate", type=float, help="quiet requests/s (default 3)")
    parser.add_argument("--flood-concurrency", type=int, help="flooder clients (default 300)")
    parser.add_argument("--flood-prompt", type=int, help="flooder mean prompt tokens (1024)")
    parser.add_argument("--flood-output", type=int, help="flooder mean output tokens (256)")
    parser.add_argument("--seed", type=int, default=7)
    add_isolation_arguments(parser)


def main(args: argparse.Namespace) -> int:
    work = Workload(flood_concurrency=40) if args.quick else Workload()
    changes = {
        "quiet_rate": args.quiet_rate,
        "flood_concurrency": args.flood_concurrency,
        "flood_prompt": args.flood_prompt,
        "flood_output": args.flood_output,
    }
    work = replace(work, **{k: v for k, v in changes.items() if v is not None})
    timing = scenario.chosen_timing(args, Timing(), Timing.quick())
    if args.warmup is not None:
        timing = with_warmup(timing, args.warmup)
    if args.sweep:
        sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    else:
        sweep = [8] if args.quick else [4, 24, 128]
    run(
        args.out, scenario.workdir_of(args), work, timing, sweep,
        headroom=args.headroom, bucket_fraction=args.bucket_fraction, seed=args.seed,
        isolation=Isolation.from_args(args),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(scenario.script_main("gateway_lab.bench.noisy", __doc__, add_arguments, main))
