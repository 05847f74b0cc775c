"""A pool's live state: its capacity, its tier bands (one fair-share object each), its hold,
its drain rate, and who waits for it or uses it."""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush

from extproc.policy.model import Fairness
from extproc.scheduler.capacity import Capacity
from extproc.scheduler.fairness import FairnessPolicy, fairness_from_settings
from extproc.scheduler.latency import AloneModel, DeltaController
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.records import Hold, PoolUsage


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
        "_budget_counts",
        "_budget_heap",
        "_weight_total",
        "active_changes",
        "alone",
        "bands",
        "capacity",
        "delta",
        "drain",
        "held",
        "name",
        "prefilling_requests",
        "prefilling_tokens",
        "queued_tokens",
        "reserve_inflight",
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
        self._budget_counts: dict[int, int] = {}
        """Token budget -> requests queued here with it."""
        self._budget_heap: list[int] = []
        """Negated budgets, a max-heap over `_budget_counts` (lazy deletion). Plain ints, no
        references to entries: the collector has nothing to walk here."""
        self.active_changes = 0
        """Bumped whenever a tenant joins or leaves `waiting` or `users` (the active set)."""
        self._weight_total: tuple[int, object, float] | None = None
        """(active_changes, policy, summed weight of the active tenants) last computed."""
        self.prefilling_tokens = 0
        self.prefilling_requests = 0
        self.reserve_inflight = 0
        """Leases admitted above a hard limit cut below what was in flight (at most the
        capacity's headroom at once; `Capacity.fits_reserve`)."""
        """Prompt tokens of admitted requests whose first token has not been seen yet."""
        self.queued_tokens = 0
        """Token budgets of the requests queued here."""
        self.alone = AloneModel()
        self.delta = DeltaController()

    def weight_total(self, policy: object, weight_of: Callable[[str], float | None]) -> float:
        """The summed weights of the tenants active in the pool (queued or admitted), cached
        until the active set or the policy changes: a light test is O(1) per dispatch."""
        cached = self._weight_total
        if cached is not None and cached[0] == self.active_changes and cached[1] is policy:
            return cached[2]
        total = 0.0
        for name in dict.fromkeys((*self.waiting, *self.users)):
            weight = weight_of(name)
            if weight is not None:
                total += weight
        self._weight_total = (self.active_changes, policy, total)
        return total

    def soft_now(self) -> int:
        """The soft limit as the δ controller scales it: what is in flight plus the requests
        that still fit below the soft limit (what is in flight when above it)."""
        return self.capacity.inflight + self.capacity.free_slots()

    def budget_queued(self, budget: int) -> None:
        self.queued_tokens += budget
        counts = self._budget_counts
        count = counts.get(budget, 0)
        counts[budget] = count + 1
        if count == 0:
            heappush(self._budget_heap, -budget)
            if len(self._budget_heap) > 2 * len(counts) + 64:
                self._budget_heap = [-b for b in counts]
                heapify(self._budget_heap)

    def budget_left(self, budget: int) -> None:
        self.queued_tokens -= budget
        counts = self._budget_counts
        count = counts[budget] - 1
        if count:
            counts[budget] = count
        else:
            del counts[budget]

    def largest_queued_budget(self) -> int:
        """The largest token budget of a request queued for this pool (0: none)."""
        heap, counts = self._budget_heap, self._budget_counts
        while heap and -heap[0] not in counts:
            heappop(heap)
        return -heap[0] if heap else 0

    def lift_hold_of(self, tenant: str) -> None:
        if self.held is not None and self.held.tenant == tenant:
            self.held = None
