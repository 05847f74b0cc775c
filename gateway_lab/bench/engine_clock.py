"""`extproc bench engine-clock`: what the emulated engine's own event loop adds to the quiet
tenant's TTFT under kvwarden's workload, against the simulator's figure for the same model.

The emulated engine (gateway_lab/engine/server.py) runs its step loop and its HTTP server in
one Python event loop. Under kvwarden's workload (a flooder at 32 requests/s x 64 tokens
beside a quiet tenant at 1 request/s, one-line prompts, streamed `/v1/completions`) that loop
writes ~2,000 chunks a second to 20-30 streams, and each step's wake-up comes late. Arms, each
the a100 engine alone on its own core, straight (no Envoy, no gateway), the load generator on
the other:

* `wake`: a step starts when the loop wakes (`--step-clock wake`: the emulator before
  2026-12-05), so the host's lag stretches every step;
* `model`: a step that follows another starts where it ended (the default,
  gateway_lab/engine/timeline.py): the lag only delays deliveries;
* `sim`: the simulator's FIFO point of `extproc bench frontier --workload kvwarden` (the same
  engine model in simulated time, no host at all), ten simulated minutes.

Each live arm measures the quiet tenant alone (its solo) and beside the flooder, in turns
(`--rounds`, the order alternating), so the ratios are side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gateway_lab.bench import frontier, scenario
from gateway_lab.bench.cores import descendants, engines_apart, group_cpu, split_cores
from gateway_lab.bench.loadgen import Load, open_loop
from gateway_lab.bench.monitor import log, wait_engines_idle
from gateway_lab.bench.records import Meter, Record
from gateway_lab.bench.self_overload_load import Timing, Workload, maker
from gateway_lab.bench.stack import engine_set
from gateway_lab.bench.stats import fmt, ttft_stats, within
from gateway_lab.engine.timeline import STEP_CLOCKS

NAME = "engine-clock"
DEFAULT_OUT = Path("results/engine-clock")
PROFILE = frontier.PROFILE
LOADS = ("alone", "room")


async def drive(url: str, work: Workload, timing: Timing, flood: bool, seed: int) -> dict[str, Any]:
    """One measured window straight at the engine: the quiet tenant's TTFT and the flooder's
    output tokens per second."""
    async with Load(url, Meter(bin_s=0.5), request_timeout_s=timing.measure_s + 60.0) as load:
        began = load.now()
        end = began + timing.warmup_s + timing.measure_s
        quiet = maker("quiet", work.quiet_output, work, seed, False)
        jobs = [
            open_loop(load, quiet, work.quiet_rate, end, seed=seed + 1, start=began,
                      grace_s=timing.grace_s),
        ]  # fmt: skip
        if flood:
            flooder = maker("flooder", work.room_output, work, seed + 2, False)
            jobs.append(open_loop(load, flooder, work.room_rate, end, seed=seed + 3, start=began))
        await asyncio.gather(*jobs)
        records: list[Record] = load.records
    start = began + timing.warmup_s
    flooding = within(records, "flooder", start, start + timing.measure_s)
    return {
        "quiet": ttft_stats(within(records, "quiet", start, start + timing.measure_s)),
        "flooder_tok_s": sum(r.output_tokens for r in flooding) / timing.measure_s,
    }


def measure_clock(
    clock: str, workdir: Path, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    """The quiet tenant alone, then beside the flooder, on a fresh engine with `clock`."""
    split = split_cores()
    args = ("--scheduling-policy", "fcfs", "--step-clock", clock)
    with engine_set(workdir / clock, {"p": 1}, PROFILE, args) as engines:
        endpoint = engines.endpoints["p"][0]
        pids = {f"engine {i}": pid for i, pid in enumerate(descendants(os.getpid()))}
        out: dict[str, Any] = {"clock": clock}
        with engines_apart(split, list(pids.values())):
            out.update(_loads(endpoint, pids, work, timing, seed, clock))
        return out


def _loads(
    endpoint: str, pids: dict[str, int], work: Workload, timing: Timing, seed: int, clock: str
) -> dict[str, Any]:
    """The quiet tenant alone, then beside the flooder."""
    out: dict[str, Any] = {}
    for load in LOADS:
        scenario.run_async(wait_engines_idle([endpoint]))
        before = group_cpu(pids)
        result = scenario.run_async(
            drive(f"http://{endpoint}/v1/completions", work, timing, load == "room", seed)
        )
        after = group_cpu(pids)
        spent = sum(after.values()) - sum(before.values())
        result["engine_cores"] = spent / (timing.warmup_s + timing.measure_s)
        out[load] = result
        log(NAME, f"{clock} {load}: quiet P50 {fmt(result['quiet']['p50_ms'])} ms, "
                  f"P99 {fmt(result['quiet']['p99_ms'])} ms")  # fmt: skip
    return out


def simulated(measure_s: float, seed: int) -> dict[str, Any]:
    """The simulator's solo and FIFO on kvwarden's workload (no host)."""
    work = replace(frontier.KVWARDEN, measure_s=measure_s)
    fifo = frontier.Point("fifo", "fifo", None)
    solo = frontier.measure(fifo, work, seed, flooder=False)
    room = frontier.measure(fifo, work, seed)
    return {
        "alone": {"quiet": {"p50_ms": solo["ttft_p50_ms"], "p99_ms": solo["ttft_p99_ms"]}},
        "room": {
            "quiet": {"p50_ms": room["ttft_p50_ms"], "p99_ms": room["ttft_p99_ms"]},
            "flooder_tok_s": room["flooder_tok_s"],
        },
    }


def ratios(arm: dict[str, Any]) -> dict[str, float]:
    alone, room = arm["alone"]["quiet"], arm["room"]["quiet"]
    return {"p50_x": room["p50_ms"] / alone["p50_ms"], "p99_x": room["p99_ms"] / alone["p99_ms"]}


def print_table(report: dict[str, Any]) -> None:
    print("\nquiet TTFT, straight at the emulated a100 engine (kvwarden's workload)")
    print("| arm | alone P50 / P99 ms | beside the flooder P50 / P99 ms | x solo P50 / P99 "
          "| flooder tok/s | engine cores |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, arm in report["arms"].items():
        alone, room = arm["alone"]["quiet"], arm["room"]["quiet"]
        x = arm["ratios"]
        cores = arm["room"].get("engine_cores")
        print(
            f"| {name} | {fmt(alone['p50_ms'])} / {fmt(alone['p99_ms'])} "
            f"| {fmt(room['p50_ms'])} / {fmt(room['p99_ms'])} "
            f"| {x['p50_x']:.2f} / {x['p99_x']:.2f} | {fmt(arm['room']['flooder_tok_s'], 0)} "
            f"| {'-' if cores is None else f'{cores:.2f}'} |"
        )


def plot(report: dict[str, Any], path: Path) -> None:
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(report["arms"])
    width = 0.38
    for offset, key, label in ((-width / 2, "p50_x", "P50"), (width / 2, "p99_x", "P99")):
        values = [report["arms"][name]["ratios"][key] for name in names]
        ax.bar([i + offset for i in range(len(names))], values, width, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_ylabel("quiet TTFT beside the flooder / alone")
    ax.set_title("the emulated engine's own event loop (kvwarden's workload)")
    ax.legend()
    save_figure(fig, path)


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the rounds of one clock: the medians' mean and the P99s' mean per load."""
    merged: dict[str, Any] = {"rounds": rounds}
    for load in LOADS:
        parts = [r[load] for r in rounds]
        merged[load] = {
            "quiet": {
                key: sum(p["quiet"][key] for p in parts) / len(parts)
                for key in ("p50_ms", "p99_ms")
            },
            "flooder_tok_s": sum(p["flooder_tok_s"] for p in parts) / len(parts),
            "engine_cores": sum(p["engine_cores"] for p in parts) / len(parts),
        }
    return merged


