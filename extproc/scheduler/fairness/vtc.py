"""Virtual token counter fair share (see extproc.scheduler.fairness.protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

from extproc.policy.model import Fairness


class VirtualTokenCounter:
    """VTC (Sheng et al., OSDI'24): serve the backlogged tenant with the smallest counter.

    Counters grow by cost / weight. When a tenant becomes backlogged its counter is lifted to
    max(own, min over the other backlogged tenants) -- or, when nobody else is backlogged, to the
    counter of the last tenant that left -- so idle time is never banked.
    """

    name = "vtc"

    @classmethod
    def from_settings(cls, settings: Fairness) -> Self:
        return cls()  # VTC has no parameters

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._members: dict[str, int] = {}
        self._joined = 0
        self._floor = 0.0

    def on_backlogged(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight
        if tenant in self._members:
            return
        members = self._members
        base = min(self._counter[m] for m in members) if members else self._floor
        self._counter[tenant] = max(self._counter.get(tenant, base), base)
        self._joined += 1
        self._members[tenant] = self._joined

    def on_idle(self, tenant: str) -> None:
        if self._members.pop(tenant, None) is not None and not self._members:
            self._floor = self._counter[tenant]

    def set_weight(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight

    def pick(self, candidates: Sequence[tuple[str, float]]) -> str:
        counter, members = self._counter, self._members
        best = candidates[0][0]
        best_key = (counter[best], members[best])
        for tenant, _cost in candidates[1:]:
            key = (counter[tenant], members[tenant])
            if key < best_key:
                best, best_key = tenant, key
        return best

    def on_dispatch(self, tenant: str, cost: float) -> None:
        self.charge(tenant, cost)

    def charge(self, tenant: str, cost: float) -> None:
        weight = self._weight.get(tenant, 1.0)
        self._counter[tenant] = self._counter.get(tenant, self._floor) + cost / weight

    def level(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def forget(self, tenant: str) -> None:
        self.on_idle(tenant)
        self._counter.pop(tenant, None)
        self._weight.pop(tenant, None)
