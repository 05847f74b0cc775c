"""`extproc simulate` (replay a trace on a simulated fleet) and `extproc simulate plan`
(capacity planning). Wire with `add_arguments(parser)` (gateway_lab.sim.arguments) and
`main(args)`.

Options of `plan` go after the word `plan`: `extproc simulate plan --trace FILE ...`.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extproc.policy import PolicyError, load_policy
from extproc.policy.runtime import Policy
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.progress import Progress
from gateway_lab.sim.arguments import DEFAULT_PROFILE, add_arguments
from gateway_lab.sim.fleet import (
    PoolEngines,
    derive_capacity,
    derived_pool,
    parse_assignments,
    profile_for_context,
    resolve_profile,
)
from gateway_lab.sim.simulator import MaxTokens, ProgressHook, SimResult
from gateway_lab.sim.slo import Slo
from gateway_lab.sim.trace import TraceError, TraceRequest, read_trace, shape_trace

__all__ = ["add_arguments", "main", "run"]

SCENARIO_DURATION_S = 600.0


class UsageError(Exception):
    """A command-line mistake: printed without a traceback, exit status 2."""


# --- shared helpers -------------------------------------------------------------------------


def _max_tokens(text: str) -> MaxTokens:
    if text in ("actual", "default"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--max-tokens {text!r}: expected actual, default or a number") from None
    if value < 1:
        raise UsageError("--max-tokens must be >= 1")
    return value


def _slo(args: argparse.Namespace) -> Slo:
    def seconds(ms: float | None) -> float | None:
        return None if ms is None or ms <= 0 else ms / 1000.0

    return Slo(
        ttft_s=seconds(args.slo_ttft_ms),
        ttft_per_ktok_s=max(0.0, args.slo_ttft_per_ktok_ms) / 1000.0,
        tpot_s=seconds(args.slo_tpot_ms),
        e2e_s=seconds(args.slo_e2e_ms),
    )


def _profiles(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    default = DEFAULT_PROFILE
    per_pool: dict[str, str] = {}
    for item in args.profile or []:
        if "=" in item:
            per_pool.update(parse_assignments([item], "--profile"))
        else:
            default = item
    return default, per_pool


def _with_engine_flags(profile: EngineProfile, args: argparse.Namespace) -> EngineProfile:
    return profile.with_overrides({"enable_prefix_caching": args.enable_prefix_caching})


def _workload(
    args: argparse.Namespace, policy: Policy | None
) -> tuple[list[TraceRequest], Policy | None]:
    """The requests (with tenants) and the policy to run them with (a scenario adds tenants)."""
    if args.scenario == "servegen":
        from gateway_lab.sim.servegen import generate, load_clients, pick_clients, scenario_policy

        clients = pick_clients(
            load_clients(args.servegen_file, args.servegen_model), args.clients, args.servegen_pick
        )
        requests = generate(
            clients,
            args.duration or SCENARIO_DURATION_S,
            seed=args.seed,
            rate_scale=args.rate_scale,
        )
        if policy is not None:
            policy = scenario_policy(policy, clients)
        return requests, policy
    if not args.trace:
        raise UsageError("give --trace FILE or --scenario servegen")
    from gateway_lab.sim.tenants import assign_tenants

    requests = shape_trace(
        read_trace(args.trace, time_unit=args.time_unit),
        rate_scale=args.rate_scale,
        duration=args.duration,
        start=args.start,
        sample=args.sample,
        seed=args.seed,
    )
    if policy is not None:
        names = list(policy.tenants)
    elif "=" in args.tenants:
        names = []
    else:
        names = ["tenant"]
    return assign_tenants(requests, names, args.tenants, seed=args.seed), policy


def _workload_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The workload options a report records."""
    return {
        "trace": args.trace,
        "scenario": args.scenario,
        "rate_scale": args.rate_scale,
        "duration": args.duration,
        "start": args.start,
        "sample": args.sample,
        "seed": args.seed,
    }


def _run(command: str, body: Any, args: argparse.Namespace) -> int:
    try:
        result: int = body(args)
        return result
    except UsageError as error:
        print(f"extproc {command}: {error}", file=sys.stderr)
        return 2
    except (PolicyError, TraceError, ValueError, OSError) as error:
        print(f"extproc {command}: {error}", file=sys.stderr)
        return 1


