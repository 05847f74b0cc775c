"""Watching a benchmark run: the engines' queue and batch (and the gateway's limits) sampled
over time, progress lines, and the wait for the engines to go idle between arms."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway_lab.bench.loadgen import Load
from gateway_lab.progress import Progress

_IDLE_WAIT_S = 15.0


@dataclass(frozen=True)
class ArmProgress:
    """The scenario's progress display (in arms) and the index of the arm that runs."""

    tracker: Progress
    index: int


CURRENT_ARM: ContextVar[ArmProgress | None] = ContextVar("bench_arm_progress", default=None)
"""Set by `scenario.run_scenario` around each arm, so `drive` and `log` need no new argument."""


def log(scenario: str, message: str) -> None:
    """A line on stderr (stdout carries the table), kept above the live progress line."""
    current = CURRENT_ARM.get()
    if current is not None:
        current.tracker.note(f"[{scenario}] {message}")
    else:
        print(f"[{scenario}] {message}", file=sys.stderr, flush=True)


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
            "delta_factor": {name: p.get("delta_factor") for name, p in pools.items()},
            "prefilling": {name: p.get("prefilling_tokens") for name, p in pools.items()},
            "alone_ttft_samples": {
                name: (p.get("alone") or {}).get("ttft_samples") for name, p in pools.items()
            },
        }


async def progress(scenario: str, arm: str, load: Load, until: float, every_s: float = 5.0) -> None:
    """Every `every_s`: time, requests answered and tokens/s per tenant, on the scenario's
    live progress line (with the arm's share of its load done); a line each without one."""
    current = CURRENT_ARM.get()
    last = 0.0
    while load.now() < until:
        step = every_s if current is None else min(every_s, current.tracker.interval_s)
        await asyncio.sleep(min(step, max(0.05, until - load.now())))
        now = load.now()
        parts = []
        for tenant in sorted(load.sent):
            done = [r for r in load.records if r.tenant == tenant and r.status == 200]
            rate = load.meter.rate(tenant, last, now)
            parts.append(f"{tenant} {len(done)}/{load.sent[tenant]} ok {rate:.0f} tok/s")
        line = f"{arm}: {now:5.1f}/{until:.0f}s  " + "; ".join(parts)
        if current is None:
            log(scenario, line)
        else:
            share = min(1.0, now / until) if until > 0 else 1.0
            current.tracker.update(current.index + share, line)
        last = now
