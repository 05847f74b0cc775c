"""Exact counts for streams cut short, from the engines' own token counters.

A completed response ends with the engine's usage, so the gateway knows it exactly. A stream
cut short (the client left, the upstream reset) never gets one: the gateway charges at once
what it saw (the prompt at its estimate, the output deltas that passed Envoy), but the engine
may have prefilled a different number of prompt tokens and generated a few more tokens before
it noticed the abort. vLLM reports those only in its counters, `vllm:prompt_tokens_total` and
`vllm:generation_tokens_total`, which count every request, aborted ones included.

So per engine (Envoy tells the accounting stream which one served a request, in the
`x-gateway-upstream` response header) the ledger keeps what this process counted since a
moment when engine and pool were both idle (the base). At the next such moment, the engine's
counters have moved by exactly what every request since the base used; minus the usage of the
completed ones, the rest belongs to the requests cut short in between. Those charges are then
corrected (bucket, fair share, `extproc_tokens_total`): exactly when they all belong to one
tenant, split in proportion to what each was charged otherwise.

This needs the process to be its engines' only client: with shared state (several processes)
it is off, and a residual nobody here can own (another client used the engine) switches the
engine's reconciliation off until the next base, with a warning. A correction that does not
come within `max_wait_s` (the engine never idle) is given up: the provisional charge stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from extproc.service.engine_watch import EngineReading, read_engine, stop_poller

log = logging.getLogger("extproc.reconcile")


@dataclass(frozen=True, slots=True)
class CutShort:
    """A request that ended without usage, as provisionally charged."""

    request_id: str
    tenant: str
    pool: str
    input_tokens: int
    output_tokens: int
    at: float


@dataclass(frozen=True, slots=True)
class Correction:
    """The final count of a cut-short request (input and output tokens)."""

    item: CutShort
    input_tokens: int
    output_tokens: int


@dataclass
class _Engine:
    pool: str
    base_prompt: float | None = None
    base_generation: float = 0.0
    counted_input: int = 0
    counted_output: int = 0
    pending: list[CutShort] = field(default_factory=list)


class EngineLedger:
    """Pure bookkeeping; `Reconciler` feeds it engine readings at quiet moments."""

    def __init__(self, max_wait_s: float = 30.0) -> None:
        self.max_wait_s = max_wait_s
        self.engines: dict[str, _Engine] = {}
        self.corrected = 0
        self.given_up = 0
        self.unattributed_tokens = 0

    def _engine(self, endpoint: str, pool: str) -> _Engine:
        engine = self.engines.get(endpoint)
        if engine is None:
            engine = self.engines[endpoint] = _Engine(pool)
        return engine

    def track(self, endpoint: str, pool: str) -> None:
        """Know an engine before its first request, so its base is taken at the first quiet
        moment (Envoy names engines host:port by address: only such endpoints match)."""
        self._engine(endpoint, pool)

    def completed(self, endpoint: str, pool: str, input_tokens: int, output_tokens: int) -> None:
        """A response ended with the engine's usage."""
        engine = self._engine(endpoint, pool)
        engine.counted_input += input_tokens
        engine.counted_output += output_tokens

    def cut_short(self, endpoint: str, item: CutShort) -> bool:
        """Hold a provisional charge for correction; False if this engine has no base yet
        (the charge then stands as it is)."""
        engine = self._engine(endpoint, item.pool)
        if engine.base_prompt is None:
            return False
        engine.counted_input += item.input_tokens
        engine.counted_output += item.output_tokens
        engine.pending.append(item)
        return True

    def wanted(self) -> list[tuple[str, str]]:
        """(endpoint, pool) of every engine that needs a reading: no base, or corrections due."""
        return [
            (endpoint, engine.pool)
            for endpoint, engine in self.engines.items()
            if engine.base_prompt is None or engine.pending
        ]

    def pending(self) -> int:
        return sum(len(engine.pending) for engine in self.engines.values())

    def balance(self, endpoint: str, reading: EngineReading) -> list[Correction]:
        """The engine and its pool are idle: settle what happened since the base, rebase."""
        engine = self.engines[endpoint]
        corrections: list[Correction] = []
        if engine.base_prompt is not None:
            residual_in = round(reading.prompt_tokens - engine.base_prompt) - engine.counted_input
            residual_out = (
                round(reading.generation_tokens - engine.base_generation) - engine.counted_output
            )
            if engine.pending:
                corrections = _share(engine.pending, residual_in, residual_out)
                self.corrected += len(corrections)
            elif residual_in or residual_out:
                self.unattributed_tokens += abs(residual_in) + abs(residual_out)
                log.warning(
                    "engine %s used %d prompt and %d output tokens this process did not "
                    "route: another client shares it, so cut-short streams on it are "
                    "charged as seen",
                    endpoint, residual_in, residual_out,
                )  # fmt: skip
        engine.base_prompt = reading.prompt_tokens
        engine.base_generation = reading.generation_tokens
        engine.counted_input = engine.counted_output = 0
        engine.pending = []
        return corrections

    def expire(self, now: float) -> list[CutShort]:
        """Pending charges older than `max_wait_s`: given up (they stand as charged). Their
        engine loses its base, since its counted totals no longer match its counters."""
        expired: list[CutShort] = []
        for engine in self.engines.values():
            if engine.pending and now - engine.pending[0].at > self.max_wait_s:
                expired.extend(engine.pending)
                engine.pending = []
                engine.base_prompt = None
                engine.counted_input = engine.counted_output = 0
        self.given_up += len(expired)
        return expired


