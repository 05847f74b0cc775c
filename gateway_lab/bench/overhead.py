"""Benchmark: what the gateway costs. The same streamed workload through the same Envoy, three ways:
straight to the engines, through the do-nothing ext_proc floor, and through our service.

`extproc bench overhead [--out results/overhead] [--quick] [--compiled-src DIR] [--before REV]
[--arms A,B]`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from extproc.policy import hash_key
from gateway_lab.bench.cores import tree_cpu_seconds
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.loadgen import Load, closed_loop, summarize
from gateway_lab.bench.noisy_isolation import listed
from gateway_lab.bench.provenance import with_provenance
from gateway_lab.bench.records import Meter, Record, Spec, percentile
from gateway_lab.bench.revisions import check_compiled, tree_env, tree_of_rev
from gateway_lab.bench.stack import Gateway, bench_stack
from gateway_lab.engine.tokens import chat_prompt_tokens
from gateway_lab.progress import Progress

DEFAULT_OUT = Path("results/overhead")
BENCH_KEY = "bench-key"
ARMS = ("straight", "noop", "extproc", "extproc-child", "extproc-lua")
"""`extproc`: our service accounting in process; `extproc-child`: with its accounting child
process (`serve --accounting-grpc`), the layout `extproc up` and the deploy files ship, its
CPU the two processes' together; `extproc-lua`: Envoy counts and tells the service
(`serve --envoy-events`, extproc.envoy_lua), so part of the work is Envoy's: compare it with
Envoy's CPU included (`cpu_per_request_with_envoy_us`)."""
WORKERS_ARM = "extproc-lua-2w"
"""Only when `--arms` names it: `extproc-lua` with two workers (`serve --workers 2
--worker-ports distinct`), their CPU and the supervisor's together."""
WORKERS = {WORKERS_ARM: 2}
"""Arms whose service runs several workers."""
COMPILED_ARM = "compiled-child"
"""With `--compiled-src DIR`: `extproc-child` running the compiled build installed in DIR
(scripts/build-compiled.sh)."""
BEFORE_ARM = "lua-before"
"""With `--before REV`: `extproc-lua` running that revision's extproc, side by side with this
tree's (a change to the counting-in-Envoy path measured in one run)."""
REQUIRED_ARMS = ("straight", "noop")
"""The arms every comparison is made against (`--arms` always runs them)."""
OURS = {
    "extproc": ("ours", "in process"),
    "extproc-child": ("ours_child", "with the child"),
    "extproc-lua": ("ours_lua", "counting in Envoy"),
    WORKERS_ARM: ("ours_lua_2w", "counting in Envoy, 2 workers"),
    COMPILED_ARM: ("compiled_child", "compiled"),
    BEFORE_ARM: ("ours_lua_before", "counting in Envoy, before"),
}
"""Our arms: their names in the summary and in the printout."""


