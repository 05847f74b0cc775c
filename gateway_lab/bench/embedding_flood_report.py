"""The embedding-flood benchmark's report: the chat tenant's TTFT against solo, the tenants'
shares of the weighted token service, the printed table and the plot
(gateway_lab.bench.embedding_flood runs the arms)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.stats import fmt

CHAT, BATCH = "chat", "batch"


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    solo = results.get("chat-solo", {}).get("tenants", {}).get(CHAT, {}).get("ttft", {})
    out: dict[str, Any] = {}
    for name, result in results.items():
        tenants = result["tenants"]
        chat, batch = tenants[CHAT], tenants.get(BATCH)
        row: dict[str, Any] = {
            "chat_p50_ms": chat["ttft"].get("p50_ms", math.nan),
            "chat_p99_ms": chat["ttft"].get("p99_ms", math.nan),
            "chat_p50_ratio": chat["ttft"].get("p50_ms", math.nan) / solo.get("p50_ms", math.nan),
            "chat_p99_ratio": chat["ttft"].get("p99_ms", math.nan) / solo.get("p99_ms", math.nan),
            "chat_served_over_offered": chat["service_per_s"]
            / max(1e-9, chat["offered_service_per_s"]),
        }
        if batch is not None:
            chat_per_weight = chat["service_per_s"] / chat["weight"]
            batch_per_weight = batch["service_per_s"] / batch["weight"]
            total = chat["service_per_s"] + batch["service_per_s"]
            row.update(
                {
                    "chat_share": chat["service_per_s"] / max(1e-9, total),
                    "batch_share": batch["service_per_s"] / max(1e-9, total),
                    "weight_share_chat": chat["weight"] / (chat["weight"] + batch["weight"]),
                    "per_weight_ratio_chat_over_batch": chat_per_weight
                    / max(1e-9, batch_per_weight),
                    "batches": batch["batches"],
                }
            )
        out[name] = row
    return out


def print_table(summary: dict[str, Any]) -> None:
    print(
        f"\n{'arm':17} {'chat p50':>9} {'p99':>9} {'p50 x':>6} {'p99 x':>6} "
        f"{'chat served/offered':>19} {'chat share':>10} {'batch share':>11} {'weights':>7} "
        f"{'batches':>7}"
    )
    for name, row in summary.items():
        print(
            f"{name:17} {fmt(row['chat_p50_ms']):>7}ms {fmt(row['chat_p99_ms']):>7}ms "
            f"{fmt(row['chat_p50_ratio'], 2):>6} {fmt(row['chat_p99_ratio'], 2):>6} "
            f"{fmt(row['chat_served_over_offered'], 2):>19} "
            f"{fmt(row.get('chat_share', math.nan), 3):>10} "
            f"{fmt(row.get('batch_share', math.nan), 3):>11} "
            f"{fmt(row.get('weight_share_chat', math.nan), 2):>7} {row.get('batches', 0):>7}"
        )
    print(
        "\nshares: weighted token service (input + 2 x output) per second in the window; "
        "served/offered: the chat tenant's service against what it sent; weights: the chat "
        "tenant's share of the weights (the weighted arm's tenants are both backlogged, so its "
        "TTFT is a queue's, not a latency)"
    )


def plot(results: dict[str, dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    ax = axes[0]
    names = list(summary)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [summary[n]["chat_p50_ms"] for n in names], 0.4,
           label="P50", color="#1f77b4", alpha=0.55)  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [summary[n]["chat_p99_ms"] for n in names], 0.4,
           label="P99", color="#1f77b4")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax.set_title("chat tenant: time to first token (ms)")
    ax.legend(fontsize=8)
    ax = axes[1]
    flooded = [n for n in names if BATCH in results[n]["tenants"]]
    for i, tenant in enumerate((CHAT, BATCH)):
        values = [results[n]["tenants"][tenant]["service_per_s"] for n in flooded]
        ax.bar([x + (i - 0.5) * 0.4 for x in range(len(flooded))], values, 0.4, label=tenant)
    ax.set_xticks(range(len(flooded)), flooded, rotation=20, fontsize=8)
    ax.set_title("weighted token service / s")
    ax.legend(fontsize=8)
    save_figure(fig, path)
