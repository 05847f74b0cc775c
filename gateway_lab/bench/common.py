"""Shared pieces of the tenant benchmarks (noisy-neighbour, token-fairness, tiers).

* Stacks on loopback: emulated engines started once per scenario (`engine_set`), and per arm
  the real Envoy either straight to them ("direct", FIFO inside the engine) or through the
  ext_proc service ("service"), `gateway_stack`.
* The service is the ordinary `extproc serve`; the capacity a benchmark asks for (adaptive
  limits, headroom) goes into the policy's pool fields (`CapacityConfig.apply`).
* A streaming load generator that records, per request, the time of the first SSE data chunk
  and counts tokens as chunks arrive (`Meter`: tokens and weighted service per tenant in time
  bins), closed loops that honour `Retry-After`, Poisson open loops with a hard stop.
* Statistics and small output helpers: percentiles, Jain's index, progress lines, JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
from ruamel.yaml import YAML

from extproc.policy import Policy, policy_from_text
from extproc.scheduler.adaptive import AdaptiveSettings
from gateway_lab.bench.loadgen import percentile
from gateway_lab.bench.stack import engine_children, free_port, front_children, start_all
from gateway_lab.engine.tokens import MESSAGE_OVERHEAD_TOKENS
from gateway_lab.processes import Stack

PROFILE = "a100-llama3-8b"
_IDLE_WAIT_S = 15.0


def log(scenario: str, message: str) -> None:
    """A progress line on stderr (stdout carries the table)."""
    print(f"[{scenario}] {message}", file=sys.stderr, flush=True)


# --- capacity the benchmark asks the service for -------------------------------------------------


@dataclass(frozen=True)
class CapacityConfig:
    """Per pool: adaptive settings (soft limit follows the engines) and/or static headroom."""

    adaptive: Mapping[str, AdaptiveSettings] = field(default_factory=dict)
    headroom: Mapping[str, int] = field(default_factory=dict)
    """Static pools: requests reserved above `max_inflight - headroom` for tenants below
    their fair share."""

    def to_json(self) -> dict[str, Any]:
        return {
            "adaptive": {name: asdict(s) for name, s in self.adaptive.items()},
            "headroom": dict(self.headroom),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CapacityConfig:
        return cls(
            adaptive={
                name: AdaptiveSettings.from_mapping(values)
                for name, values in (data.get("adaptive") or {}).items()
            },
            headroom={name: int(v) for name, v in (data.get("headroom") or {}).items()},
        )

    def apply(self, policy_text: str) -> str:
        """The policy with these settings in its pools' `adaptive` and `headroom` fields
        (returned as JSON, which is YAML too)."""
        policy = YAML(typ="safe").load(policy_text)
        pools = policy["pools"]
        for name, settings in self.adaptive.items():
            pools[name]["adaptive"] = {
                "min_inflight": settings.min_inflight,
                "initial_inflight": settings.initial_inflight,
                "target_waiting": settings.target_waiting,
                "kv_target": settings.kv_target,
                "increase": settings.increase,
                "decrease": settings.decrease,
                "cooldown": settings.cooldown_s,
                "smoothing": settings.smoothing,
                "poll_interval": settings.poll_interval_s,
            }
            pools[name]["headroom"] = settings.headroom
        for name, headroom in self.headroom.items():
            pools[name]["headroom"] = headroom
        return orjson.dumps(policy, option=orjson.OPT_INDENT_2).decode()


# --- stacks --------------------------------------------------------------------------------------


@dataclass
class EngineSet:
    """Emulated engines, one per endpoint, by pool."""

    endpoints: dict[str, list[str]]
    stack: Stack

    def all(self) -> list[str]:
        return [e for endpoints in self.endpoints.values() for e in endpoints]


@contextlib.contextmanager
def engine_set(
    workdir: Path,
    pools: Mapping[str, int],
    profile: str = PROFILE,
    engine_args: Sequence[str] = (),
) -> Iterator[EngineSet]:
    """Start `pools[name]` engines for each pool; stop them on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    endpoints = {
        name: [f"127.0.0.1:{free_port()}" for _ in range(count)] for name, count in pools.items()
    }
    stack = Stack()
    children, checks = engine_children(workdir, endpoints, profile, tuple(engine_args))
    stack.children.extend(children)
    try:
        start_all(stack, checks)
        yield EngineSet(endpoints, stack)
    finally:
        stack.stop()