def arm_names(
    compiled: bool, before: bool = False, wanted: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The arms to run: `ARMS` and the optional ones asked for, or the `wanted` ones (with the
    floor and straight)."""
    optional = (*((COMPILED_ARM,) if compiled else ()), *((BEFORE_ARM,) if before else ()))
    if wanted is None:
        return (*ARMS, *optional)
    every = (*ARMS, WORKERS_ARM, *optional)
    unknown = sorted(set(wanted) - set(every))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {list(every)}")
    return tuple(arm for arm in every if arm in wanted or arm in REQUIRED_ARMS)


def bench_policy(short: str, long_: str) -> str:
    limits = "{requests_per_minute: 10000000, tokens_per_minute: 1000000000, max_queued: 100000}"
    return f"""\
version: 1
tiers: [standard]
tenants:
  bench:
    tier: standard
    api_keys: ["{hash_key(BENCH_KEY)}"]
    limits: {limits}
pools:
  short: {{max_total_tokens: 8192, max_inflight: 4096, max_inflight_tokens: 100000000,
           endpoints: ["{short}"], headroom: 0, adaptive: {{enabled: false}}}}
  long: {{max_total_tokens: 131072, max_inflight: 64, max_inflight_tokens: 100000000,
          endpoints: ["{long_}"], headroom: 0, adaptive: {{enabled: false}}}}
"""


def workload(output_tokens: int) -> Callable[[int], Spec]:
    prompt = "Summarise the benefits of fair scheduling for shared inference fleets. " * 3
    tokens = chat_prompt_tokens([{"role": "user", "content": prompt}])
    spec = Spec("bench", BENCH_KEY, prompt, tokens, output_tokens)

    def make(_: int) -> Spec:
        return spec

    return make


async def closed_run(
    url: str, make: Callable[[int], Spec], concurrency: int, duration_s: float
) -> list[Record]:
    """`concurrency` clients back to back for `duration_s`; the requests in flight then end."""
    async with Load(url, Meter(bin_s=1.0), request_timeout_s=max(60.0, duration_s * 3)) as load:
        await closed_loop(load, make, concurrency, duration_s, finish=True)
    return load.records


def _cpu_s(stack: Gateway, child: str) -> float:
    """CPU seconds of a child's process tree (`extproc`: the server and its accounting child,
    if any; `envoy`); 0 without one."""
    pid = stack.pid_of(child)
    return 0.0 if pid is None else tree_cpu_seconds(pid)


def measure(
    stack: Gateway, output_tokens: int, concurrency: int, duration_s: float, arm: str = ""
) -> dict[str, Any]:
    cpu_before, envoy_before = _cpu_s(stack, "extproc"), _cpu_s(stack, "envoy")
    started = time.perf_counter()
    records = asyncio.run(closed_run(stack.url, workload(output_tokens), concurrency, duration_s))
    elapsed = time.perf_counter() - started
    cpu = _cpu_s(stack, "extproc") - cpu_before
    envoy_cpu = _cpu_s(stack, "envoy") - envoy_before
    summary: dict[str, Any] = dict(summarize(records, elapsed))
    ok = summary["ok"] or 1.0
    summary.update(
        ttfb_ms=[r.ttft * 1000 for r in records if r.status == 200 and r.ttft is not None],
        arm=arm or stack.arm,
        output_tokens=output_tokens,
        concurrency=concurrency,
        elapsed_s=elapsed,
        extproc_cpu_s=cpu,
        extproc_cpu_us_per_request=cpu / ok * 1e6,
        envoy_cpu_s=envoy_cpu,
        envoy_cpu_us_per_request=envoy_cpu / ok * 1e6,
        chunks_per_request=summary["chunks"] / ok,
    )
    return summary


def per_chunk_us(short: dict[str, Any], long_: dict[str, Any]) -> float:
    """CPU per streamed chunk: the slope between a short and a long response."""
    extra_chunks = long_["chunks_per_request"] - short["chunks_per_request"]
    extra_cpu = long_["extproc_cpu_us_per_request"] - short["extproc_cpu_us_per_request"]
    return extra_cpu / extra_chunks if extra_chunks > 0 else float("nan")


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's runs of the same load in several rounds, as one run: totals of requests,
    seconds and CPU; percentiles over every request of every round."""
    first = rounds[0]
    ok = sum(r["ok"] for r in rounds)
    elapsed = sum(r["elapsed_s"] for r in rounds)
    cpu = sum(r["extproc_cpu_s"] for r in rounds)
    envoy_cpu = sum(r["envoy_cpu_s"] for r in rounds)
    chunks = sum(r["chunks"] for r in rounds)
    ttfb = [t for r in rounds for t in r["ttfb_ms"]]
    return {
        "arm": first["arm"],
        "output_tokens": first["output_tokens"],
        "concurrency": first["concurrency"],
        "rounds": len(rounds),
        "ok": ok,
        "elapsed_s": elapsed,
        "rps": ok / elapsed if elapsed else math.nan,
        "ttfb_p50_ms": percentile(ttfb, 50),
        "ttfb_p99_ms": percentile(ttfb, 99),
        "chunks": chunks,
        "extproc_cpu_s": cpu,
        "extproc_cpu_us_per_request": cpu / (ok or 1.0) * 1e6,
        "envoy_cpu_s": envoy_cpu,
        "envoy_cpu_us_per_request": envoy_cpu / (ok or 1.0) * 1e6,
        "chunks_per_request": chunks / (ok or 1.0),
    }


def planned_seconds(loads: list[tuple[int, int, float]], rounds: int, arms: int) -> float:
    """Seconds of load `interleaved` runs: what the progress display counts."""
    return rounds * arms * sum(seconds for _, _, seconds in loads)


