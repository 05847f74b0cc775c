"""The noisy-neighbour trade-off without the host (`extproc bench frontier`): the quiet
tenant's P99 time to first token against total throughput, one curve per lever, traced in
the simulator.

The live benchmark (`extproc bench noisy-neighbour`) runs ~60 quiet requests per arm on a
shared 2-core machine, so one slow request moves its P99 by a third and one run does not
place an arm on the curve. Here the same scheduler the service runs and the same engine model
the emulated engine runs (gateway_lab/sim: `Scheduler`, `EngineCore`, one a100-llama3-8b
engine with vLLM's priority policy, as the shipped pools run it) replay the noisy-neighbour
workload in simulated time, so every point is exact for its seed and a sweep takes seconds.

Workload (gateway_lab/bench/noisy.py's, open loop): the quiet tenant at 3 requests/s
(Poisson, 200-token prompts, 64 output tokens); the flooder Poisson above the engine's
capacity (9 requests/s by default), prompts uniform in 512..1,536 tokens and outputs in
128..384. Points:

* `fifo`: no limit at the door; the engine queues first come, first served;
* `door-N`: a static limit of N requests at the door for backlogged tenants (light ones get
  8 more, the headroom), for each N of `--limits`;
* `paced-N`: the same with prefill pacing (`prefill_budget_tokens`, `--prefill-budget`);
* `steps-N`: the same on an engine with smaller steps (`max_num_batched_tokens`,
  `--step-tokens`).

`--workload kvwarden` is kvwarden's published load (below, `KVWARDEN`): FIFO, kvwarden's bucket,
door limits, the service's default capacity (`default`) and the same paced at B prompt tokens
(`paced-B`, `--kvwarden-budgets`), and first-token objectives.

`--workload over` is issue 16's `over` load (the flooder at 48 requests/s x 256 tokens, above
what the engine's batch runs) with the service's default capacity, the adaptive soft limit
fed the engine's own counts (gateway_lab/sim/engine_limits.py), and first-token objectives on
it: the live `over-full` and `over-first-D` arms without the host they share a core with.

Per point: the quiet tenant's TTFT P50 / P99 and P99 of its per-response time per output
token, each as a ratio to the quiet tenant alone in the simulator (the same requests, no
flooder), the output tokens/s of both tenants in the window against FIFO's, and the share
of the flooder's requests that reach the engine in a group of three or more at one instant
(`grouped`: a door limit that binds makes such groups, and they prefill together). (The
simulator keeps one time per response, not every gap, so the every-gap P99 of the live
benchmark is not here; TPOT averages a response.) Issue 15's target region is P99 TTFT <= 2x
and P99 inter-token <= 1.5x at >= 95% of FIFO's throughput.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extproc.policy import policy_from_text
from gateway_lab.bench import scenario
from gateway_lab.bench.monitor import log
from gateway_lab.bench.noisy_isolation import listed
from gateway_lab.bench.records import percentile
from gateway_lab.bench.stats import fmt
from gateway_lab.engine.profiles import EngineProfile, get_profile
from gateway_lab.sim.engine_limits import with_engine_limits
from gateway_lab.sim.fleet import PoolEngines
from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.simulator import SimConfig, simulate
from gateway_lab.sim.trace import TraceRequest

NAME = "frontier"
DEFAULT_OUT = Path("results/frontier")
PROFILE = "a100-llama3-8b"
HEADROOM = 8
ADAPTIVE_CEILING = 512
"""The adaptive points' max_inflight, as the live self-overload arms' policy."""
DEFAULT_LIMITS = (4, 8, 16, 32, 64, 96, 128, 192, 248)
DEFAULT_DELTAS = ("100ms", "300ms", "1s")
DEFAULT_TAIL_DELTAS = ("100ms", "300ms")
DELTA_PREFILL_BUDGET = 4096
"""The δ points' prefill budget when the paced curve is off (the live arms' default)."""
TARGET_TTFT_RATIO = 2.0
TARGET_TPOT_RATIO = 1.5
TARGET_THROUGHPUT = 0.95


@dataclass(frozen=True)
class Workload:
    quiet_rate: float = 3.0
    quiet_prompt: int = 200
    quiet_output: int = 64
    flooder_rate: float = 9.0
    flooder_prompt: tuple[int, int] = (512, 1536)
    flooder_output: tuple[int, int] = (128, 384)
    flooder_start_s: float = 10.0
    """The quiet tenant alone first, so the δ controller learns what alone is (the live
    arms send priming requests for the same reason)."""
    warmup_s: float = 50.0
    measure_s: float = 120.0
    grace_s: float = 15.0
    """Quiet requests still without a first token this long after the window count with
    their wait so far (a lower bound)."""

    def requests(self, seed: int, flooder: bool = True) -> list[TraceRequest]:
        rng = random.Random(seed)
        end = self.warmup_s + self.measure_s
        out = [
            TraceRequest(at, self.quiet_prompt, self.quiet_output, "quiet")
            for at in _poisson(rng, self.quiet_rate, end)
        ]
        if flooder:
            out += [
                TraceRequest(
                    self.flooder_start_s + at,
                    rng.randint(*self.flooder_prompt),
                    rng.randint(*self.flooder_output),
                    "flooder",
                )
                for at in _poisson(rng, self.flooder_rate, end - self.flooder_start_s)
            ]
        return sorted(out, key=lambda request: request.at)


KVWARDEN = Workload(
    quiet_rate=1.0, quiet_prompt=14, flooder_rate=32.0, flooder_prompt=(14, 14),
    flooder_output=(64, 64), measure_s=600.0,
)  # fmt: skip
"""kvwarden's published workload (the `room` load of `extproc bench self-overload`): one-line
prompts, 64 tokens, the quiet tenant at 1 request/s beside a flooder at 32; ten simulated
minutes, so the P99 is of ~600 quiet requests."""
OVER = Workload(
    quiet_rate=1.0, quiet_prompt=14, flooder_rate=48.0, flooder_prompt=(14, 14),
    flooder_output=(256, 256), warmup_s=10.0, measure_s=300.0,
)  # fmt: skip
"""The `over` load of `extproc bench self-overload` (issue 16): the flooder at 48 requests/s
x 256 tokens, above what the engine's batch of 256 sequences runs; the window starts with the
flood, as the live arm's does, and lasts five simulated minutes."""
OVER_FIRST_TOKEN = ("20ms", "30ms")
TARGET_OVER_P99_RATIO = 2.0
KVWARDEN_BUCKET = "{requests_per_minute: 600, requests_burst: 10, max_queued: 1000000}"
"""kvwarden 0.1.6's hero configuration: a per-tenant bucket of 600 requests/min, burst 10."""
KVWARDEN_LIMITS = (8, 12, 16, 24, 32, 48, 64)
KVWARDEN_FIRST_TOKEN = ("10ms", "20ms", "30ms")
KVWARDEN_BUDGETS = (1, 28)
"""Prefill budgets of kvwarden's workload: 1, one backlogged prompt in prefill at a time (any
prompt reaches it), and two of its flooder's 14-token prompts."""
TARGET_KVWARDEN_P99_RATIO = 1.10
TARGET_KVWARDEN_FLOODER_MULTIPLE = 2.0


