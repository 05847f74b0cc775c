"""Benchmark: what the gateway adds at low load, and where in the request it goes.

One emulated A100 / Llama-3.1-8B engine, pinned to a core of its own where the machine has
two (Envoy, the front and this load generator on the others). One tenant sends 1 request/s
(Poisson), streamed `/v1/completions` with a one-line prompt and no `stream_options`, through:

* `straight`: Envoy straight to the engine;
* `noop`: Envoy with the do-nothing ext_proc (gateway_lab.bench.noop), the gRPC-in-Python floor;
  `noop-one-trip` the same with the body streamed without waiting for the headers reply
  (`envoy render --one-round-trip`, gateway_lab.bench.trips);
* `mimic`: the same server answering the way our service does (`noop --mimic`: gateway headers,
  the `include_usage` body rewrite, the route-cache clear, dynamic metadata, the stream ended
  at the forward) without deciding anything: what the shape of our replies costs Envoy;
* `one-trip`: the mimic for one round trip (`noop --mimic --one-round-trip`);
* `noop-sync`: the floor on grpc's synchronous server (`noop --sync`: a pool thread per stream,
  no event loop), so what asyncio costs the floor shows beside `noop`;
* `noop-no-acct`: the floor without the accounting filter (removed from the bootstrap), so
  Envoy opens no observability stream on the way upstream: what opening it costs the request;
* `service`: our service with the default policy; `service-one-trip` the same with one round
  trip;
* `service-child`: the same with the accounting streams in the service's child process
  (`serve --accounting-grpc`, Envoy's accounting cluster), the layout `extproc up` and the
  deploy files use;
* `static`: the same with the pool's adaptive soft limit off, so nothing reads the engine's
  `/metrics` (10 times a second by default): what that polling costs the engine and us;
* `before` (with `--before-src DIR`): our service from another source tree (PYTHONPATH=DIR),
  to compare a change with what it replaces in the same run; `before-child` the same with its
  accounting child process, as `service-child`;
* any arm with `-awake` (`straight-awake`, `noop-awake`, `service-awake`): the same with every
  CPU kept from going idle (gateway_lab.bench.awake), so no message waits for a halted CPU to
  wake; what it adds is measured against `straight-awake`.

The arms take turns in `--rounds` rounds (a fresh stack per turn, the order rotated each
round), so drifts of a shared machine hit every arm alike. Per arm: the time to the first
streamed chunk at the client (P50/P99 and what each adds to `straight`), the front process's
CPU, and Envoy's own per-phase timestamps (gateway_lab.bench.phases).

`extproc bench low-load [--rounds 3] [--measure 20] [--before-src DIR]`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.envoy_routes import ACCOUNTING_FILTER
from extproc.policy import hash_key
from gateway_lab.bench import awake, phases, revisions, scenario, trips
from gateway_lab.bench.cores import (
    CoreSplit,
    descendants,
    engines_apart,
    pin,
    split_cores,
    tree_cpu_seconds,
)
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.loadgen import Load, open_loop
from gateway_lab.bench.monitor import log, wait_engines_idle
from gateway_lab.bench.records import Meter, Record, Spec, percentile
from gateway_lab.bench.stack import PROFILE, Gateway, engine_set, gateway_stack

NAME = "low-load"
DEFAULT_OUT = Path("results/low-load")
KEY = "bench-quiet-key"
TENANT = "quiet"
WARMUP_TENANT = "warmup"
ARMS = (
    "straight", "noop", "noop-one-trip", "noop-grpclib", "noop-sync", "noop-no-acct", "mimic",
    "mimic-grpclib", "one-trip", "service", "service-one-trip", "service-child", "static",
)  # fmt: skip
BEFORE_ARMS = ("before", "before-child")
"""Arms that run the service of `--before-src`."""
AWAKE = "-awake"
"""The suffix of an arm run with every CPU kept awake."""
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 3.0


@dataclass(frozen=True)
class Settings:
    rounds: int = 3
    measure_s: float = 20.0
    warmup_s: float = 3.0
    rate: float = 1.0
    output_tokens: int = 64
    prompt_words: int = 12


def policy_text(endpoint: str, adaptive: bool = True) -> str:
    """The default policy (DRR, headroom, adaptive soft limit, overload shedding); without
    `adaptive`, a static soft limit."""
    static = "" if adaptive else "adaptive: {enabled: false},\n          "
    return f"""\