def interleaved(
    stacks: dict[str, Gateway],
    loads: list[tuple[int, int, float]],
    rounds: int,
    label: str,
    tracker: Progress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every load (output tokens, clients, seconds) on every arm, arm after arm, `rounds`
    times over: slow drifts and other processes' bursts then hit every arm alike. Returns
    the merged runs and the raw ones."""
    raw: list[dict[str, Any]] = []
    for round_index in range(rounds):
        for tokens, concurrency, seconds in loads:
            for arm, stack in stacks.items():
                tracker.phase(
                    f"{label}round {round_index + 1}/{rounds}: {arm}, "
                    f"{tokens}-token responses, {concurrency} clients, {seconds:.0f}s"
                )
                measured = measure(stack, tokens, concurrency, seconds, arm)
                raw.append({**measured, "round": round_index})
                tracker.update(tracker.done + seconds)
    order = list(stacks)
    keys = sorted(
        dict.fromkeys((r["arm"], r["output_tokens"], r["concurrency"]) for r in raw),
        key=lambda k: (order.index(k[0]), k[2], k[1]),
    )
    merged = [
        merge_rounds([r for r in raw if (r["arm"], r["output_tokens"], r["concurrency"]) == key])
        for key in keys
    ]
    return merged, raw


def stacks_of(
    exit_stack: contextlib.ExitStack,
    workdir: Path,
    profile: str,
    tracker: Progress,
    arms: Sequence[str],
    sources: dict[str, Path],
) -> dict[str, Gateway]:
    """The arms' stacks, all up at once (idle while another arm is measured); `sources`: the
    tree an arm's service runs from, when not this one."""
    stacks: dict[str, Gateway] = {}
    for arm in arms:
        tracker.note(f"[overhead] starting the {arm} stack ({profile})")
        child = arm.endswith("-child")
        where = workdir / f"{profile}-{arm}"
        in_envoy = arm in ("extproc-lua", WORKERS_ARM, BEFORE_ARM)
        kind = "extproc" if arm == COMPILED_ARM or in_envoy else arm.removesuffix("-child")
        env = tree_env(sources[arm]) if arm in sources else None
        stack = exit_stack.enter_context(
            bench_stack(
                where,
                bench_policy,
                kind,
                profile,
                accounting_process=child,
                extproc_env=env,
                count_in_envoy=in_envoy,
                workers=WORKERS.get(arm, 1),
            )
        )
        measure(stack, 20, 4, 1.0)  # warm up connections and caches
        stacks[arm] = stack
    return stacks


def run(
    out: Path,
    quick: bool,
    workdir: Path,
    compiled_src: Path | None = None,
    before_src: Path | None = None,
    wanted: Sequence[str] | None = None,
) -> dict[str, Any]:
    levels = (8,) if quick else (8, 32)
    short_s, long_s = (3.0, 6.0) if quick else (6.0, 10.0)
    rounds = 1 if quick else 2
    loads = [(t, c, sec) for c in levels for t, sec in ((20, short_s), (500, long_s))]
    bound_loads = [(20, GATEWAY_BOUND_CLIENTS, 3.0 if quick else 8.0)]
    sources: dict[str, Path] = {}
    if compiled_src is not None:
        check_compiled(compiled_src)
        sources[COMPILED_ARM] = compiled_src
    if before_src is not None:
        sources[BEFORE_ARM] = before_src
    arms = arm_names(compiled_src is not None, before_src is not None, wanted)
    total = planned_seconds(loads, rounds, len(arms)) + planned_seconds(
        bound_loads, rounds, len(arms)
    )
    tracker = Progress("overhead", total, unit="s of load")
    with contextlib.ExitStack() as exit_stack:
        stacks = stacks_of(exit_stack, workdir, "a100-llama3-8b", tracker, arms, sources)
        runs, raw = interleaved(stacks, loads, rounds, "", tracker)
    with contextlib.ExitStack() as exit_stack:
        stacks = stacks_of(exit_stack, workdir, GATEWAY_BOUND_PROFILE, tracker, arms, sources)
        saturated, raw_saturated = interleaved(
            stacks, bound_loads, rounds, "gateway-bound ", tracker
        )
    report = compare(runs, levels)
    tracker.phase("in-process cost of our handlers (no gRPC)")
    chunks = round(_find(runs, "noop", 20, levels[0])["chunks_per_request"])
    in_process = measure_in_process(2_000 if quick else 10_000, chunks)
    in_process_compiled = (
        None
        if compiled_src is None
        else measure_in_process(2_000 if quick else 10_000, chunks, tree_env(compiled_src))
    )
    tracker.finish()
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "runs": runs,
        "summary": report,
        "gateway_bound": saturated,
        "in_process_us": in_process,
        "in_process_compiled_us": in_process_compiled,
        "raw_runs": raw + raw_saturated,
    }
    (out / "results.json").write_text(json.dumps(with_provenance(results), indent=2))
    plot(runs, out / "overhead.png")
    print_table(runs, report)
    print(
        f"\ngateway-bound throughput ({GATEWAY_BOUND_PROFILE!r} engines, 20-token responses, "
        f"{GATEWAY_BOUND_CLIENTS} clients; the load generator shares the cores):"
    )
    for row in saturated:
        print(
            f"  {row['arm']:14s} {row['rps']:7.1f} req/s  ext_proc CPU "
            f"{row['extproc_cpu_us_per_request']:6.0f} us/request"
        )
    floor_rps = next(r["rps"] for r in saturated if r["arm"] == "noop")
    for row in saturated:
        if row["arm"] in OURS:
            print(f"  {row['arm']} / floor = {row['rps'] / floor_rps:.2f}x (target >= 0.9)")
    print(f"\nin-process (our handlers alone, {chunks} chunks, hot loop: bench.inprocess):")
    for phase, micros in in_process.items():
        compiled = (
            ""
            if in_process_compiled is None
            else f"  compiled {in_process_compiled[phase]:7.1f} us"
        )
        print(f"  {phase:28s} {micros:7.1f} us{compiled}")
    return results


