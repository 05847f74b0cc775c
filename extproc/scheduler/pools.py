"""A pool's live state: its capacity, its tier bands (one fair-share object each), its hold,
its drain rate, and who waits for it or uses it."""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from extproc.policy.model import Fairness
from extproc.scheduler.capacity import Capacity
from extproc.scheduler.fairness import FairnessPolicy, fairness_from_settings
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.records import Hold, PoolUsage, QueueEntry


class Band:
    """The tenants of one tier competing for one pool."""

    __slots__ = ("fair", "members", "queued", "rank", "tier")

    def __init__(self, rank: int, tier: str, fair: FairnessPolicy) -> None:
        self.rank = rank
        self.tier = tier
        self.fair = fair
        self.members: dict[str, None] = {}
        self.queued = 0
        """Requests the members have queued for the pool (kept in step by `Live`), so the
        backlog ahead of a tier costs O(tiers), not O(members)."""


def new_bands(tiers: list[str], fairness: Fairness) -> list[Band]:
    return [Band(rank, tier, fairness_from_settings(fairness)) for rank, tier in enumerate(tiers)]


class PoolState:
    __slots__ = (
        "_budget_pushes",
        "_budgets",
        "bands",
        "capacity",
        "drain",
        "held",
        "name",
        "retired",
        "users",
        "waiting",
    )

    def __init__(self, name: str, capacity: Capacity, bands: list[Band], drain: DecayingRate):
        self.name = name
        self.capacity = capacity
        self.bands = bands
        self.drain = drain
        self.held: Hold | None = None
        self.retired = False
        self.waiting: dict[str, None] = {}
        """Tenants with queued requests for this pool (backlogged or not)."""
        self.users: dict[str, PoolUsage] = {}
        """Tenants with admitted requests in this pool (for headroom shares)."""
        self._budgets: list[tuple[int, int, QueueEntry]] = []
        """(-budget, push number, entry) of entries queued here: a max-heap, lazy deletion."""
        self._budget_pushes = 0

    def budget_queued(self, entry: QueueEntry, live_entries: int) -> None:
        """Track a newly queued entry's budget; `live_entries` bounds how many are alive."""
        self._budget_pushes += 1
        heappush(self._budgets, (-entry.ticket.budget, self._budget_pushes, entry))
        if len(self._budgets) > 2 * live_entries + 64:
            self._budgets = [item for item in self._budgets if item[2].alive]
            heapify(self._budgets)

    def largest_queued_budget(self) -> int:
        """The largest token budget of a request queued for this pool (0: none)."""
        heap = self._budgets
        while heap and not heap[0][2].alive:
            heappop(heap)
        return -heap[0][0] if heap else 0

    def lift_hold_of(self, tenant: str) -> None:
        if self.held is not None and self.held.tenant == tenant:
            self.held = None
