"""Virtual token counter fair share (see extproc.scheduler.fairness.protocol)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from heapq import heapify, heappop, heappush
from typing import ClassVar, Self

from extproc.policy.model import Fairness


class VirtualTokenCounter:
    """VTC (Sheng et al., OSDI'24): serve the backlogged tenant with the smallest counter.

    Counters grow by cost / weight. When a tenant becomes backlogged its counter is lifted to
    max(own, min over the other backlogged tenants) -- or, when nobody else is backlogged, to the
    counter of the last tenant that left -- so idle time is never banked.

    A heap of (counter, join number, tenant) holds an up-to-date item for every member (and
    stale ones, skipped when they reach the top), so the smallest member counter -- the pick
    when every member is a candidate, and the base at joining -- costs O(log members).
    """

    name: ClassVar[str] = "vtc"

    @classmethod
    def from_settings(cls, settings: Fairness) -> Self:
        return cls()  # VTC has no parameters

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._members: dict[str, int] = {}
        self._joined = 0
        self._floor = 0.0
        self._heap: list[tuple[float, int, str]] = []

    def on_backlogged(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight
        if tenant in self._members:
            return
        base = self._heap_top()[0] if self._members else self._floor
        counter = max(self._counter.get(tenant, base), base)
        self._counter[tenant] = counter
        self._joined += 1
        self._members[tenant] = self._joined
        heappush(self._heap, (counter, self._joined, tenant))

    def _heap_top(self) -> tuple[float, int, str]:
        """The member with the smallest (counter, join number); there must be one."""
        heap, counter, members = self._heap, self._counter, self._members
        if len(heap) > 2 * len(members) + 64:
            heap[:] = [(counter[m], joined, m) for m, joined in members.items()]
            heapify(heap)
        while True:
            top = heap[0]
            value, joined, tenant = top
            if members.get(tenant) == joined and counter[tenant] == value:
                return top
            heappop(heap)

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

    def pick_member(self, cost_of: Callable[[str], float]) -> str:
        return self._heap_top()[2]

    def on_dispatch(self, tenant: str, cost: float) -> None:
        self.charge(tenant, cost)

    def charge(self, tenant: str, cost: float) -> None:
        weight = self._weight.get(tenant, 1.0)
        value = self._counter.get(tenant, self._floor) + cost / weight
        self._counter[tenant] = value
        joined = self._members.get(tenant)
        if joined is not None:
            heappush(self._heap, (value, joined, tenant))

    def level(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def forget(self, tenant: str) -> None:
        self.on_idle(tenant)
        self._counter.pop(tenant, None)
        self._weight.pop(tenant, None)
