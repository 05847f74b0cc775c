"""Poll the engines' `/metrics` and feed the pools' adaptive capacity (the asyncio side).

Every `poll_interval` the watcher scrapes each endpoint of every pool whose capacity is
adaptive, sums `vllm:num_requests_waiting` and `vllm:num_requests_running`, takes the largest
`vllm:kv_cache_usage_perc` (vLLM V1; `vllm:gpu_cache_usage_perc` on older servers), and hands
the pool one `EngineSample`. When a soft limit changes it calls `on_change` (the admission
controller's `pump`), since a larger limit can admit queued requests at once. An endpoint that
does not answer in time is left out of the sample; a pool none of whose engines answered gets
no sample, and its limit stays where it was.

The pure controller is `extproc.scheduler.adaptive`; this module only does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from extproc.scheduler.adaptive import EngineCapacities, EngineSample
from extproc.scheduler.clock import Clock

log = logging.getLogger("extproc.engine_watch")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
_WANTED = (WAITING, RUNNING, *KV_USAGE, PROMPT_TOKENS, GENERATION_TOKENS)


@dataclass(frozen=True, slots=True)
class EngineReading:
    """The figures of one engine's /metrics page this service uses."""

    waiting: float
    running: float
    kv_usage: float
    prompt_tokens: float = 0.0
    """Counter: prompt tokens of every request the engine prefilled (aborted ones too)."""
    generation_tokens: float = 0.0
    """Counter: every token the engine generated (aborted requests' too)."""

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0


def parse_engine_metrics(text: str) -> EngineReading | None:
    """Read the gauges from a Prometheus text page (summed over label sets); None if the
    page has none of them (not a vLLM engine)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in _WANTED:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]
        parts = rest.split()
        try:
            value = float(parts[0])
        except (ValueError, IndexError):
            continue
        if name in KV_USAGE:
            values[name] = max(values.get(name, 0.0), value)
        else:
            values[name] = values.get(name, 0.0) + value
    if not any(name in values for name in _WANTED):
        return None
    kv = next((values[name] for name in KV_USAGE if name in values), 0.0)
    return EngineReading(
        values.get(WAITING, 0.0),
        values.get(RUNNING, 0.0),
        kv,
        values.get(PROMPT_TOKENS, 0.0),
        values.get(GENERATION_TOKENS, 0.0),
    )


def pool_sample(at: float, readings: Sequence[EngineReading]) -> EngineSample | None:
    if not readings:
        return None
    return EngineSample(
        at=at,
        waiting=sum(r.waiting for r in readings),
        running=sum(r.running for r in readings),
        kv_usage=max(r.kv_usage for r in readings),
        engines=len(readings),
    )


async def read_engine(session: aiohttp.ClientSession, endpoint: str) -> EngineReading | None:
    """Scrape one engine's /metrics; None if it does not answer in time or is not vLLM."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    try:
        async with session.get(url.rstrip("/") + "/metrics") as response:
            if response.status != 200:
                return None
            return parse_engine_metrics(await response.text())
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def stop_poller(
    task: asyncio.Task[None] | None, session: aiohttp.ClientSession | None
) -> None:
    """Cancel a background polling task and close its HTTP session."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if session is not None:
        await session.close()


Endpoints = Callable[[], Mapping[str, Sequence[str]]]
"""Pool name -> its engine endpoints (host:port), read at every poll (policy reloads)."""


class EngineWatcher:
    def __init__(
        self,
        capacities: EngineCapacities,
        endpoints: Endpoints,
        clock: Clock,
        on_change: Callable[[], None],
        *,
        interval_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.capacities = capacities
        self.endpoints = endpoints
        self.clock = clock
        self.on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.polls = 0
        self.failures = 0
        self.last: dict[str, EngineSample] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def interval(self) -> float:
        return self.interval_s or self.capacities.poll_interval_s()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        session, self._session = self._session, None
        await stop_poller(task, session)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching; one bad poll must not stop the limits moving
                log.exception("engine metrics poll failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s or max(0.5, 3 * self.interval))
            self._session = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def _read(self, endpoint: str) -> EngineReading | None:
        return await read_engine(self._client(), endpoint)

    async def poll_once(self) -> dict[str, EngineSample]:
        """Scrape every adaptive pool's engines once and feed the samples."""
        pools = {
            name: list(endpoints)
            for name, endpoints in self.endpoints().items()
            if name in self.capacities.adaptive
        }
        if not pools:
            return {}
        targets = [(name, endpoint) for name, endpoints in pools.items() for endpoint in endpoints]
        readings = await asyncio.gather(*(self._read(endpoint) for _, endpoint in targets))
        by_pool: dict[str, list[EngineReading]] = {name: [] for name in pools}
        for (name, _endpoint), reading in zip(targets, readings, strict=True):
            if reading is None:
                self.failures += 1
            else:
                by_pool[name].append(reading)
        self.polls += 1
        now = self.clock.now()
        changed = False
        samples: dict[str, EngineSample] = {}
        for name, found in by_pool.items():
            sample = pool_sample(now, found)
            if sample is None:
                continue
            samples[name] = sample
            self.last[name] = sample
            changed = self.capacities.observe(name, sample) or changed
        if changed:
            self.on_change()
        return samples
