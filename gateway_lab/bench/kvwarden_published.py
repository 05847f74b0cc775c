"""Re-read kvwarden's published per-request results: is a tail from the steady state or from
the start of the run?

kvwarden's benchmark writes one CSV per tenant and arm (`tenant_<name>.csv`: tenant,
request_id, submit_time, ttft_ms, total_latency_ms, tokens_out, error). This prints, per
directory and tenant, the TTFT percentiles over the whole run and over what remains after the
first `--skip` seconds (a warm-up cut, as our benchmarks make), and when the slow requests
were sent. Nothing of kvwarden's data is shipped: point it at a checkout of kvwarden's
repository (its `results/` directories).

`extproc bench kvwarden-published DIR [DIR ...] [--skip 10] [--slow-ms 200]`
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway_lab.bench import scenario
from gateway_lab.bench.stats import fmt

NAME = "kvwarden-published"
DEFAULT_OUT = Path("results/kvwarden-published")


@dataclass(frozen=True)
class Sent:
    """One answered request: seconds after the tenant's first submit, and its TTFT."""

    offset_s: float
    ttft_ms: float


def read_tenant_csv(path: Path) -> tuple[list[Sent], int]:
    """The answered requests of one tenant CSV in submit order, and how many rows had an
    error (those are left out, as kvwarden's summaries leave them out)."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    answered = [row for row in rows if not row.get("error") and row.get("ttft_ms")]
    if not answered:
        return [], len(rows)
    first = min(float(row["submit_time"]) for row in answered)
    sent = [Sent(float(row["submit_time"]) - first, float(row["ttft_ms"])) for row in answered]
    return sorted(sent, key=lambda s: s.offset_s), len(rows) - len(answered)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(sent: Sequence[Sent], skip_s: float, slow_ms: float) -> dict[str, Any]:
    """Percentiles over the whole run and after `skip_s`; when the slow requests were sent."""

    def stats(values: list[float]) -> dict[str, float]:
        return {
            "count": len(values),
            "p50_ms": percentile(values, 0.50),
            "p95_ms": percentile(values, 0.95),
            "p99_ms": percentile(values, 0.99),
            "max_ms": max(values) if values else math.nan,
        }

    slow = [s.offset_s for s in sent if s.ttft_ms > slow_ms]
    return {
        "whole_run": stats([s.ttft_ms for s in sent]),
        "after_skip": stats([s.ttft_ms for s in sent if s.offset_s >= skip_s]),
        "slow_count": len(slow),
        "slow_last_sent_s": max(slow) if slow else None,
    }


def read_directory(directory: Path, skip_s: float, slow_ms: float) -> dict[str, Any]:
    """Per tenant: `describe`'s figures and the requests themselves ([offset s, TTFT ms])."""
    tenants = {}
    for path in sorted(directory.glob("tenant_*.csv")):
        sent, errors = read_tenant_csv(path)
        if not sent and not errors:
            continue  # a header only: the tenant did not run in this arm
        tenants[path.stem.removeprefix("tenant_")] = {
            **describe(sent, skip_s, slow_ms),
            "errors": errors,
            "requests": [[s.offset_s, s.ttft_ms] for s in sent],
        }
    return tenants


def plot(report: dict[str, Any], path: Path) -> None:
    """Each request's TTFT against when it was sent, one panel per directory."""
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    directories = report["directories"]
    fig, axes = plt.subplots(len(directories), 1, figsize=(9, 2.6 * len(directories)),
                             squeeze=False, sharex=True)  # fmt: skip
    for ax, (name, tenants) in zip(axes[:, 0], directories.items(), strict=True):
        for tenant, row in tenants.items():
            points = row["requests"]
            ax.scatter([p[0] for p in points], [p[1] for p in points], s=4, label=tenant)
        ax.axvline(report["skip_s"], color="grey", linestyle="--", linewidth=1)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("TTFT ms (log)")
        if any(row["requests"] for row in tenants.values()):
            ax.set_yscale("log")
            ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds after the tenant's first request")
    save_figure(fig, path)


def print_table(report: dict[str, Any]) -> None:
    skip, slow = report["skip_s"], report["slow_ms"]
    print(
        f"\n{'directory / tenant':48} {'n':>5} {'p50':>7} {'p95':>7} {'p99':>8} {'max':>8}   "
        f"after the first {skip:g} s: {'n':>5} {'p99':>7} {'max':>7}   slow (>{slow:g} ms)"
    )
    for directory, tenants in report["directories"].items():
        for tenant, row in tenants.items():
            whole, after = row["whole_run"], row["after_skip"]
            last = row["slow_last_sent_s"]
            when = "none" if last is None else f"{row['slow_count']}, last sent at {last:.1f} s"
            if row["errors"]:
                when += f"; {row['errors']} errors left out"
            print(
                f"{(directory + ' / ' + tenant)[-48:]:48} {whole['count']:>5} "
                f"{fmt(whole['p50_ms']):>7} {fmt(whole['p95_ms']):>7} {fmt(whole['p99_ms']):>8} "
                f"{fmt(whole['max_ms']):>8}   {'':>21}{after['count']:>5} "
                f"{fmt(after['p99_ms']):>7} {fmt(after['max_ms']):>7}   {when}"
            )


def run(directories: Sequence[Path], out: Path, skip_s: float, slow_ms: float) -> dict[str, Any]:
    report = {
        "scenario": NAME,
        "skip_s": skip_s,
        "slow_ms": slow_ms,
        "directories": {d.name: read_directory(d, skip_s, slow_ms) for d in directories},
    }
    scenario.save_results(
        out, report, "kvwarden-published.png", lambda path: plot(report, path),
        lambda: print_table(report),
    )  # fmt: skip
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directories", nargs="+", type=Path, help="kvwarden result directories (tenant_*.csv)"
    )
    parser.add_argument("--skip", type=float, default=10.0, help="warm-up seconds to cut")
    parser.add_argument("--slow-ms", type=float, default=200.0, help="what counts as slow")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)


def main(args: argparse.Namespace) -> int:
    missing = [d for d in args.directories if not any(d.glob("tenant_*.csv"))]
    if missing:
        raise SystemExit(f"no tenant_*.csv in {', '.join(map(str, missing))}")
    run(args.directories, args.out, args.skip, args.slow_ms)
    return 0
