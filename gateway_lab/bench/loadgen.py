"""An HTTP load generator for OpenAI-style streamed requests: time to first byte, end, chunks."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass
class Sample:
    tenant: str
    start: float
    status: int
    ttfb_s: float | None
    latency_s: float
    chunks: int
    output_tokens: int
    queue_ms: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RequestSpec:
    tenant: str
    key: str
    prompt: str
    max_tokens: int
    stream: bool = True
    headers: dict[str, str] = field(default_factory=dict)


def request_body(spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "bench",
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "stream": spec.stream,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_one(session: aiohttp.ClientSession, url: str, spec: RequestSpec) -> Sample:
    headers = {"authorization": f"Bearer {spec.key}", **spec.headers}
    start = time.perf_counter()
    ttfb: float | None = None
    chunks = 0
    output_tokens = 0
    try:
        async with session.post(url, json=request_body(spec), headers=headers) as response:
            queue = response.headers.get("x-gateway-queue-ms")
            async for chunk in response.content.iter_any():
                if ttfb is None:
                    ttfb = time.perf_counter() - start
                chunks += chunk.count(b"data: ")
            if response.status == 200:
                output_tokens = spec.max_tokens
            return Sample(
                spec.tenant, start, response.status, ttfb, time.perf_counter() - start,
                chunks, output_tokens, float(queue) if queue else None,
            )  # fmt: skip
    except (TimeoutError, aiohttp.ClientError):
        return Sample(spec.tenant, start, 0, ttfb, time.perf_counter() - start, chunks, 0, None)


async def closed_loop(
    url: str,
    make: Callable[[int], RequestSpec],
    concurrency: int,
    duration_s: float,
    max_requests: int | None = None,
) -> list[Sample]:
    """`concurrency` workers send back to back until `duration_s` or `max_requests`."""
    samples: list[Sample] = []
    deadline = time.perf_counter() + duration_s
    counter = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=max(60.0, duration_s * 3))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal counter
            while time.perf_counter() < deadline and (
                max_requests is None or counter < max_requests
            ):
                counter += 1
                samples.append(await send_one(session, url, make(counter)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def open_loop(
    url: str,
    make: Callable[[int], RequestSpec],
    rate_per_s: float,
    duration_s: float,
    rng: random.Random,
    session: aiohttp.ClientSession,
) -> list[Sample]:
    """Poisson arrivals at `rate_per_s` for `duration_s`, whatever the responses do."""
    tasks: list[asyncio.Task[Sample]] = []
    start = time.perf_counter()
    at = 0.0
    index = 0
    while True:
        at += rng.expovariate(rate_per_s)
        if at > duration_s:
            break
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        index += 1
        tasks.append(asyncio.create_task(send_one(session, url, make(index))))
    return list(await asyncio.gather(*tasks))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples: Sequence[Sample], elapsed_s: float) -> dict[str, float]:
    ok = [s for s in samples if s.status == 200]
    ttfb = [s.ttfb_s for s in ok if s.ttfb_s is not None]
    return {
        "requests": float(len(samples)),
        "ok": float(len(ok)),
        "rps": len(ok) / elapsed_s if elapsed_s > 0 else math.nan,
        "ttfb_p50_ms": percentile(ttfb, 50) * 1000,
        "ttfb_p99_ms": percentile(ttfb, 99) * 1000,
        "latency_mean_ms": statistics.fmean(s.latency_s for s in ok) * 1000 if ok else math.nan,
        "chunks": float(sum(s.chunks for s in ok)),
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / elapsed_s if elapsed_s else 0.0,
    }
