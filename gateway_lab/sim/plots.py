"""PNG plots of a simulation or a plan (matplotlib, headless; import this module lazily:
matplotlib is the optional `bench` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.replicas import TIMELINE_BUCKET_S
from gateway_lab.sim.simulator import SimResult
from gateway_lab.sim.stats import group_by

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gateway_lab.sim.plan import PlanResult


def _cdf(axes: Axes, records: Sequence[RequestRecord], label: str, which: str) -> None:
    values = sorted(
        v * 1000.0 for r in records if (v := (r.ttft if which == "ttft" else r.e2e)) is not None
    )
    if not values:
        return
    count = len(values)
    axes.step(values, [(i + 1) / count for i in range(count)], where="post", label=label)


def latency_cdfs(result: SimResult, path: Path, max_groups: int = 12) -> Path:
    """TTFT and end-to-end latency CDFs per tenant (top row) and per pool (bottom row)."""
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    groupings = (
        ("tenant", group_by(result.records, lambda r: r.tenant)),
        ("pool", group_by(result.records, lambda r: r.pool)),
    )
    for row, (kind, groups) in enumerate(groupings):
        largest = sorted(groups.items(), key=lambda item: -len(item[1]))[:max_groups]
        for column, which in enumerate(("ttft", "e2e")):
            ax = axes[row][column]
            for name, records in sorted(largest):
                _cdf(ax, records, name, which)
            ax.set_xscale("log")
            ax.set_xlabel(f"{'TTFT' if which == 'ttft' else 'end-to-end latency'} (ms)")
            ax.set_ylabel("fraction of completed requests")
            ax.set_title(f"{'TTFT' if which == 'ttft' else 'E2E'} by {kind}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def utilisation(result: SimResult, path: Path) -> Path:
    """Busy-time fraction of every replica (left) and of each pool per minute (right)."""
    span = max(result.end_time, 1e-9)
    replicas = result.replicas
    figure, (bars, lines) = plt.subplots(
        1, 2, figsize=(max(12.0, 0.3 * len(replicas) + 8), 4.5), width_ratios=(1, 1.4)
    )
    pools = list(result.fleet)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, replica in enumerate(replicas):
        colour = colours[pools.index(replica.pool) % len(colours)]
        bars.bar(index, replica.busy_s / span, color=colour)
    bars.set_xticks(range(len(replicas)), [r.name for r in replicas], rotation=90, fontsize="small")
    bars.set_ylim(0, 1.05)
    bars.set_ylabel("busy fraction")
    bars.set_title("per replica (busy time / simulated time)")
    for pool in pools:
        members = [r for r in replicas if r.pool == pool]
        width = max((len(r.busy_timeline) for r in members), default=0)
        if not width:
            continue
        series = [
            sum(r.busy_timeline[i] for r in members if i < len(r.busy_timeline))
            / (TIMELINE_BUCKET_S * len(members))
            for i in range(width)
        ]
        minutes = [(i + 0.5) * TIMELINE_BUCKET_S / 60.0 for i in range(width)]
        lines.plot(minutes, series, label=f"{pool} ({len(members)} replicas)")
    lines.set_ylim(0, 1.05)
    lines.set_xlabel("simulated time (min)")
    lines.set_ylabel("busy fraction")
    lines.set_title("per pool, over time")
    lines.grid(True, alpha=0.3)
    if lines.get_lines():
        lines.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plan_chart(result: PlanResult, path: Path) -> Path:
    """Replicas per option (stacked short + long) and saving vs the closed form."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = ["homogeneous"] + [f"split @{s.threshold}" for s in result.splits]
    shorts = [float(result.homogeneous.replicas or 0)] + [
        float(s.short.replicas or 0) if s.short else 0.0 for s in result.splits
    ]
    longs = [0.0] + [float(s.long.replicas or 0) if s.long else 0.0 for s in result.splits]
    left.bar(labels, shorts, label="short (or only) pool")
    left.bar(labels, longs, bottom=shorts, label="long pool")
    left.set_ylabel("engine replicas")
    left.set_title("fewest replicas meeting the SLO")
    left.legend(fontsize="small")
    thresholds = [str(s.threshold) for s in result.splits]
    measured = [100.0 * (result.saving(s) or 0.0) for s in result.splits]
    predicted = [100.0 * s.predicted_saving for s in result.splits]
    predicted_time = [100.0 * s.predicted_saving_time for s in result.splits]
    positions = list(range(len(thresholds)))
    right.bar([p - 0.27 for p in positions], measured, width=0.27, label="simulated")
    right.bar(positions, predicted, width=0.27, label="alpha*(1-1/rho), alpha by requests")
    right.bar([p + 0.27 for p in positions], predicted_time, width=0.27, label="alpha by work")
    right.axhline(0.0, color="black", linewidth=0.8)
    right.set_xticks(positions, thresholds)
    right.set_xlabel("routing threshold (tokens)")
    right.set_ylabel("saving vs homogeneous (%)")
    right.set_title("GPU saving")
    right.legend(fontsize="small", framealpha=0.6, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