version: 1
tiers: [standard]
tenants:
  {TENANT}: {{tier: standard, api_keys: ["{hash_key(KEY)}"]}}
pools:
  {scenario.POOL}: {{max_total_tokens: 131072, max_inflight: 512,
          max_inflight_tokens: 1000000000, {static}endpoints: ["{endpoint}"]}}
estimation: {{mode: flat, default_bytes_per_token: 4.0}}
gateway: {{default_max_tokens: 256}}
"""


@dataclass(frozen=True, slots=True)
class CompletionSpec(Spec):
    def body(self) -> bytes:
        return orjson.dumps(
            {"model": "bench", "prompt": self.prompt, "max_tokens": self.max_tokens,
             "ignore_eos": True, "stream": True}
        )  # fmt: skip


def maker(label: str, settings: Settings, seed: int) -> Any:
    """Specs of one-line prompts; `label` goes in X-Bench-Tenant (Envoy logs it)."""
    rng = random.Random(seed)
    words = ("tell", "me", "a", "story", "about", "the", "sea", "and", "a", "ship", "at", "dawn")
    prompts = [
        " ".join(rng.choice(words) for _ in range(settings.prompt_words)) + "." for _ in range(16)
    ]
    headers = {"x-bench-tenant": label}

    def make(index: int) -> Spec:
        return CompletionSpec(
            TENANT, KEY, prompts[index % 16], settings.prompt_words + 2,
            settings.output_tokens, headers,
        )  # fmt: skip

    return make


def no_accounting_bootstrap(text: str) -> str:
    """The timed bootstrap without the accounting filter (the `noop-no-acct` arm)."""
    bootstrap = json.loads(phases.timed_bootstrap(text))
    for manager in trips.managers(bootstrap):
        before = len(manager["httpFilters"])
        manager["httpFilters"] = [
            f for f in manager["httpFilters"] if f["name"] != ACCOUNTING_FILTER
        ]
        if len(manager["httpFilters"]) == before:
            raise ValueError("the bootstrap has no accounting filter")
        for host in manager["routeConfig"]["virtualHosts"]:
            for route in host["routes"]:
                route.get("typedPerFilterConfig", {}).pop(ACCOUNTING_FILTER, None)
    return json.dumps(bootstrap)


EDITS = {
    "noop-one-trip": trips.one_round_trip,
    "one-trip": trips.one_round_trip,
    "service-one-trip": trips.one_round_trip,
    "noop-no-acct": no_accounting_bootstrap,
}


@contextlib.contextmanager
def front(arm: str, workdir: Path, endpoint: str, before_src: Path | None) -> Iterator[Gateway]:
    noops = (
        "noop", "noop-one-trip", "noop-grpclib", "noop-sync", "noop-no-acct", "mimic",
        "mimic-grpclib", "one-trip",
    )  # fmt: skip
    kind = "straight" if arm == "straight" else "noop" if arm in noops else "extproc"
    noop_args: tuple[str, ...] = ()
    if arm in ("mimic", "mimic-grpclib", "one-trip"):
        noop_args = ("--mimic", scenario.POOL)
    if arm == "one-trip":
        noop_args += ("--one-round-trip",)
    if arm.endswith("-grpclib"):
        noop_args += ("--grpclib",)
    if arm == "noop-sync":
        noop_args += ("--sync",)
    env = None
    if arm in BEFORE_ARMS:
        assert before_src is not None
        env = revisions.tree_env(before_src)
    with gateway_stack(
        workdir, policy_text(endpoint, adaptive=arm != "static"), kind,
        bootstrap_edit=EDITS.get(arm, phases.timed_bootstrap),
        accounting_process=arm in ("service-child", "before-child"), noop_args=noop_args,
        extproc_env=env,
    ) as gateway:  # fmt: skip
        yield gateway


def front_cpu(gateway: Gateway) -> float:
    """CPU seconds of the ext_proc process (and its workers); 0 without one."""
    pid = gateway.pid_of("extproc")
    return 0.0 if pid is None else tree_cpu_seconds(pid)


async def drive(gateway: Gateway, settings: Settings, seed: int) -> tuple[list[Record], float]:
    """Warm-up requests, then the measured ones; their records and the front's CPU seconds."""
    url = gateway.base_url + "/v1/completions"
    async with Load(url, Meter(bin_s=1.0), request_timeout_s=60.0) as load:
        warm = maker(WARMUP_TENANT, settings, seed)
        await open_loop(load, warm, settings.rate * 4, settings.warmup_s, seed=seed, grace_s=5.0)
        warmed = len(load.records)
        cpu_before = front_cpu(gateway)
        start = load.now()
        quiet = maker(TENANT, settings, seed + 1)
        until = start + settings.measure_s
        await open_loop(load, quiet, settings.rate, until, seed=seed + 2, start=start, grace_s=10.0)
        cpu = front_cpu(gateway) - cpu_before
        return load.records[warmed:], cpu