def run(out: Path, timing: Timing, rounds: int, seed: int, sim_s: float) -> dict[str, Any]:
    began = time.perf_counter()
    work = Workload()
    by_clock: dict[str, list[dict[str, Any]]] = {clock: [] for clock in STEP_CLOCKS}
    for index in range(rounds):
        order = ("wake", "model") if index % 2 == 0 else ("model", "wake")
        for clock in order:
            by_clock[clock].append(measure_clock(clock, out / "stacks", work, timing, seed + index))
    arms: dict[str, Any] = {"sim": simulated(sim_s, seed)}
    arms.update({clock: _merge(by_clock[clock]) for clock in ("wake", "model")})
    for arm in arms.values():
        arm["ratios"] = ratios(arm)
    report = {
        "scenario": NAME,
        "profile": PROFILE,
        "workload": work.__dict__,
        "timing": timing.__dict__,
        "rounds": rounds,
        "seed": seed,
        "arms": arms,
        "wall_s": time.perf_counter() - began,
    }
    scenario.save_results(
        out, report, "engine-clock.png", lambda path: plot(report, path),
        lambda: print_table(report),
    )  # fmt: skip
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--measure", type=float, default=60.0, help="measured s per window")
    parser.add_argument("--rounds", type=int, default=2, help="turns per clock (default 2)")
    parser.add_argument(
        "--sim-seconds", type=float, default=600.0, help="simulated seconds of the sim arm"
    )
    parser.add_argument("--seed", type=int, default=7)


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    timing = Timing(args.measure)
    sim_s = args.sim_seconds
    if args.quick:
        timing, sim_s = Timing.quick(), 20.0
    run(args.out, timing, args.rounds, args.seed, sim_s)
    return 0
