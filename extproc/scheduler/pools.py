"""A pool's live state: its capacity, its tier bands (one fair-share object each), its hold,
its drain rate, and who waits for it or uses it."""

from __future__ import annotations

from extproc.policy.model import Fairness
from extproc.scheduler.capacity import Capacity
from extproc.scheduler.fairness import FairnessPolicy, fairness_from_settings
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.records import Hold, PoolUsage


class Band:
    """The tenants of one tier competing for one pool."""

    __slots__ = ("fair", "members", "rank", "tier")

    def __init__(self, rank: int, tier: str, fair: FairnessPolicy) -> None:
        self.rank = rank
        self.tier = tier
        self.fair = fair
        self.members: dict[str, None] = {}


def new_bands(tiers: list[str], fairness: Fairness) -> list[Band]:
    return [Band(rank, tier, fairness_from_settings(fairness)) for rank, tier in enumerate(tiers)]


class PoolState:
    __slots__ = ("bands", "capacity", "drain", "held", "name", "retired", "users", "waiting")

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

    def lift_hold_of(self, tenant: str) -> None:
        if self.held is not None and self.held.tenant == tenant:
            self.held = None