def run_turn(
    arm: str, round_index: int, endpoint: str, workdir: Path, settings: Settings,
    split: CoreSplit | None, before_src: Path | None,
) -> dict[str, Any]:  # fmt: skip
    scenario.run_async(wait_engines_idle([endpoint]))
    where = workdir / f"{arm}-{round_index}"
    spinning = arm.endswith(AWAKE)
    cpus = os.sched_getaffinity(0) | (split.engine if split else frozenset())
    with (
        awake.kept_awake(cpus if spinning else ()),
        front(arm.removesuffix(AWAKE), where, endpoint, before_src) as gateway,
    ):
        if split is not None:
            for child in gateway.stack.children:
                if child.process is not None:
                    pin(child.process.pid, split.front)
        seed = 1000 * round_index + 7
        records, cpu = scenario.run_async(drive(gateway, settings, seed))
    rows = [
        r for r in phases.read_phase_log(where / "envoy.log") if r.get("tenant_header") == TENANT
    ]
    ttft = [r.ttft * 1000.0 for r in records if r.status == 200 and r.ttft is not None]
    failed = sum(1 for r in records if r.status != 200)
    log(NAME, f"round {round_index + 1} {arm}: {len(ttft)} answered, p50 "
              f"{percentile(ttft, 50):.1f} ms, failed {failed}, front CPU {cpu:.2f} s")  # fmt: skip
    return {"ttft_ms": ttft, "failed": failed, "cpu_s": cpu, "rows": rows}


def merge(turns: list[dict[str, Any]], measure_s: float) -> dict[str, Any]:
    ttft = [t for turn in turns for t in turn["ttft_ms"]]
    rows = [row for turn in turns for row in turn["rows"]]
    cpu = sum(turn["cpu_s"] for turn in turns)
    answered = len(ttft)
    return {
        "requests": answered,
        "failed": sum(turn["failed"] for turn in turns),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "front_cores": cpu / (measure_s * len(turns)),
        "front_cpu_us_per_request": cpu / answered * 1e6 if answered else float("nan"),
        "phases": phases.breakdown(rows),
        "ttft_ms": ttft,
    }


