"""Deficit round robin fair share with a token quantum (see extproc.scheduler.fairness.protocol)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import ClassVar, Self

from extproc.policy.model import Fairness

_EPS = 1e-9


class DeficitRoundRobin:
    """DRR with a token quantum: each visit adds quantum * weight to the tenant's deficit; the
    tenant being visited keeps dispatching while its head's cost <= deficit.

    Visits are computed, not looped: when the current tenant cannot afford its head, `pick`
    finds in one pass which member would first afford its head going round the ring (members in
    join order, starting after the current one), and credits every member the quanta of the
    visits made on the way. A tenant that stops being backlogged loses its positive deficit
    (credit is not banked) but keeps a negative one (a debt from settlement).

    `pick_member` (every member a candidate) walks the ring from the current position and stops
    at the first member that affords its head within one visit: that member is the pick, as
    the full computation would find, so in the common case a pick costs a few steps, not
    O(members). The ring is the members' join positions in a sorted list (lazy deletion).
    """

    name: ClassVar[str] = "drr"

    @classmethod
    def from_settings(cls, settings: Fairness) -> Self:
        return cls(settings.quantum)

    def __init__(self, quantum: float) -> None:
        if quantum <= 0:
            raise ValueError("quantum must be positive")
        self.quantum = float(quantum)
        self._deficit: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._position: dict[str, int] = {}
        self._joined = 0
        self._current: str | None = None
        self._current_position = 0
        self._ring: list[int] = []
        """Join positions in increasing order; those no longer in `_at` are left members."""
        self._at: dict[int, str] = {}

    def on_backlogged(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight
        if tenant in self._position:
            return
        self._joined += 1
        self._position[tenant] = self._joined
        self._ring.append(self._joined)
        self._at[self._joined] = tenant
        self._deficit.setdefault(tenant, 0.0)

    def on_idle(self, tenant: str) -> None:
        left = self._position.pop(tenant, None)
        if left is None:
            return
        del self._at[left]
        if len(self._ring) > 2 * len(self._at) + 32:
            self._ring = [p for p in self._ring if p in self._at]
        self._deficit[tenant] = min(self._deficit.get(tenant, 0.0), 0.0)
        if self._current == tenant:
            self._current = None

    def set_weight(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight

    def pick(self, candidates: Sequence[tuple[str, float]]) -> str:
        deficit = self._deficit
        current = self._current
        if current is not None:
            for tenant, cost in candidates:
                if tenant == current:
                    if deficit[tenant] + _EPS >= cost:
                        return tenant
                    break
        marker = self._current_position
        position = self._position
        ring = sorted(candidates, key=lambda c: (position[c[0]] <= marker, position[c[0]]))
        size = len(ring)
        best = ring[0][0]
        best_time = math.inf
        for offset, (tenant, cost) in enumerate(ring, start=1):
            need = cost - deficit[tenant]
            grant = self.quantum * self._weight[tenant]
            visits = 1 if need <= grant + _EPS else math.ceil((need - _EPS) / grant)
            at = float((visits - 1) * size + offset)
            if at < best_time:
                best, best_time = tenant, at
        for offset, (tenant, _cost) in enumerate(ring, start=1):
            if offset <= best_time:
                visits = 1 + int(best_time - offset) // size
                deficit[tenant] += visits * self.quantum * self._weight[tenant]
        self._current = best
        self._current_position = position[best]
        return best

    def pick_member(self, cost_of: Callable[[str], float]) -> str:
        deficit = self._deficit
        current = self._current
        if current is not None and deficit[current] + _EPS >= cost_of(current):
            return current  # `_current` is always a member (on_idle clears it)
        ring, at = self._ring, self._at
        start = bisect_right(ring, self._current_position)
        walked: list[str] = []
        for index in range(start, start + len(ring)):
            tenant = at.get(ring[index - len(ring)] if index >= len(ring) else ring[index])
            if tenant is None:
                continue
            walked.append(tenant)
            if cost_of(tenant) - deficit[tenant] <= self.quantum * self._weight[tenant] + _EPS:
                for visited in walked:  # one visit each on the way, as `pick` credits
                    deficit[visited] += self.quantum * self._weight[visited]
                self._current = tenant
                self._current_position = self._position[tenant]
                return tenant
        # nobody affords its head within one visit: the full computation
        return self.pick([(tenant, cost_of(tenant)) for tenant in walked])

    def on_dispatch(self, tenant: str, cost: float) -> None:
        self._deficit[tenant] = self._deficit.get(tenant, 0.0) - cost

    def charge(self, tenant: str, cost: float) -> None:
        value = self._deficit.get(tenant, 0.0) - cost
        if tenant not in self._position:
            value = min(value, 0.0)
        self._deficit[tenant] = value

    def level(self, tenant: str) -> float:
        return self._deficit.get(tenant, 0.0)

    def forget(self, tenant: str) -> None:
        self.on_idle(tenant)
        self._deficit.pop(tenant, None)
        self._weight.pop(tenant, None)
