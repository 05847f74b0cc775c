"""Benchmark: locality-aware fairness (DLPM, D²LPM) against VTC and DRR on shared-prefix traffic.

Two emulated A100 / Llama-3.1-8B replicas in one pool, each with a KV cache smaller than the
traffic's working set (`--kv-blocks`), prefix caching on (vLLM's default). Three tenants of one
tier, through the real Envoy and the ext_proc service, with the same door capacity in each arm:

* chat: closed-loop clients, each running multi-turn conversations that resend the whole
  history (a unique system prompt per conversation, then turns);
* docs: closed-loop clients whose requests start with one of a few long shared system prompts;
* quiet: Poisson arrivals of unique prompts (no prefix to reuse): its TTFT is the cost a
  locality-blind tenant pays.

Arms: vtc and drr (Envoy balances the pool's two endpoints round robin), dlpm (the gateway's
locality index orders the queue and picks the replica: D²LPM). Fresh engines per arm, so no
arm inherits another's cache. Reported per arm: completed requests/s and tokens/s, the prefix
hit rate from the engines' own counters (vllm:prefix_cache_hits_total / queries_total), each
tenant's dispatched service (1 x prompt + 2 x max_tokens at admission), the largest service gap
between the two backlogged tenants over intervals where both stay backlogged, from the
gateway's own accounting (`/v1/tenants` sampled every 0.1 s), against the DLPM bound 2Q + 2U,
and the quiet tenant's TTFT. Ratios are against the vtc arm of the same run.

`extproc bench locality [--out results/locality] [--quick]`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.policy import hash_key
from extproc.service.engine_metrics import parse_engine_metrics
from gateway_lab.bench import scenario
from gateway_lab.bench.loadgen import Load, open_loop
from gateway_lab.bench.locality_report import plot, summarize_arms, table
from gateway_lab.bench.monitor import log
from gateway_lab.bench.records import RECORD_COLUMNS, Meter, Record, Spec, prompt_text
from gateway_lab.bench.stack import PROFILE, engine_set
from gateway_lab.bench.stats import status_counts, ttft_stats
from gateway_lab.engine.tokens import MESSAGE_OVERHEAD_TOKENS

NAME = "locality"
DEFAULT_OUT = Path("results/locality")
POOL = "main"
KEYS = {"chat": "bench-chat-key", "docs": "bench-docs-key", "quiet": "bench-quiet-key"}
BACKLOGGED = ("chat", "docs")
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
ARMS = ("vtc", "drr", "dlpm")


@dataclass(frozen=True)
class Workload:
    replicas: int = 2
    kv_blocks: int = 2000
    """KV blocks (16 tokens) per replica: 32k tokens, below the working set of both tenants."""
    chat_clients: int = 16
    chat_system: int = 1500
    chat_turn: int = 60
    turns: int = 6
    docs_clients: int = 12
    docs_prompts: int = 8
    docs_system: int = 2000
    docs_question: int = 40
    quiet_rate: float = 1.0
    quiet_prompt: int = 400
    output: int = 8
    max_inflight: int = 16
    quantum: int = 64


@dataclass(frozen=True)
class Timing:
    warmup_s: float = 10.0
    measure_s: float = 30.0
    bin_s: float = 0.25

    @classmethod
    def quick(cls) -> Timing:
        return cls(3.0, 8.0, 0.25)


@dataclass(frozen=True, slots=True)
class ChatSpec(Spec):
    """A request with a whole message list (a conversation's history)."""

    messages: tuple[tuple[str, str], ...] = field(default=())

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "model": "bench",
                "messages": [{"role": role, "content": text} for role, text in self.messages],
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )


def chat_spec(tenant: str, messages: Sequence[tuple[str, str]], output: int) -> ChatSpec:
    tokens = sum(MESSAGE_OVERHEAD_TOKENS + math.ceil(len(t.encode()) / 4) for _, t in messages)
    return ChatSpec(tenant, KEYS[tenant], "", tokens, output, messages=tuple(messages))


