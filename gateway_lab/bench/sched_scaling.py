"""Scheduler cost per admission against queue depth (`extproc bench scheduler-scaling`).

The pure scheduler with a ManualClock, no service: the pool's slots are full and `depth`
requests are queued (over a few or many tenants); then each cycle submits one request,
releases one lease, dispatches (one admission), polls and asks for the next deadline, so the
depth stays constant. CPU per cycle at depth 10,000 should be within 1.5x of depth 10.

Each measurement runs in a fresh process per arm and round (`--worker`, importing only the
standard library and `extproc`), so `--before REV_OR_PATH` can put an older scheduler beside
this one: a source tree (a directory holding `extproc/`) or a git revision, exported with
`git archive`. Rounds alternate the arms; medians of the rounds are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway_lab.bench.provenance import with_provenance
from gateway_lab.bench.revisions import tree_of_rev

SCENARIO = "scheduler-scaling"
DEPTHS = (10, 1_000, 10_000)
TENANT_MODES = {"few": (4, False), "many": (1_000, False), "deadlines": (4, True)}
"""Name -> (tenants the requests are spread over, round robin; whether each request has a
deadline). At a shallow depth only some of the many tenants have a request queued, so tenants
keep joining and leaving the fair share. With deadlines (an hour away: never shed) submit
estimates each request's earliest start and poll runs the shed scan every 0.5 s of clock."""
_WORKER_TIMEOUT_S = 300.0


# --- the worker: stdlib and extproc only (it may run against an older extproc) ---------------


def _policy_text(tenants: int, fairness: str, depth: int) -> str:
    lines = ["version: 1", "tiers: [gold, silver]", "tenants:"]
    for index in range(tenants):
        tier = "gold" if index % 4 == 0 else "silver"
        lines.append(
            f"  t{index}: {{tier: {tier}, weight: {1 + index % 3}, limits: "
            f"{{requests_per_minute: 1000000000, tokens_per_minute: 1000000000000, "
            f"max_queued: {depth + 10}, max_queue_wait: 86400}}}}"
        )
    lines += [
        "pools:",
        # headroom 0: every slot full before any request queues (also valid for older trees)
        "  p: {max_total_tokens: 1000000, max_inflight: 8, max_inflight_tokens: 10000000, "
        'headroom: 0, endpoints: ["127.0.0.1:1"]}',
        f"fairness: {{policy: {fairness}, quantum: 4096}}",
        "gateway: {lease_timeout: 600s}",
    ]
    return "\n".join(lines) + "\n"


def _measure(
    depth: int, tenants: int, fairness: str, cycles: int, deadlines: bool = False
) -> dict[str, float]:
    from extproc.policy import policy_from_text
    from extproc.scheduler import ManualClock, Scheduler, Ticket

    clock = ManualClock(1000.0)
    sched = Scheduler(policy_from_text(_policy_text(tenants, fairness, depth)), clock)
    counter = 0
    leases: list[int] = []

    def ticket() -> Ticket:
        nonlocal counter
        counter += 1
        # sizes vary so that fair-share costs differ between tenants
        deadline = clock.now() + 3600.0 if deadlines else None
        tenant = f"t{counter % tenants}"
        return Ticket(f"r{counter}", tenant, "p", 50 + counter % 7 * 20, 100, deadline=deadline)

    for _ in range(8 + depth):  # fill the slots, then the queue
        if sched.submit(ticket()) is not None:
            raise RuntimeError("the benchmark policy rejected a request")
        leases.extend(a.lease.lease_id for a in sched.dispatch())
    if sched.queued() != depth:
        raise RuntimeError(f"expected {depth} queued, found {sched.queued()}")
    phases = {"submit": 0, "release": 0, "dispatch": 0, "poll": 0}
    clock_ns = time.thread_time_ns  # CPU time: other processes' bursts do not count
    for index in range(cycles):
        clock.advance(0.001)
        t0 = clock_ns()
        sched.submit(ticket())
        t1 = clock_ns()
        sched.release(leases[index], 140, 90)
        t2 = clock_ns()
        admitted = sched.dispatch()
        t3 = clock_ns()
        sched.poll()
        sched.next_deadline()
        t4 = clock_ns()
        leases.extend(a.lease.lease_id for a in admitted)
        phases["submit"] += t1 - t0
        phases["release"] += t2 - t1
        phases["dispatch"] += t3 - t2
        phases["poll"] += t4 - t3
    if sched.queued() != depth or len(leases) != cycles + 8:
        raise RuntimeError("the queue depth drifted: the cycle did not admit one per release")
    out = {"cpu_us": sum(phases.values()) / cycles / 1e3}
    out.update({f"{name}_us": ns / cycles / 1e3 for name, ns in phases.items()})
    return out


def _worker(spec: dict[str, Any]) -> None:
    import gc

    results = []
    configs = spec["configs"]
    shift = spec["round"] % len(configs)  # each round starts elsewhere: drift hits all alike
    for config in configs[shift:] + configs[:shift]:
        gc.collect()
        figures = _measure(
            config["depth"],
            config["tenants"],
            spec["fairness"],
            spec["cycles"],
            config["deadlines"],
        )
        results.append({**config, **figures})
    print(json.dumps(results))


