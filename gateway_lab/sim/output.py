"""Text tables and JSON documents for simulation reports and plans."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gateway_lab.sim.plan import PlanResult, PoolPlan, SplitPlan


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100.0 * value:.2f}%"


def _row(name: str, summary: dict[str, Any]) -> str:
    ttft = summary["ttft_ms"]
    e2e = summary["e2e_ms"]
    wait = summary["queue_wait_ms"]
    return (
        f"{name:<24} {summary['requests']:>7} {summary['completed']:>7} {summary['rejected']:>6} "
        f"{_ms(ttft['p50']):>7} {_ms(ttft['p90']):>7} {_ms(ttft['p99']):>7} "
        f"{_ms(e2e['p50']):>7} {_ms(e2e['p99']):>7} {_ms(wait['p99']):>7} "
        f"{_pct(summary['slo_attainment']['all']):>8} {summary['preemptions']:>6}"
    )


def format_report(report: dict[str, Any]) -> str:
    header = (
        f"{'':<24} {'reqs':>7} {'done':>7} {'rej':>6} {'ttft50':>7} {'ttft90':>7} "
        f"{'ttft99':>7} {'e2e50':>7} {'e2e99':>7} {'wait99':>7} {'slo':>8} {'preem':>6}"
    )
    lines = [header + "   (ms)", _row("all", report["overall"])]
    for title, key in (("tenant", "by_tenant"), ("pool", "by_pool")):
        lines.append(f"-- by {title}")
        lines.extend(_row(name, summary) for name, summary in report[key].items())
    lines.append("-- engines")
    for name, pool in report["engines"].items():
        lines.append(
            f"{name:<24} {pool['replicas']} x {pool['profile']} "
            f"(max_num_seqs {pool['max_num_seqs']}): utilisation {_pct(pool['utilisation'])}, "
            f"{pool['preemptions']} preemptions, {pool['output_tokens_per_s']:.0f} output tok/s, "
            f"prefix cache hit rate {_pct(pool['prefix_cache_hit_rate'])}"
        )
    outcomes = ", ".join(f"{k} {v}" for k, v in report["overall"]["outcomes"].items())
    lines.append(f"outcomes: {outcomes}")
    return "\n".join(lines)


def _pool_dict(plan: PoolPlan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "role": plan.role,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": plan.max_num_seqs,
        "requests": plan.requests,
        "replicas": plan.replicas,
        "estimate": plan.estimate,
        "saturation_throughput": dataclasses.asdict(plan.throughput),
        "trials": [dataclasses.asdict(trial) for trial in plan.trials],
    }


def _split_dict(result: PlanResult, split: SplitPlan) -> dict[str, Any]:
    return {
        "threshold": split.threshold,
        "alpha": split.alpha,
        "alpha_tokens": split.alpha_tokens,
        "alpha_time": split.alpha_time,
        "rho": split.rho,
        "replicas": split.replicas,
        "saving": result.saving(split),
        "predicted_saving": split.predicted_saving,
        "predicted_saving_time": split.predicted_saving_time,
        "short": _pool_dict(split.short),
        "long": _pool_dict(split.long),
    }


def plan_to_dict(result: PlanResult) -> dict[str, Any]:
    best = result.best()
    return {
        "config": result.config,
        "requests": result.requests,
        "span_s": result.span_s,
        "wall_s": result.wall_s,
        "homogeneous": _pool_dict(result.homogeneous),
        "splits": [_split_dict(result, split) for split in result.splits],
        "best_threshold": None if best is None else best.threshold,
    }


def _replicas(plan: PoolPlan | None) -> str:
    if plan is None:
        return "0"
    return "none" if plan.replicas is None else str(plan.replicas)


def format_plan(result: PlanResult) -> str:
    homogeneous = result.homogeneous
    lines = [
        f"{result.requests} requests over {result.span_s:.0f}s; "
        f"homogeneous pool (max_model_len {homogeneous.max_model_len}, "
        f"{homogeneous.max_num_seqs} seqs/engine): {_replicas(homogeneous)} replicas",
        "short/long: replicas x max_num_seqs; alpha: share of requests routed short, alpha_t: "
        "their share of the work; rho: throughput gain of the short configuration",
        f"{'threshold':>9} {'alpha':>6} {'alpha_t':>7} {'rho':>6} {'short':>11} {'long':>11} "
        f"{'total':>5} {'saving':>8} {'a(1-1/rho)':>10} {'a_t(1-1/rho)':>12}",
    ]
    for split in result.splits:
        short = split.short
        long = split.long
        short_text = f"{_replicas(short)} x{short.max_num_seqs}" if short else "0"
        long_text = f"{_replicas(long)} x{long.max_num_seqs}" if long else "0"
        total = split.replicas
        lines.append(
            f"{split.threshold:>9} {split.alpha:>6.3f} {split.alpha_time:>7.3f} {split.rho:>6.3f} "
            f"{short_text:>11} {long_text:>11} {'none' if total is None else total:>5} "
            f"{_pct(result.saving(split)):>8} {_pct(split.predicted_saving):>10} "
            f"{_pct(split.predicted_saving_time):>12}"
        )
    best = result.best()
    if best is not None:
        lines.append(f"best split: threshold {best.threshold} ({_pct(result.saving(best))} fewer)")
    lines.append(f"planned in {result.wall_s:.1f}s")
    return "\n".join(lines)