def policy_text(endpoints: Sequence[str], arm: str, work: Workload) -> str:
    limits = "{max_queued: 400, max_queue_wait: 600s}"
    tenants = "\n".join(
        f'  {t}: {{tier: standard, api_keys: ["{hash_key(k)}"], limits: {limits}}}'
        for t, k in KEYS.items()
    )
    quoted = ", ".join(f'"{e}"' for e in endpoints)
    return f"""\
version: 1
tiers: [standard]
tenants:
{tenants}
pools:
  {POOL}: {{max_total_tokens: 8192, max_inflight: {work.max_inflight},
          max_inflight_tokens: 1000000000, endpoints: [{quoted}],
          replica_kv_tokens: {work.kv_blocks * 16}, adaptive: {{enabled: false}}}}
fairness: {{policy: {arm}, input_weight: {INPUT_WEIGHT}, output_weight: {OUTPUT_WEIGHT},
           quantum: {work.quantum}}}
estimation: {{mode: flat, default_bytes_per_token: 4.0}}
gateway: {{default_max_tokens: 256, message_timeout: 10s}}
"""


async def conversations(load: Load, work: Workload, client: int, until: float, seed: int) -> None:
    """One chat client: conversation after conversation, each turn resending the history."""
    rng = random.Random(seed * 1000 + client)
    while load.now() < until:
        messages = [("system", prompt_text(work.chat_system, rng))]
        for _turn in range(work.turns):
            messages.append(("user", prompt_text(work.chat_turn, rng)))
            record = await load.send(chat_spec("chat", messages, work.output))
            if load.now() >= until:
                return
            if record.status != 200:
                messages.pop()
                await asyncio.sleep(0.1)
                continue
            messages.append(("assistant", prompt_text(work.output, rng)))


async def documents(
    load: Load, work: Workload, client: int, until: float, systems: Sequence[str], seed: int
) -> None:
    """One docs client: a shared system prompt, a fresh question, again."""
    rng = random.Random(seed * 2000 + client)
    while load.now() < until:
        messages = [("system", rng.choice(systems)), ("user", prompt_text(work.docs_question, rng))]
        record = await load.send(chat_spec("docs", messages, work.output))
        if record.status != 200:
            await asyncio.sleep(0.1)


def quiet_maker(work: Workload, seed: int) -> Any:
    rng = random.Random(seed)

    def make(_index: int) -> Spec:
        text = prompt_text(work.quiet_prompt, rng)
        return Spec("quiet", KEYS["quiet"], text, work.quiet_prompt, work.output)

    return make


async def drive_arm(
    arm: str, url: str, admin_url: str, work: Workload, timing: Timing, seed: int
) -> tuple[Load, list[Sample]]:
    meter = Meter(timing.bin_s, INPUT_WEIGHT, OUTPUT_WEIGHT)
    end = timing.warmup_s + timing.measure_s
    rng = random.Random(seed)
    systems = [prompt_text(work.docs_system, rng) for _ in range(work.docs_prompts)]
    async with Load(url, meter) as load:
        sampler = asyncio.ensure_future(sample_gateway(load, admin_url, end, work.output))
        jobs = [
            *(conversations(load, work, c, end, seed) for c in range(work.chat_clients)),
            *(documents(load, work, c, end, systems, seed) for c in range(work.docs_clients)),
            open_loop(load, quiet_maker(work, seed + 7), work.quiet_rate, end, seed=seed + 8),
        ]
        await scenario.drive(NAME, arm, load, [_until(jobs, load, end)], end)
        samples = await sampler
    return load, samples