# --- simulate -------------------------------------------------------------------------------


def _fleet(args: argparse.Namespace, policy: Policy) -> dict[str, PoolEngines]:
    default, per_pool = _profiles(args)
    replicas = parse_assignments(args.replicas, "--replicas")
    unknown = sorted((set(replicas) | set(per_pool)) - set(policy.pools))
    if unknown:
        raise UsageError(
            f"unknown pool(s) {', '.join(unknown)}; the policy has {list(policy.pools)}"
        )
    fleet: dict[str, PoolEngines] = {}
    for name, pool in policy.pools.items():
        base = _with_engine_flags(resolve_profile(per_pool.get(name, default)), args)
        profile = base
        if not args.no_context_scaling:
            length = min(pool.max_total_tokens, base.max_model_len)
            profile = profile_for_context(
                base, length, kv_provision=args.kv_provision, seq_cap=args.max_num_seqs_cap
            )
        try:
            count = int(replicas.get(name, len(pool.endpoints)))
        except ValueError:
            raise UsageError(f"--replicas {name}={replicas[name]}: not a number") from None
        fleet[name] = PoolEngines(name, profile, count)
    return fleet


def _capacity_notes(policy: Policy, fleet: dict[str, PoolEngines]) -> list[str]:
    notes = []
    for name, engines in fleet.items():
        derived = derived_pool(engines)
        limit = policy.pools[name].max_inflight
        if limit != derived.max_inflight:
            effect = "engines queue FCFS" if limit > derived.max_inflight else "engines idle"
            notes.append(
                f"note: pool {name!r} admits {limit} in flight, its {engines.replicas} replicas "
                f"batch {derived.max_inflight} ({effect}; --capacity derived matches them)"
            )
    return notes


def _save_requests(result: SimResult, path: Path) -> None:
    fields = [
        "request_id", "tenant", "tier", "pool", "arrival", "input_tokens", "output_tokens",
        "max_tokens", "outcome", "queue_wait", "ttft", "e2e", "tpot", "preemptions", "replica",
    ]  # fmt: skip
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for r in result.records:
            writer.writerow(
                [
                    r.request_id, r.tenant, r.tier, r.pool, f"{r.arrival:.6f}", r.input_tokens,
                    r.generated, r.max_tokens, r.outcome.value if r.outcome else "",
                    _opt(r.queue_wait), _opt(r.ttft), _opt(r.e2e), _opt(r.tpot), r.preemptions,
                    "" if r.replica is None else result.replicas[r.replica].name,
                ]
            )  # fmt: skip