def _poisson(rng: random.Random, rate: float, end: float) -> list[float]:
    times, at = [], rng.expovariate(rate)
    while at < end:
        times.append(at)
        at += rng.expovariate(rate)
    return times


@dataclass(frozen=True)
class Point:
    name: str
    curve: str
    limit: int | None
    """Requests at the door for backlogged tenants (None: no limit, FIFO)."""
    prefill_budget: int = 0
    step_tokens: int | None = None
    latency_delta: str | None = None
    """The tier's δ objective (YAML flow text): the controller scales the limit and the
    prefill budget for backlogged tenants."""
    flooder_limits: str = "{max_queued: 1000000}"
    """The flooder's `limits` (YAML flow text): the `bucket` point is kvwarden's bucket."""
    engine_policy: str = "priority"
    """The engine's scheduling policy where the door limits (FIFO is always fcfs); the door
    sets each request's engine priority only on `priority`."""
    adaptive: bool = False
    """The service's default capacity instead of `limit`: the adaptive soft limit, fed the
    engine's counts (gateway_lab/sim/engine_limits.py), under a ceiling of 512."""


def policy_text(point: Point) -> str:
    fifo = point.limit is None and not point.adaptive
    inflight = 1_000_000 if point.limit is None else point.limit + HEADROOM
    capacity = (
        f"max_inflight: {inflight}, headroom: {0 if fifo else HEADROOM},\n"
        "       adaptive: {enabled: false},"
        if not point.adaptive
        else f"max_inflight: {ADAPTIVE_CEILING},"
    )
    objective = scenario.standard_objective(point.latency_delta)
    return f"""\
version: 1
tiers: [standard]
{objective}tenants:
  quiet: {{tier: standard, limits: {{max_queued: 1000000}}}}
  flooder: {{tier: standard, limits: {point.flooder_limits}}}
pools:
  p: {{max_total_tokens: 131072, {capacity}
       max_inflight_tokens: 1000000000000, endpoints: ["127.0.0.1:1"],
       prefill_budget_tokens: {point.prefill_budget},
       engine_priority: {"true" if not fifo and point.engine_policy == "priority" else "false"}}}
"""


