"""One load generator for OpenAI-style streamed chat requests, closed-loop or open-loop.

`Load` sends requests through one gateway and records each one (`Record`: the time of the first
SSE data chunk, output tokens counted as chunks arrive, the gateway's queue wait, and for the
tenants named in `gap_tenants` the arrival time and tokens of every output chunk, from which
every inter-token gap is measured), feeding a `Meter`. `closed_loop` keeps N clients sending
back to back (honouring `Retry-After`); `open_loop` sends Poisson arrivals whatever the
answers. `summarize` gives the latency and throughput figures of a run.

While a `Load` is open its process runs no automatic garbage collection (`CollectorPaused`):
a full collection of the load generator's growing heap stopped this client's event loop for
up to ~190 ms, and its young collections for up to 15 ms of CPU, which the benchmark then timed
as the gateway's latency (docs/benchmarks.md, "The benchmark's own pauses").
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

import aiohttp

from gateway_lab.bench.records import Chunks, Meter, Record, Spec, percentile


class CollectorPaused:
    """No automatic garbage collection in this process while any holder is in; the heap is
    collected when the first holder enters and when the last one leaves, outside what a
    benchmark times. Reference counting still frees everything but cycles, and a load
    generator makes few: a traced `over` run's young collections freed nothing, and the full
    ones at its arms' ends 1,500-5,400 objects each."""

    _holders = 0

    def __enter__(self) -> None:
        if CollectorPaused._holders == 0:
            gc.collect()
            gc.disable()
        CollectorPaused._holders += 1

    def __exit__(self, *exc: object) -> None:
        CollectorPaused._holders -= 1
        if CollectorPaused._holders == 0:
            gc.enable()
            gc.collect()


class Load:
    """Sends streamed chat requests through one gateway and records them."""

    def __init__(
        self,
        url: str,
        meter: Meter,
        t0: float | None = None,
        request_timeout_s: float | None = None,
        gap_tenants: Collection[str] = (),
    ) -> None:
        """`request_timeout_s`: the longest a request may take (None: no limit, for the
        tenant scenarios whose requests may queue for minutes). `gap_tenants`: the tenants
        whose records keep every output chunk's arrival (`Record.chunks`)."""
        self.url = url
        self.gap_tenants = frozenset(gap_tenants)
        self.request_timeout_s = request_timeout_s
        self.meter = meter
        self.t0 = time.perf_counter() if t0 is None else t0
        self.wall_t0 = time.time() - (time.perf_counter() - self.t0)
        """The wall-clock time of time 0 (to join records with other processes' logs)."""
        self.records: list[Record] = []
        self.pending: dict[int, Record] = {}
        self.sent: dict[str, int] = {}
        self._ids = 0
        self._session: aiohttp.ClientSession | None = None
        self._collector_paused = CollectorPaused()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def __aenter__(self) -> Load:
        self._collector_paused.__enter__()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=10.0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._session is not None:
                await self._session.close()
        finally:
            self._collector_paused.__exit__()

    def finish_pending(self, tenant: str | None = None) -> None:
        """Record the requests (of `tenant`, or all) still running as the run stops: those
        with a first token as incomplete, those without one as censored, with their elapsed
        time as a lower bound of their TTFT."""
        now = self.now()
        for ident, record in list(self.pending.items()):
            if tenant is not None and record.tenant != tenant:
                continue
            if record.ttft is None:
                record.ttft = now - record.start
                record.censored = True
            record.end = now
            self.records.append(record)
            del self.pending[ident]

    async def send(self, spec: Spec) -> Record:
        assert self._session is not None, "use `async with Load(...)`"
        meter = self.meter
        headers = {
            "authorization": f"Bearer {spec.key}",
            "content-type": "application/json",
            **spec.headers,
        }
        self._ids += 1
        ident = self._ids
        record = Record(
            spec.tenant, self.now(), 0, None, 0.0, spec.prompt_tokens, 0, None, spec.max_tokens
        )
        chunks = record.chunks = Chunks() if spec.tenant in self.gap_tenants else None
        self.pending[ident] = record
        self.sent[spec.tenant] = self.sent.get(spec.tenant, 0) + 1
        try:
            async with self._session.post(self.url, data=spec.body(), headers=headers) as response:
                record.status = response.status
                queue = response.headers.get("x-gateway-queue-ms")
                record.queue_ms = float(queue) if queue else None
                retry = response.headers.get("retry-after")
                record.retry_after = float(retry) if retry else None
                counter = TokenEvents()
                async for chunk in response.content.iter_any():
                    at = self.now()
                    record.events += chunk.count(b"data: ")
                    if record.ttft is None and response.status == 200 and b"data: " in chunk:
                        record.ttft = at - record.start
                        meter.first_token(spec.tenant, at, spec.prompt_tokens)
                    if response.status != 200:
                        continue
                    tokens = counter.feed(chunk)
                    if tokens:
                        record.output_tokens += tokens
                        meter.output(spec.tenant, at, tokens)
                        if chunks is not None:
                            chunks.add(at, tokens)
                record.complete = True
        except (aiohttp.ClientError, TimeoutError, OSError):
            record.status = record.status or 0
        finally:
            recorded = self.pending.pop(ident, None) is None
        if not recorded:  # not already recorded by finish_pending
            record.end = self.now()
            self.records.append(record)
        return record


