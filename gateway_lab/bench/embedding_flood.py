"""Benchmark: embedding flood. A tenant posting large embedding batches beside a chat tenant,
both on one pool whose engine serves chat and embeddings.

The chat tenant ("chat") sends streamed chat requests at a Poisson rate; the batch tenant
("batch") keeps `batch_concurrency` `/v1/embeddings` calls going from a closed loop, each of
`batch_inputs` inputs (2,000 by default) of `input_tokens` tokens. The emulated engine runs
every input as a prefill-only request (as vLLM's pooling runner does) and schedules by
priority (`--scheduling-policy priority`, as the pools the project ships). Arms:

* chat-solo: the chat tenant alone through the service (its reference);
* fifo: both, Envoy straight to the engine (no priorities set: FCFS inside the engine);
* gateway-admission: both through the service: token-weighted DRR (an embedding batch costs
  its input tokens; a chat request input + 2 x output), capacity that follows the engine, and
  the scheduler's engine priority (tier rank x 2, + 1 for a backlogged tenant) in every body;
* gateway-priority: the same, and the pool's `pooling_priority` (9) in each batch instead, so
  the engine serves every chat request before a batch's inputs still waiting;
* gateway: priority as well, and a static soft limit (`adaptive: {enabled: false}`,
  `max_inflight` 64, headroom 8) instead of the one that follows the engine.

Once admitted, a batch's 2,000 inputs sit in the engine's queue: admission alone bounds how
many batches are there, not how long a chat request waits behind one. And the adaptive soft
limit reads those waiting inputs (`vllm:num_requests_waiting`) as an overloaded engine and
shrinks, holding chat requests at the door.

Reported: the chat tenant's time to first token (P50/P99) against solo; each tenant's
weighted token service per second and per unit of weight, and the chat tenant's served /
offered tokens (a tenant below its fair share is owed all it asks, not half the pool).

`extproc bench embedding-flood [--out results/embedding-flood] [--quick] [--batch-inputs N]`
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.policy import hash_key
from extproc.scheduler.adaptive import AdaptiveSettings
from gateway_lab.bench import scenario
from gateway_lab.bench.capacity import CapacityConfig
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.loadgen import Load, open_loop
from gateway_lab.bench.monitor import Monitor, log
from gateway_lab.bench.records import RECORD_COLUMNS, Meter, Spec
from gateway_lab.bench.stack import PROFILE, EngineSet, Gateway
from gateway_lab.bench.stats import fmt, status_counts, ttft_stats, within

NAME = "embedding-flood"
DEFAULT_OUT = Path("results/embedding-flood")
CHAT, BATCH = "chat", "batch"
KEYS = {name: f"bench-{name}-key" for name in (CHAT, BATCH)}
_WORDS = ("art", "bay", "cab", "dew", "elk", "fig", "gem", "hut", "ink", "jar")


@dataclass(frozen=True)
class Workload:
    chat_rate: float = 3.0
    chat_prompt: int = 300
    chat_output: int = 64
    batch_concurrency: int = 2
    batch_inputs: int = 2000
    input_tokens: int = 16
    """Each embedding input's tokens (the emulator counts 4 bytes a token)."""
    chat_weight: float = 1.0
    batch_weight: float = 1.0
    headroom: int = 8


@dataclass(frozen=True)
class Timing:
    warmup_solo_s: float = 5.0
    warmup_s: float = 10.0
    measure_s: float = 30.0
    grace_s: float = 15.0

    @classmethod
    def quick(cls) -> Timing:
        return cls(1.0, 2.0, 8.0, 4.0)


@dataclass(frozen=True)
class Arm:
    name: str
    path: str
    flood: bool
    warmup_s: float
    pooling_priority: int | None = None
    static: bool = False
    """A static soft limit (STATIC_INFLIGHT - headroom) instead of the adaptive one."""


STATIC_INFLIGHT = 64
POOLING_PRIORITY = 9
"""Above every chat request's engine priority (one tier: 0, or 1 when backlogged)."""
ENGINE_ARGS = ("--scheduling-policy", "priority")


def policy_text(
    endpoint: str, work: Workload, pooling_priority: int | None = None, static: bool = False
) -> str:
    limits = "{max_queued: 100000, max_queue_wait: 600s}"
    weights = {CHAT: work.chat_weight, BATCH: work.batch_weight}
    lines = ["version: 1", "tiers: [standard]", "tenants:"]
    for name, weight in weights.items():
        lines.append(
            f'  {name}: {{tier: standard, weight: {weight}, api_keys: ["{hash_key(KEYS[name])}"],'
            f" limits: {limits}}}"
        )
    pool = [
        "max_total_tokens: 131072",
        f"max_inflight: {STATIC_INFLIGHT if static else 512}",
        "max_inflight_tokens: 1000000000",
        f'endpoints: ["{endpoint}"]',
        "serves: [chat, completions, embeddings, rerank]",
    ]
    if static:
        pool.append("adaptive: {enabled: false}")
    if pooling_priority is not None:
        pool.append(f"pooling_priority: {pooling_priority}")
    lines += [
        "pools:",
        f"  {scenario.POOL}: {{{', '.join(pool)}}}",
        "fairness: {policy: drr, input_weight: 1, output_weight: 2, quantum: 64}",
        "estimation: {mode: flat, default_bytes_per_token: 4.0}",
        "gateway: {default_max_tokens: 256, message_timeout: 10s}",
    ]
    return "\n".join(lines) + "\n"