def engine_profile(point: Point) -> EngineProfile:
    """The shipped pools' priority policy; FIFO is the engine's own first come, first served."""
    policy = "fcfs" if point.limit is None and not point.adaptive else point.engine_policy
    profile = get_profile(PROFILE).with_overrides({"scheduling_policy": policy})
    if point.step_tokens is not None:
        profile = profile.with_overrides({"max_num_batched_tokens": point.step_tokens})
    return profile


def tokens_within(records: Sequence[RequestRecord], start: float, end: float, now: float) -> float:
    """Output tokens generated in [start, end): each response's tokens spread evenly from its
    first token to its last (or to `now`, when the run stopped it)."""
    total = 0.0
    for record in records:
        if record.first_token_at is None or record.generated == 0:
            continue
        first, last = record.first_token_at, record.finished_at or now
        if last <= first:
            total += record.generated if start <= first < end else 0
            continue
        overlap = max(0.0, min(end, last) - max(start, first))
        total += record.generated * overlap / (last - first)
    return total


def measure(point: Point, work: Workload, seed: int, flooder: bool = True) -> dict[str, Any]:
    start, end = work.warmup_s, work.warmup_s + work.measure_s
    stop = end + work.grace_s
    config = SimConfig(
        policy_from_text(policy_text(point)),
        {"p": PoolEngines("p", engine_profile(point), 1)},
        time_limit=stop,
    )
    if point.adaptive:
        config, _ = with_engine_limits(config)
    result = simulate(work.requests(seed, flooder), config)
    quiet = [r for r in result.records if r.tenant == "quiet" and start <= r.arrival < end]
    ttft = [stop - r.arrival if r.ttft is None else r.ttft for r in quiet]
    tpot = [r.tpot for r in quiet if r.tpot is not None]
    flooding = [r for r in result.records if r.tenant == "flooder"]
    return {
        "point": point.name,
        "curve": point.curve,
        "limit": point.limit,
        "quiet_requests": len(quiet),
        "quiet_without_first_token": sum(1 for r in quiet if r.ttft is None),
        "ttft_p50_ms": percentile(ttft, 50) * 1000.0,
        "ttft_p99_ms": percentile(ttft, 99) * 1000.0,
        "tpot_p99_ms": percentile(tpot, 99) * 1000.0,
        "output_tok_s": tokens_within(result.records, start, end, result.end_time) / work.measure_s,
        "flooder_tok_s": tokens_within(flooding, start, end, result.end_time) / work.measure_s,
        **arrival_groups(flooding, start, end),
    }


