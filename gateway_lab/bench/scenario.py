"""The skeleton every tenant scenario (noisy-neighbour, token-fairness, tiers) fills in.

A scenario has arms, run one after another on the same emulated engines: per arm the real Envoy
straight to them ("direct", FIFO inside the engine) or through the ext_proc service
("service", with the capacity the arm asks for written into the policy), `arm_gateway`. The
load of an arm is a foreground tenant's Poisson arrivals, alone or beside closed-loop
background tenants (`contend`), driven with progress lines and, if asked, engine
monitoring (`drive`). `run_scenario` runs the arms and collects their results, then
writes `results.json` and the plot and prints the table (`save_results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

from extproc.policy import hash_key
from gateway_lab.bench.capacity import CapacityConfig
from gateway_lab.bench.loadgen import Load, closed_loop, open_loop
from gateway_lab.bench.monitor import (
    CURRENT_ARM,
    ArmProgress,
    Monitor,
    log,
    progress,
    wait_engines_idle,
)
from gateway_lab.bench.provenance import with_provenance
from gateway_lab.bench.records import Spec, distinct_prompt, prompt_text
from gateway_lab.bench.stack import EngineSet, Gateway, engine_set, gateway_stack
from gateway_lab.progress import Progress

POOL = "main"
PATHS = {"direct": "straight", "service": "extproc"}
"""An arm's path and the front it runs (`gateway_stack`'s arm)."""


class NamedArm(Protocol):
    @property
    def name(self) -> str: ...


ArmT = TypeVar("ArmT", bound=NamedArm)
Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Conclusion:
    """What a scenario makes of its arms' results: the summary saved beside them (None: no
    summary), the plot and the printed table."""

    summary: Any
    draw: Callable[[Path], None]
    table: Callable[[], None]


def run_scenario(
    name: str,
    out: Path,
    workdir: Path,
    *,
    profile: str,
    work: Any,
    timing: Any,
    settings: Mapping[str, Any],
    arms: Sequence[ArmT],
    run_arm: Callable[[ArmT, EngineSet, Results], dict[str, Any]],
    conclude: Callable[[Results], Conclusion],
    figure: str,
    engine_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One engine for `POOL` (started with `engine_args`), every arm on it in turn (`run_arm`
    sees the results so far), then the report (`settings` after the workload and timing)
    saved with the plot."""
    began = time.perf_counter()
    results: Results = {}
    log(name, f"{len(arms)} arms, {timing.measure_s:.0f}s measured each; profile {profile}")
    tracker = Progress(name, len(arms), unit="arms")
    with engine_set(workdir / "engines", {POOL: 1}, profile, engine_args) as engines:
        for index, arm in enumerate(arms):
            tracker.phase(f"arm {arm.name}", done=index)
            token = CURRENT_ARM.set(ArmProgress(tracker, index))
            try:
                results[arm.name] = run_arm(arm, engines, results)
            finally:
                CURRENT_ARM.reset(token)
            tracker.update(index + 1)
    tracker.finish(f"{len(arms)} arms")
    conclusion = conclude(results)
    report: dict[str, Any] = {
        "scenario": name,
        "profile": profile,
        "workload": work.__dict__,
        "timing": timing.__dict__,
        **settings,
        "wall_s": time.perf_counter() - began,
    }
    if conclusion.summary is not None:
        report["summary"] = conclusion.summary
    report["arms"] = results
    save_results(out, report, figure, conclusion.draw, conclusion.table)
    return report


