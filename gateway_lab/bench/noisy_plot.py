"""The noisy-neighbour plot: quiet TTFT per arm, tokens/s, the trade-off curve, engine queues,
and the quiet tenant's inter-token gaps (every-gap P99 against alone, per arm and against
throughput)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.scenario import POOL

TARGET_RATIO = 1.10
TARGET_THROUGHPUT = 0.95


_COLORS = {
    "alone": "#7f7f7f", "fifo": "#d62728", "bucket": "#ff7f0e", "full": "#2ca02c",
    "paced": "#9467bd", "delta": "#8c564b",
}  # fmt: skip
ISOLATION_TTFT_RATIO = 2.0
"""Issue 15's quiet P99 TTFT target (gateway_lab/bench/noisy_isolation.py)."""
ISOLATION_GAP_RATIO = 1.5
"""Issue 15's quiet P99 inter-token gap target: the P99 of every gap (`stats.gap_stats`), not
the per-response time per output token."""


def plot(results: dict[str, dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = summary["rows"]
    names = list(results)
    colors = [_COLORS.get(results[n]["kind"], "#1f77b4") for n in names]
    fig, axes = plt.subplots(2, 3, figsize=(19, 8.5))
    ax = axes[0][0]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [rows[n]["quiet_p50_ms"] for n in names], 0.4, label="P50",
           color=colors, alpha=0.55)  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [rows[n]["quiet_p99_ms"] for n in names], 0.4, label="P99",
           color=colors)  # fmt: skip
    ax.set_yscale("log")
    ax.set_title("quiet tenant: time to first token (ms; light P50, dark P99)")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax = axes[0][1]
    flood = [rows[n]["flooder_tok_s"] for n in names]
    quiet = [rows[n]["quiet_tok_s"] for n in names]
    ax.bar(list(xs), flood, color=colors, label="flooder")
    ax.bar(list(xs), quiet, bottom=flood, color="black", label="quiet")
    fifo = summary["fifo_total_tok_s"]
    if not math.isnan(fifo):
        ax.axhline(fifo * TARGET_THROUGHPUT, ls="--", color="black", lw=0.8)
        ax.text(0, fifo * TARGET_THROUGHPUT, " 95% of FIFO", va="bottom", fontsize=8)
    ax.set_title("output tokens/s (flooder + quiet)")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    _against_throughput(ax, results, rows, "p99_ratio")
    soft = sorted(
        (rows[n]["throughput_vs_fifo"] * 100, rows[n]["p99_ratio"])
        for n in names
        if results[n]["kind"] in ("soft", "full")
    )
    if soft:
        ax.plot([s[0] for s in soft], [s[1] for s in soft], color="#1f77b4", lw=0.8)
    ax.axhline(TARGET_RATIO, ls="--", color="green", lw=0.8)
    ax.axhline(ISOLATION_TTFT_RATIO, ls=":", color="#8c564b", lw=0.8)
    ax.axvline(TARGET_THROUGHPUT * 100, ls="--", color="green", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("total output tokens/s, % of FIFO")
    ax.set_ylabel("quiet P99 TTFT / alone")
    ax.set_title("trade-off: right of 95%, below 1.10x (dashed) / 2.0x (dotted)")
    ax = axes[1][1]
    for name, style in (("full", "-"), ("fifo", ":")):
        result = results.get(name)
        if result is None:
            continue
        series = result["timeseries"]
        ts = [s["t"] for s in series]
        ax.plot(ts, [s["running"] for s in series], style, color="#1f77b4",
                label=f"{name}: engine running")  # fmt: skip
        ax.plot(ts, [s["waiting"] for s in series], style, color="#d62728",
                label=f"{name}: engine waiting")  # fmt: skip
        if name == "full":
            ax.plot(ts, [(s.get("limit") or {}).get(POOL) for s in series], style,
                    color="#2ca02c", label="full: gateway soft limit")  # fmt: skip
    ax.set_xlabel("seconds")
    ax.set_title("engine batch and queue over time (full policy vs FIFO)")
    ax.legend(fontsize=8)
    _inter_token(axes[0][2], axes[1][2], results, rows)
    save_figure(fig, path)


def _inter_token(
    bars: Any, tradeoff: Any, results: dict[str, dict[str, Any]], rows: dict[str, Any]
) -> None:
    """Per arm, the every-gap P99 ratio beside the TPOT P99 ratio; then the gap ratio against
    throughput (the isolation target's plane)."""
    names = list(results)
    xs = range(len(names))
    colors = [_COLORS.get(results[n]["kind"], "#1f77b4") for n in names]
    bars.bar([x - 0.2 for x in xs], [rows[n]["gap_p99_ratio"] for n in names], 0.4,
             color=colors, label="every gap P99")  # fmt: skip
    bars.bar([x + 0.2 for x in xs], [rows[n]["tpot_p99_ratio"] for n in names], 0.4,
             color=colors, alpha=0.45, label="per-response TPOT P99")  # fmt: skip
    bars.axhline(ISOLATION_GAP_RATIO, ls=":", color="#8c564b", lw=0.8)
    bars.set_title("quiet inter-token P99 / alone (dark every gap, light TPOT)")
    bars.set_xticks(list(xs), names, rotation=30, ha="right")
    _against_throughput(tradeoff, results, rows, "gap_p99_ratio")
    tradeoff.axhline(ISOLATION_GAP_RATIO, ls=":", color="#8c564b", lw=0.8)
    tradeoff.axvline(TARGET_THROUGHPUT * 100, ls="--", color="green", lw=0.8)
    tradeoff.set_xlabel("total output tokens/s, % of FIFO")
    tradeoff.set_ylabel("quiet P99 inter-token gap / alone")
    tradeoff.set_title("inter-token: right of 95%, below 1.5x (dotted)")


def _against_throughput(
    ax: Any, results: dict[str, dict[str, Any]], rows: dict[str, Any], ratio: str
) -> None:
    """Each contended arm as a labelled point: total throughput (% of FIFO) against `ratio`."""
    for name, result in results.items():
        row = rows[name]
        if result["kind"] == "alone" or math.isnan(row["throughput_vs_fifo"]):
            continue
        at = (row["throughput_vs_fifo"] * 100, row[ratio])
        ax.scatter(*at, color=_COLORS.get(result["kind"], "#1f77b4"), s=40)
        ax.annotate(name, at, fontsize=8, xytext=(4, 4), textcoords="offset points")
