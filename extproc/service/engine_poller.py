"""One poller of the engines' Prometheus `/metrics`, shared by everything that reads them.

Two subscribers read the engines: the engine watcher (`extproc.service.engine_watch`) feeds
the pools' adaptive limits every poll interval, and the reconciler (`extproc.service.reconcile`)
reads idle engines' token counters to correct cut-short streams. Each says when it next wants
readings and of which engines. At each tick the poller fetches every engine a due subscriber
wants once, over one HTTP client, and hands each subscriber its readings as soon as its own
engines answered (an engine slow to answer one subscriber does not hold up the other). An
engine that does not answer in time, or is not a vLLM engine, reads as None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

import aiohttp

from extproc.service.engine_metrics import EngineReading, parse_engine_metrics

log = logging.getLogger("extproc.engine_poller")

Readings = Mapping[str, EngineReading | None]
"""Endpoint -> its reading; None: no answer in time, or not a vLLM engine."""


class MetricsSubscriber(Protocol):
    def due_in(self) -> float:
        """Seconds until it wants its next readings (<= 0: now)."""
        ...

    def wanted(self) -> Mapping[str, float]:
        """Called when due, just before the fetch: the endpoints (host:port) to read, each
        with how long to wait for its answer; empty for nothing this time."""
        ...

    def deliver(self, readings: Readings) -> object:
        """The readings of the endpoints its last `wanted` named."""
        ...


class EnginePoller:
    def __init__(self) -> None:
        self._subscribers: list[MetricsSubscriber] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False

    def subscribe(self, subscriber: MetricsSubscriber) -> None:
        """Feed `subscriber` from now on; starts polling (in the running event loop)."""
        if subscriber not in self._subscribers:
            self._subscribers.append(subscriber)
        self.reschedule()
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-poller")

    def unsubscribe(self, subscriber: MetricsSubscriber) -> None:
        """No more readings for `subscriber`, not even from a fetch under way."""
        with contextlib.suppress(ValueError):
            self._subscribers.remove(subscriber)

    def reschedule(self) -> None:
        """A subscriber is due sooner than it said: look at the due times again."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop polling and close the HTTP client: the shutdown of every subscriber."""
        task, self._task = self._task, None
        if task is not None:
            # Python 3.11's wait_for swallows a cancel that lands as the event is set (an
            # unsubscribe just before the stop): the loop then sees the flag and ends.
            self._stopping = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def read(self, wanted: Mapping[str, float]) -> dict[str, EngineReading | None]:
        """Read these endpoints now, outside the ticks (each with its timeout)."""
        readings = await asyncio.gather(*(self._read(e, t) for e, t in wanted.items()))
        return dict(zip(wanted, readings, strict=True))

    async def _run(self) -> None:
        while not self._stopping:
            delay = min((s.due_in() for s in self._subscribers), default=None)
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            await self._tick([s for s in self._subscribers if s.due_in() <= 0])

    async def _tick(self, due: Sequence[MetricsSubscriber]) -> None:
        wants: list[tuple[MetricsSubscriber, Mapping[str, float]]] = []
        for subscriber in due:
            try:
                wants.append((subscriber, subscriber.wanted()))
            except Exception:  # one subscriber's failure must not stop the others' readings
                log.exception("engine metrics subscriber %s failed", type(subscriber).__name__)
        timeouts: dict[str, float] = {}
        for _, wanted in wants:
            for endpoint, timeout_s in wanted.items():
                timeouts[endpoint] = max(timeouts.get(endpoint, 0.0), timeout_s)
        fetches = {e: asyncio.ensure_future(self._read(e, t)) for e, t in timeouts.items()}
        try:
            await asyncio.gather(*(self._feed(s, wanted, fetches) for s, wanted in wants))
        finally:
            for fetch in fetches.values():
                fetch.cancel()  # only still running when this tick was cancelled
            await asyncio.gather(*fetches.values(), return_exceptions=True)

    async def _feed(
        self,
        subscriber: MetricsSubscriber,
        wanted: Mapping[str, float],
        fetches: Mapping[str, asyncio.Future[EngineReading | None]],
    ) -> None:
        try:
            readings = {endpoint: await fetches[endpoint] for endpoint in wanted}
            if subscriber in self._subscribers:
                subscriber.deliver(readings)
        except Exception:
            log.exception("engine metrics subscriber %s failed", type(subscriber).__name__)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _read(self, endpoint: str, timeout_s: float) -> EngineReading | None:
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._client().get(
                url.rstrip("/") + "/metrics", timeout=timeout
            ) as response:
                if response.status != 200:
                    return None
                return parse_engine_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
