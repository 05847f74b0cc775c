"""The calibration workload and its measurement: streamed `/v1/completions` requests of random
token ids against one engine, closed-loop levels and noisy-neighbour rounds, pooled per engine
over alternating rounds (`measure`)."""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from gateway_lab.progress import Progress

MODEL = "tiny-llama"
TOKEN_ID_RANGE = (1_000, 100_000)  # ordinary cl100k ids; specials start at 100,256
REQUEST_TIMEOUT_S = 300.0
BURST_ITL_S = 0.0005


@dataclass(frozen=True)
class Workload:
    levels: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 200
    output_tokens: int = 64
    min_requests_per_level: int = 16
    short_prompt_tokens: int = 50
    short_output_tokens: int = 16
    long_prompt_tokens: int = 1800
    long_output_tokens: int = 16
    long_counts: tuple[int, ...] = (0, 1, 2, 4)
    repeats: int = 3
    long_head_start_s: float = 0.02
    rounds: int = 3
    seed: int = 7


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    itl_s: float | None
    e2e_s: float
    tokens: int

    @property
    def burst(self) -> bool:
        """The stream reached the client in one burst at its end (tokens < 0.5 ms apart on
        average, far below any engine step): the server's HTTP side was stalled, so the
        arrival of the first chunk says nothing about when the engine produced it."""
        return self.tokens >= 4 and self.itl_s is not None and self.itl_s < BURST_ITL_S


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    output_tokens_per_s: float
    engine_ttft_mean_ms: float = math.nan
    burst_delivered: int = 0
    """Streams delivered in one burst (host stall); left out of the TTFT and ITL figures."""
    """TTFT as the engine itself reports it (mean of its vllm:time_to_first_token_seconds)."""


@dataclass
class InterferenceResult:
    long_prompts: int
    long_prompt_tokens: int
    short_ttft_p50_ms: float
    short_ttft_max_ms: float
    samples: int = 0
    burst_delivered: int = 0


@dataclass
class EngineResult:
    engine: str
    description: str
    levels: list[LevelResult] = field(default_factory=list)
    interference: list[InterferenceResult] = field(default_factory=list)
    startup_s: float | None = None
    load_1m: list[float] = field(default_factory=list)
    """The machine's 1-minute load average when each round started (2 cores: 2.0 is full)."""


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(tokens)]


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int] | str,
    max_tokens: int,
    priority: int | None = None,
    on_chunk: Callable[[float], None] | None = None,
) -> Timing:
    """One streamed `/v1/completions` request (vLLM `priority` if given) and its timing.

    `on_chunk` is called with the arrival time (`time.perf_counter()`) of each chunk that
    carries tokens, as it arrives."""
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    first: float | None = None
    last = start
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = orjson.loads(line[5:])
            if not chunk.get("choices"):
                continue  # the final usage-only chunk
            usage = chunk.get("usage") or {}
            count = usage.get("completion_tokens")
            tokens = int(count) if isinstance(count, int) else tokens + 1
            if tokens >= 1 and first is None:
                first = now
            last = now
            if on_chunk is not None:
                on_chunk(now)
    if first is None or tokens < 1:
        raise RuntimeError(f"{url}: a stream without tokens")
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return Timing(first - start, itl, last - start, tokens)


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


TTFT_METRIC = "vllm:time_to_first_token_seconds"


async def _histogram(session: aiohttp.ClientSession, url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on an engine's /metrics page, over all label sets."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def _level_round(
    session: aiohttp.ClientSession, url: str, concurrency: int, work: Workload, rng: random.Random
) -> tuple[list[Timing], float]:
    """One closed-loop round: ``concurrency`` clients, each sending requests back to back."""
    per_client = max(2, math.ceil(work.min_requests_per_level / concurrency))
    prompts = [
        [random_prompt(rng, work.prompt_tokens) for _ in range(per_client)]
        for _ in range(concurrency)
    ]

    async def client(mine: list[list[int]]) -> list[Timing]:
        return [await stream_completion(session, url, p, work.output_tokens) for p in mine]

    start = time.perf_counter()
    results = await asyncio.gather(*(client(mine) for mine in prompts))
    wall = time.perf_counter() - start
    return [t for batch in results for t in batch], wall


def _level_result(
    concurrency: int, timings: list[Timing], wall: float, engine_ttft: tuple[float, float]
) -> LevelResult:
    clean = [t for t in timings if not t.burst]
    itls = [t.itl_s for t in clean if t.itl_s is not None] or [math.nan]
    ttfts = [t.ttft_s for t in clean] or [math.nan]
    ttft_sum, ttft_count = engine_ttft
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        wall_s=round(wall, 3),
        ttft_p50_ms=round(statistics.median(ttfts) * 1000, 2),
        ttft_p90_ms=round(_pct(ttfts, 0.9) * 1000, 2),
        itl_p50_ms=round(statistics.median(itls) * 1000, 2),
        output_tokens_per_s=round(sum(t.tokens for t in timings) / wall, 1),
        engine_ttft_mean_ms=round(ttft_sum / ttft_count * 1000, 2) if ttft_count else math.nan,
        burst_delivered=len(timings) - len(clean),
    )