def arrival_groups(
    records: Sequence[RequestRecord], start: float, end: float, least: int = 3
) -> dict[str, float | int]:
    """How the flooder's requests reach the engine in [start, end): the share that arrive in a
    group of at least `least` at the same instant (they prefill in one step), and the largest
    group. A door limit that binds makes such groups (docs/benchmarks.md, "Paced at one
    prompt")."""
    groups = Counter(
        round(r.engine_at, 6)
        for r in records
        if r.engine_at is not None and start <= r.engine_at < end
    )
    arrived = sum(groups.values())
    grouped = sum(size for size in groups.values() if size >= least)
    return {
        "flooder_grouped_share": grouped / arrived if arrived else 0.0,
        "flooder_largest_group": max(groups.values(), default=0),
    }


def points(
    limits: Sequence[int], prefill_budget: int, step_tokens: Sequence[int],
    deltas: Sequence[str] = (), tail_deltas: Sequence[str] = (), delta_budget: int | None = None,
) -> list[Point]:  # fmt: skip
    """`delta_budget`: the δ points' prefill budget (None: the paced curve's, or
    DELTA_PREFILL_BUDGET without one; 0: none, the controller paces by prompts)."""
    out = [Point("fifo", "fifo", None)]
    out += [Point(f"door-{n}", "door limit", n) for n in limits]
    if prefill_budget:
        out += [
            Point(f"paced-{n}", f"door limit, paced {prefill_budget}", n, prefill_budget)
            for n in limits
        ]
    for tokens in step_tokens:
        out += [
            Point(f"steps{tokens}-{n}", f"door limit, {tokens}-token steps", n, 0, tokens)
            for n in limits
        ]
    top = max(limits)
    budget = (prefill_budget or DELTA_PREFILL_BUDGET) if delta_budget is None else delta_budget
    objectives = [
        *((f"delta-{d}", "δ objective", f"{{every_token: {d}}}") for d in deltas),
        *((f"tail-{d}", "δ objective at P99", f"{{every_token: {d}, quantile: 0.99}}")
          for d in tail_deltas),
    ]  # fmt: skip
    out += [
        Point(name, f"{curve} (paced {budget}, limit {top})", top, budget, latency_delta=text)
        for name, curve, text in objectives
    ]
    return out


def kvwarden_points(
    limits: Sequence[int], first_token: Sequence[str], budgets: Sequence[int] = ()
) -> list[Point]:
    """FIFO, kvwarden's bucket on the flooder (as in front of FIFO: no door limit, the
    engine first come, first served), door limits, the service's default capacity (the live
    `room-full` arm) alone and paced at each of `budgets` prompt tokens (`room-paced-B`),
    and first-token objectives on the largest limit (the live `room-first-D` arms)."""
    top = max(limits)
    bucket = Point("bucket", "kvwarden's bucket", None, flooder_limits=KVWARDEN_BUCKET)
    out = [Point("fifo", "fifo", None), bucket]
    out += [Point(f"door-{n}", "door limit", n) for n in limits]
    out += [Point("default", "default policy, paced", None, adaptive=True)]
    out += [Point(f"paced-{b}", "default policy, paced", None, b, adaptive=True) for b in budgets]
    out += [
        Point(f"first-{d}", f"first-token objective (limit {top})", top,
              latency_delta=scenario.first_token_objective(d))
        for d in first_token
    ]  # fmt: skip
    return out


def over_points(first_token: Sequence[str]) -> list[Point]:
    """FIFO, the service's default capacity (the live `over-full` arm) and first-token
    objectives on it (`over-first-D`)."""
    out = [Point("fifo", "fifo", None), Point("default", "default policy", None, adaptive=True)]
    out += [
        Point(f"first-{d}", "first-token objective", None, adaptive=True,
              latency_delta=scenario.first_token_objective(d))
        for d in first_token
    ]  # fmt: skip
    return out