def capacity(work: Workload, static: bool = False) -> CapacityConfig:
    if static:
        return CapacityConfig(headroom={scenario.POOL: work.headroom})
    settings = AdaptiveSettings(min_inflight=4, initial_inflight=16, headroom=work.headroom)
    return CapacityConfig(adaptive={scenario.POOL: settings})


def batch_body(work: Workload, rng: random.Random) -> bytes:
    """`batch_inputs` texts of exactly `input_tokens` tokens each for the emulator (4 bytes
    a token: three-letter words and their space)."""
    inputs = [
        " ".join(rng.choice(_WORDS) for _ in range(work.input_tokens)) + " "
        for _ in range(work.batch_inputs)
    ]
    return orjson.dumps({"model": "bench", "input": inputs})


@dataclass
class BatchRecord:
    start: float
    end: float
    status: int
    prompt_tokens: int
    queue_ms: float | None


async def batch_loop(
    url: str, load: Load, meter: Meter, work: Workload, until: float, seed: int
) -> list[BatchRecord]:
    """`batch_concurrency` clients posting embedding batches back to back until `until`; each
    answered batch's usage.prompt_tokens counts as service at its completion."""
    rng = random.Random(seed)
    bodies = [batch_body(work, rng) for _ in range(4)]
    headers = {"authorization": f"Bearer {KEYS[BATCH]}", "content-type": "application/json"}
    records: list[BatchRecord] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        sent = index
        while load.now() < until:
            start = load.now()
            status, tokens, queue = 0, 0, None
            try:
                async with session.post(url, data=bodies[sent % 4], headers=headers) as response:
                    status = response.status
                    raw = await response.read()
                    queued = response.headers.get("x-gateway-queue-ms")
                    queue = float(queued) if queued else None
                if status == 200:
                    tokens = int(orjson.loads(raw)["usage"]["prompt_tokens"])
                    meter.first_token(BATCH, load.now(), tokens)
            except (aiohttp.ClientError, TimeoutError, OSError):
                await asyncio.sleep(0.1)
            records.append(BatchRecord(start, load.now(), status, tokens, queue))
            sent += 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.ensure_future(client(i, session)) for i in range(work.batch_concurrency)]
        try:
            await asyncio.wait(clients, timeout=max(0.0, until - load.now()))
        finally:
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    return records


def chat_maker(work: Workload, seed: int) -> Callable[[int], Spec]:
    return scenario.fixed_maker(CHAT, KEYS[CHAT], work.chat_prompt, work.chat_output, seed)