GATEWAY_BOUND_PROFILE = "fast"
GATEWAY_BOUND_CLIENTS = 32


def measure_in_process(
    requests: int, chunks: int, env: dict[str, str] | None = None
) -> dict[str, float]:
    """gateway_lab.bench.inprocess in a fresh process: this one's heap (load generator, results)
    would make garbage collection, and so the figures, larger than in the service. `env`: the
    compiled build's (`tree_env`)."""
    command = [sys.executable, "-m", "gateway_lab.bench.inprocess", "--json",
               "--requests", str(requests), "--chunks", str(chunks)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600, env=env)
    figures: dict[str, float] = json.loads(done.stdout)
    return figures


def _find(runs: list[dict[str, Any]], arm: str, tokens: int, level: int) -> dict[str, Any]:
    return next(
        r
        for r in runs
        if r["arm"] == arm and r["output_tokens"] == tokens and r["concurrency"] == level
    )


def compare(runs: list[dict[str, Any]], levels: tuple[int, ...]) -> dict[str, Any]:
    """Per level: our two layouts' CPU per request and per chunk against the floor's, and
    requests/s; `ours` is the in-process layout, `ours_child` the shipped one."""
    summary: dict[str, Any] = {}
    present = {r["arm"] for r in runs}
    for level in levels:
        noop_short, noop_long = _find(runs, "noop", 20, level), _find(runs, "noop", 500, level)
        straight_short = _find(runs, "straight", 20, level)
        floor_req = noop_short["extproc_cpu_us_per_request"]
        floor_both = floor_req + noop_short["envoy_cpu_us_per_request"]
        floor_chunk = per_chunk_us(noop_short, noop_long)
        figures: dict[str, Any] = {
            "cpu_per_request_us": {"floor": floor_req},
            "cpu_per_request_with_envoy_us": {"floor": floor_both},
            "cpu_per_chunk_us": {"floor": floor_chunk},
            "rps_20_tokens": {"straight": straight_short["rps"], "floor": noop_short["rps"]},
            "ttfb_p50_increase_ms": {
                "floor": noop_short["ttfb_p50_ms"] - straight_short["ttfb_p50_ms"]
            },
        }
        for arm, (name, _label) in OURS.items():
            if arm not in present:
                continue
            short, long_ = _find(runs, arm, 20, level), _find(runs, arm, 500, level)
            request, chunk = short["extproc_cpu_us_per_request"], per_chunk_us(short, long_)
            figures["cpu_per_request_us"] |= {name: request, f"{name}_ratio": request / floor_req}
            both = request + short["envoy_cpu_us_per_request"]
            figures["cpu_per_request_with_envoy_us"] |= {
                name: both,
                f"{name}_ratio": both / floor_both,
            }
            figures["cpu_per_chunk_us"] |= {name: chunk, f"{name}_ratio": chunk / floor_chunk}
            figures["rps_20_tokens"] |= {
                name: short["rps"],
                f"{name}_vs_floor": short["rps"] / noop_short["rps"],
            }
            figures["ttfb_p50_increase_ms"][name] = (
                short["ttfb_p50_ms"] - straight_short["ttfb_p50_ms"]
            )
        summary[f"concurrency_{level}"] = figures
    return summary