def over_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 16 above capacity: quiet P99 <= 2x solo, judged for the default policy."""
    default = next(row for row in rows if row["point"] == "default")
    return {
        "met": default["ttft_p99_x"] <= TARGET_OVER_P99_RATIO,
        "points_within": [
            row["point"] for row in rows if row["ttft_p99_x"] <= TARGET_OVER_P99_RATIO
        ],
    }


def ratios(rows: list[dict[str, Any]], solo: dict[str, Any]) -> dict[str, Any]:
    """Each point's ratios to solo and to FIFO, and where the target region is reached."""
    fifo = next(row for row in rows if row["point"] == "fifo")
    for row in rows:
        row["ttft_p50_x"] = row["ttft_p50_ms"] / solo["ttft_p50_ms"]
        row["ttft_p99_x"] = row["ttft_p99_ms"] / solo["ttft_p99_ms"]
        row["tpot_p99_x"] = row["tpot_p99_ms"] / solo["tpot_p99_ms"]
        row["of_fifo"] = row["output_tok_s"] / fifo["output_tok_s"]
    bucket = next((row for row in rows if row["point"] == "bucket"), None)
    if bucket is not None:
        return kvwarden_target(rows, bucket)
    if any(row["point"] == "default" for row in rows):
        return over_target(rows)
    busy = [row for row in rows if row["of_fifo"] >= TARGET_THROUGHPUT]
    held = [
        row
        for row in rows
        if row["ttft_p99_x"] <= TARGET_TTFT_RATIO and row["tpot_p99_x"] <= TARGET_TPOT_RATIO
    ]
    best_busy = min(busy, key=lambda row: row["ttft_p99_x"], default=None)
    best_held = max(held, key=lambda row: row["of_fifo"], default=None)
    return {
        "met": any(row in held for row in busy),
        "best_p99_at_95pct": None if best_busy is None else best_busy["point"],
        "most_throughput_within_latency_targets": None if best_held is None else best_held["point"],
    }


def kvwarden_target(rows: list[dict[str, Any]], bucket: dict[str, Any]) -> dict[str, Any]:
    """Issue 15 on kvwarden's workload: quiet P99 <= 1.10x solo while the flooder gets at
    least twice the output tokens kvwarden's bucket lets through."""
    floor = TARGET_KVWARDEN_FLOODER_MULTIPLE * bucket["flooder_tok_s"]
    ours = [row for row in rows if row["point"] not in ("fifo", "bucket")]
    meeting = [
        row
        for row in ours
        if row["ttft_p99_x"] <= TARGET_KVWARDEN_P99_RATIO and row["flooder_tok_s"] >= floor
    ]
    enough = [row for row in ours if row["flooder_tok_s"] >= floor]
    best = min(enough, key=lambda row: row["ttft_p99_x"], default=None)
    return {
        "met": bool(meeting),
        "flooder_tok_s_needed": floor,
        "best_p99_with_enough_flooder_tokens": None if best is None else best["point"],
    }


