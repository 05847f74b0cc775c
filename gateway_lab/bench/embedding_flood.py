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
  `max_inflight` 64, headroom 8) instead of the one that follows the engine;
* step-N: `gateway` on an engine started with `--max-num-batched-tokens N` (256, 384, 512)
  instead of the profile's 2,048: a step full of embedding inputs, which a chat prompt's
  prefill shares, takes a fraction of the time, for less embedding throughput (a setting of
  the shared pool's engines);
* weighted: `step-384` with both tenants backlogged (the chat tenant a closed loop of
  `chat_backlog` clients, more than the pool's slots, the batch tenant `weighted_batches`
  calls in flight), weights chat 3 : batch 1: the token service should split 3 : 1.

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
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.scheduler.adaptive import AdaptiveSettings
from gateway_lab.bench import embedding_flood_report, scenario
from gateway_lab.bench.capacity import CapacityConfig
from gateway_lab.bench.loadgen import Load, closed_loop, open_loop
from gateway_lab.bench.monitor import Monitor, log
from gateway_lab.bench.records import RECORD_COLUMNS, Meter, Spec
from gateway_lab.bench.stack import PROFILE, EngineSet, Gateway, engine_set
from gateway_lab.bench.stats import fmt, status_counts, ttft_stats, within

NAME = "embedding-flood"
DEFAULT_OUT = Path("results/embedding-flood")
CHAT, BATCH = embedding_flood_report.CHAT, embedding_flood_report.BATCH
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
    step_tokens: tuple[int, ...] = (256, 384, 512)
    """`--max-num-batched-tokens` of the engines of the step arms (the profile's: 2,048)."""
    weighted_step_tokens: int = 384
    inflight_tokens: int = 98_304
    """The static arms' `max_inflight_tokens`: three batches' input tokens. The door counts
    a call as one request, and a batch is 2,000 engine sequences: only a token bound lets
    the door's fair share decide how much of each tenant's work is in the engine."""
    chat_backlog: int = 96
    weighted_batches: int = 6
    weighted: tuple[float, float] = (3.0, 1.0)
    """The weighted arm's weights, chat and batch."""


@dataclass(frozen=True)
class Timing:
    warmup_solo_s: float = 5.0
    warmup_s: float = 10.0
    measure_s: float = 30.0
    grace_s: float = 15.0
    weighted_measure_s: float = 60.0
    """The weighted arm's window: a batch's service counts when it is answered, so the
    split needs many batches to settle."""

    @classmethod
    def quick(cls) -> Timing:
        return cls(1.0, 2.0, 8.0, 4.0, 8.0)


@dataclass(frozen=True)
class Arm:
    name: str
    path: str
    flood: bool
    warmup_s: float
    pooling_priority: int | None = None
    static: bool = False
    """A static soft limit (STATIC_INFLIGHT - headroom) instead of the adaptive one."""
    step_tokens: int | None = None
    """On an engine of its own, started with `--max-num-batched-tokens step_tokens`."""
    backlogged: bool = False
    """Both tenants backlogged (closed loops) and weighted `Workload.weighted`."""

    def weights(self, work: Workload) -> dict[str, float]:
        chat, batch = work.weighted if self.backlogged else (work.chat_weight, work.batch_weight)
        return {CHAT: chat, BATCH: batch}


STATIC_INFLIGHT = 64
POOLING_PRIORITY = 9
"""Above every chat request's engine priority (one tier: 0, or 1 when backlogged)."""
ENGINE_ARGS = ("--scheduling-policy", "priority")


def policy_text(
    endpoint: str,
    weights: dict[str, float],
    pooling_priority: int | None = None,
    static: bool = False,
    inflight_tokens: int = 98_304,
) -> str:
    lines = scenario.standard_tenants(weights, KEYS)
    pool = [
        "max_total_tokens: 131072",
        f"max_inflight: {STATIC_INFLIGHT if static else 512}",
        f"max_inflight_tokens: {inflight_tokens if static else 1_000_000_000}",
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
    end = arm.warmup_s + (timing.weighted_measure_s if arm.backlogged else timing.measure_s)
    batches: list[BatchRecord] = []
    async with Load(gateway.url, meter) as load:

        async def flood() -> None:
            url = gateway.base_url + "/v1/embeddings"
            flood_work = replace(work, batch_concurrency=work.weighted_batches)
            batches.extend(
                await batch_loop(
                    url, load, meter, flood_work if arm.backlogged else work,
                    end + (0.0 if arm.backlogged else timing.grace_s), seed,
                )
            )  # fmt: skip

        if arm.backlogged:
            chat = closed_loop(
                load, chat_maker(work, seed), work.chat_backlog, end, seed=seed + 1,
                ramp_s=1.0,
            )  # fmt: skip
        else:
            chat = open_loop(
                load, chat_maker(work, seed), work.chat_rate, end, seed=seed + 1,
                grace_s=timing.grace_s,
            )  # fmt: skip
        jobs = [chat, flood()] if arm.flood else [chat]
        monitor = Monitor(load, engines.all(), gateway.admin_url)
        await scenario.drive(NAME, arm.name, load, jobs, end, monitor, end + timing.grace_s)
    return summarize_arm(arm, load, meter, monitor, batches, arm.weights(work), end)


def summarize_arm(
    arm: Arm,
    load: Load,
    meter: Meter,
    monitor: Monitor,
    batches: list[BatchRecord],
    weights: dict[str, float],
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
        "weight": weights[CHAT],
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
            "weight": weights[BATCH],
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
    arm: Arm,
    engines: EngineSet,
    workdir: Path,
    work: Workload,
    timing: Timing,
    seed: int,
    profile: str = PROFILE,
) -> dict[str, Any]:
    args: tuple[str, ...] = ENGINE_ARGS
    with contextlib.ExitStack() as stack:
        if arm.step_tokens is not None:
            args = (*ENGINE_ARGS, "--max-num-batched-tokens", str(arm.step_tokens))
            engines = stack.enter_context(
                engine_set(workdir / f"engines-{arm.name}", {scenario.POOL: 1}, profile, args)
            )
        endpoint = engines.endpoints[scenario.POOL][0]
        text = policy_text(
            endpoint, arm.weights(work), arm.pooling_priority, arm.static, work.inflight_tokens
        )
        gateway = stack.enter_context(
            scenario.arm_gateway(
                NAME, arm.name, workdir, engines, text, arm.path, capacity(work, arm.static)
            )
        )
        result: dict[str, Any] = scenario.run_async(
            drive_arm(arm, gateway, engines, work, timing, seed)
        )
    result["engine_args"] = list(args)
    ttft = result["tenants"][CHAT]["ttft"]
    log(NAME, f"arm {arm.name}: chat p50 {fmt(ttft.get('p50_ms', math.nan))} ms "
              f"p99 {fmt(ttft.get('p99_ms', math.nan))} ms")  # fmt: skip
    return result


def run(
    out: Path,
    workdir: Path,
    work: Workload,
    timing: Timing,
    *,
    seed: int = 29,
    profile: str = PROFILE,
    selected: Sequence[str] = (),
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
        *(
            Arm(
                f"step-{tokens}",
                "service",
                True,
                timing.warmup_s,
                pooling_priority=POOLING_PRIORITY,
                static=True,
                step_tokens=tokens,
            )
            for tokens in work.step_tokens
        ),
        Arm(
            "weighted",
            "service",
            True,
            timing.warmup_s,
            static=True,
            step_tokens=work.weighted_step_tokens,
            backlogged=True,
        ),
    ]
    if selected:
        unknown = set(selected) - {arm.name for arm in arms}
        if unknown:
            raise SystemExit(f"{NAME}: unknown arms {sorted(unknown)}")
        arms = [arm for arm in arms if arm.name in selected]

    def conclude(results: scenario.Results) -> scenario.Conclusion:
        summary = embedding_flood_report.compare(results)
        return scenario.Conclusion(
            summary,
            lambda path: embedding_flood_report.plot(results, summary, path),
            lambda: embedding_flood_report.print_table(summary),
        )

    return scenario.run_scenario(
        NAME, out, workdir, profile=profile, work=work, timing=timing,
        settings={"weights": {arm.name: arm.weights(work) for arm in arms}}, arms=arms,
        run_arm=lambda arm, engines, _results: run_arm(
            arm, engines, workdir, work, timing, seed, profile
        ),
        conclude=conclude, figure="embedding-flood.png", engine_args=ENGINE_ARGS,
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm (default 30)")
    parser.add_argument("--batch-inputs", type=int, help="inputs per embedding call (default 2000)")
    parser.add_argument("--batch-concurrency", type=int, help="embedding calls kept in flight")
    parser.add_argument("--input-tokens", type=int, help="tokens per embedding input (default 16)")
    parser.add_argument("--chat-rate", type=float, help="chat requests/s (default 3)")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument(
        "--arms", help="comma-separated arms to run (default all; ratios need chat-solo)"
    )


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
    selected = [a for a in (args.arms or "").split(",") if a]
    run(args.out, scenario.workdir_of(args), work, timing, seed=args.seed, selected=selected)
    log(NAME, f"done in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.embedding_flood", __doc__, add_arguments, main)
    )
