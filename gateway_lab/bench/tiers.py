"""Benchmark: tiers. A premium tenant and three standard tenants together, over capacity.

The premium tenant ("acme") sends chat requests at a moderate Poisson rate; three standard
tenants ("globex" weight 2, "initech" and "hooli" weight 1) each keep many requests going from
a closed loop, together more than the engine batches. One emulated A100 / Llama-3.1-8B engine,
the real Envoy. Arms:

* premium-solo: the premium tenant alone through the service (its reference);
* fifo: everyone, Envoy straight to the engine (FCFS inside the engine, no tiers);
* tiers: everyone through the service: strict tiers, DRR fair share (weighted) inside the
  standard tier, capacity that follows the engine plus headroom (the full policy).

Reported: the premium tenant's time to first token (P50/P99) against its solo value; each
standard tenant's weighted token service per unit of weight and Jain's index of those (1.0:
shares exactly proportional to weights); every tenant's longest wait (queue wait at the door
and time to first token): nothing may starve.

`extproc bench tiers [--out results/tiers] [--quick]`
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extproc.policy import hash_key
from extproc.scheduler.adaptive import AdaptiveSettings
from gateway_lab.bench import scenario
from gateway_lab.bench.capacity import CapacityConfig
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.loadgen import Load
from gateway_lab.bench.monitor import Monitor, log
from gateway_lab.bench.records import RECORD_COLUMNS, Meter, Spec
from gateway_lab.bench.stack import PROFILE, EngineSet, Gateway
from gateway_lab.bench.stats import fmt, jain_index, status_counts, ttft_stats, within

NAME = "tiers"
DEFAULT_OUT = Path("results/tiers")
PREMIUM = "acme"
STANDARD = {"globex": 2.0, "initech": 1.0, "hooli": 1.0}
KEYS = {name: f"bench-{name}-key" for name in (PREMIUM, *STANDARD)}


@dataclass(frozen=True)
class Workload:
    premium_rate: float = 2.0
    premium_prompt: int = 300
    premium_output: int = 128
    standard_concurrency: int = 100
    """Closed-loop clients per standard tenant (3 x 100 > the engine's 256 sequences)."""
    standard_prompt: int = 1024
    standard_output: int = 256
    spread: float = 0.5
    headroom: int = 8


@dataclass(frozen=True)
class Timing:
    warmup_solo_s: float = 5.0
    warmup_s: float = 25.0
    measure_s: float = 45.0
    ramp_s: float = 8.0
    grace_s: float = 15.0

    @classmethod
    def quick(cls) -> Timing:
        return cls(0.5, 1.5, 3.0, 0.5, 2.0)


@dataclass(frozen=True)
class Arm:
    name: str
    path: str
    standard: bool
    warmup_s: float


def policy_text(endpoint: str, work: Workload) -> str:
    limits = "{max_queued: 100000, max_queue_wait: 600s}"
    lines = [
        "version: 1",
        "tiers: [premium, standard]",
        "tenants:",
        f'  {PREMIUM}: {{tier: premium, api_keys: ["{hash_key(KEYS[PREMIUM])}"], '
        f"limits: {limits}}}",
    ]
    for name, weight in STANDARD.items():
        lines.append(
            f'  {name}: {{tier: standard, weight: {weight}, api_keys: ["{hash_key(KEYS[name])}"],'
            f" limits: {limits}}}"
        )
    lines += [
        "pools:",
        f"  {scenario.POOL}: {{max_total_tokens: 131072, max_inflight: 512, "
        f'max_inflight_tokens: 1000000000, endpoints: ["{endpoint}"]}}',
        "fairness: {policy: drr, input_weight: 1, output_weight: 2, quantum: 64}",
        "estimation: {mode: flat, default_bytes_per_token: 4.0}",
        "gateway: {default_max_tokens: 256, message_timeout: 10s}",
    ]
    return "\n".join(lines) + "\n"


def capacity(work: Workload) -> CapacityConfig:
    settings = AdaptiveSettings(min_inflight=4, initial_inflight=16, headroom=work.headroom)
    return CapacityConfig(adaptive={scenario.POOL: settings})


def premium_maker(work: Workload, seed: int) -> Callable[[int], Spec]:
    return scenario.fixed_maker(
        PREMIUM, KEYS[PREMIUM], work.premium_prompt, work.premium_output, seed
    )


def standard_maker(tenant: str, work: Workload, seed: int) -> Callable[[int], Spec]:
    return scenario.spread_maker(
        tenant, KEYS[tenant], work.standard_prompt, work.standard_output, work.spread, seed,
        vary_output=True,
    )  # fmt: skip


async def drive_arm(
    arm: Arm, gateway: Gateway, engines: EngineSet, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    meter = Meter(bin_s=0.5)
    end = arm.warmup_s + timing.measure_s
    async with Load(gateway.url, meter) as load:
        standard = [
            scenario.Background(
                standard_maker(tenant, work, seed + 10 + index),
                work.standard_concurrency,
                seed + 20 + index,
            )
            for index, tenant in enumerate(STANDARD)
        ]
        premium = scenario.Foreground(premium_maker(work, seed), work.premium_rate, seed + 1)
        monitor = await scenario.contend(
            NAME, arm.name, load, engines, gateway, premium, standard if arm.standard else [],
            end, grace_s=timing.grace_s, ramp_s=timing.ramp_s,
        )  # fmt: skip
    return summarize_arm(arm, load, meter, monitor, end)


def summarize_arm(
    arm: Arm, load: Load, meter: Meter, monitor: Monitor, end: float
) -> dict[str, Any]:
    start = arm.warmup_s
    tenants: dict[str, Any] = {}
    for tenant in (PREMIUM, *STANDARD):
        if tenant not in load.sent:
            continue
        # Latency figures of requests sent in the window; waits over the whole run (requests
        # still waiting at the end count with their wait so far).
        records = within(load.records, tenant, start, end)
        everything = [r for r in load.records if r.tenant == tenant]
        waits = [r.queue_ms for r in everything if r.queue_ms is not None]
        tenants[tenant] = {
            "ttft": ttft_stats(records),
            "ttft_all": ttft_stats(everything),
            "status": status_counts(everything),
            "queue_wait_max_ms": max(waits) if waits else None,
            "queue_wait_p99_ms": sorted(waits)[max(0, math.ceil(0.99 * len(waits)) - 1)]
            if waits
            else None,
            "tok_s": meter.rate(tenant, start, end),
            "service_per_s": meter.rate(tenant, start, end, service=True),
            "weight": STANDARD.get(tenant, 1.0),
        }
    standard = [t for t in STANDARD if t in tenants]
    per_weight = [tenants[t]["service_per_s"] / STANDARD[t] for t in standard]
    return {
        "arm": arm.name,
        "path": arm.path,
        "window_s": [start, end],
        "tenants": tenants,
        "standard_jain_per_weight": jain_index(per_weight) if per_weight else math.nan,
        "total_tok_s": sum(t["tok_s"] for t in tenants.values()),
        "timeseries": monitor.samples,
        "records": {"columns": RECORD_COLUMNS, "rows": [r.as_row() for r in load.records]},
    }


def run_arm(
    arm: Arm, engines: EngineSet, workdir: Path, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    endpoint = engines.endpoints[scenario.POOL][0]
    with scenario.arm_gateway(
        NAME, arm.name, workdir, engines, policy_text(endpoint, work), arm.path, capacity(work)
    ) as gateway:
        result: dict[str, Any] = scenario.run_async(
            drive_arm(arm, gateway, engines, work, timing, seed)
        )
    premium = result["tenants"].get(PREMIUM, {}).get("ttft", {})
    log(NAME, f"arm {arm.name}: premium p50 {fmt(premium.get('p50_ms', math.nan))} ms "
              f"p99 {fmt(premium.get('p99_ms', math.nan))} ms")  # fmt: skip
    return result


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    solo = results.get("premium-solo", {}).get("tenants", {}).get(PREMIUM, {}).get("ttft", {})
    out: dict[str, Any] = {}
    for name, result in results.items():
        premium = result["tenants"].get(PREMIUM, {}).get("ttft", {})
        out[name] = {
            "premium_p50_ms": premium.get("p50_ms", math.nan),
            "premium_p99_ms": premium.get("p99_ms", math.nan),
            "premium_p50_ratio": premium.get("p50_ms", math.nan) / solo.get("p50_ms", math.nan),
            "premium_p99_ratio": premium.get("p99_ms", math.nan) / solo.get("p99_ms", math.nan),
            "standard_jain_per_weight": result["standard_jain_per_weight"],
            "total_tok_s": result["total_tok_s"],
            "longest_wait_ms": {
                t: {
                    "queue": v["queue_wait_max_ms"],
                    "ttft": v["ttft_all"]["max_ms"],
                    "censored": v["ttft_all"]["censored"],
                }
                for t, v in result["tenants"].items()
            },
        }
    return out


def print_table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    print(
        f"\n{'arm':13} {'premium p50':>11} {'p99':>9} {'p50 x':>6} {'p99 x':>6} "
        f"{'std Jain/weight':>15} {'total tok/s':>11}"
    )
    for name, row in summary.items():
        print(
            f"{name:13} {fmt(row['premium_p50_ms']):>9}ms {fmt(row['premium_p99_ms']):>7}ms "
            f"{fmt(row['premium_p50_ratio'], 2):>6} {fmt(row['premium_p99_ratio'], 2):>6} "
            f"{fmt(row['standard_jain_per_weight'], 3):>15} {fmt(row['total_tok_s'], 0):>11}"
        )
    print(
        "\nmax door wait: longest time a request was held by the gateway; longest wait: longest"
        "\ntime to first token, counting requests still waiting when the run stopped"
    )
    print(
        f"\n{'arm':13} {'tenant':8} {'tier':8} {'weight':>6} {'tok/s':>7} {'service/s/w':>11} "
        f"{'max door wait':>13} {'longest wait':>12} {'answered':>8}"
    )
    for name, result in results.items():
        for tenant, v in result["tenants"].items():
            tier = "premium" if tenant == PREMIUM else "standard"
            ok = v["status"].get("200", 0)
            queue = v["queue_wait_max_ms"]
            print(
                f"{name:13} {tenant:8} {tier:8} {v['weight']:6.1f} {v['tok_s']:7.0f} "
                f"{v['service_per_s'] / v['weight']:11.0f} "
                f"{(fmt(queue / 1000.0, 2) + 's') if queue is not None else '-':>13} "
                f"{fmt(v['ttft_all']['max_ms'] / 1000.0, 2) + 's':>12} {ok:8d}"
            )


def plot(results: dict[str, dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    names = list(summary)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [summary[n]["premium_p50_ms"] for n in names], 0.4,
           label="P50", color="#9467bd", alpha=0.55)  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [summary[n]["premium_p99_ms"] for n in names], 0.4,
           label="P99", color="#9467bd")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(list(xs), names)
    ax.set_title("premium tenant: time to first token (ms)")
    ax.legend(fontsize=8)
    ax = axes[1]
    width = 0.8 / max(1, len(STANDARD))
    arms = [n for n in results if any(t in results[n]["tenants"] for t in STANDARD)]
    for i, tenant in enumerate(STANDARD):
        values = [
            results[n]["tenants"].get(tenant, {}).get("service_per_s", 0.0) / STANDARD[tenant]
            for n in arms
        ]
        ax.bar([x + (i - 1) * width for x in range(len(arms))], values, width,
               label=f"{tenant} (w={STANDARD[tenant]:g})")  # fmt: skip
    ax.set_xticks(range(len(arms)), arms)
    ax.set_title("standard tenants: weighted service / s per unit of weight")
    ax.legend(fontsize=8)
    ax = axes[2]
    tenants = [PREMIUM, *STANDARD]
    width = 0.8 / max(1, len(arms))
    for i, name in enumerate(arms):
        values = [
            (results[name]["tenants"].get(t, {}).get("ttft_all", {}).get("max_ms") or 0.0) / 1000.0
            for t in tenants
        ]
        ax.bar([x + (i - 0.5) * width for x in range(len(tenants))], values, width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(tenants)), tenants)
    ax.set_title("longest time to first token per tenant (s)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(
    out: Path,
    workdir: Path,
    work: Workload,
    timing: Timing,
    *,
    seed: int = 23,
    profile: str = PROFILE,
) -> dict[str, Any]:
    arms = [
        Arm("premium-solo", "service", False, timing.warmup_solo_s),
        Arm("fifo", "direct", True, timing.warmup_s),
        Arm("tiers", "service", True, timing.warmup_s),
    ]

    def conclude(results: scenario.Results) -> scenario.Conclusion:
        summary = compare(results)
        return scenario.Conclusion(
            summary,
            lambda path: plot(results, summary, path),
            lambda: print_table(results, summary),
        )

    return scenario.run_scenario(
        NAME, out, workdir, profile=profile, work=work, timing=timing,
        settings={"weights": STANDARD}, arms=arms,
        run_arm=lambda arm, engines, _results: run_arm(arm, engines, workdir, work, timing, seed),
        conclude=conclude, figure="tiers.png",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm (default 45)")
    parser.add_argument("--premium-rate", type=float, help="premium requests/s (default 2)")
    parser.add_argument("--standard-concurrency", type=int, help="clients per standard tenant")
    parser.add_argument("--seed", type=int, default=23)


def main(args: argparse.Namespace) -> int:
    work = Workload(standard_concurrency=16) if args.quick else Workload()
    if args.premium_rate:
        work = replace(work, premium_rate=args.premium_rate)
    if args.standard_concurrency:
        work = replace(work, standard_concurrency=args.standard_concurrency)
    timing = scenario.chosen_timing(args, Timing(), Timing.quick())
    run(args.out, scenario.workdir_of(args), work, timing, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(scenario.script_main("gateway_lab.bench.tiers", __doc__, add_arguments, main))
