"""The noisy-neighbour report (gateway_lab/bench/noisy.py): an arm's inter-token figures
against its reference, and the table printed at the end of a run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from gateway_lab.bench.noisy_plot import (
    ISOLATION_GAP_RATIO,
    ISOLATION_TTFT_RATIO,
    TARGET_RATIO,
    TARGET_THROUGHPUT,
)
from gateway_lab.bench.stats import fmt


class _Named(Protocol):
    @property
    def name(self) -> str: ...


def inter_token_row(result: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, float]:
    """The quiet tenant's P99 every-gap and per-response TPOT (ms) and their ratios to the same
    figure of the arm's alone reference (`reference`: its result; None: NaN ratios)."""
    gap = result["quiet_gaps"]["p99_ms"]
    tpot = result["quiet_tpot"]["p99_ms"]
    ref_gap = reference["quiet_gaps"]["p99_ms"] if reference else math.nan
    ref_tpot = reference["quiet_tpot"]["p99_ms"] if reference else math.nan
    return {
        "quiet_gap_p50_ms": result["quiet_gaps"]["p50_ms"],
        "quiet_gap_p99_ms": gap,
        "gap_p99_ratio": gap / ref_gap,
        "quiet_tpot_p99_ms": tpot,
        "tpot_p99_ratio": tpot / ref_tpot,
    }


UNSTEADY_SPREAD = 0.25
"""An arm whose window halves' throughputs differ by more than this share of the larger was
not in a steady state: its window figure belongs to a transient (a controller still
walking, a backlog draining), not to its operating point."""


def unsteady_ok(first: float, second: float) -> bool:
    """True unless both halves were measured and differ by more than `UNSTEADY_SPREAD`."""
    if math.isnan(first) or math.isnan(second) or max(first, second) <= 0:
        return True
    return abs(first - second) <= UNSTEADY_SPREAD * max(first, second)


def print_table(summary: dict[str, Any], arms: Sequence[_Named]) -> None:
    """The noisy-neighbour table and its verdicts, as `compare` summarised them."""
    rows = summary["rows"]
    print(
        f"\n{'arm':14} {'quiet p50':>10} {'quiet p99':>10} {'p50 x':>6} {'p99 x':>7} "
        f"{'gap99 x':>7} {'tpot99 x':>8} {'flooder tok/s':>13} {'total tok/s':>11} "
        f"{'vs FIFO':>7}"
    )
    for arm in arms:
        row = rows.get(arm.name)
        if row is None:
            continue
        print(
            f"{arm.name:14} {fmt(row['quiet_p50_ms']):>8}ms {fmt(row['quiet_p99_ms']):>8}ms "
            f"{fmt(row['p50_ratio'], 2):>6} {fmt(row['p99_ratio'], 2):>7} "
            f"{fmt(row['gap_p99_ratio'], 2):>7} {fmt(row['tpot_p99_ratio'], 2):>8} "
            f"{fmt(row['flooder_tok_s'], 0):>13} "
            f"{fmt(row['total_tok_s'], 0):>11} "
            f"{fmt(row['throughput_vs_fifo'] * 100, 0):>6}%"
        )
    unsteady = []
    for arm in arms:
        first, second = rows.get(arm.name, {}).get("halves_tok_s", [math.nan, math.nan])
        if not unsteady_ok(first, second):
            unsteady.append(f"{arm.name} {first:.0f} -> {second:.0f}")
    if unsteady:
        print(
            f"not steady (total tok/s, first vs second half of the window, more than "
            f"{UNSTEADY_SPREAD:.0%} apart): {'; '.join(unsteady)}"
        )
    target = summary["target"]
    full = rows.get("full")
    if full is not None:
        verdict = "met" if target["full_policy_met"] else "NOT met"
        print(
            f"\ntarget: full-policy quiet P99 <= {TARGET_RATIO:.2f}x alone with total >= "
            f"{TARGET_THROUGHPUT:.0%} of FIFO: {verdict} "
            f"(P99 {full['p99_ratio']:.2f}x, throughput {full['throughput_vs_fifo']:.0%})"
        )
    plain = rows.get("plain")
    if full is not None and plain is not None:
        verdict = "met" if target["plain_policy_met"] else "NOT met"
        print(
            f"target: plain-policy quiet P99 ratio <= "
            f"{target['plain_p99_ratio_of_full_max']:.2f}x full's with total >= "
            f"{target['plain_throughput_of_full_min']:.0%} of full's: {verdict} "
            f"(P99 ratio {plain['p99_ratio'] / full['p99_ratio']:.2f}x full's, "
            f"throughput {plain['total_tok_s'] / full['total_tok_s']:.0%} of full's)"
        )
    met = [name for name, ok in summary["isolation_target"].items() if ok]
    print(
        f"target: quiet P99 TTFT <= {ISOLATION_TTFT_RATIO:.1f}x and P99 inter-token gap <= "
        f"{ISOLATION_GAP_RATIO:.1f}x alone at >= {TARGET_THROUGHPUT:.0%} of FIFO: "
        + (f"met by {', '.join(met)}" if met else "NOT met by any arm")
    )
    for label, key in (
        ("best P99 ratio at >= 95% of FIFO", "best_at_95pct_throughput"),
        ("best P99 ratio at any throughput", "best_ratio_overall"),
    ):
        name = summary.get(key)
        if name:
            row = rows[name]
            print(
                f"{label}: {name} ({row['p99_ratio']:.2f}x, "
                f"{row['throughput_vs_fifo']:.0%} of FIFO)"
            )
        else:
            print(f"{label}: none")
