"""Capacity that tracks the engines: an AIMD request limit driven by their own metrics.

Too low a limit starves the engines' batches (throughput falls below plain FIFO); too high a
limit lets an engine queue requests first-come first-served again, which undoes fairness at
the door (docs/benchmarks.md, noisy neighbour). So the pool's *soft* limit follows two
signals that vLLM publishes on `/metrics`, summed or maxed over the pool's engines:

* `vllm:num_requests_waiting`: requests an engine accepted but could not schedule. It must
  stay near zero. A request that arrives during a step waits for that step to end, so a few
  waiting requests now and then are normal: the controller smooths the signal (an
  exponentially weighted average over polls) and only calls it congestion above
  `target_waiting`;
* `vllm:kv_cache_usage_perc` (a fraction 0..1): above `kv_target` the next decodes preempt.

Additive increase, multiplicative decrease (as TCP, and Envoy's adaptive_concurrency filter in
spirit): while the limit binds (admitted requests reached it since the last sample) and the
engines are not congested, the limit grows by `increase` per sample; on congestion it is
multiplied by `decrease`, then left alone for `cooldown_s` so that the engines' queue can
drain before the next verdict. The limit stays within [min_inflight, max_inflight -
headroom]; the hard limit is soft + headroom (see `capacity.py`).

Everything here is pure and clock-free: samples carry their own time. The asyncio poller that
produces samples is `extproc.service.engine_watch`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from extproc.policy.model import Pool
from extproc.scheduler.capacity import Capacity, StaticCapacity, pool_headroom


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One poll of a pool's engines."""

    at: float
    """Clock time of the poll (the scheduler's clock)."""
    waiting: float
    """Sum of vllm:num_requests_waiting over the engines that answered."""
    running: float
    """Sum of vllm:num_requests_running."""
    kv_usage: float
    """Largest vllm:kv_cache_usage_perc (0..1) among the engines."""
    engines: int = 1
    """Engines that answered."""


