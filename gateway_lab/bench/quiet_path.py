"""Where each of a tenant's requests spent its time to the first chunk, from the client and
Envoy together: the load generator's record of a request joined with Envoy's access-log line
of the same request (gateway_lab.bench.phases), by start time.

Per request (ms):

* `in`: the client's start -> Envoy received the request's first byte (the client's send, the
  connection);
* `door`: Envoy received it -> its first byte went upstream (the ext_proc round trips, with any
  wait at the door);
* `engine`: first byte upstream -> the engine's first body byte at Envoy;
* `out`: that byte at Envoy -> the client read its first chunk (Envoy relaying it, the client's
  event loop reading it).

The four add up to the client's time to first chunk; `sent` is the request's wall-clock start
(seconds). Medians say what a typical request pays;
the slowest requests say what sets the tail, which is the point above capacity.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway_lab.bench.phases import START_FIELD, logged_number
from gateway_lab.bench.records import Record, percentile

MATCH_WINDOW_S = 0.05
"""A client record and an Envoy line whose starts are further apart than this are not the same
request (one wall clock for both; the quiet tenant sends about one a second)."""
PARTS = ("in", "door", "engine", "out")


def join(
    records: Sequence[Record], rows: Sequence[Mapping[str, Any]], wall_t0: float, tenant: str
) -> list[dict[str, float]]:
    """The tenant's answered requests that both sides saw, split into PARTS (ms) with their
    `ttft` (ms); `wall_t0` is the wall-clock time of the records' time 0."""
    lines = sorted(
        (start, row)
        for row in rows
        if row.get("tenant_header") == tenant
        and str(row.get("status")) == "200"
        and (start := logged_number(row.get(START_FIELD))) is not None
    )
    starts = [start for start, _row in lines]
    out: list[dict[str, float]] = []
    for record in records:
        if record.tenant != tenant or record.status != 200 or record.ttft is None:
            continue
        sent = wall_t0 + record.start
        row = _nearest(lines, starts, sent)
        if row is None:
            continue
        start, line = row
        door_us = logged_number(line.get("upstream_start"))
        first_us = logged_number(line.get("upstream_first_chunk"))
        if door_us is None or first_us is None:
            continue
        ttft_ms = record.ttft * 1000.0
        in_ms = (start - sent) * 1000.0
        out.append(
            {
                "sent": sent,
                "ttft": ttft_ms,
                "in": in_ms,
                "door": door_us / 1000.0,
                "engine": (first_us - door_us) / 1000.0,
                "out": ttft_ms - in_ms - first_us / 1000.0,
            }
        )
    return out


def _nearest(
    lines: Sequence[tuple[float, Mapping[str, Any]]], starts: Sequence[float], at: float
) -> tuple[float, Mapping[str, Any]] | None:
    """The line whose start is nearest `at`, within MATCH_WINDOW_S of it; `starts` are the
    lines' starts, for the search."""
    best: tuple[float, Mapping[str, Any]] | None = None
    for start, row in lines[bisect.bisect_left(starts, at - MATCH_WINDOW_S) :]:
        if start > at + MATCH_WINDOW_S:
            break
        if best is None or abs(start - at) < abs(best[0] - at):
            best = (start, row)
    return best


def split(joined: Sequence[Mapping[str, float]], slowest: int = 3) -> dict[str, Any]:
    """Median of each part, and the parts of the `slowest` requests (by time to first chunk)."""
    if not joined:
        return {"requests": 0, "median_ms": {}, "slowest_ms": []}
    median = {name: percentile([r[name] for r in joined], 50) for name in ("ttft", *PARTS)}
    worst = sorted(joined, key=lambda r: r["ttft"], reverse=True)[:slowest]
    return {
        "requests": len(joined),
        "median_ms": median,
        "slowest_ms": [{name: r[name] for name in ("ttft", *PARTS)} for r in worst],
    }


def print_split(by_arm: Mapping[str, Mapping[str, Any]]) -> None:
    """One block per arm: the median request and the slowest ones, part by part."""
    shown = {arm: s for arm, s in by_arm.items() if s.get("requests")}
    if not shown:
        return
    print("\nthe quiet tenant's first chunk, part by part (ms, client and Envoy joined):")
    print(f"{'arm':20} {'request':>10} {'ttft':>8} " + "".join(f"{p:>8}" for p in PARTS))
    for arm, result in shown.items():
        rows = [("median", result["median_ms"])]
        rows += [(f"slowest {i + 1}", r) for i, r in enumerate(result["slowest_ms"])]
        for i, (label, parts) in enumerate(rows):
            cells = "".join(f"{_fmt(parts[p]):>8}" for p in PARTS)
            print(f"{arm if i == 0 else '':20} {label:>10} {_fmt(parts['ttft']):>8} {cells}")


def plot_split(ax: Any, by_arm: Mapping[str, Mapping[str, Any]]) -> None:
    """Stacked bars on `ax` (a matplotlib Axes): per arm, the median request and the slowest
    one, each cut into PARTS."""
    labels: list[str] = []
    bars: list[Mapping[str, float]] = []
    for arm, result in by_arm.items():
        labels += [f"{arm}\nmedian of each", f"{arm}\nslowest"]
        bars += [result["median_ms"], result["slowest_ms"][0]]
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for part in PARTS:
        heights = [max(0.0, bar[part]) for bar in bars]
        ax.bar(xs, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("quiet time to first chunk (ms)")
    ax.set_title("where it went: client -> Envoy (in), door, engine, relay (out)", fontsize=9)
    ax.legend(fontsize=8)


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"
