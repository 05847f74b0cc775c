"""`SharedCapacity`: a pool's capacity as one process sees it when several share the pool.

The authority is the lease set in Redis (a gate call grants or refuses each admission). This
object is the scheduler's local *mirror* of it, so that the scheduler only proposes admissions
that probably fit: its in-flight counts are this process's own leases (including tentative
ones waiting for the gate) plus the other processes' leases as last seen in a Redis answer.

After the gate refuses an admission for lack of capacity the pool is *blocked*: it proposes
nothing until something may have changed (a release event from any process, or the periodic
re-check), so a stale mirror cannot make the process spin. In local mode (Redis unreachable)
the other processes are ignored and the limits are this process's share.

Headroom (see extproc.scheduler.capacity): the gate in Redis enforces the hard limits
(`max_inflight`, `max_inflight_tokens`) exactly; the soft limit (`max_inflight - headroom`)
is applied by each process's scheduler on this mirror, so it holds up to races.
"""

from __future__ import annotations

from extproc.policy.model import Pool
from extproc.scheduler.capacity import pool_headroom


class SharedCapacity:
    __slots__ = (
        "blocked",
        "hard_inflight",
        "headroom",
        "inflight",
        "inflight_tokens",
        "max_inflight",
        "max_inflight_tokens",
        "mine",
        "mine_tokens",
        "others",
        "others_tokens",
        "shared",
    )

    def __init__(self, pool: Pool) -> None:
        self.hard_inflight = 0
        self.headroom = 0
        self.max_inflight = 0
        self.max_inflight_tokens = 0
        self.update(pool)
        self.mine = 0
        self.mine_tokens = 0
        self.others = 0
        self.others_tokens = 0
        self.inflight = 0
        self.inflight_tokens = 0
        self.blocked = False
        self.shared = True

    def _total(self) -> None:
        if self.shared:
            self.inflight = self.mine + self.others
            self.inflight_tokens = self.mine_tokens + self.others_tokens
        else:
            self.inflight = self.mine
            self.inflight_tokens = self.mine_tokens

    # -- Capacity protocol ----------------------------------------------------------------------

    def has_slot(self) -> bool:
        return not self.blocked and self.inflight < self.max_inflight

    def free_slots(self) -> int:
        return max(0, self.max_inflight - self.inflight)

    def fits(self, budget: int) -> bool:
        return (
            not self.blocked
            and self.inflight < self.max_inflight
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def soft_limit(self) -> int:
        return self.max_inflight

    def has_headroom(self) -> bool:
        return not self.blocked and self.inflight < self.hard_inflight

    def fits_headroom(self, budget: int) -> bool:
        return (
            not self.blocked
            and self.inflight < self.hard_inflight
            and self.inflight_tokens + budget <= self.max_inflight_tokens
        )

    def fits_reserve(self, budget: int) -> bool:
        del budget  # a shared pool's hard limit is the policy's: it never moves
        return False

    def can_ever_fit(self, budget: int) -> bool:
        return budget <= self.max_inflight_tokens

    def acquire(self, budget: int) -> None:
        self.mine += 1
        self.mine_tokens += budget
        self._total()

    def release(self, budget: int) -> None:
        self.mine -= 1
        self.mine_tokens -= budget
        self._total()

    def update(self, pool: Pool) -> None:
        self.hard_inflight = pool.max_inflight
        self.headroom = min(pool_headroom(pool), pool.max_inflight - 1)
        self.max_inflight = pool.max_inflight - self.headroom
        self.max_inflight_tokens = pool.max_inflight_tokens

    def describe(self) -> dict[str, int]:
        return {
            "max_inflight": self.max_inflight,
            "hard_inflight": self.hard_inflight,
            "headroom": self.headroom,
            "max_inflight_tokens": self.max_inflight_tokens,
            "own_inflight": self.mine,
            "others_inflight": self.others if self.shared else 0,
        }

    # -- the mirror -----------------------------------------------------------------------------

    def observe(self, total: int, total_tokens: int, confirmed: int, confirmed_tokens: int) -> None:
        """Redis counted `total` leases; `confirmed` of them are this process's."""
        self.others = max(0, total - confirmed)
        self.others_tokens = max(0, total_tokens - confirmed_tokens)
        self._total()

    def set_shared(self, shared: bool) -> None:
        self.shared = shared
        if not shared:
            self.blocked = False
        self._total()