async def _until(jobs: Sequence[Any], load: Load, end: float) -> None:
    """Run the clients until `end`, then cut what still runs (recorded as cut short)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, timeout=max(0.0, end - load.now()) + 1.0)
        load.finish_pending()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_counters(endpoints: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Each engine's (prefix-cache queries, hits) counters, in tokens."""
    out: dict[str, tuple[float, float]] = {}
    for endpoint in endpoints:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
            reading = parse_engine_metrics(response.read().decode())
        queries = reading.prefix_queries if reading is not None else None
        hits = reading.prefix_hits if reading is not None else None
        out[endpoint] = (queries or 0.0, hits or 0.0)
    return out


def gateway_locality(admin_url: str | None) -> Any:
    if admin_url is None:
        return None
    with urllib.request.urlopen(f"{admin_url}/v1/tenants", timeout=5) as response:
        return orjson.loads(response.read()).get("locality")


def _cost(record: Record) -> float:
    return INPUT_WEIGHT * record.prompt_tokens + OUTPUT_WEIGHT * record.max_tokens


@dataclass(frozen=True, slots=True)
class Sample:
    """One `/v1/tenants` snapshot: each backlogged tenant's dispatched cost so far (the
    gateway's own accounting) and whether it was backlogged in the pool then."""

    at: float
    cost: dict[str, float]
    backlogged: dict[str, bool]


def sample_of(at: float, tenants: dict[str, Any], output: int) -> Sample:
    """Cost as the fair share counts it, 1 x input + 2 x output: the snapshot's served tokens
    (budgets, settled) plus one more output's worth per request (every request asks `output`)."""
    cost, backlogged = {}, {}
    for name in BACKLOGGED:
        item = tenants.get(name, {})
        extra = (OUTPUT_WEIGHT - 1.0) * output * item.get("served_requests", 0)
        cost[name] = INPUT_WEIGHT * item.get("served_tokens", 0) + extra
        backlogged[name] = POOL in item.get("backlogged_pools", [])
    return Sample(at, cost, backlogged)


async def sample_gateway(
    load: Load, admin_url: str, until: float, output: int, every_s: float = 0.1
) -> list[Sample]:
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while load.now() < until:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{admin_url}/v1/tenants") as response:
                    body = await response.json()
                samples.append(sample_of(load.now(), body.get("tenants", {}), output))
            await asyncio.sleep(every_s)
    return samples


def backlogged_gap(samples: Sequence[Sample], start: float, end: float) -> dict[str, float]:
    """The largest |S_chat(t1, t2) - S_docs(t1, t2)| between samples in [start, end) with both
    tenants backlogged at every sample from t1 to t2 (the bound's condition), and between any
    two samples (for reference). Sampling can only miss a larger gap between two samples."""
    chosen = [s for s in samples if start <= s.at < end]
    first, second = BACKLOGGED

    def widest(run: Sequence[Sample]) -> float:
        diffs = [s.cost[first] - s.cost[second] for s in run]
        return max(diffs) - min(diffs) if diffs else 0.0

    runs: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in chosen:
        if all(sample.backlogged.values()):
            current.append(sample)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    both = sum(run[-1].at - run[0].at for run in runs)
    return {
        "max_gap": max((widest(run) for run in runs), default=0.0),
        "max_gap_any_interval": widest(chosen),
        "both_backlogged_s": both,
        "samples": float(len(chosen)),
    }