async def _interference_round(
    session: aiohttp.ClientSession,
    url: str,
    long_count: int,
    work: Workload,
    rng: random.Random,
) -> list[Timing]:
    """The short request's timings, each sent just after ``long_count`` long prompts."""
    ttfts = []
    for _ in range(work.repeats):
        longs = [
            asyncio.create_task(
                stream_completion(
                    session,
                    url,
                    random_prompt(rng, work.long_prompt_tokens),
                    work.long_output_tokens,
                )
            )
            for _ in range(long_count)
        ]
        await asyncio.sleep(work.long_head_start_s)
        short = await stream_completion(
            session, url, random_prompt(rng, work.short_prompt_tokens), work.short_output_tokens
        )
        await asyncio.gather(*longs)
        ttfts.append(short)
    return ttfts


@dataclass
class _Samples:
    """Every sample one engine gave, pooled over rounds."""

    work: Workload
    timings: dict[int, list[Timing]] = field(default_factory=dict)
    walls: dict[int, float] = field(default_factory=dict)
    engine_ttft: dict[int, tuple[float, float]] = field(default_factory=dict)
    shorts: dict[int, list[Timing]] = field(default_factory=dict)
    load_1m: list[float] = field(default_factory=list)

    def result(self, engine: str, description: str) -> EngineResult:
        result = EngineResult(engine=engine, description=description)
        for concurrency in self.work.levels:
            timings = self.timings[concurrency]
            engine_ttft = self.engine_ttft.get(concurrency, (0.0, 0.0))
            result.levels.append(
                _level_result(concurrency, timings, self.walls[concurrency], engine_ttft)
            )
        for count in self.work.long_counts:
            shorts = self.shorts[count]
            ttfts = [t.ttft_s for t in shorts if not t.burst] or [math.nan]
            result.interference.append(
                InterferenceResult(
                    long_prompts=count,
                    long_prompt_tokens=count * self.work.long_prompt_tokens,
                    short_ttft_p50_ms=round(statistics.median(ttfts) * 1000, 2),
                    short_ttft_max_ms=round(max(ttfts) * 1000, 2),
                    samples=len(shorts),
                    burst_delivered=sum(t.burst for t in shorts),
                )
            )
        result.load_1m = [round(x, 2) for x in self.load_1m]
        return result


async def _warm_up(
    session: aiohttp.ClientSession, url: str, work: Workload, rng: random.Random
) -> None:
    """First requests pay one-off costs (allocation, lazy init) on both engines."""
    for _ in range(3):
        await stream_completion(session, url, random_prompt(rng, work.prompt_tokens), 8)
    await asyncio.gather(
        *(
            stream_completion(session, url, random_prompt(rng, work.prompt_tokens), 8)
            for _ in range(8)
        )
    )


def _session() -> aiohttp.ClientSession:
    """A fresh client per phase: a pooled connection left idle longer than the server's
    keep-alive (uvicorn: 5 s) may be closed under us ("Server disconnected")."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def _round(url: str, work: Workload, rng: random.Random, samples: _Samples) -> None:
    samples.load_1m.append(os.getloadavg()[0])
    for concurrency in work.levels:
        async with _session() as session:
            before = await _histogram(session, url, TTFT_METRIC)
            timings, wall = await _level_round(session, url, concurrency, work, rng)
            after = await _histogram(session, url, TTFT_METRIC)
        samples.timings.setdefault(concurrency, []).extend(timings)
        samples.walls[concurrency] = samples.walls.get(concurrency, 0.0) + wall
        total, count = samples.engine_ttft.get(concurrency, (0.0, 0.0))
        samples.engine_ttft[concurrency] = (
            total + after[0] - before[0],
            count + after[1] - before[1],
        )
    for count in work.long_counts:
        async with _session() as session:
            shorts = await _interference_round(session, url, count, work, rng)
        samples.shorts.setdefault(count, []).extend(shorts)


@dataclass(frozen=True)
class Target:
    """A running engine to measure."""

    engine: str
    url: str
    description: str
    startup_s: float | None = None


async def measure(targets: Sequence[Target], work: Workload) -> list[EngineResult]:
    """Run the workload ``work.rounds`` times against every target, alternating targets round
    by round (and which goes first), so both see the same background load on a shared machine.
    Samples are pooled per target; only one engine is loaded at any time."""
    samples = {t.engine: _Samples(work) for t in targets}
    rngs = {t.engine: random.Random(work.seed) for t in targets}
    for target in targets:
        async with _session() as session:
            await _warm_up(session, target.url, work, rngs[target.engine])
    tracker = Progress("calibrate", work.rounds * len(targets), unit="engine rounds")
    for index in range(work.rounds):
        order = list(targets) if index % 2 == 0 else list(reversed(targets))
        for position, target in enumerate(order):
            done = index * len(targets) + position
            tracker.phase(f"round {index + 1}/{work.rounds}: {target.engine}", done=done)
            await _round(target.url, work, rngs[target.engine], samples[target.engine])
    tracker.finish(f"{work.rounds} rounds")
    results = []
    for target in targets:
        result = samples[target.engine].result(target.engine, target.description)
        result.startup_s = target.startup_s
        for level in result.levels:
            print(f"  {target.engine}: {level}", flush=True)
        for found in result.interference:
            print(f"  {target.engine}: {found}", flush=True)
        results.append(result)
    return results
