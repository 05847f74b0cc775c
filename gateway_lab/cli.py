"""The lab's `extproc` subcommands: up, engine, bench, simulate.

Registered under the `extproc.commands` entry point group, so the runtime CLI lists them
without importing the lab.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

# scenario name -> (module under gateway_lab.bench, help)
BENCH_SCENARIOS = {
    "estimator": ("estimator", "token estimation error per content category"),
    "overhead": ("overhead", "CPU and latency cost against a do-nothing ext_proc floor"),
    "calibrate": ("calibrate", "emulator cpu-tiny profile against a real vLLM (CPU) engine"),
    "calibrate-scheduling": (
        "calibrate_sched",
        "engine priority and long_prefill_token_threshold: emulator against vLLM (CPU)",
    ),
    "calibrate-prefix-cache": (
        "calibrate_prefix",
        "prefix caching: a repeated long prompt's TTFT vs a fresh one, emulator vs vLLM (CPU)",
    ),
    "noisy-neighbour": (
        "noisy",
        "a quiet tenant beside a flooder: FIFO, token bucket, full policy",
    ),
    "token-fairness": ("fairness", "request-count vs token (DRR, VTC) fairness: Jain, service gap"),
    "tiers": ("tiers", "premium vs standard tenants over capacity: TTFT, weighted shares, waits"),
    "embedding-flood": (
        "embedding_flood",
        "2,000-input embedding batches beside chat on one pool: chat TTFT, token shares",
    ),
    "vllm-priority": (
        "vllm_priority",
        "engine priority on real vLLM (CPU): a quiet tenant beside a flooder, priority vs fcfs",
    ),
    "scaleout": ("scaleout", "admissions/s and latency with 1, 2, 4 processes, memory vs Redis"),
    "scheduler-scaling": ("sched_scaling", "scheduler CPU per admission vs queue depth"),
    "locality": (
        "locality",
        "shared-prefix traffic on two replicas: VTC, DRR, DLPM (throughput, hits, gap, quiet TTFT)",
    ),
    "locality-sim": (
        "locality_sim",
        "simulated replay of a hash_ids trace (Mooncake): VTC/DRR/DLPM",
    ),
    "low-load": (
        "lowload",
        "what the gateway adds at 1 request/s, per phase: straight, do-nothing, mimic, ours",
    ),
    "kvwarden-published": (
        "kvwarden_published",
        "kvwarden's published per-request CSVs: the tail over the whole run vs after a warm-up",
    ),
    "idle-cpu": ("idle_cpu", "CPU of an idle service: the overload monitor on, off, and before"),
    "frontier": (
        "frontier",
        "noisy neighbour in the simulator: quiet P99 TTFT vs throughput per lever, no host noise",
    ),
    "engine-clock": (
        "engine_clock",
        "the emulated engine's own event loop under kvwarden's workload: its step clock, vs sim",
    ),
    "self-overload": (
        "self_overload",
        "a quiet tenant while the gateway itself is overloaded; kvwarden peer; phase timings",
    ),
    "envoy-counting": (
        "envoy_counting",
        "CPU per streamed chunk: tokens counted in Envoy (Lua) vs relayed to ext_proc",
    ),
    "provenance": (
        "provenance",
        "what differs between two runs' results.json: revision, host, Envoy, package versions",
    ),
}


def _engine(args: argparse.Namespace) -> int:
    from gateway_lab.engine.cli import run

    return run(args)


def _bench(module: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        result: int = importlib.import_module(f"gateway_lab.bench.{module}").main(args)
        return result

    return run


def _simulate(args: argparse.Namespace) -> int:
    from gateway_lab.sim.cli import main as run_simulate

    return run_simulate(args)


def _up(args: argparse.Namespace) -> int:
    from gateway_lab.up import run_up

    return run_up(args)


def register(commands: Any, default_policy: str) -> None:
    """Add the lab's subcommands to the `extproc` parser (`commands` is its subparsers)."""
    engine = commands.add_parser("engine", help="run an emulated vLLM engine")
    from gateway_lab.engine.cli import add_arguments

    add_arguments(engine)
    engine.set_defaults(func=_engine)

    bench = commands.add_parser("bench", help="benchmarks (results saved as JSON and PNG)")
    scenarios = bench.add_subparsers(dest="scenario", required=True)
    for name, (module, help_text) in BENCH_SCENARIOS.items():
        scenario = scenarios.add_parser(name, help=help_text)
        importlib.import_module(f"gateway_lab.bench.{module}").add_arguments(scenario)
        scenario.set_defaults(func=_bench(module))

    simulate = commands.add_parser("simulate", help="offline simulation and capacity planning")
    from gateway_lab.sim.arguments import add_arguments as add_simulate_arguments

    add_simulate_arguments(simulate)
    simulate.set_defaults(func=_simulate)

    up = commands.add_parser("up", help="run Envoy, the service and emulated engines together")
    from gateway_lab.up import add_arguments as add_up_arguments

    add_up_arguments(up, default_policy)
    up.set_defaults(func=_up)