async def drive_arm(
    arm: Arm, gateway: Gateway, engines: EngineSet, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    meter = Meter(bin_s=0.5)
    end = arm.warmup_s + timing.measure_s
    batches: list[BatchRecord] = []
    async with Load(gateway.url, meter) as load:

        async def flood() -> None:
            url = gateway.base_url + "/v1/embeddings"
            batches.extend(await batch_loop(url, load, meter, work, end + timing.grace_s, seed))

        chat = open_loop(
            load, chat_maker(work, seed), work.chat_rate, end, seed=seed + 1,
            grace_s=timing.grace_s,
        )  # fmt: skip
        jobs = [chat, flood()] if arm.flood else [chat]
        monitor = Monitor(load, engines.all(), gateway.admin_url)
        await scenario.drive(NAME, arm.name, load, jobs, end, monitor, end + timing.grace_s)
    return summarize_arm(arm, load, meter, monitor, batches, work, end)


def summarize_arm(
    arm: Arm,
    load: Load,
    meter: Meter,
    monitor: Monitor,
    batches: list[BatchRecord],
    work: Workload,
    end: float,
) -> dict[str, Any]:
    start = arm.warmup_s
    window = max(1e-9, end - start)
    records = within(load.records, CHAT, start, end)
    offered = sum(r.prompt_tokens + 2 * r.max_tokens for r in records)
    chat = {
        "ttft": ttft_stats(records),
        "status": status_counts(records),
        "service_per_s": meter.rate(CHAT, start, end, service=True),
        "offered_service_per_s": offered / window,
        "weight": work.chat_weight,
    }
    tenants: dict[str, Any] = {CHAT: chat}
    if arm.flood:
        done = [b for b in batches if b.status == 200]
        waits = [b.queue_ms for b in done if b.queue_ms is not None]
        tenants[BATCH] = {
            "batches": len(done),
            "status": {
                str(s): sum(1 for b in batches if b.status == s)
                for s in {b.status for b in batches}
            },
            "batch_latency_p50_s": _median([b.end - b.start for b in done]),
            "queue_wait_max_ms": max(waits) if waits else None,
            "service_per_s": meter.rate(BATCH, start, end, service=True),
            "weight": work.batch_weight,
        }
    return {
        "arm": arm.name,
        "path": arm.path,
        "window_s": [start, end],
        "tenants": tenants,
        "timeseries": monitor.samples,
        "records": {"columns": RECORD_COLUMNS, "rows": [r.as_row() for r in load.records]},
        "batches": [[round(b.start, 3), round(b.end, 3), b.status, b.prompt_tokens, b.queue_ms]
                    for b in batches],
    }  # fmt: skip


def _median(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def run_arm(
    arm: Arm, engines: EngineSet, workdir: Path, work: Workload, timing: Timing, seed: int
) -> dict[str, Any]:
    endpoint = engines.endpoints[scenario.POOL][0]
    text = policy_text(endpoint, work, arm.pooling_priority, arm.static)
    with scenario.arm_gateway(
        NAME, arm.name, workdir, engines, text, arm.path, capacity(work, arm.static)
    ) as gateway:
        result: dict[str, Any] = scenario.run_async(
            drive_arm(arm, gateway, engines, work, timing, seed)
        )
    ttft = result["tenants"][CHAT]["ttft"]
    log(NAME, f"arm {arm.name}: chat p50 {fmt(ttft.get('p50_ms', math.nan))} ms "
              f"p99 {fmt(ttft.get('p99_ms', math.nan))} ms")  # fmt: skip
    return result


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
        f"{'chat served/offered':>19} {'chat share':>10} {'batch share':>11} {'batches':>7}"
    )
    for name, row in summary.items():
        print(
            f"{name:17} {fmt(row['chat_p50_ms']):>7}ms {fmt(row['chat_p99_ms']):>7}ms "
            f"{fmt(row['chat_p50_ratio'], 2):>6} {fmt(row['chat_p99_ratio'], 2):>6} "
            f"{fmt(row['chat_served_over_offered'], 2):>19} "
            f"{fmt(row.get('chat_share', math.nan), 3):>10} "
            f"{fmt(row.get('batch_share', math.nan), 3):>11} {row.get('batches', 0):>7}"
        )
    print(
        "\nshares: weighted token service (input + 2 x output) per second in the window; "
        "served/offered: the chat tenant's service against what it sent"
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


def run(
    out: Path,
    workdir: Path,
    work: Workload,
    timing: Timing,
    *,
    seed: int = 29,
    profile: str = PROFILE,
) -> dict[str, Any]:
    arms = [
        Arm("chat-solo", "service", False, timing.warmup_solo_s),
        Arm("fifo", "direct", True, timing.warmup_s),
        Arm("gateway-admission", "service", True, timing.warmup_s),
        Arm(
            "gateway-priority", "service", True, timing.warmup_s, pooling_priority=POOLING_PRIORITY
        ),
        Arm(
            "gateway",
            "service",
            True,
            timing.warmup_s,
            pooling_priority=POOLING_PRIORITY,
            static=True,
        ),
    ]

    def conclude(results: scenario.Results) -> scenario.Conclusion:
        summary = compare(results)
        return scenario.Conclusion(
            summary, lambda path: plot(results, summary, path), lambda: print_table(summary)
        )

    return scenario.run_scenario(
        NAME, out, workdir, profile=profile, work=work, timing=timing,
        settings={"weights": {CHAT: work.chat_weight, BATCH: work.batch_weight}}, arms=arms,
        run_arm=lambda arm, engines, _results: run_arm(arm, engines, workdir, work, timing, seed),
        conclude=conclude, figure="embedding-flood.png", engine_args=ENGINE_ARGS,
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm (default 30)")
    parser.add_argument("--batch-inputs", type=int, help="inputs per embedding call (default 2000)")
    parser.add_argument("--batch-concurrency", type=int, help="embedding calls kept in flight")
    parser.add_argument("--input-tokens", type=int, help="tokens per embedding input (default 16)")
    parser.add_argument("--chat-rate", type=float, help="chat requests/s (default 3)")
    parser.add_argument("--seed", type=int, default=29)


def main(args: argparse.Namespace) -> int:
    work = Workload()
    for flag, field in (
        ("batch_inputs", "batch_inputs"),
        ("batch_concurrency", "batch_concurrency"),
        ("input_tokens", "input_tokens"),
        ("chat_rate", "chat_rate"),
    ):
        value = getattr(args, flag)
        if value:
            work = replace(work, **{field: value})
    timing = scenario.chosen_timing(args, Timing(), Timing.quick())
    began = time.perf_counter()
    run(args.out, scenario.workdir_of(args), work, timing, seed=args.seed)
    log(NAME, f"done in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.embedding_flood", __doc__, add_arguments, main)
    )
