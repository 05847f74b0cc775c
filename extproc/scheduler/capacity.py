"""How much work a pool takes at once: a small component the scheduler asks before dispatch.

`StaticCapacity` enforces the policy's `max_inflight` (requests) and `max_inflight_tokens`
(sum of admitted budgets). A later adaptive implementation (limits driven by the engines'
`vllm:num_requests_waiting` / `vllm:kv_cache_usage_perc`) and headroom (a soft limit only
tenants below their fair share may exceed, up to the hard limit) implement the same protocol:
the decision stays inside `fits`, and `can_ever_fit` answers with the hard limit so that the
scheduler rejects only requests that could never pass.
"""

from __future__ import annotations

from typing import Protocol

from extproc.policy.model import Pool


class Capacity(Protocol):
    inflight: int
    inflight_tokens: int

    def has_slot(self) -> bool:
        """Room for one more request of some size (cheap test before looking at queues)."""
        ...

    def free_slots(self) -> int: ...

    def fits(self, budget: int) -> bool:
        """Room right now for one more request with this token budget."""
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
        """Limits for snapshots and metrics."""
        ...


class StaticCapacity:
    """Fixed limits from the policy file."""

    __slots__ = ("inflight", "inflight_tokens", "max_inflight", "max_inflight_tokens")

    def __init__(self, pool: Pool) -> None:
        self.max_inflight = pool.max_inflight
        self.max_inflight_tokens = pool.max_inflight_tokens
        self.inflight = 0
        self.inflight_tokens = 0

    def has_slot(self) -> bool:
        return self.inflight < self.max_inflight

    def free_slots(self) -> int:
        return max(0, self.max_inflight - self.inflight)

    def fits(self, budget: int) -> bool:
        return (
            self.inflight < self.max_inflight
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def can_ever_fit(self, budget: int) -> bool:
        return budget <= self.max_inflight_tokens

    def acquire(self, budget: int) -> None:
        self.inflight += 1
        self.inflight_tokens += budget

    def release(self, budget: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= budget

    def update(self, pool: Pool) -> None:
        self.max_inflight = pool.max_inflight
        self.max_inflight_tokens = pool.max_inflight_tokens

    def describe(self) -> dict[str, int]:
        return {"max_inflight": self.max_inflight, "max_inflight_tokens": self.max_inflight_tokens}