def print_table(report: dict[str, Any]) -> None:
    solo = report["solo"]
    print(
        f"\nsolo (quiet alone): TTFT p50 {fmt(solo['ttft_p50_ms'])} ms, p99 "
        f"{fmt(solo['ttft_p99_ms'])} ms, TPOT p99 {fmt(solo['tpot_p99_ms'])} ms"
    )
    header = f"{'TTFT p50 x':>10} {'p99 x':>7} {'TPOT99 x':>8} {'tok/s':>7} {'vs FIFO':>7}"
    print(f"\n{'point':16} {header} {'flooder tok/s':>13} {'grouped':>7}")
    for row in report["rows"]:
        print(
            f"{row['point']:16} {fmt(row['ttft_p50_x'], 2):>10} {fmt(row['ttft_p99_x'], 2):>7} "
            f"{fmt(row['tpot_p99_x'], 2):>8} {fmt(row['output_tok_s'], 0):>7} "
            f"{row['of_fifo']:>7.0%} {fmt(row['flooder_tok_s'], 0):>13} "
            f"{row['flooder_grouped_share']:>7.0%}"
        )
    found = report["summary"]
    verdict = "met" if found["met"] else "NOT met"
    if "points_within" in found:
        within = ", ".join(found["points_within"]) or "none"
        print(
            f"\ntarget (the default policy's quiet P99 TTFT <= {TARGET_OVER_P99_RATIO}x solo): "
            f"{verdict}; points within it: {within}"
        )
        return
    if "flooder_tok_s_needed" in found:
        print(
            f"\ntarget (quiet P99 TTFT <= {TARGET_KVWARDEN_P99_RATIO}x solo with the flooder at "
            f">= {fmt(found['flooder_tok_s_needed'], 0)} tok/s, twice the bucket's): {verdict}"
        )
        best = found["best_p99_with_enough_flooder_tokens"]
        print(f"best P99 TTFT with enough flooder tokens: {_described(report, best)}")
        return
    print(
        f"\ntarget (P99 TTFT <= {TARGET_TTFT_RATIO}x and P99 TPOT <= {TARGET_TPOT_RATIO}x solo "
        f"at >= {TARGET_THROUGHPUT:.0%} of FIFO): {verdict}"
    )
    print(f"best P99 TTFT at >= 95% of FIFO: {_described(report, found['best_p99_at_95pct'])}")
    print(
        "most throughput within both latency targets: "
        f"{_described(report, found['most_throughput_within_latency_targets'])}"
    )


