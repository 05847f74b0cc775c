"""Benchmark: token fairness versus request-count fairness (the VTC paper's point).

Two tenants of one tier send requests at the same Poisson rate, above what the pool serves, so
both stay backlogged at the door: "long" sends ~2,000-token prompts (RAG, documents), "short"
~200-token chat turns; both ask for the same output. Through the real Envoy and the ext_proc
service to one emulated A100 / Llama-3.1-8B engine, with a fixed door capacity, three arms:

* requests: request-count fairness, i.e. DRR with input_weight 0 and output_weight 1: every
  request costs the same, so both tenants get the same number of requests (round robin);
* drr: token fairness, Deficit Round Robin with cost = 1 x input + 2 x output tokens;
* vtc: token fairness, the Virtual Token Counter with the same cost.

Service is measured with one yardstick in every arm, the VTC paper's weighted tokens
(1 x input + 2 x output): *delivered* as the engine streams (prompt at the first token, output
per token) and *dispatched* at the door (a request's whole cost when it is admitted). Reported:
Jain's fairness index of the two tenants' service in the measured window, and the largest
service gap, max over intervals [t1, t2] of |W_long(t1, t2) - W_short(t1, t2)|, against the
VTC bound 2 x U (U: the largest single-request cost).

`extproc bench token-fairness [--out results/token-fairness] [--quick]`
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extproc.policy import hash_key
from gateway_lab.bench import scenario
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.loadgen import Load, open_loop
from gateway_lab.bench.monitor import log
from gateway_lab.bench.records import RECORD_COLUMNS, Meter, Record, Spec
from gateway_lab.bench.stack import PROFILE, EngineSet
from gateway_lab.bench.stats import fmt, jain_index, status_counts

NAME = "token-fairness"
DEFAULT_OUT = Path("results/token-fairness")
TENANTS = ("long", "short")
KEYS = {"long": "bench-long-key", "short": "bench-short-key"}
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


@dataclass(frozen=True)
class Workload:
    rate: float = 8.0
    """Requests/s each tenant sends (Poisson): above what either can get, so both stay
    backlogged in every arm."""
    long_prompt: int = 2000
    short_prompt: int = 200
    output: int = 128
    spread: float = 0.1
    """Prompt sizes uniform in [(1 - spread) x, (1 + spread) x]."""
    max_inflight: int = 16
    """The door's fixed capacity (requests in the engine)."""
    max_queued: int = 400


@dataclass(frozen=True)
class Timing:
    warmup_s: float = 10.0
    measure_s: float = 50.0
    bin_s: float = 0.5

    @classmethod
    def quick(cls) -> Timing:
        return cls(1.0, 3.0, 0.25)


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    input_weight: float
    output_weight: float
    label: str


ARMS = (
    Arm("requests", "drr", 0.0, 1.0, "request-count (every request costs the same)"),
    Arm("drr", "drr", INPUT_WEIGHT, OUTPUT_WEIGHT, "DRR, tokens (1 x in + 2 x out)"),
    Arm("vtc", "vtc", INPUT_WEIGHT, OUTPUT_WEIGHT, "VTC, tokens (1 x in + 2 x out)"),
)


def policy_text(endpoint: str, arm: Arm, work: Workload) -> str:
    limits = f"{{max_queued: {work.max_queued}, max_queue_wait: 600s}}"
    return f"""\
version: 1
tiers: [standard]
tenants:
  long: {{tier: standard, api_keys: ["{hash_key(KEYS["long"])}"], limits: {limits}}}
  short: {{tier: standard, api_keys: ["{hash_key(KEYS["short"])}"], limits: {limits}}}
pools:
  {scenario.POOL}: {{max_total_tokens: 131072, max_inflight: {work.max_inflight},
          max_inflight_tokens: 1000000000, endpoints: ["{endpoint}"],
          headroom: 0, adaptive: {{enabled: false}}}}
fairness: {{policy: {arm.policy}, input_weight: {arm.input_weight},
           output_weight: {arm.output_weight}, quantum: 64}}
estimation: {{mode: flat, default_bytes_per_token: 4.0}}
gateway: {{default_max_tokens: 256, message_timeout: 10s}}
"""


def maker(tenant: str, prompt: int, work: Workload, seed: int) -> Callable[[int], Spec]:
    return scenario.spread_maker(
        tenant, KEYS[tenant], prompt, work.output, work.spread, seed, vary_output=False
    )


def request_cost(record: Record) -> float:
    return INPUT_WEIGHT * record.prompt_tokens + OUTPUT_WEIGHT * record.max_tokens