@dataclass(frozen=True, slots=True)
class AdaptiveSettings:
    """How a pool's soft limit follows its engines (policy: `pools.NAME.adaptive`)."""

    min_inflight: int = 4
    initial_inflight: int | None = None
    """Starting soft limit; None: min(16, ceiling)."""
    target_waiting: float = 1.0
    """Smoothed engine queue (requests) above which the engines count as congested."""
    kv_target: float = 0.9
    increase: float = 1.0
    """Requests added per sample while the limit binds and the engines are not congested."""
    decrease: float = 0.9
    """Factor applied to the limit on congestion."""
    cooldown_s: float = 1.0
    """After a decrease, no change for this long (the engines' queue drains)."""
    smoothing: float = 0.3
    """Weight of a new sample in the average of `waiting` (1: no smoothing)."""
    poll_interval_s: float = 0.1
    headroom: int = 0
    """Requests above the soft limit for tenants below their fair share."""
    static_until_sampled: bool = False
    """Hold the soft limit at its ceiling (the static limit) until the first engine sample,
    then start from `initial_inflight`: the default for a pool without an `adaptive` section,
    so that engines without vLLM metrics keep the static limit."""

    def __post_init__(self) -> None:
        if self.min_inflight < 1:
            raise ValueError("min_inflight must be >= 1")
        if self.initial_inflight is not None and self.initial_inflight < 1:
            raise ValueError("initial_inflight must be >= 1")
        if self.target_waiting < 0 or not 0 < self.kv_target <= 1:
            raise ValueError("target_waiting must be >= 0 and kv_target in (0, 1]")
        if self.increase <= 0 or not 0 < self.decrease < 1:
            raise ValueError("increase must be > 0 and decrease in (0, 1)")
        if self.cooldown_s < 0 or not 0 < self.smoothing <= 1 or self.poll_interval_s <= 0:
            raise ValueError("cooldown_s >= 0, smoothing in (0, 1], poll_interval_s > 0")
        if self.headroom < 0:
            raise ValueError("headroom must be >= 0")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AdaptiveSettings:
        """From a JSON/YAML mapping with these field names; unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown adaptive capacity setting(s): {', '.join(unknown)}")
        return cls(**dict(values))

    @classmethod
    def from_pool(cls, pool: Pool) -> AdaptiveSettings | None:
        """The pool's adaptive settings, or None when `adaptive: {enabled: false}` (static).

        A pool without an `adaptive` section gets the defaults, static until sampled."""
        if not pool.adaptive_enabled:
            return None
        section = pool.adaptive
        if section is None:
            return cls(headroom=pool_headroom(pool), static_until_sampled=True)
        raw = section.model_dump(exclude={"enabled"})
        renamed = {
            "cooldown": "cooldown_s",
            "poll_interval": "poll_interval_s",
        }
        values = {renamed.get(k, k): v for k, v in raw.items() if v is not None}
        values.setdefault("headroom", pool_headroom(pool))
        return cls.from_mapping(values)


class AimdLimit:
    """The controller alone: a float limit within [floor, ceiling], moved by samples."""

    __slots__ = (
        "_cooldown_until",
        "ceiling",
        "decreases",
        "floor",
        "increases",
        "last_sample_at",
        "limit",
        "settings",
        "waiting_avg",
    )

    def __init__(self, settings: AdaptiveSettings, ceiling: int) -> None:
        self.settings = settings
        self.ceiling = max(1, ceiling)
        self.floor = min(settings.min_inflight, self.ceiling)
        self.last_sample_at: float | None = None
        self.limit = float(self.ceiling) if self.static() else self.initial_limit()
        self.waiting_avg = 0.0
        self.increases = 0
        self.decreases = 0
        self._cooldown_until = -math.inf

    def initial_limit(self) -> float:
        initial = self.settings.initial_inflight or min(16, self.ceiling)
        return float(min(max(initial, self.floor), self.ceiling))

    def static(self) -> bool:
        """Still at the static limit: no engine sample yet (`static_until_sampled`)."""
        return self.settings.static_until_sampled and self.last_sample_at is None

    def set_ceiling(self, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self.floor = min(self.settings.min_inflight, self.ceiling)
        if self.static():
            self.limit = float(self.ceiling)
        else:
            self.limit = min(max(self.limit, self.floor), self.ceiling)

    def congested(self, sample: EngineSample) -> bool:
        return (
            self.waiting_avg > self.settings.target_waiting
            or sample.kv_usage > self.settings.kv_target
        )

    def observe(self, sample: EngineSample, peak_inflight: int) -> None:
        """Fold one sample in. `peak_inflight`: most requests admitted since the last one."""
        settings = self.settings
        if self.static():
            self.limit = self.initial_limit()
        alpha = settings.smoothing
        self.waiting_avg = alpha * sample.waiting + (1.0 - alpha) * self.waiting_avg
        self.last_sample_at = sample.at
        if sample.at < self._cooldown_until:
            return
        if self.congested(sample):
            lowered = max(float(self.floor), self.limit * settings.decrease)
            if lowered < self.limit:
                self.limit = lowered
                self.decreases += 1
            self._cooldown_until = sample.at + settings.cooldown_s
        elif peak_inflight >= math.floor(self.limit) and self.limit < self.ceiling:
            self.limit = min(float(self.ceiling), self.limit + settings.increase)
            self.increases += 1


class AdaptiveCapacity:
    """A pool's capacity with a soft request limit that follows its engines (Capacity)."""

    __slots__ = (
        "_peak",
        "controller",
        "headroom",
        "inflight",
        "inflight_tokens",
        "max_inflight_tokens",
        "pool_max_inflight",
        "settings",
    )

    def __init__(self, pool: Pool, settings: AdaptiveSettings) -> None:
        self.settings = settings
        self.inflight = 0
        self.inflight_tokens = 0
        self._peak = 0
        self.pool_max_inflight = pool.max_inflight
        self.max_inflight_tokens = pool.max_inflight_tokens
        self.headroom = min(settings.headroom, max(0, pool.max_inflight - 1))
        self.controller = AimdLimit(settings, pool.max_inflight - self.headroom)

    # -- the controller's side ------------------------------------------------------------------

    def observe(self, sample: EngineSample) -> bool:
        """Fold an engine sample in; True when the soft limit changed."""
        before = self.soft_limit()
        self.controller.observe(sample, self._peak)
        self._peak = self.inflight
        return self.soft_limit() != before

    @property
    def limit(self) -> float:
        return self.controller.limit

    # -- Capacity ---------------------------------------------------------------------------------

    def soft_limit(self) -> int:
        return max(1, math.floor(self.controller.limit))

    def hard_limit(self) -> int:
        return min(self.soft_limit() + self.headroom, self.pool_max_inflight)

    def has_slot(self) -> bool:
        return self.inflight < self.soft_limit()

    def free_slots(self) -> int:
        return max(0, self.soft_limit() - self.inflight)

    def fits(self, budget: int) -> bool:
        return (
            self.inflight < self.soft_limit()
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def has_headroom(self) -> bool:
        return self.inflight < self.hard_limit()

    def fits_headroom(self, budget: int) -> bool:
        return (
            self.inflight < self.hard_limit()
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def fits_reserve(self, budget: int) -> bool:
        return (
            self.inflight < self.pool_max_inflight
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def can_ever_fit(self, budget: int) -> bool:
        return budget <= self.max_inflight_tokens

    def acquire(self, budget: int) -> None:
        self.inflight += 1
        self.inflight_tokens += budget
        self._peak = max(self._peak, self.inflight)

    def release(self, budget: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= budget

    def update(self, pool: Pool) -> None:
        self.pool_max_inflight = pool.max_inflight
        self.max_inflight_tokens = pool.max_inflight_tokens
        self.headroom = min(self.settings.headroom, max(0, pool.max_inflight - 1))
        self.controller.set_ceiling(pool.max_inflight - self.headroom)

    def reconfigure(self, settings: AdaptiveSettings) -> None:
        """New controller settings (a policy reload); the current limit is kept, clamped."""
        limit = self.controller.limit
        self.settings = settings
        self.headroom = min(settings.headroom, max(0, self.pool_max_inflight - 1))
        kept = settings
        if not self.controller.static():
            kept = replace(
                settings, initial_inflight=max(1, math.floor(limit)), static_until_sampled=False
            )
        self.controller = AimdLimit(kept, self.pool_max_inflight - self.headroom)

    def describe(self) -> dict[str, int]:
        return {
            "max_inflight": self.soft_limit(),
            "hard_inflight": self.hard_limit(),
            "headroom": self.headroom,
            "max_inflight_tokens": self.max_inflight_tokens,
            "configured_max_inflight": self.pool_max_inflight,
            "adaptive": 1,
            "limit_increases": self.controller.increases,
            "limit_decreases": self.controller.decreases,
        }


class EngineCapacities:
    """Builds each pool's Capacity (the Scheduler's `capacity_factory`) and keeps the adaptive
    ones by pool name, for the engine watcher to feed.

    `overrides` set a pool's adaptive settings whatever its policy says (benchmarks, tests);
    otherwise a pool gets an AdaptiveCapacity unless its policy says `adaptive: {enabled:
    false}`, which gets a StaticCapacity, with its policy `headroom` unless `static_headroom`
    names one.
    A pool keeps its kind (static or adaptive) across policy reloads until a restart."""

    def __init__(
        self,
        overrides: Mapping[str, AdaptiveSettings] | None = None,
        *,
        static_headroom: Mapping[str, int] | None = None,
    ) -> None:
        self.overrides = dict(overrides or {})
        self.static_headroom = dict(static_headroom or {})
        self.adaptive: dict[str, AdaptiveCapacity] = {}

    def settings_for(self, name: str, pool: Pool) -> AdaptiveSettings | None:
        return self.overrides.get(name) or AdaptiveSettings.from_pool(pool)

    def factory(self, name: str, pool: Pool) -> Capacity:
        settings = self.settings_for(name, pool)
        if settings is None:
            self.adaptive.pop(name, None)
            return StaticCapacity(pool, self.static_headroom.get(name))
        capacity = AdaptiveCapacity(pool, settings)
        self.adaptive[name] = capacity
        return capacity

    def observe(self, pool: str, sample: EngineSample) -> bool:
        """Feed one sample to the pool's adaptive capacity; True when its limit changed."""
        capacity = self.adaptive.get(pool)
        return capacity.observe(sample) if capacity is not None else False

    def poll_interval_s(self, default: float = 0.1) -> float:
        if not self.adaptive:
            return default
        return min(c.settings.poll_interval_s for c in self.adaptive.values())
