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

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.endpoints import EndpointClass
from extproc.service.engine_metrics import EngineReading
from extproc.service.engine_poller import EnginePoller, Readings

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
    endpoint: EndpointClass = "chat"
    """Its endpoint class: a correction moves that class's token bucket too."""
    fair_exempt: bool = False
    """It was outside the fair share (admitted through the headroom): so is its correction."""


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

    def sole_engine(self, pool: str) -> str | None:
        """The pool's engine when it has exactly one, with a base: the one that served any of
        the pool's requests, even one whose response never named it, and can correct it."""
        endpoints = [endpoint for endpoint, engine in self.engines.items() if engine.pool == pool]
        if len(endpoints) != 1 or self.engines[endpoints[0]].base_prompt is None:
            return None
        return endpoints[0]

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
    """Reads engines at quiet moments and hands the ledger's corrections to the gateway (a
    subscriber of the engine poller)."""

    def __init__(
        self,
        ledger: EngineLedger,
        hooks: ReconcileHooks,
        poller: EnginePoller,
        *,
        settle_delay_s: float = 0.2,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.ledger = ledger
        self.hooks = hooks
        self.poller = poller
        self.settle_delay_s = settle_delay_s
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._next_at = 0.0
        self._reading: dict[str, str] = {}
        """Endpoint -> pool of the engines being read (between `wanted` and `deliver`)."""
        self._admissions_seen = 0

    def start(self) -> None:
        self._schedule()
        self.poller.subscribe(self)

    def wake(self) -> None:
        """A pool went idle with corrections due: look soon."""
        self._next_at = min(self._next_at, time.monotonic() + self.settle_delay_s)
        self.poller.reschedule()

    def _schedule(self) -> None:
        # Every look waits the settle delay first, to let the engines see the aborts of
        # streams that just ended. Corrections still due are retried at once; an engine
        # without a base is looked at often: until it has one, its cut-short streams cannot
        # be corrected.
        if self.ledger.pending():
            wait = 0.0
        elif any(e.base_prompt is None for e in self.ledger.engines.values()):
            wait = self.settle_delay_s
        else:
            wait = self.interval_s
        self._next_at = time.monotonic() + wait + self.settle_delay_s

    def due_in(self) -> float:
        return self._next_at - time.monotonic()

    def wanted(self) -> dict[str, float]:
        """Give up what waited too long, then: every engine that needs a reading whose pool
        is idle."""
        self._schedule()  # if no delivery follows, look again as usual
        for item in self.ledger.expire(self.hooks.now()):
            self.hooks.give_up(item)
        self._reading = {
            endpoint: pool for endpoint, pool in self.ledger.wanted() if self.hooks.pool_idle(pool)
        }
        self._admissions_seen = self.hooks.admissions()
        return dict.fromkeys(self._reading, self.timeout_s)

    def deliver(self, readings: Readings) -> int:
        """Balance the engines that were idle throughout; returns corrections applied."""
        reading_pools, self._reading = self._reading, {}
        applied = 0
        for endpoint, pool in reading_pools.items():
            reading = readings.get(endpoint)
            if reading is None or not reading.idle:
                continue
            if self.hooks.admissions() != self._admissions_seen or not self.hooks.pool_idle(pool):
                continue  # a request started meanwhile: the reading may not match the books
            for correction in self.ledger.balance(endpoint, reading):
                self.hooks.apply(correction)
                applied += 1
        self._schedule()
        return applied

    async def run_once(self) -> int:
        """Read every engine that needs it whose pool is idle, now; returns corrections applied.
        For before `start`: once subscribed, the poller's ticks feed it."""
        return self.deliver(await self.poller.read(self.wanted()))