@contextlib.contextmanager
def arm_gateway(
    scenario: str,
    arm: str,
    workdir: Path,
    engines: EngineSet,
    policy_text: str,
    path: str,
    capacity: CapacityConfig | None = None,
    *,
    announce: str | None = None,
) -> Iterator[Gateway]:
    """Once the engines are idle, Envoy straight to them (`path="direct"`) or through
    `extproc serve` (`"service"`, with `capacity` written into the policy), logs under
    workdir/arm; `announce` is the progress line (default: what starts)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {tuple(PATHS)}")
    run_async(wait_engines_idle(engines.all()))
    service = " + service" if path == "service" else ""
    log(scenario, announce or f"arm {arm}: starting Envoy{service}")
    if path == "service" and capacity is not None:
        policy_text = capacity.apply(policy_text)
    with gateway_stack(workdir / arm, policy_text, PATHS[path]) as gateway:
        yield gateway


def first_token_objective(spec: str) -> str:
    """A first-token δ objective (YAML flow text) from a bench's `--first-token-deltas` item:
    `30ms` or `2x` bound a typical first token; `2x-p99` the 99th percentile of them
    (`quantile: 0.99`; `-p999` is 0.999)."""
    objective, _, percentile = spec.partition("-p")
    if not percentile:
        return f"{{first_token: {objective}}}"
    if not percentile.isdigit():
        raise ValueError(f"{spec!r}: a percentile suffix is -p followed by digits (2x-p99)")
    return f"{{first_token: {objective}, quantile: 0.{percentile}}}"


def standard_objective(latency_delta: str | None) -> str:
    """The policy line giving tier `standard` the δ objective `latency_delta` (YAML flow text:
    `30ms`, `{first_token: 2x}`), newline included; "" without one."""
    return "".join(f"{line}\n" for line in _objective_lines(latency_delta))


def _objective_lines(latency_delta: str | None) -> list[str]:
    if not latency_delta:
        return []
    return [f"tier_options: {{standard: {{latency_delta: {latency_delta}}}}}"]


def standard_tenants(
    weights: Mapping[str, float], keys: Mapping[str, str], latency_delta: str | None = None
) -> list[str]:
    """A policy's first lines: one tier, `standard` (with the δ objective `latency_delta`, if
    given), and each tenant of `weights` in it with its weight, its key of `keys` (hashed)
    and queue limits that never refuse in a run."""
    limits = "{max_queued: 100000, max_queue_wait: 600s}"
    lines = ["version: 1", "tiers: [standard]", *_objective_lines(latency_delta), "tenants:"]
    for name, weight in weights.items():
        lines.append(
            f'  {name}: {{tier: standard, weight: {weight}, api_keys: ["{hash_key(keys[name])}"],'
            f" limits: {limits}}}"
        )
    return lines


def fixed_maker(
    tenant: str, key: str, prompt: int, output: int, seed: int
) -> Callable[[int], Spec]:
    """Requests of `prompt` tokens and `output` out, over 16 prompt texts made distinct per
    request (`distinct_prompt`: no prefix-cache hits between them)."""
    rng = random.Random(seed)
    prompts = [prompt_text(prompt, rng) for _ in range(16)]

    def make(index: int) -> Spec:
        return Spec(tenant, key, distinct_prompt(prompts[index % 16], index), prompt, output)

    return make


def spread_maker(
    tenant: str, key: str, prompt: int, output: int, spread: float, seed: int, *, vary_output: bool
) -> Callable[[int], Spec]:
    """Requests of uniform sizes in [(1 - spread) x, (1 + spread) x] of the prompt (and, with
    `vary_output`, of the output) tokens: identical requests would start and end in lockstep.
    Each request's text is made distinct (`distinct_prompt`: no prefix-cache hits)."""
    rng = random.Random(seed)
    low, high = 1.0 - spread, 1.0 + spread
    words = prompt_text(math.ceil(prompt * high), rng)

    def make(index: int) -> Spec:
        tokens = max(8, round(prompt * rng.uniform(low, high)))
        out = max(1, round(output * rng.uniform(low, high))) if vary_output else output
        text = distinct_prompt(words[: 4 * (tokens - 4)], index)
        return Spec(tenant, key, text, tokens, out)

    return make