@dataclass
class Gateway:
    """One arm's Envoy (and service): where to send requests."""

    arm: str
    base_url: str
    admin_url: str | None
    policy: Policy
    stack: Stack

    @property
    def url(self) -> str:
        return self.base_url + "/v1/chat/completions"


PATHS = ("direct", "service")


@contextlib.contextmanager
def gateway_stack(
    workdir: Path,
    engines: EngineSet,
    policy_text: str,
    path: str,
    capacity: CapacityConfig | None = None,
) -> Iterator[Gateway]:
    """Envoy straight to the engines (`path="direct"`) or through `extproc serve`
    (`"service"`, with `capacity` written into the policy), on fresh loopback ports."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}")
    workdir.mkdir(parents=True, exist_ok=True)
    if path == "service" and capacity is not None:
        policy_text = capacity.apply(policy_text)
    policy_path = workdir / "policy.yaml"
    policy_path.write_text(policy_text)
    policy = policy_from_text(policy_text, str(policy_path))
    front = front_children(
        workdir, policy_path, policy, "extproc" if path == "service" else "straight"
    )
    stack = Stack()
    stack.children.extend(front.children)
    try:
        start_all(stack, front.checks)
        yield Gateway(
            arm=path,
            base_url=front.base_url,
            admin_url=front.admin_url,
            policy=policy,
            stack=stack,
        )
    finally:
        stack.stop()


async def wait_engines_idle(endpoints: Sequence[str], timeout_s: float = _IDLE_WAIT_S) -> bool:
    """Wait until no engine runs or queues a request (the previous arm's work is gone)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while time.monotonic() < deadline:
            readings = await asyncio.gather(*(engine_reading(session, e) for e in endpoints))
            if all(r is not None and r["running"] == 0 and r["waiting"] == 0 for r in readings):
                return True
            await asyncio.sleep(0.2)
    return False


async def engine_reading(session: aiohttp.ClientSession, endpoint: str) -> dict[str, float] | None:
    from extproc.service.engine_metrics import parse_engine_metrics

    try:
        async with session.get(f"http://{endpoint}/metrics") as response:
            reading = parse_engine_metrics(await response.text())
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    if reading is None:
        return None
    return {"waiting": reading.waiting, "running": reading.running, "kv": reading.kv_usage}


# --- requests ------------------------------------------------------------------------------------

_WORDS: tuple[str, ...] = (
    "art", "bay", "cab", "dew", "elk", "fig", "gem", "hut", "ink", "jar",
    "kit", "lid", "mud", "nut", "oak", "pen", "quo", "rug", "sap", "tin",
    "urn", "van", "wax", "yak", "zip", "arc", "bee", "cod", "dye", "eel",
)  # fmt: skip


def prompt_text(tokens: int, rng: random.Random) -> str:
    """A chat message the emulated engine counts as exactly `tokens` prompt tokens
    (4 per message + one per 4 bytes: every word here is 4 bytes with its space)."""
    words = max(1, tokens - MESSAGE_OVERHEAD_TOKENS)
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text + " "


@dataclass(frozen=True, slots=True)
class Spec:
    tenant: str
    key: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    headers: Mapping[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "model": "bench",
                "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )


@dataclass(slots=True)
class Record:
    """One request, times in seconds since the run's start."""

    tenant: str
    start: float
    status: int
    ttft: float | None
    """First SSE data chunk after the start (None: none arrived)."""
    end: float
    prompt_tokens: int
    output_tokens: int
    queue_ms: float | None
    max_tokens: int = 0
    retry_after: float | None = None
    complete: bool = False
    """The response ended normally (not cut by the end of the run)."""
    censored: bool = False
    """Cut by the end of the run before its first token: `ttft` is a lower bound."""

    def as_row(self) -> list[Any]:
        return [
            self.tenant,
            round(self.start, 4),
            self.status,
            None if self.ttft is None else round(self.ttft, 5),
            round(self.end, 4),
            self.prompt_tokens,
            self.output_tokens,
            self.queue_ms,
            self.max_tokens,
            self.complete,
            self.censored,
        ]


RECORD_COLUMNS = [
    "tenant", "start_s", "status", "ttft_s", "end_s", "prompt_tokens", "output_tokens",
    "queue_ms", "max_tokens", "complete", "censored",
]  # fmt: skip


class Meter:
    """Per tenant, in time bins: output tokens received and weighted service
    (input_weight * prompt tokens at the first token, output_weight per output token)."""

    def __init__(self, bin_s: float, input_weight: float = 1.0, output_weight: float = 2.0):
        self.bin_s = bin_s
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tokens: dict[str, dict[int, float]] = {}
        self.service: dict[str, dict[int, float]] = {}

    def _add(
        self, table: dict[str, dict[int, float]], tenant: str, at: float, value: float
    ) -> None:
        bins = table.setdefault(tenant, {})
        index = int(at // self.bin_s)
        bins[index] = bins.get(index, 0.0) + value

    def first_token(self, tenant: str, at: float, prompt_tokens: int) -> None:
        self._add(self.service, tenant, at, self.input_weight * prompt_tokens)

    def output(self, tenant: str, at: float, tokens: int) -> None:
        self._add(self.tokens, tenant, at, float(tokens))
        self._add(self.service, tenant, at, self.output_weight * tokens)

    def total(self, tenant: str, start: float, end: float, *, service: bool = False) -> float:
        bins = (self.service if service else self.tokens).get(tenant, {})
        first, last = int(start // self.bin_s), math.ceil(end / self.bin_s)
        return sum(v for i, v in bins.items() if first <= i < last)

    def rate(self, tenant: str, start: float, end: float, *, service: bool = False) -> float:
        return self.total(tenant, start, end, service=service) / max(1e-9, end - start)

    def series(self, tenant: str, end: float, *, service: bool = False) -> list[float]:
        """Per-bin values from 0 to `end` (for plots and the JSON)."""
        bins = (self.service if service else self.tokens).get(tenant, {})
        return [round(bins.get(i, 0.0), 2) for i in range(math.ceil(end / self.bin_s))]

    def tenants(self) -> list[str]:
        return sorted(set(self.tokens) | set(self.service))


class Load:
    """Sends streamed chat requests through one gateway and records them."""

    def __init__(self, url: str, meter: Meter, t0: float | None = None) -> None:
        self.url = url
        self.meter = meter
        self.t0 = time.perf_counter() if t0 is None else t0
        self.records: list[Record] = []
        self.pending: dict[int, Record] = {}
        self.sent: dict[str, int] = {}
        self._ids = 0
        self._session: aiohttp.ClientSession | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def __aenter__(self) -> Load:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

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
        self.pending[ident] = record
        self.sent[spec.tenant] = self.sent.get(spec.tenant, 0) + 1
        try:
            async with self._session.post(self.url, data=spec.body(), headers=headers) as response:
                record.status = response.status
                queue = response.headers.get("x-gateway-queue-ms")
                record.queue_ms = float(queue) if queue else None
                retry = response.headers.get("retry-after")
                record.retry_after = float(retry) if retry else None
                carry = b""
                async for chunk in response.content.iter_any():
                    at = self.now()
                    if record.ttft is None and response.status == 200 and b"data: " in chunk:
                        record.ttft = at - record.start
                        meter.first_token(spec.tenant, at, spec.prompt_tokens)
                    if response.status != 200:
                        continue
                    events = (carry + chunk).split(b"\n\n")
                    carry = events.pop()
                    tokens = sum(1 for event in events if _is_token(event))
                    if tokens:
                        record.output_tokens += tokens
                        meter.output(spec.tenant, at, tokens)
                record.complete = True
        except (aiohttp.ClientError, TimeoutError, OSError):
            record.status = record.status or 0
        finally:
            recorded = self.pending.pop(ident, None) is None
        if not recorded:  # not already recorded by finish_pending
            record.end = self.now()
            self.records.append(record)
        return record


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
) -> None:
    """`concurrency` clients, each sending its next request when the last one ends, until
    `until` (run time) or `stop` is set, then cut. A 429 is retried after its Retry-After,
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

    await _run_until([client(i) for i in range(concurrency)], load, until, stop, tenants)


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


# --- monitoring ----------------------------------------------------------------------------------


class Monitor:
    """Samples the engines' queue and batch (and the gateway's limit) every `interval_s`."""

    def __init__(
        self, load: Load, engines: Sequence[str], admin_url: str | None, interval_s: float = 0.5
    ):
        self.load = load
        self.engines = list(engines)
        self.admin_url = admin_url
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []

    async def run(self, until: float) -> None:
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while self.load.now() < until:
                at = self.load.now()
                readings = await asyncio.gather(*(engine_reading(session, e) for e in self.engines))
                found = [r for r in readings if r is not None]
                sample: dict[str, Any] = {
                    "t": round(at, 3),
                    "waiting": sum(r["waiting"] for r in found),
                    "running": sum(r["running"] for r in found),
                    "kv": max((r["kv"] for r in found), default=0.0),
                }
                if self.admin_url is not None:
                    sample.update(await self._gateway(session))
                self.samples.append(sample)
                await asyncio.sleep(max(0.0, self.interval_s - (self.load.now() - at)))

    async def _gateway(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        try:
            async with session.get(f"{self.admin_url}/v1/tenants") as response:
                data = await response.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return {}
        pools = data.get("pools", {})
        return {
            "limit": {name: p.get("max_inflight") for name, p in pools.items()},
            "inflight": {name: p.get("inflight") for name, p in pools.items()},
            "queued": {name: p.get("queued") for name, p in pools.items()},
        }


async def progress(scenario: str, arm: str, load: Load, until: float, every_s: float = 5.0) -> None:
    """A progress line every `every_s`: time, requests answered and tokens/s per tenant."""
    last = 0.0
    while load.now() < until:
        await asyncio.sleep(min(every_s, max(0.05, until - load.now())))
        now = load.now()
        parts = []
        for tenant in sorted(load.sent):
            done = [r for r in load.records if r.tenant == tenant and r.status == 200]
            rate = load.meter.rate(tenant, last, now)
            parts.append(f"{tenant} {len(done)}/{load.sent[tenant]} ok {rate:.0f} tok/s")
        log(scenario, f"{arm}: {now:5.1f}/{until:.0f}s  " + "; ".join(parts))
        last = now


# --- statistics ----------------------------------------------------------------------------------


def ttft_stats(records: Sequence[Record]) -> dict[str, Any]:
    """P50/P90/P99/max of the first-chunk times (ms) of the answered (and censored) ones."""
    values = [r.ttft for r in records if r.ttft is not None and (r.status == 200 or r.censored)]
    censored = sum(1 for r in records if r.censored)
    return {
        "count": len(values),
        "censored": censored,
        "p50_ms": percentile(values, 50) * 1000.0,
        "p90_ms": percentile(values, 90) * 1000.0,
        "p99_ms": percentile(values, 99) * 1000.0,
        "max_ms": max(values) * 1000.0 if values else math.nan,
        "mean_ms": sum(values) / len(values) * 1000.0 if values else math.nan,
    }


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    if not values or all(v == 0 for v in values):
        return math.nan
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def status_counts(records: Sequence[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        key = str(record.status)
        counts[key] = counts.get(key, 0) + 1
    return counts


def within(records: Sequence[Record], tenant: str, start: float, end: float) -> list[Record]:
    return [r for r in records if r.tenant == tenant and start <= r.start < end]


def fmt(value: float, digits: int = 1) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (f"{value:.{digits}f}")
    )


def add_scenario_arguments(
    parser: argparse.ArgumentParser, default_out: Path, measure_help: str
) -> None:
    """The flags every tenant scenario takes (its own knobs follow)."""
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--workdir", type=Path, help="logs of the stacks (default: OUT/stacks)")
    parser.add_argument("--measure", type=float, help=measure_help)


TimingT = TypeVar("TimingT")


def chosen_timing(args: argparse.Namespace, default: TimingT, quick: TimingT) -> TimingT:
    """A scenario's timing from its flags: `--quick` for the short one, `--measure S` to
    change the measured seconds per arm."""
    timing = quick if args.quick else default
    if args.measure:
        timing = replace(timing, measure_s=args.measure)  # type: ignore[type-var]
    return timing


def save_figure(fig: Any, path: Path, dpi: int = 90) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def save_results(
    out: Path,
    report: Any,
    figure: str,
    draw: Callable[[Path], None],
    table: Callable[[], None],
) -> None:
    """Write `results.json` and the plot under `out`, print the table and where they are."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", report)
    draw(out / figure)
    table()
    print(f"\nresults: {out / 'results.json'}, plot: {out / figure}")


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_async(coroutine: Awaitable[Any]) -> Any:
    """asyncio.run with uvloop when available (the load generator is CPU-bound)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_as_coroutine(coroutine))
    return uvloop.run(_as_coroutine(coroutine))


async def _as_coroutine(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