def _opt(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def _progress_hook(tracker: Progress, horizon: float) -> ProgressHook:
    """The simulator's hook, shown as requests resolved (with an ETA) and simulated time."""
    tracker.phase(f"{tracker.total:.0f} requests arriving over {horizon:.0f}s")

    def hook(sim_time: float, resolved: int, _total: int) -> None:
        tracker.update(resolved, f"t={sim_time:.0f}/{horizon:.0f}s")

    return hook


def _simulate(args: argparse.Namespace) -> int:
    from gateway_lab.sim.output import format_report, write_json
    from gateway_lab.sim.simulator import SimConfig, simulate
    from gateway_lab.sim.stats import report

    policy = load_policy(args.policy)
    requests, scenario = _workload(args, policy)
    assert scenario is not None
    policy = scenario
    fleet = _fleet(args, policy)
    if args.capacity == "derived":
        policy = derive_capacity(policy, fleet)
    else:
        for note in _capacity_notes(policy, fleet):
            print(note, file=sys.stderr)
    if not requests:
        raise UsageError("the workload has no requests")
    tracker = None if args.quiet else Progress("simulate", len(requests), unit="requests")
    config = SimConfig(
        policy=policy,
        fleet=fleet,
        slo=_slo(args),
        max_tokens=_max_tokens(args.max_tokens),
        balance=args.balance,
    )
    hook = None if tracker is None else _progress_hook(tracker, requests[-1].at)
    result = simulate(requests, config, hook)
    if tracker is not None:
        tracker.finish(f"{result.end_time:.0f}s simulated")
    data = report(result)
    data["config"] = {
        **_workload_settings(args),
        "policy": args.policy,
        "tenants": args.tenants,
        "max_tokens": args.max_tokens,
        "capacity": args.capacity,
        "balance": args.balance,
        "pools": {
            name: {
                "replicas": engines.replicas,
                "profile": engines.profile.name,
                "max_model_len": engines.profile.max_model_len,
                "max_num_seqs": engines.profile.max_num_seqs,
                "max_inflight": policy.pools[name].max_inflight,
                "max_inflight_tokens": policy.pools[name].max_inflight_tokens,
                "max_total_tokens": policy.pools[name].max_total_tokens,
            }
            for name, engines in fleet.items()
        },
    }
    out = Path(args.out)
    written = [write_json(out / "report.json", data)]
    if args.save_requests:
        _save_requests(result, out / "requests.csv")
        written.append(out / "requests.csv")
    if not args.no_plots:
        written.extend(_plots(result, out))
    print(format_report(data))
    print(
        f"simulated {data['simulated_s']:.0f}s, {len(requests)} requests, {result.events} events "
        f"in {result.wall_s:.1f}s; wrote {', '.join(str(p) for p in written)}"
    )
    return 0


def _plots(result: SimResult, out: Path) -> list[Path]:
    try:
        from gateway_lab.sim.plots import latency_cdfs, utilisation
    except ImportError:
        print("note: matplotlib is not installed: no plots", file=sys.stderr)
        return []
    return [
        latency_cdfs(result, out / "latency_cdf.png"),
        utilisation(result, out / "utilisation.png"),
    ]


# --- plan -----------------------------------------------------------------------------------


def _thresholds(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--thresholds {text!r}: expected numbers like 2048,4096,8192") from None
    if not values or min(values) < 2:
        raise UsageError("--thresholds needs at least one threshold >= 2")
    return values


def _plan(args: argparse.Namespace) -> int:
    from gateway_lab.sim.output import format_plan, plan_to_dict, write_json
    from gateway_lab.sim.plan import PlanConfig, plan_capacity

    policy = load_policy(args.policy) if args.policy else None
    requests, policy = _workload(args, policy)
    if not requests:
        raise UsageError("the workload has no requests")
    default, per_pool = _profiles(args)
    if per_pool:
        raise UsageError("plan uses one engine profile: --profile NAME")
    config = PlanConfig(
        base_profile=_with_engine_flags(resolve_profile(default), args),
        slo=_slo(args),
        attainment=args.attainment,
        thresholds=_thresholds(args.thresholds),
        long_context=args.long_context,
        kv_provision=args.kv_provision,
        seq_cap=args.max_num_seqs_cap,
        max_tokens=_max_tokens(args.max_tokens),
        policy=policy,
        max_replicas=args.max_replicas,
        throughput_sample=args.throughput_sample,
        balance=args.balance,
    )

    # The total is the number of pools to size, which the planner sets once it knows it.
    tracker = None if args.quiet else Progress("plan", 1, unit="pools")

    def log(line: str) -> None:
        if tracker is not None:
            tracker.note(line)

    result = plan_capacity(requests, config, log, tracker)
    if tracker is not None:
        tracker.finish(f"{tracker.total:.0f} pools sized")
    data = plan_to_dict(result)
    data["workload"] = _workload_settings(args)
    out = Path(args.out)
    written = [write_json(out / "plan.json", data)]
    if not args.no_plots:
        try:
            from gateway_lab.sim.plots import plan_chart
        except ImportError:
            print("note: matplotlib is not installed: no plots", file=sys.stderr)
        else:
            written.append(plan_chart(result, out / "plan.png"))
    print(format_plan(result))
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


# --- entry points ---------------------------------------------------------------------------


def simulate_main(args: argparse.Namespace) -> int:
    return _run("simulate", _simulate, args)


def plan_main(args: argparse.Namespace) -> int:
    return _run("simulate plan", _plan, args)


def main(args: argparse.Namespace) -> int:
    """Entry point for the `simulate` parser built by `add_arguments`."""
    if getattr(args, "sim_command", None) == "plan":
        return plan_main(args)
    return simulate_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway_lab.sim", description=__doc__)
    add_arguments(parser)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))