def measure(
    arm: str, load: Load, timing: Timing, work: Workload, counters: dict[str, Any]
) -> dict[str, Any]:
    start, end = timing.warmup_s, timing.warmup_s + timing.measure_s
    done = [r for r in load.records if r.complete and r.status == 200 and start <= r.end < end]
    per_tenant = {t: [r for r in done if r.tenant == t] for t in KEYS}
    gaps = backlogged_gap(counters["samples"], start, end)
    service = {
        t: sum(_cost(r) for r in load.records if r.tenant == t and r.queue_ms is not None
               and r.status == 200 and start <= r.start + r.queue_ms / 1000.0 < end)
        for t in BACKLOGGED
    }  # fmt: skip
    largest_prompt = work.chat_system + work.turns * (
        work.chat_turn + work.output + 2 * MESSAGE_OVERHEAD_TOKENS
    )
    largest = INPUT_WEIGHT * max(largest_prompt, work.docs_system + 64) + OUTPUT_WEIGHT * (
        work.output
    )
    bound = 2 * work.quantum + 2 * largest
    queries = sum(after[0] - before[0] for before, after in counters["engines"])
    hits = sum(after[1] - before[1] for before, after in counters["engines"])
    quiet = [r for r in load.records if r.tenant == "quiet" and start <= r.start < end]
    return {
        "arm": arm,
        "completed_per_s": len(done) / timing.measure_s,
        "prompt_tokens_per_s": sum(r.prompt_tokens for r in done) / timing.measure_s,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / timing.measure_s,
        "completed": {t: len(rs) for t, rs in per_tenant.items()},
        "service_per_s": {t: value / timing.measure_s for t, value in service.items()},
        **gaps,
        "bound": bound,
        "largest_request_cost": largest,
        "engine_prefix_query_tokens": queries,
        "engine_prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / queries if queries else math.nan,
        "quiet_ttft": ttft_stats(quiet),
        "statuses": status_counts(load.records),
        "gateway_locality": counters.get("gateway"),
        "record_columns": RECORD_COLUMNS,
        "records": [r.as_row() for r in load.records],
    }


def run_arm(arm: str, workdir: Path, work: Workload, timing: Timing, seed: int) -> dict[str, Any]:
    engine_args = ("--kv-blocks", str(work.kv_blocks), "--max-model-len", "8192")
    with engine_set(workdir / arm / "engines", {POOL: work.replicas}, PROFILE, engine_args) as (
        engines
    ):
        endpoints = engines.endpoints[POOL]
        text = policy_text(endpoints, arm, work)
        with scenario.arm_gateway(
            NAME, arm, workdir, engines, text, "service", announce=f"arm {arm}: starting"
        ) as gateway:
            assert gateway.admin_url is not None
            before = engine_counters(endpoints)
            load, samples = scenario.run_async(
                drive_arm(arm, gateway.url, gateway.admin_url, work, timing, seed)
            )
            after = engine_counters(endpoints)
            counters: dict[str, Any] = {
                "samples": samples,
                "engines": [(before[e], after[e]) for e in endpoints],
                "gateway": gateway_locality(gateway.admin_url),
            }
    return measure(arm, load, timing, work, counters)


def run(out: Path, workdir: Path, work: Workload, timing: Timing, seed: int) -> dict[str, Any]:
    began = time.perf_counter()
    log(NAME, f"{len(ARMS)} arms, {timing.measure_s:.0f}s measured each, {work.replicas} replicas")
    results = {arm: run_arm(arm, workdir, work, timing, seed) for arm in ARMS}
    summary = summarize_arms(results)
    report = {
        "scenario": NAME,
        "profile": PROFILE,
        "workload": work.__dict__,
        "timing": timing.__dict__,
        "seed": seed,
        "wall_s": time.perf_counter() - began,
        "summary": summary,
        "arms": results,
    }
    scenario.save_results(
        out, report, "locality.png", lambda p: plot(results, p), lambda: table(results, summary)
    )
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scenario.add_scenario_arguments(parser, DEFAULT_OUT, "measured seconds per arm (default 30)")
    parser.add_argument("--replicas", type=int, help="engine replicas in the pool (default 2)")
    parser.add_argument("--kv-blocks", type=int, help="KV blocks per replica (default 2000)")
    parser.add_argument("--seed", type=int, default=5)


def main(args: argparse.Namespace) -> int:
    work = Workload()
    if args.replicas:
        work = replace(work, replicas=args.replicas)
    if args.kv_blocks:
        work = replace(work, kv_blocks=args.kv_blocks)
    timing = scenario.chosen_timing(args, Timing(), Timing.quick())
    run(args.out, scenario.workdir_of(args), work, timing, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main("gateway_lab.bench.locality", __doc__, add_arguments, main)
    )