def _described(report: dict[str, Any], name: str | None) -> str:
    if name is None:
        return "none"
    row = next(row for row in report["rows"] if row["point"] == name)
    return (
        f"{name} ({row['ttft_p99_x']:.2f}x TTFT, {row['tpot_p99_x']:.2f}x TPOT, "
        f"{row['of_fifo']:.0%} of FIFO)"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    curves: dict[str, list[dict[str, Any]]] = {}
    for row in report["rows"]:
        curves.setdefault(row["curve"], []).append(row)
    for curve, rows in curves.items():
        marker = "s" if curve == "fifo" else "o"
        ax.plot(
            [100 * r["of_fifo"] for r in rows], [r["ttft_p99_x"] for r in rows],
            marker=marker, label=curve,
        )  # fmt: skip
    ax.axhline(TARGET_TTFT_RATIO, color="grey", linestyle="--", linewidth=1)
    ax.axvline(100 * TARGET_THROUGHPUT, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("total output tokens/s, % of FIFO")
    ax.set_ylabel("quiet P99 TTFT / solo (log)")
    ax.set_title("noisy neighbour in the simulator (the target: below and right of the lines)")
    ax.legend()
    save_figure(fig, path)


def run(
    out: Path,
    work: Workload,
    swept: Sequence[Point],
    seed: int,
    workload: str = "noisy",
    engine_policy: str = "priority",
) -> dict[str, Any]:
    began = time.perf_counter()
    solo = measure(Point("solo", "solo", None), work, seed, flooder=False)
    rows = []
    for point in swept:
        rows.append(measure(point, work, seed))
        log(NAME, f"{point.name}: {fmt(rows[-1]['ttft_p99_ms'])} ms P99 TTFT, "
                  f"{fmt(rows[-1]['output_tok_s'], 0)} tok/s")  # fmt: skip
    report = {
        "scenario": NAME,
        "workload_name": workload,
        "profile": PROFILE,
        "engine_policy": engine_policy,
        "workload": work.__dict__,
        "seed": seed,
        "solo": solo,
        "rows": rows,
        "summary": ratios(rows, solo),
        "wall_s": time.perf_counter() - began,
    }
    scenario.save_results(
        out, report, "frontier.png", lambda path: plot(report, path),
        lambda: print_table(report),
    )  # fmt: skip
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--workload", choices=("noisy", "kvwarden", "over"), default="noisy",
        help="noisy-neighbour's (default), kvwarden's (1 + 32 requests/s, one-line prompts, "
        "64 tokens; its bucket as a point, the first-token objectives as the δ points) or "
        "issue 16's `over` (the flooder at 48/s x 256 tokens; the default policy's adaptive "
        "limit and first-token objectives on it)",
    )  # fmt: skip
    parser.add_argument(
        "--measure", type=float,
        help="simulated seconds measured (noisy 120, kvwarden 600, over 300)",
    )  # fmt: skip
    parser.add_argument("--limits", help=f"door limits swept (default {DEFAULT_LIMITS}; "
                                         f"kvwarden's workload {KVWARDEN_LIMITS})")  # fmt: skip
    parser.add_argument(
        "--prefill-budget", type=int, default=1024,
        help="prompt tokens prefilling of the paced-N points (0: no paced curve)",
    )  # fmt: skip
    parser.add_argument(
        "--kvwarden-budgets", default=",".join(str(b) for b in KVWARDEN_BUDGETS),
        help="prefill budgets of kvwarden's workload's paced-B points: the default policy "
        "paced at B prompt tokens (default %(default)s; '' none)",
    )  # fmt: skip
    parser.add_argument(
        "--step-tokens", default="512",
        help="engine max_num_batched_tokens of the stepsT-N curves (comma-separated; '' none)",
    )  # fmt: skip
    parser.add_argument(
        "--deltas", default=",".join(DEFAULT_DELTAS),
        help="every-token δ objectives of the delta-D points ('' none; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--delta-budget", type=int,
        help="prefill budget of the delta-D and tail-D points (default: --prefill-budget, or "
        f"{DELTA_PREFILL_BUDGET} when 0; 0: none, the δ cut paces by prompts)",
    )  # fmt: skip
    parser.add_argument(
        "--tail-deltas", default=",".join(DEFAULT_TAIL_DELTAS),
        help="the same at P99 (quantile 0.99), the tail-D points (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--first-token-deltas",
        help="first-token objectives of kvwarden's workload (default "
        f"{','.join(KVWARDEN_FIRST_TOKEN)}) and of `over` ({','.join(OVER_FIRST_TOKEN)}): "
        "30ms, 2x (a multiple of alone), 2x-p99 (quantile 0.99)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--engine-policy", choices=("priority", "fcfs"), default="priority",
        help="the engine's scheduling policy behind a door limit (default %(default)s, as the "
        "shipped pools run; fcfs is vLLM's own default, where the door sets no priority)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    kvwarden = args.workload == "kvwarden"
    work = {"kvwarden": KVWARDEN, "over": OVER}.get(args.workload, Workload())
    if args.quick:
        work = replace(work, flooder_start_s=5.0, warmup_s=15.0, measure_s=20.0)
    if args.measure:
        work = replace(work, measure_s=args.measure)
    default = KVWARDEN_LIMITS if kvwarden else DEFAULT_LIMITS
    limits = [int(n) for n in listed(args.limits)] if args.limits else list(default)
    steps = [int(n) for n in listed(args.step_tokens)]
    if not limits or any(n < 1 for n in [*limits, *steps]):
        raise SystemExit("--limits needs at least one; --limits and --step-tokens are positive")
    swept = (
        kvwarden_points(limits, listed(args.first_token_deltas or ",".join(KVWARDEN_FIRST_TOKEN)),
                        [int(b) for b in listed(args.kvwarden_budgets)])
        if kvwarden
        else over_points(listed(args.first_token_deltas or ",".join(OVER_FIRST_TOKEN)))
        if args.workload == "over"
        else points(limits, args.prefill_budget, steps, listed(args.deltas),
                    listed(args.tail_deltas), args.delta_budget)
    )  # fmt: skip
    swept = [replace(point, engine_policy=args.engine_policy) for point in swept]
    run(args.out, work, swept, args.seed, args.workload, args.engine_policy)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main(f"gateway_lab.bench.{NAME}", __doc__, add_arguments, main)
    )
