"""Where the ext_proc process's CPU goes under streamed load, by shared object: our service
beside the do-nothing floor, each sampled with Linux `perf` while the overhead benchmark's
streamed workload runs through it.

`python -m gateway_lab.bench.front_profile [--arms noop,extproc,extproc-child] [--seconds 15]
[--compiled-src .compiled] [--before REV]`

Each arm gets its own stack (two emulated engines, Envoy, the ext_proc server, as
`extproc bench overhead`), a warm-up, then `--clients` clients back to back asking for
`--tokens`-token streamed responses while `perf record` samples the ext_proc process. The
table gives, per arm, the samples in each shared object (libpython: Python code being
interpreted, ours and the libraries'; cygrpc: gRPC's core and its Cython layer; _message:
protobuf; loop: uvloop; the kernel) and the same per streamed chunk in microseconds
(samples / frequency / chunks). Needs `perf` (Debian's linux-perf) and
`kernel.perf_event_paranoid` <= 2 for a process of one's own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway_lab.bench.cores import descendants
from gateway_lab.bench.overhead import COMPILED_ARM, bench_policy, measure
from gateway_lab.bench.provenance import with_provenance
from gateway_lab.bench.revisions import check_compiled, tree_env, tree_of_rev
from gateway_lab.bench.stack import bench_stack

DEFAULT_OUT = Path("results/front-profile")
FREQUENCY_HZ = 999
BEFORE_ARM = "before-child"
"""With `--before REV`: the child layout running the service of git revision REV."""
SETTLE_S = 3.0
"""perf stops this long before the load does, so it samples the steady state only."""


def parse_dso_report(text: str) -> dict[str, int]:
    """`perf report --sort dso --stdio -n` lines ("  43.50%   539  libpython3.11.so.1.0") as
    {shared object: samples}."""
    samples: dict[str, int] = {}
    for raw in text.splitlines():
        fields = raw.split(None, 2)
        if len(fields) < 3 or not fields[0].endswith("%") or not fields[1].isdigit():
            continue
        name = fields[2].strip()
        samples[name] = samples.get(name, 0) + int(fields[1])
    return samples


def short_name(dso: str) -> str:
    """`cygrpc.cpython-311-x86_64-linux-gnu.so` -> `cygrpc`, `[kernel.kallsyms]` -> `kernel`."""
    if dso.startswith("[kernel"):
        return "kernel"
    base = dso.split("/")[-1]
    for cut in (".cpython-", ".abi3", ".so"):
        base = base.split(cut)[0]
    return base


def per_chunk_us(samples: Mapping[str, int], chunks: int) -> dict[str, float]:
    """Samples by object as microseconds of CPU per streamed chunk."""
    if chunks <= 0:
        return {}
    return {name: count / FREQUENCY_HZ / chunks * 1e6 for name, count in samples.items()}


def profile_arm(
    arm: str, workdir: Path, seconds: float, tokens: int, clients: int,
    sources: Mapping[str, Path] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`sources`: the tree each of the arms COMPILED_ARM and BEFORE_ARM runs."""
    perf_data = workdir / f"{arm}.perf.data"
    child = arm.endswith("-child")
    source = (sources or {}).get(arm)
    kind = "extproc" if source is not None else arm.removesuffix("-child")
    env = tree_env(source) if source is not None else None
    with bench_stack(
        workdir / arm, bench_policy, kind, accounting_process=child, extproc_env=env
    ) as stack:
        measure(stack, 20, 4, 2.0)  # warm up connections and caches
        pid = stack.pid_of("extproc")
        if pid is None:
            raise SystemExit(f"arm {arm} has no ext_proc process to profile")
        pids = ",".join(str(p) for p in (pid, *descendants(pid)))  # with the accounting child
        sampled_s = max(1.0, seconds - SETTLE_S)
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-F", str(FREQUENCY_HZ), "-p", pids, "-o",
             str(perf_data), "--", "sleep", f"{sampled_s:.1f}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            run = measure(stack, tokens, clients, seconds)
        finally:
            perf.wait(timeout=seconds + 60)
    report = subprocess.run(
        ["perf", "report", "-i", str(perf_data), "--sort", "dso", "--stdio", "-n"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    samples: Counter[str] = Counter()
    for dso, count in parse_dso_report(report).items():
        samples[short_name(dso)] += count
    # the chunks perf saw: the run's chunk rate over the sampled seconds
    chunks = round(run["chunks"] / run["elapsed_s"] * sampled_s)
    return {
        "arm": arm,
        "samples": dict(samples),
        "sampled_s": sampled_s,
        "chunks_sampled": chunks,
        "us_per_chunk": per_chunk_us(samples, chunks),
        "cpu_us_per_request": run["extproc_cpu_us_per_request"],
        "chunks_per_request": run["chunks_per_request"],
    }


def merge(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One arm's rounds as one: samples and chunks summed, CPU per request averaged."""
    samples: Counter[str] = Counter()
    for run in runs:
        samples.update(run["samples"])
    chunks = sum(run["chunks_sampled"] for run in runs)
    return {
        "arm": runs[0]["arm"],
        "rounds": len(runs),
        "samples": dict(samples),
        "sampled_s": sum(run["sampled_s"] for run in runs),
        "chunks_sampled": chunks,
        "us_per_chunk": per_chunk_us(samples, chunks),
        "cpu_us_per_request": sum(r["cpu_us_per_request"] for r in runs) / len(runs),
        "chunks_per_request": runs[0]["chunks_per_request"],
    }


def print_table(results: Iterable[Mapping[str, Any]]) -> None:
    rows = list(results)
    names = sorted({n for r in rows for n in r["us_per_chunk"]},
                   key=lambda n: -max(r["us_per_chunk"].get(n, 0.0) for r in rows))  # fmt: skip
    print("\nCPU per streamed chunk by shared object (us, perf samples):")
    print(f"{'object':16}" + "".join(f"{r['arm']:>15}" for r in rows))
    for name in names:
        cells = "".join(f"{r['us_per_chunk'].get(name, 0.0):>15.1f}" for r in rows)
        print(f"{name:16}{cells}")
    print(f"{'total':16}" + "".join(f"{sum(r['us_per_chunk'].values()):>15.1f}" for r in rows))
    print(f"{'/proc, us/req':16}" + "".join(f"{r['cpu_us_per_request']:>15.0f}" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--arms", default="noop,extproc,extproc-child",
        help="of noop, extproc (accounting in process), extproc-child (the shipped layout: "
        "the accounting streams in a child process, both sampled)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=15.0, help="streamed load per arm")
    parser.add_argument("--tokens", type=int, default=500, help="output tokens per response")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="repeat the arms, in alternating order, and merge each arm's rounds",
    )  # fmt: skip
    parser.add_argument(
        "--compiled-src", type=Path, metavar="DIR",
        help=f"the compiled build in DIR (scripts/build-compiled.sh): adds the arm "
        f"{COMPILED_ARM!r}, the child layout running it",
    )  # fmt: skip
    parser.add_argument(
        "--before", metavar="REV",
        help=f"adds the arm {BEFORE_ARM!r}: the child layout running git revision REV, side by "
        "side with this checkout's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        print("front_profile needs `perf` (Debian: linux-perf)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    sources: dict[str, Path] = {}
    if args.compiled_src is not None:
        check_compiled(args.compiled_src)
        sources[COMPILED_ARM] = args.compiled_src
    if args.before is not None:
        sources[BEFORE_ARM] = tree_of_rev(args.before, args.out / "before-src")
    arms += list(sources)
    runs = [
        profile_arm(
            arm, args.out / f"round-{turn}", args.seconds, args.tokens, args.clients, sources
        )
        for turn in range(args.rounds)
        for arm in (arms if turn % 2 == 0 else arms[::-1])  # drift hits every arm alike
    ]
    results = [merge([r for r in runs if r["arm"] == arm]) for arm in arms]
    print_table(results)
    (args.out / "results.json").write_text(json.dumps(with_provenance(results), indent=2))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