class TokenEvents:
    """Counts the output-token events of one SSE body, read by read (an event may be split
    across reads: its start waits for the next one)."""

    __slots__ = ("_carry",)

    def __init__(self) -> None:
        self._carry = b""

    def feed(self, data: bytes) -> int:
        """The output tokens whose events this read completes."""
        events = (self._carry + data).split(b"\n\n")
        self._carry = events.pop()
        return sum(1 for event in events if _is_token(event))


def _is_token(event: bytes) -> bool:
    """An SSE event that carries one output token (not the role, usage or [DONE] events)."""
    if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
        return False
    if b'"choices":[]' in event:
        return False
    return not (b'"role"' in event and b'"content":""' in event)


async def closed_loop(
    load: Load,
    make: Callable[[int], Spec],
    concurrency: int,
    until: float,
    *,
    ramp_s: float = 0.0,
    seed: int = 0,
    stop: asyncio.Event | None = None,
    finish: bool = False,
) -> None:
    """`concurrency` clients, each sending its next request when the last one ends, until
    `until` (run time) or `stop` is set, then cut; with `finish`, no new request after `until`
    but the ones in flight end (latency runs). A 429 is retried after its Retry-After,
    with exponential backoff and jitter while 429s repeat (as OpenAI's SDKs do)."""
    rng = random.Random(seed)
    counter = 0
    tenants: set[str] = set()

    async def client(index: int) -> None:
        nonlocal counter
        await asyncio.sleep(ramp_s * index / max(1, concurrency))
        rejected = 0
        while load.now() < until:
            counter += 1
            spec = make(counter)
            tenants.add(spec.tenant)
            record = await load.send(spec)
            if record.status == 429:
                rejected += 1
                base = max(record.retry_after or 1.0, min(8.0, 0.5 * 2 ** (rejected - 1)))
                await asyncio.sleep(base * rng.uniform(0.5, 1.5))
            elif record.status != 200:
                rejected = 0
                await asyncio.sleep(0.1)
            else:
                rejected = 0

    clients = [client(i) for i in range(concurrency)]
    if finish:
        await asyncio.gather(*clients)
    else:
        await _run_until(clients, load, until, stop, tenants)


async def open_loop(
    load: Load,
    make: Callable[[int], Spec],
    rate_per_s: float,
    until: float,
    *,
    seed: int = 0,
    start: float = 0.0,
    grace_s: float = 0.0,
) -> None:
    """Poisson arrivals at `rate_per_s` from `start` to `until` (run time), whatever the
    answers. Then requests still before their first token get up to `grace_s` more; those
    still without one are recorded as censored, and everything still running is cut."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Record]] = []
    tenants: set[str] = set()
    at = start
    index = 0
    try:
        while True:
            at += rng.expovariate(rate_per_s)
            if at >= until:
                break
            delay = at - load.now()
            if delay > 0:
                await asyncio.sleep(delay)
            index += 1
            spec = make(index)
            tenants.add(spec.tenant)
            tasks.append(asyncio.create_task(load.send(spec)))
        remaining = until - load.now()
        if remaining > 0:
            await asyncio.sleep(remaining)
        for tenant in tenants:
            await wait_first_tokens(load, tenant, grace_s)
            load.finish_pending(tenant)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_until(
    coroutines: Sequence[Awaitable[None]],
    load: Load,
    until: float,
    stop: asyncio.Event | None,
    tenants: set[str],
) -> None:
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    stopper = asyncio.ensure_future(stop.wait() if stop is not None else asyncio.Event().wait())
    try:
        remaining = until - load.now()
        if remaining > 0:
            await asyncio.wait(
                [*tasks, stopper], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        for tenant in tenants:
            load.finish_pending(tenant)
    finally:
        stopper.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_first_tokens(load: Load, tenant: str, grace_s: float) -> None:
    """Give a tenant's requests still before their first token up to `grace_s` to get it."""
    deadline = load.now() + grace_s
    while load.now() < deadline:
        if not any(r.tenant == tenant and r.ttft is None for r in load.pending.values()):
            return
        await asyncio.sleep(0.05)


def summarize(records: Sequence[Record], elapsed_s: float) -> dict[str, float]:
    """Requests, answered ones, their rate, first-chunk P50/P99, mean latency, SSE events and
    output tokens/s (an answered request delivers its `max_tokens`: the load sets `ignore_eos`)."""
    ok = [r for r in records if r.status == 200]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return {
        "requests": float(len(records)),
        "ok": float(len(ok)),
        "rps": len(ok) / elapsed_s if elapsed_s > 0 else math.nan,
        "ttfb_p50_ms": percentile(ttft, 50) * 1000,
        "ttfb_p99_ms": percentile(ttft, 99) * 1000,
        "latency_mean_ms": statistics.fmean(r.end - r.start for r in ok) * 1000 if ok else math.nan,
        "chunks": float(sum(r.events for r in ok)),
        "output_tokens_per_s": sum(r.max_tokens for r in ok) / elapsed_s if elapsed_s else 0.0,
    }