def _share(items: list[CutShort], residual_in: int, residual_out: int) -> list[Correction]:
    """Split the residuals over the cut-short requests, in proportion to their charges (the
    largest remainder method, so the parts add up exactly); no count goes below zero."""
    ins = _apportion([item.input_tokens for item in items], residual_in)
    outs = _apportion([item.output_tokens for item in items], residual_out)
    return [
        Correction(item, max(0, item.input_tokens + extra_in), max(0, item.output_tokens + extra))
        for item, extra_in, extra in zip(items, ins, outs, strict=True)
    ]


def _apportion(weights: list[int], total: int) -> list[int]:
    if not weights:
        return []
    mass = sum(weights)
    shares = (
        [total * w / mass for w in weights] if mass > 0 else [total / len(weights)] * len(weights)
    )
    parts = [math.floor(share) for share in shares]
    left = total - sum(parts)
    order = sorted(range(len(weights)), key=lambda i: parts[i] - shares[i])
    for i in order[:left]:
        parts[i] += 1
    return parts


@dataclass(frozen=True)
class ReconcileHooks:
    """What the reconciler needs from the gateway."""

    pool_idle: Callable[[str], bool]
    """No request of this process admitted to the pool is still open."""
    admissions: Callable[[], int]
    """A counter of admissions so far (a reading taken while it moved is discarded)."""
    apply: Callable[[Correction], None]
    give_up: Callable[[CutShort], None]
    now: Callable[[], float]


class Reconciler:
    """Reads engines at quiet moments and hands the ledger's corrections to the gateway."""

    def __init__(
        self,
        ledger: EngineLedger,
        hooks: ReconcileHooks,
        *,
        settle_delay_s: float = 0.2,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.ledger = ledger
        self.hooks = hooks
        self.settle_delay_s = settle_delay_s
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="reconcile")

    def wake(self) -> None:
        """A pool went idle with corrections due: look soon."""
        self._wake.set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        session, self._session = self._session, None
        await stop_poller(task, session)

    async def _run(self) -> None:
        while True:
            # An engine without a base is looked at often: until it has one, its cut-short
            # streams cannot be corrected.
            missing = any(e.base_prompt is None for e in self.ledger.engines.values())
            interval = self.settle_delay_s if missing else self.interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()
            try:
                # Let the engines see the aborts of streams that just ended.
                await asyncio.sleep(self.settle_delay_s)
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed pass must not stop the corrections
                log.exception("reconciliation pass failed")

    async def run_once(self) -> int:
        """Read every engine that needs it whose pool is idle; returns corrections applied."""
        for item in self.ledger.expire(self.hooks.now()):
            self.hooks.give_up(item)
        applied = 0
        for endpoint, pool in self.ledger.wanted():
            if not self.hooks.pool_idle(pool):
                continue
            seen = self.hooks.admissions()
            reading = await read_engine(self._client(), endpoint)
            if reading is None or not reading.idle:
                continue
            if self.hooks.admissions() != seen or not self.hooks.pool_idle(pool):
                continue  # a request started meanwhile: the reading may not match the books
            for correction in self.ledger.balance(endpoint, reading):
                self.hooks.apply(correction)
                applied += 1
        if self.ledger.pending():
            self._wake.set()  # still due: try again after the settle delay
        return applied

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session
