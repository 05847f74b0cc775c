"""Token buckets: pure math, a store interface, an in-memory store, OpenAI-style headers.

A bucket holds `level` units, at most `capacity`, and refills continuously at
`refill_per_second`. Its state is `(level, updated_at)`; every operation first refills to
`now`. The math lives in pure functions so that a Redis store (Lua scripts) can implement the
same `LimitStore` protocol with exactly the same numbers.

A level may go negative: settlement debits real usage above the reserved estimate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

TIME_EPSILON_S = 1e-9
"""A bucket "covers" a cost when it would after at most this long: absorbs float rounding so
that waiting exactly the advertised Retry-After always passes."""


@dataclass(frozen=True, slots=True)
class Bucket:
    key: str
    capacity: float
    refill_per_second: float


@dataclass(frozen=True, slots=True)
class Take:
    bucket: Bucket
    cost: float


@dataclass(frozen=True, slots=True)
class TakeResult:
    ok: bool
    levels: tuple[float, ...]
    """Each bucket's level after the call (after taking, when ok), in the order of the takes."""
    wait_s: float | None
    """0.0 when ok; else seconds until every bucket covers its cost; None when a cost exceeds
    its bucket's capacity (it can never pass)."""


# --- pure functions -----------------------------------------------------------------------------


def refilled(level: float, updated_at: float, bucket: Bucket, now: float) -> float:
    """The level at `now` (never above capacity; time going backwards adds nothing)."""
    if level >= bucket.capacity:
        return bucket.capacity
    elapsed = now - updated_at
    if elapsed <= 0:
        return level
    return min(bucket.capacity, level + elapsed * bucket.refill_per_second)


def wait_seconds(level: float, cost: float, refill_per_second: float) -> float:
    """Seconds until `level` reaches `cost` by refill alone."""
    if level >= cost:
        return 0.0
    return (cost - level) / refill_per_second


def covers(level: float, cost: float, refill_per_second: float) -> bool:
    return wait_seconds(level, cost, refill_per_second) <= TIME_EPSILON_S


def can_ever_cover(cost: float, bucket: Bucket) -> bool:
    return cost <= bucket.capacity


def take_all(levels: Sequence[float], takes: Sequence[Take]) -> TakeResult:
    """All-or-nothing take over already refilled levels."""
    if any(not can_ever_cover(t.cost, t.bucket) for t in takes):
        return TakeResult(False, tuple(levels), None)
    pairs = list(zip(levels, takes, strict=True))
    waits = [wait_seconds(lv, t.cost, t.bucket.refill_per_second) for lv, t in pairs]
    wait = max(waits, default=0.0)
    if wait > TIME_EPSILON_S:
        return TakeResult(False, tuple(levels), wait)
    return TakeResult(True, tuple(lv - t.cost for lv, t in pairs), 0.0)


def given_back(level: float, amount: float, bucket: Bucket) -> float:
    """A refund: never fills a bucket above its capacity."""
    return min(bucket.capacity, level + amount)


def adjusted(level: float, delta: float, bucket: Bucket) -> float:
    """Settlement: positive delta debits (may go below zero), negative refunds (up to full)."""
    return min(bucket.capacity, level - delta)


def seconds_until_full(level: float, bucket: Bucket) -> float:
    return wait_seconds(level, bucket.capacity, bucket.refill_per_second)


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI's x-ratelimit-reset-* headers write it: 20ms, 1.5s, 6m0s."""
    millis = math.ceil(max(0.0, seconds) * 1000.0 - 1e-6)
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = str(rest // 1000) if rest % 1000 == 0 else f"{rest / 1000:.3f}".rstrip("0")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return f"{out}{secs}s"


def ratelimit_headers(limits: Iterable[tuple[str, Bucket, float]]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-<suffix> for each (suffix, bucket, level) given."""
    headers: dict[str, str] = {}
    for suffix, bucket, level in limits:
        headers[f"x-ratelimit-limit-{suffix}"] = limit_value(bucket)
        headers[f"x-ratelimit-remaining-{suffix}"] = remaining_value(level)
        headers[f"x-ratelimit-reset-{suffix}"] = reset_value(level, bucket)
    return headers


def limit_value(bucket: Bucket) -> str:
    """The x-ratelimit-limit-* value."""
    return str(int(bucket.capacity))


def remaining_value(level: float) -> str:
    """The x-ratelimit-remaining-* value."""
    return str(max(0, math.floor(level + 1e-9)))


def reset_value(level: float, bucket: Bucket) -> str:
    """The x-ratelimit-reset-* value."""
    return format_reset(seconds_until_full(level, bucket))


# --- stores -------------------------------------------------------------------------------------


class LimitStore(Protocol):
    """Where bucket state lives. Every method refills to `now` first (see the pure functions)."""

    def try_take(self, takes: Sequence[Take], now: float) -> TakeResult:
        """Take every cost if every bucket covers its cost now, else take nothing."""
        ...

    def give_back(self, bucket: Bucket, amount: float, now: float) -> None:
        """Refund a charge for work that was never served."""
        ...

    def adjust(self, bucket: Bucket, delta: float, now: float) -> None:
        """Settle: replace a reserved estimate by real usage (delta = actual - reserved)."""
        ...

    def level(self, bucket: Bucket, now: float) -> float: ...


class MemoryLimitStore:
    """Bucket state in a dict, for one process (and for tests)."""

    def __init__(self) -> None:
        self._state: dict[str, tuple[float, float]] = {}

    def _level(self, bucket: Bucket, now: float) -> float:
        state = self._state.get(bucket.key)
        if state is None:
            return bucket.capacity
        return refilled(state[0], state[1], bucket, now)

    def _store(self, bucket: Bucket, level: float, now: float) -> None:
        previous = self._state.get(bucket.key)
        at = now if previous is None else max(previous[1], now)
        self._state[bucket.key] = (level, at)

    def try_take(self, takes: Sequence[Take], now: float) -> TakeResult:
        levels = [self._level(t.bucket, now) for t in takes]
        result = take_all(levels, takes)
        if result.ok:
            for take, level in zip(takes, result.levels, strict=True):
                self._store(take.bucket, level, now)
        return result

    def give_back(self, bucket: Bucket, amount: float, now: float) -> None:
        self._store(bucket, given_back(self._level(bucket, now), amount, bucket), now)

    def adjust(self, bucket: Bucket, delta: float, now: float) -> None:
        self._store(bucket, adjusted(self._level(bucket, now), delta, bucket), now)

    def level(self, bucket: Bucket, now: float) -> float:
        return self._level(bucket, now)

    def forget(self, key: str) -> None:
        self._state.pop(key, None)