@dataclass(frozen=True)
class Foreground:
    """The tenant whose latency is measured: Poisson arrivals of `make`'s requests."""

    make: Callable[[int], Spec]
    rate: float
    seed: int


@dataclass(frozen=True)
class Background:
    """A closed-loop tenant: `concurrency` clients of `make`'s requests."""

    make: Callable[[int], Spec]
    concurrency: int
    seed: int


async def contend(
    scenario: str,
    arm: str,
    load: Load,
    engines: EngineSet,
    gateway: Gateway,
    foreground: Foreground,
    background: Sequence[Background],
    end: float,
    *,
    grace_s: float,
    ramp_s: float,
) -> Monitor:
    """The foreground tenant's arrivals until `end` (then up to `grace_s` for first tokens)
    beside the background tenants' closed loops, which stop when the foreground is done;
    returns the monitor that sampled the engines and the gateway meanwhile."""
    done = asyncio.Event()

    async def steady() -> None:
        try:
            await open_loop(
                load, foreground.make, foreground.rate, end, seed=foreground.seed, grace_s=grace_s
            )
        finally:
            done.set()

    jobs = [
        steady(),
        *(
            closed_loop(
                load, b.make, b.concurrency, end + grace_s, ramp_s=ramp_s, seed=b.seed, stop=done
            )
            for b in background
        ),
    ]
    monitor = Monitor(load, engines.all(), gateway.admin_url)
    await drive(scenario, arm, load, jobs, end, monitor, end + grace_s)
    return monitor


async def drive(
    scenario: str,
    arm: str,
    load: Load,
    jobs: Sequence[Awaitable[None]],
    end: float,
    monitor: Monitor | None = None,
    monitor_until: float = 0.0,
) -> None:
    """Run the jobs with a progress line every few seconds (and `monitor` sampling until
    `monitor_until`), then stop the watchers."""
    watchers = []
    if monitor is not None:
        watchers.append(asyncio.ensure_future(monitor.run(monitor_until)))
    watchers.append(asyncio.ensure_future(progress(scenario, arm, load, end)))
    try:
        await asyncio.gather(*jobs)
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


def script_main(
    module: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    main: Callable[[argparse.Namespace], int],
) -> int:
    """`python -m <module>`: the scenario's own parser, then its `main`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    add_arguments(parser)
    return main(parser.parse_args())


def workdir_of(args: argparse.Namespace) -> Path:
    """Where the stacks' logs go: `--workdir`, or OUT/stacks."""
    path: Path = args.workdir or args.out / "stacks"
    return path


def add_scenario_arguments(
    parser: argparse.ArgumentParser, default_out: Path, measure_help: str
) -> None:
    """The flags every tenant scenario takes (its own knobs follow)."""
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--workdir", type=Path, help="logs of the stacks (default: OUT/stacks)")
    parser.add_argument("--measure", type=float, help=measure_help)


TimingT = TypeVar("TimingT")


def chosen_timing(args: argparse.Namespace, default: TimingT, quick: TimingT) -> TimingT:
    """A scenario's timing from its flags: `--quick` for the short one, `--measure S` to
    change the measured seconds per arm."""
    timing = quick if args.quick else default
    if args.measure:
        timing = replace(timing, measure_s=args.measure)  # type: ignore[type-var]
    return timing


def save_results(
    out: Path,
    report: Any,
    figure: str,
    draw: Callable[[Path], None],
    table: Callable[[], None],
) -> None:
    """Write `results.json` (with what it ran on: gateway_lab.bench.provenance) and the plot
    under `out`, print the table and where they are."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", with_provenance(report))
    draw(out / figure)
    table()
    print(f"\nresults: {out / 'results.json'}, plot: {out / figure}")


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def run_async(coroutine: Awaitable[Any]) -> Any:
    """asyncio.run with uvloop when available (the load generator is CPU-bound)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_as_coroutine(coroutine))
    return uvloop.run(_as_coroutine(coroutine))


async def _as_coroutine(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