def compare(by_arm: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What each arm adds to `straight` (an `-awake` arm: to `straight-awake`)."""
    out: dict[str, Any] = {}
    for arm, result in by_arm.items():
        straight = by_arm.get("straight" + AWAKE if arm.endswith(AWAKE) else "straight")
        added_p50 = result["ttft_p50_ms"] - straight["ttft_p50_ms"] if straight else float("nan")
        added_p99 = result["ttft_p99_ms"] - straight["ttft_p99_ms"] if straight else float("nan")
        out[arm] = {"added_p50_ms": added_p50, "added_p99_ms": added_p99}
    return out


def print_table(by_arm: dict[str, dict[str, Any]], added: dict[str, Any]) -> None:
    print(f"\n{'arm':16} {'answered':>8} {'TTFT p50':>9} {'p99':>8} {'+p50':>7} {'+p99':>7} "
          f"{'front cores':>11} {'CPU us/req':>10}")  # fmt: skip

    def signed(value: float | None) -> str:  # None: NaN read back from results.json
        return "-" if value is None or math.isnan(value) else f"{value:+.2f}"

    for arm, r in by_arm.items():
        print(
            f"{arm:16} {r['requests']:8d} {r['ttft_p50_ms']:8.1f}ms {r['ttft_p99_ms']:7.1f}ms "
            f"{signed(added[arm]['added_p50_ms']):>7} {signed(added[arm]['added_p99_ms']):>7} "
            f"{r['front_cores']:11.3f} {r['front_cpu_us_per_request']:10.0f}"
        )
    print("\nEnvoy: the request's first byte -> its first byte upstream (ms), P50 / P90:")
    for arm, r in by_arm.items():
        upstream = r["phases"]["phases_ms"]["upstream_start"]
        print(f"  {arm:16} {upstream['p50']:6.2f} / {upstream['p90']:6.2f}")
    phases.print_breakdown({arm: r["phases"] for arm, r in by_arm.items()})
    for arm in ("service", "before", "service" + AWAKE):
        if arm in added and "straight" in added:
            p50, p99 = added[arm]["added_p50_ms"], added[arm]["added_p99_ms"]
            print(f"\n{arm}: added p50 {p50:+.2f} ms (target <= {TARGET_ADDED_P50_MS}), "
                  f"p99 {p99:+.2f} ms (target <= {TARGET_ADDED_P99_MS})")  # fmt: skip


def plot(by_arm: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
    arms = list(by_arm)
    xs = list(range(len(arms)))

    def client(arm: str, quantile: str) -> float:
        value: float = by_arm[arm][f"ttft_{quantile}_ms"]
        return value

    def upstream(arm: str, quantile: str) -> float:
        value: float = by_arm[arm]["phases"]["phases_ms"]["upstream_start"][quantile]
        return value

    panels = (
        (left, client, ("p50", "p99"), "time to first chunk at the client (ms)"),
        (right, upstream, ("p50", "p90"),
         "Envoy: request's first byte -> first byte upstream (ms)"),
    )  # fmt: skip
    for axis, value, quantiles, title in panels:
        for offset, quantile in ((-0.2, quantiles[0]), (0.2, quantiles[1])):
            heights = [value(a, quantile) for a in arms]
            axis.bar([x + offset for x in xs], heights, 0.4, label=quantile.upper())
        axis.set_xticks(xs, arms)
        axis.set_title(title)
        axis.legend()
    save_figure(fig, path, dpi=110)


def run(out: Path, workdir: Path, settings: Settings, arms: list[str],
        before_src: Path | None) -> dict[str, Any]:  # fmt: skip
    began = time.perf_counter()
    split = split_cores()
    log(NAME, split.describe() if split else "fewer than two cores: nothing pinned")
    turns: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with engine_set(workdir / "engines", {scenario.POOL: 1}, PROFILE) as engines:
        endpoint = engines.endpoints[scenario.POOL][0]
        with engines_apart(split, descendants(os.getpid())):
            for round_index in range(settings.rounds):
                shift = round_index % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    turn = run_turn(
                        arm, round_index, endpoint, workdir, settings, split, before_src
                    )
                    turns[arm].append(turn)
    by_arm = {arm: merge(turns[arm], settings.measure_s) for arm in arms}
    added = compare(by_arm)
    report = {
        "scenario": NAME,
        "settings": settings.__dict__,
        "cores": None if split is None else {"engine": sorted(split.engine),
                                             "front": sorted(split.front)},
        "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - began,
        "added": added,
        "arms": by_arm,
    }  # fmt: skip
    scenario.save_results(
        out, report, "low-load.png", lambda path: plot(by_arm, path),
        lambda: print_table(by_arm, added),
    )  # fmt: skip
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--workdir", type=Path, help="logs of the stacks (default: OUT/stacks)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--measure", type=float, help="measured seconds per arm and round")
    parser.add_argument(
        "--arms",
        help=f"comma-separated subset of {list(ARMS)} (and {', '.join(BEFORE_ARMS)}), each "
        f"also with {AWAKE}: every CPU kept awake (gateway_lab/bench/awake.py)",
    )
    parser.add_argument(
        "--before-src", type=Path, help="a source tree whose service runs as the `before` arm"
    )


def main(args: argparse.Namespace) -> int:
    settings = Settings(rounds=1, measure_s=5.0, warmup_s=1.0) if args.quick else Settings()
    if args.rounds != Settings.rounds:
        settings = Settings(**{**settings.__dict__, "rounds": args.rounds})
    if args.measure:
        settings = Settings(**{**settings.__dict__, "measure_s": args.measure})
    arms = list(ARMS) + (["before"] if args.before_src else [])
    if args.arms:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a.removesuffix(AWAKE) not in (*ARMS, *BEFORE_ARMS)]
    before = {a.removesuffix(AWAKE) for a in arms} & set(BEFORE_ARMS)
    if unknown or (before and args.before_src is None):
        raise SystemExit(f"unknown arms {unknown} (known: {list(ARMS)}; {', '.join(BEFORE_ARMS)} "
                         "need --before-src)")  # fmt: skip
    run(args.out, scenario.workdir_of(args), settings, arms, args.before_src)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.lowload", __doc__, add_arguments, main)
    )
