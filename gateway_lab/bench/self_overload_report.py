"""What `extproc bench self-overload` prints and plots from its results (the run itself:
gateway_lab/bench/self_overload.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway_lab.bench import gc_trace, host_trace, phases, quiet_path, reply_probe
from gateway_lab.bench.cores import CoreSplit
from gateway_lab.bench.stats import fmt

ONSET_S = 10.0
"""The quiet requests sent in the flood's first seconds (the warm-up included) are its onset:
what a controller lets in before its first samples is still in the engines then."""
TARGET_OVER_P99_RATIO = 2.0


def print_tables(
    summary: dict[str, Any], results: dict[str, dict[str, Any]], split: CoreSplit | None
) -> None:
    print_table(summary, results)
    if any("gc_pauses" in result for result in results.values()):
        gc_trace.print_pauses({name: r.get("gc_pauses", []) for name, r in results.items()})
    traced = {name: r["host"] for name, r in results.items() if "host" in r}
    if traced:
        front = [f"cpu{c}" for c in sorted(split.front)] if split else []
        host_trace.print_slow(traced, front)


def print_table(summary: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    rows = summary["rows"]
    print(
        f"\n{'arm':20} {'quiet p50':>10} {'p99':>9} {'p50 x':>6} {'p99 x':>6} {'failed':>6} "
        f"{'flood tok/s':>11}  flooder answers / cpu cores"
    )
    for name, row in rows.items():
        cpu = " ".join(f"{k.split()[0]} {v:.2f}" for k, v in row["cpu_cores"].items())
        print(
            f"{name:20} {fmt(row['quiet_p50_ms']):>8}ms {fmt(row['quiet_p99_ms']):>7}ms "
            f"{fmt(row['p50_x_solo'], 2):>6} {fmt(row['p99_x_solo'], 2):>6} "
            f"{row['quiet_failed']:>6} {fmt(row['flooder_output_tok_s'], 0):>11}  "
            f"{row['flooder_status'] or '-'} / {cpu}"
        )
    print_onset(results)
    phased = {n: r["phases"] for n, r in results.items() if "phases" in r}
    phases.print_breakdown(phased)
    quiet_path.print_split({n: r["quiet_path"] for n, r in results.items() if "quiet_path" in r})
    reply_probe.print_door(results)
    print("\ntargets:")
    for target, met in summary["targets"].items():
        print(f"  {target}: {'met' if met else 'NOT met'}")


def print_onset(results: dict[str, dict[str, Any]]) -> None:
    """The quiet tenant's first chunk in the flood's first ONSET_S seconds and after them."""
    loaded = {n: r for n, r in results.items() if r["load"] != "alone" and "quiet_onset" in r}
    if not loaded:
        return
    print(f"\nquiet TTFT in the flood's first {ONSET_S:.0f} s (warm-up included) and after:")
    print(f"{'arm':24} {'onset n':>7} {'p50':>9} {'max':>9} {'after n':>7} {'p50':>9} {'p99':>9}")
    for name, r in loaded.items():
        onset, after = r["quiet_onset"], r["quiet_after_onset"]
        onset_ms = f"{fmt(onset['p50_ms']):>7}ms {fmt(onset['max_ms']):>7}ms"
        after_ms = f"{fmt(after['p50_ms']):>7}ms {fmt(after['p99_ms']):>7}ms"
        print(f"{name:24} {onset['count']:>7} {onset_ms} {after['count']:>7} {after_ms}")


def plot(results: dict[str, dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    names = list(summary["rows"])
    paths = {
        n: r["quiet_path"] for n, r in results.items() if r.get("quiet_path", {}).get("requests")
    }
    fig, axes = plt.subplots(1, 2 if paths else 1, figsize=(16 if paths else 10, 4.5))
    ax = axes[0] if paths else axes
    xs = range(len(names))
    p50 = [summary["rows"][n]["p50_x_solo"] for n in names]
    p99 = [summary["rows"][n]["p99_x_solo"] for n in names]
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="quiet P50 x solo")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="quiet P99 x solo")
    ax.axhline(TARGET_OVER_P99_RATIO, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("time to first chunk / solo (log)")
    ax.legend()
    if paths:
        quiet_path.plot_split(axes[1], paths)
    save_figure(fig, path)
    traced = {n: r["host"]["timeline"] for n, r in results.items() if "host" in r}
    if traced:
        host_trace.plot_timeline(traced, path.with_name("host-trace.png"))