def dispatched_bins(records: Sequence[Record], bin_s: float) -> dict[str, dict[int, float]]:
    """Cost of each admitted request at its admission (start + the gateway's queue wait)."""
    out: dict[str, dict[int, float]] = {}
    for record in records:
        if record.queue_ms is None or record.status != 200:
            continue
        at = record.start + record.queue_ms / 1000.0
        bins = out.setdefault(record.tenant, {})
        index = int(at // bin_s)
        bins[index] = bins.get(index, 0.0) + request_cost(record)
    return out


def cumulative(bins: dict[int, float], first: int, last: int) -> list[float]:
    total = 0.0
    out = []
    for index in range(first, last):
        total += bins.get(index, 0.0)
        out.append(total)
    return out


def service_figures(
    bins: dict[str, dict[int, float]], start: float, end: float, bin_s: float, bound: float
) -> dict[str, Any]:
    """Totals, Jain's index and the largest gap of the two tenants in [start, end)."""
    first, last = int(start // bin_s), int(end // bin_s)
    curves = {t: cumulative(bins.get(t, {}), first, last) for t in TENANTS}
    totals = {t: (curves[t][-1] if curves[t] else 0.0) for t in TENANTS}
    diff = [a - b for a, b in zip(curves["long"], curves["short"], strict=True)]
    diff = [0.0, *diff]
    gap = max(diff) - min(diff) if diff else math.nan
    seconds = max(1e-9, end - start)
    return {
        "service_per_s": {t: totals[t] / seconds for t in TENANTS},
        "jain": jain_index([totals[t] for t in TENANTS]),
        "max_gap": gap,
        "gap_over_bound": gap / bound if bound else math.nan,
        "curves": {t: [round(v, 1) for v in curves[t]] for t in TENANTS},
    }


async def drive_arm(
    arm: Arm, url: str, work: Workload, timing: Timing, seed: int
) -> tuple[Load, Meter, float]:
    meter = Meter(timing.bin_s, INPUT_WEIGHT, OUTPUT_WEIGHT)
    end = timing.warmup_s + timing.measure_s
    async with Load(url, meter) as load:
        jobs = [
            open_loop(load, maker(t, p, work, seed + i), work.rate, end, seed=seed + 10 + i)
            for i, (t, p) in enumerate((("long", work.long_prompt), ("short", work.short_prompt)))
        ]
        await scenario.drive(NAME, arm.name, load, jobs, end)
    return load, meter, end


def run_arm(
    arm: Arm, engines: EngineSet, workdir: Path, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    endpoint = engines.endpoints[scenario.POOL][0]
    text = policy_text(endpoint, arm, work)
    with scenario.arm_gateway(
        NAME, arm.name, workdir, engines, text, "service", announce=f"arm {arm.name}: {arm.label}"
    ) as gateway:
        load, meter, end = scenario.run_async(drive_arm(arm, gateway.url, work, timing, seed))
    start = timing.warmup_s
    longest_prompt = math.ceil(work.long_prompt * (1 + work.spread))
    unit = INPUT_WEIGHT * longest_prompt + OUTPUT_WEIGHT * work.output
    bound = 2.0 * unit
    delivered = service_figures(meter.service, start, end, timing.bin_s, bound)
    dispatched = service_figures(
        dispatched_bins(load.records, timing.bin_s), start, end, timing.bin_s, bound
    )
    requests = {
        t: sum(
            1
            for r in load.records
            if r.tenant == t and r.queue_ms is not None and start <= r.start + r.queue_ms / 1e3
            and r.start + r.queue_ms / 1e3 < end
        )
        / timing.measure_s
        for t in TENANTS
    }  # fmt: skip
    log(
        NAME,
        f"arm {arm.name}: Jain {delivered['jain']:.3f}, gap {delivered['max_gap']:.0f} "
        f"({delivered['gap_over_bound']:.2f} x bound)",
    )
    return {
        "arm": arm.name,
        "label": arm.label,
        "fairness": {
            "policy": arm.policy,
            "input_weight": arm.input_weight,
            "output_weight": arm.output_weight,
        },
        "window_s": [start, end],
        "largest_request_cost": unit,
        "vtc_bound": bound,
        "admitted_per_s": requests,
        "delivered": delivered,
        "dispatched": dispatched,
        "tokens_per_s": {t: meter.rate(t, start, end) for t in TENANTS},
        "status": {t: status_counts([r for r in load.records if r.tenant == t]) for t in TENANTS},
        "records": {"columns": RECORD_COLUMNS, "rows": [r.as_row() for r in load.records]},
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'arm':9} {'admitted req/s':>15} {'service/s (1xin+2xout)':>23} "
        f"{'Jain':>6} {'max gap':>8} {'gap/bound':>9} {'Jain@door':>9} {'gap/bound@door':>14}"
    )
    print(f"{'':9} {'long':>7} {'short':>7} {'long':>11} {'short':>11}")
    for name, r in results.items():
        d, g = r["delivered"], r["dispatched"]
        print(
            f"{name:9} {r['admitted_per_s']['long']:7.2f} {r['admitted_per_s']['short']:7.2f} "
            f"{d['service_per_s']['long']:11.0f} {d['service_per_s']['short']:11.0f} "
            f"{fmt(d['jain'], 3):>6} {fmt(d['max_gap'], 0):>8} {fmt(d['gap_over_bound'], 2):>9} "
            f"{fmt(g['jain'], 3):>9} {fmt(g['gap_over_bound'], 2):>14}"
        )
    any_result = next(iter(results.values()), None)
    if any_result is not None:
        print(
            f"\nVTC bound 2 x U = {any_result['vtc_bound']:.0f} weighted tokens "
            f"(U = largest request cost {any_result['largest_request_cost']:.0f}); "
            "gap = max over intervals of |service(long) - service(short)|"
        )


def plot(results: dict[str, dict[str, Any]], timing: Timing, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [axes[0][0], axes[0][1], axes[1][0]]
    colors = {"long": "#d62728", "short": "#1f77b4"}
    for ax, (name, result) in zip(panels, results.items(), strict=False):
        curves = result["delivered"]["curves"]
        for tenant in TENANTS:
            ys = [v / 1000.0 for v in curves[tenant]]
            xs = [timing.warmup_s + (i + 1) * timing.bin_s for i in range(len(ys))]
            ax.plot(xs, ys, color=colors[tenant], label=f"{tenant} prompts")
        ax.set_title(f"{name}: {result['label']}\nJain {result['delivered']['jain']:.3f}",
                     fontsize=9)  # fmt: skip
        ax.set_xlabel("seconds")
        ax.set_ylabel("weighted service (k tokens, 1 x in + 2 x out)")
        ax.legend(fontsize=8)
    ax = axes[1][1]
    bound = max((r["vtc_bound"] for r in results.values()), default=0.0) / 1000.0
    for name, result in results.items():
        curves = result["delivered"]["curves"]
        diff = [(a - b) / 1000.0 for a, b in zip(curves["long"], curves["short"], strict=True)]
        xs = [timing.warmup_s + (i + 1) * timing.bin_s for i in range(len(diff))]
        label = name
        if diff and abs(diff[-1]) > 3 * bound:
            label = f"{name} (off the scale: {diff[-1]:+.0f}k at the end)"
        ax.plot(xs, diff, label=label)
    ax.axhline(bound, ls="--", color="black", lw=0.8)
    ax.axhline(-bound, ls="--", color="black", lw=0.8, label="VTC bound +-2U")
    if bound > 0:
        ax.set_ylim(-3 * bound, 3 * bound)
    ax.set_title("service(long) - service(short) since the window start", fontsize=9)
    ax.set_xlabel("seconds")
    ax.set_ylabel("k weighted tokens")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(
    out: Path,
    workdir: Path,
    work: Workload,
    timing: Timing,
    *,
    seed: int = 11,
    profile: str = PROFILE,
) -> dict[str, Any]:

    def conclude(results: scenario.Results) -> scenario.Conclusion:
        return scenario.Conclusion(
            None, lambda path: plot(results, timing, path), lambda: print_table(results)
        )

    return scenario.run_scenario(
        NAME, out, workdir, profile=profile, work=work, timing=timing,
        settings={"weights": {"input": INPUT_WEIGHT, "output": OUTPUT_WEIGHT}}, arms=ARMS,
        run_arm=lambda arm, engines, _results: run_arm(arm, engines, workdir, work, timing, seed),
        conclude=conclude, figure="token-fairness.png",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm (default 50)")
    parser.add_argument("--rate", type=float, help="requests/s per tenant (default 8)")
    parser.add_argument("--max-inflight", type=int, help="door capacity (default 16)")
    parser.add_argument("--seed", type=int, default=11)


def main(args: argparse.Namespace) -> int:
    work = Workload()
    if args.rate:
        work = replace(work, rate=args.rate)
    if args.max_inflight:
        work = replace(work, max_inflight=args.max_inflight)
    timing = scenario.chosen_timing(args, Timing(), Timing.quick())
    run(args.out, scenario.workdir_of(args), work, timing, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.fairness", __doc__, add_arguments, main)
    )