# --- the driver ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=f"results/{SCENARIO}", help="where results go")
    parser.add_argument(
        "--before",
        default=None,
        metavar="REV_OR_PATH",
        help="also measure an older scheduler: a source tree holding extproc/, or a git rev",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm (interleaved)")
    parser.add_argument("--cycles", type=int, default=2000, help="admissions per measurement")
    parser.add_argument("--fairness", default="drr", choices=("drr", "vtc"))
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke tests)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _run_worker(tree: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # -P: the script's folder is not put on sys.path, so only `tree` supplies extproc
    done = subprocess.run(
        [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=_WORKER_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker failed on {tree}:\n{done.stderr}")
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def _key(row: dict[str, Any]) -> tuple[str, int]:
    return (str(row["tenants_mode"]), int(row["depth"]))


def summarise(raw: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over rounds per (arm, tenants, depth), depth ratios, and after/before ratios."""
    medians: dict[str, dict[tuple[str, int], dict[str, float]]] = {}
    for arm, rounds in raw.items():
        by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rows in rounds:
            for row in rows:
                by_key.setdefault(_key(row), []).append(row)
        medians[arm] = {
            key: {
                field: statistics.median(r[field] for r in rows)
                for field in rows[0]
                if field.endswith("_us")
            }
            for key, rows in by_key.items()
        }
    table = []
    for arm, figures in medians.items():
        for (mode, depth), values in sorted(figures.items()):
            shallow = figures.get((mode, min(d for m, d in figures if m == mode)))
            row = {"arm": arm, "tenants_mode": mode, "depth": depth, **values}
            row["vs_shallowest"] = values["cpu_us"] / shallow["cpu_us"] if shallow else None
            if arm != "after" and (mode, depth) in medians.get("after", {}):
                row["after_vs_this"] = medians["after"][(mode, depth)]["cpu_us"] / values["cpu_us"]
            table.append(row)
    deepest = [r for r in table if r["arm"] == "after" and r["depth"] == max(DEPTHS)]
    worst = max((r["vs_shallowest"] for r in deepest), default=None)
    return {"rows": table, "worst_deep_ratio": worst, "target_ratio": 1.5}


def _print_table(summary: dict[str, Any]) -> None:
    header = (
        f"{'arm':<7}{'tenants':>8}{'depth':>8}{'cpu us':>9}{'submit':>8}{'release':>8}"
        f"{'dispatch':>9}{'poll':>7}{'vs d10':>8}{'after/this':>11}"
    )
    print(header)
    for r in summary["rows"]:
        versus = r.get("after_vs_this")
        print(
            f"{r['arm']:<7}{r['tenants_mode']:>8}{r['depth']:>8}{r['cpu_us']:>9.1f}"
            f"{r['submit_us']:>8.1f}{r['release_us']:>8.1f}{r['dispatch_us']:>9.1f}"
            f"{r['poll_us']:>7.1f}{r['vs_shallowest']:>7.2f}x"
            f"{'' if versus is None else f'{versus:>10.2f}x'}"
        )
    worst = summary["worst_deep_ratio"]
    if worst is not None:
        met = "met" if worst <= summary["target_ratio"] else "NOT met"
        print(
            f"target: CPU per admission at depth {max(DEPTHS):,} within "
            f"{summary['target_ratio']}x of depth {min(DEPTHS)}: worst {worst:.2f}x ({met})"
        )


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in summary["rows"]:
        series.setdefault((r["arm"], r["tenants_mode"]), []).append((r["depth"], r["cpu_us"]))
    for (arm, mode), points in sorted(series.items()):
        points.sort()
        style = "-o" if arm == "after" else "--s"
        tenants, deadlines = TENANT_MODES[mode]
        label = f"{arm}, {tenants:,} tenants{', deadlines' if deadlines else ''}"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("requests queued")
    ax.set_ylabel("CPU per admission (us): submit, release, dispatch, poll")
    ax.set_title("Scheduler cost vs queue depth (pure scheduler, ManualClock)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return 0
    depths = (10, 100) if args.quick else DEPTHS
    rounds = 1 if args.quick else args.rounds
    cycles = 200 if args.quick else args.cycles
    configs = [
        {"depth": d, "tenants": n, "deadlines": deadlines, "tenants_mode": mode}
        for mode, (n, deadlines) in TENANT_MODES.items()
        for d in depths
    ]
    spec: dict[str, Any] = {"configs": configs, "fairness": args.fairness, "cycles": cycles}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"after": Path(__file__).resolve().parents[2]}
        if args.before is not None:
            given = Path(args.before)
            trees["before"] = given if given.is_dir() else tree_of_rev(args.before, Path(scratch))
        raw: dict[str, list[list[dict[str, Any]]]] = {arm: [] for arm in trees}
        for round_index in range(rounds):
            order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
            for arm in order:
                print(f"[{SCENARIO}] round {round_index + 1}/{rounds}: {arm}", file=sys.stderr)
                raw[arm].append(_run_worker(trees[arm], {**spec, "round": round_index}))
    summary = summarise(raw)
    _print_table(summary)
    results = {
        "scenario": SCENARIO,
        "fairness": args.fairness,
        "cycles": cycles,
        "rounds": rounds,
        "tenant_modes": TENANT_MODES,
        "before": args.before,
        "raw": raw,
        "summary": summary,
    }
    (out / "results.json").write_text(json.dumps(with_provenance(results), indent=1, default=str))
    _plot(summary, out / f"{SCENARIO}.png")
    print(f"results: {out / 'results.json'}, plot: {out / (SCENARIO + '.png')}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