def print_table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print(f"\n{'arm':14} {'tokens':>6} {'conc':>4} {'req/s':>8} {'ttfb p50':>9} {'ttfb p99':>9} "
          f"{'cpu us/req':>10} {'chunks/req':>10}")  # fmt: skip
    for r in runs:
        print(
            f"{r['arm']:14} {r['output_tokens']:6d} {r['concurrency']:4d} {r['rps']:8.1f} "
            f"{r['ttfb_p50_ms']:8.1f}ms {r['ttfb_p99_ms']:8.1f}ms "
            f"{r['extproc_cpu_us_per_request']:10.0f} {r['chunks_per_request']:10.1f}"
        )
    for level, figures in summary.items():
        request, chunk, rps = (
            figures["cpu_per_request_us"],
            figures["cpu_per_chunk_us"],
            figures["rps_20_tokens"],
        )
        print(f"\n{level}:")
        for name, label in OURS.values():
            if name not in request:
                continue
            print(
                f"  {label}: CPU/request {request[name]:.0f} us vs floor {request['floor']:.0f} us"
                f" = {request[name + '_ratio']:.2f}x (target <= 1.25); CPU/chunk "
                f"{chunk[name]:.1f} us vs {chunk['floor']:.1f} us = {chunk[name + '_ratio']:.2f}x"
                f" (target <= 1.5); req/s {rps[name]:.0f} vs {rps['floor']:.0f} = "
                f"{rps[name + '_vs_floor']:.2f}x (target >= 0.9)"
            )
        with_envoy = figures["cpu_per_request_with_envoy_us"]
        print(
            "  with Envoy's CPU, per request: "
            + ", ".join(
                f"{label} {with_envoy[name]:.0f} us = {with_envoy[name + '_ratio']:.2f}x"
                for name, label in OURS.values()
                if name in with_envoy
            )
            + f" (floor {with_envoy['floor']:.0f} us)"
        )
        print(f"  straight {rps['straight']:.0f} req/s")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [f"{r['output_tokens']}t c{r['concurrency']}" for r in runs if r["arm"] == "straight"]
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    width = 0.8 / len(arms)
    for offset, arm in enumerate(arms):
        mine = [r for r in runs if r["arm"] == arm]
        xs = [i + (offset - (len(arms) - 1) / 2) * width for i in range(len(mine))]
        axes[0].bar(xs, [r["rps"] for r in mine], width, label=arm)
        axes[1].bar(xs, [r["ttfb_p50_ms"] for r in mine], width, label=arm)
        axes[2].bar(xs, [r["extproc_cpu_us_per_request"] for r in mine], width, label=arm)
    for ax, title in zip(
        axes, ("requests/s", "TTFB p50 (ms)", "ext_proc CPU us/request"), strict=True
    ):
        ax.set_title(title)
        ax.set_xticks(range(len(labels)), labels, rotation=20)
        ax.legend()
    save_figure(fig, path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--workdir", type=Path, help="logs of the stacks (default: OUT/stacks)")
    parser.add_argument(
        "--compiled-src",
        type=Path,
        help="a folder holding the compiled build (scripts/build-compiled.sh): adds the arm "
        f"{COMPILED_ARM!r}, and the hot loop compiled",
    )
    parser.add_argument(
        "--before", metavar="REV",
        help=f"adds the arm {BEFORE_ARM!r}: counting in Envoy with the service of revision REV",
    )  # fmt: skip
    parser.add_argument(
        "--arms", help=f"comma-separated arms to run ({', '.join(REQUIRED_ARMS)} always run)"
    )


def main(args: argparse.Namespace) -> int:
    workdir = args.workdir or args.out / "stacks"
    before = None if args.before is None else tree_of_rev(args.before, workdir / "before-src")
    wanted = None if args.arms is None else listed(args.arms)
    run(args.out, args.quick, workdir, args.compiled_src, before, wanted)
    return 0
