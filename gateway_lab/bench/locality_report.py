"""The locality benchmark's ratios, table and plot (gateway_lab.bench.locality)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.stats import fmt

TARGET_THROUGHPUT_RATIO = 1.5
_COLORS = {"vtc": "#d62728", "drr": "#ff7f0e", "dlpm": "#2ca02c"}


def _ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def summarize_arms(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every arm against vtc, measured side by side in this run."""
    base = results.get("vtc", {})
    rows: dict[str, dict[str, float]] = {}
    for name, arm in results.items():
        rows[name] = {
            "throughput_vs_vtc": _ratio(arm["completed_per_s"], base.get("completed_per_s", 0)),
            "prompt_tokens_vs_vtc": _ratio(
                arm["prompt_tokens_per_s"], base.get("prompt_tokens_per_s", 0)
            ),
            "quiet_p99_vs_vtc": _ratio(
                arm["quiet_ttft"]["p99_ms"], base.get("quiet_ttft", {}).get("p99_ms", math.nan)
            ),
            "gap_over_bound": arm["max_gap"] / arm["bound"],
        }
    dlpm = rows.get("dlpm", {})
    return {
        "rows": rows,
        "target_throughput_ratio": TARGET_THROUGHPUT_RATIO,
        "dlpm_meets_throughput": dlpm.get("throughput_vs_vtc", 0.0) >= TARGET_THROUGHPUT_RATIO,
        "dlpm_gap_within_bound": dlpm.get("gap_over_bound", math.inf) <= 1.0,
    }


def table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    head = (
        f"{'arm':6} {'req/s':>7} {'x vtc':>6} {'prompt tok/s':>12} {'hit rate':>8} "
        f"{'chat svc/s':>10} {'docs svc/s':>10} {'gap':>8} {'bound':>8} {'gap/bound':>9} "
        f"{'quiet p50':>9} {'quiet p99':>9}"
    )
    print(head)
    for name, arm in results.items():
        row = summary["rows"][name]
        service = arm["service_per_s"]
        print(
            f"{name:6} {fmt(arm['completed_per_s'], 2):>7} {fmt(row['throughput_vs_vtc'], 2):>6} "
            f"{fmt(arm['prompt_tokens_per_s'], 0):>12} {fmt(arm['prefix_hit_rate'] * 100, 1):>7}% "
            f"{fmt(service['chat'], 0):>10} {fmt(service['docs'], 0):>10} "
            f"{fmt(arm['max_gap'], 0):>8} {fmt(arm['bound'], 0):>8} "
            f"{fmt(row['gap_over_bound'], 2):>9} {fmt(arm['quiet_ttft']['p50_ms'], 0):>9} "
            f"{fmt(arm['quiet_ttft']['p99_ms'], 0):>9}"
        )
    print(
        f"\ndlpm throughput >= {TARGET_THROUGHPUT_RATIO}x vtc: {summary['dlpm_meets_throughput']};"
        f" dlpm service gap within its bound: {summary['dlpm_gap_within_bound']}"
    )


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    names = list(results)
    colors = [_COLORS.get(n, "#1f77b4") for n in names]
    xs = list(range(len(names)))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        (axes[0][0], [results[n]["completed_per_s"] for n in names], "completed requests/s"),
        (
            axes[0][1],
            [results[n]["prefix_hit_rate"] * 100 for n in names],
            "prefix cache hit rate (%, engines' counters)",
        ),
        (
            axes[1][1],
            [results[n]["quiet_ttft"]["p99_ms"] for n in names],
            "quiet tenant (unique prompts): P99 TTFT (ms)",
        ),
    ]
    for ax, values, title in panels:
        ax.bar(xs, values, color=colors)
        ax.set_xticks(xs, names)
        ax.set_title(title)
    ax = axes[1][0]
    gaps = [results[n]["max_gap"] for n in names]
    ax.bar(xs, gaps, color=colors)
    ax.axhline(results[names[0]]["bound"], ls="--", color="black", lw=0.8)
    ax.text(0, results[names[0]]["bound"], " DLPM bound 2Q + 2U", va="bottom", fontsize=8)
    ax.set_xticks(xs, names)
    ax.set_title("largest dispatched-service gap, chat vs docs (weighted tokens)")
    save_figure(fig, path)
