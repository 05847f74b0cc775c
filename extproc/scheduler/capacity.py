"""How much work a pool takes at once: a small component the scheduler asks before dispatch.

Two request limits, a *soft* one and a *hard* one (docs/benchmarks.md, noisy neighbour):

* below the soft limit anyone may be dispatched, in tier and fair-share order;
* between the soft and the hard limit (the *headroom*) only tenants below their fair share of
  the pool may be dispatched, so a quiet tenant never waits for a whole request of a tenant
  that keeps the soft limit full; the scheduler decides who is below its share and asks
  `fits_headroom`.

`StaticCapacity` takes both from the policy: hard = `max_inflight`, soft = `max_inflight -
headroom` (`headroom: 0` means one limit; omitted, it is sized from `max_inflight`).
`extproc.scheduler.adaptive.AdaptiveCapacity` moves the soft limit with the engines'
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (hard = soft + headroom). Token
room (`max_inflight_tokens`) is one hard limit for both. `can_ever_fit` answers with the hard
limits so that the scheduler rejects only requests that could never pass.
"""

from __future__ import annotations

from typing import Protocol

from extproc.policy.model import Pool


def pool_headroom(pool: Pool) -> int:
    """The pool's headroom in requests, its default resolved (`Pool.effective_headroom`)."""
    return pool.effective_headroom


class Capacity(Protocol):
    inflight: int
    inflight_tokens: int
    headroom: int
    """Requests above the soft limit for tenants below their fair share."""

    def has_slot(self) -> bool:
        """Room below the soft limit for one more request of some size (cheap test)."""
        ...

    def free_slots(self) -> int:
        """Requests that still fit below the soft limit."""
        ...

    def fits(self, budget: int) -> bool:
        """Room below the soft limit right now for one more request with this token budget
        (monotone: a budget that fits means every smaller one fits too)."""
        ...

    def has_headroom(self) -> bool:
        """Room below the hard limit for one more request of some size."""
        ...

    def fits_headroom(self, budget: int) -> bool:
        """Room below the hard limit for a request of a tenant below its fair share."""
        ...

    def fits_reserve(self, budget: int) -> bool:
        """Room for such a request above a hard limit that has moved below what is in flight
        (an adaptive limit cut under load): up to the pool's configured `max_inflight`, token
        room permitting. The scheduler lets at most `headroom` requests in this way at once
        (`PoolState.reserve_inflight`), so a quiet tenant does not wait for the backlogged
        tenants' requests to drain down to the cut limit. False where the hard limit is fixed."""
        ...

    def can_ever_fit(self, budget: int) -> bool:
        """Whether the request could fit in an empty pool (hard limits)."""
        ...

    def acquire(self, budget: int) -> None: ...

    def release(self, budget: int) -> None: ...

    def update(self, pool: Pool) -> None:
        """A policy reload changed the pool's limits; in-flight work is kept."""
        ...

    def describe(self) -> dict[str, int]:
        """Limits for snapshots and metrics (`max_inflight` is the soft limit now)."""
        ...


class StaticCapacity:
    """Fixed limits from the policy file."""

    __slots__ = (
        "_headroom_override",
        "hard_inflight",
        "headroom",
        "inflight",
        "inflight_tokens",
        "max_inflight",
        "max_inflight_tokens",
    )

    def __init__(self, pool: Pool, headroom: int | None = None) -> None:
        self.inflight = 0
        self.inflight_tokens = 0
        self.headroom = 0
        self.hard_inflight = 0
        self.max_inflight = 0
        self.max_inflight_tokens = 0
        self._headroom_override = headroom
        self._configure(pool)

    def _configure(self, pool: Pool) -> None:
        override = self._headroom_override
        wanted = pool_headroom(pool) if override is None else max(0, override)
        self.hard_inflight = pool.max_inflight
        self.headroom = min(wanted, pool.max_inflight - 1)
        self.max_inflight = pool.max_inflight - self.headroom
        self.max_inflight_tokens = pool.max_inflight_tokens

    def has_slot(self) -> bool:
        return self.inflight < self.max_inflight

    def free_slots(self) -> int:
        return max(0, self.max_inflight - self.inflight)

    def fits(self, budget: int) -> bool:
        return (
            self.inflight < self.max_inflight
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def soft_limit(self) -> int:
        return self.max_inflight

    def has_headroom(self) -> bool:
        return self.inflight < self.hard_inflight

    def fits_headroom(self, budget: int) -> bool:
        return (
            self.inflight < self.hard_inflight
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def fits_reserve(self, budget: int) -> bool:
        del budget  # the hard limit is the policy's max_inflight: it never moves below it
        return False

    def can_ever_fit(self, budget: int) -> bool:
        return budget <= self.max_inflight_tokens

    def acquire(self, budget: int) -> None:
        self.inflight += 1
        self.inflight_tokens += budget

    def release(self, budget: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= budget

    def update(self, pool: Pool) -> None:
        self._configure(pool)

    def describe(self) -> dict[str, int]:
        return {
            "max_inflight": self.max_inflight,
            "hard_inflight": self.hard_inflight,
            "headroom": self.headroom,
            "max_inflight_tokens": self.max_inflight_tokens,
        }
