"""Token-weighted fair share between the tenants of one band (one tier, one pool).

The scheduler keeps one policy object per (pool, tier) band; a tenant belongs to exactly one tier,
so the state is effectively per (pool, tenant). "Backlogged" here means: the tenant has queued
requests for this pool *and* is not held back by its own concurrency limit, i.e. it competes for
the pool right now. Costs are in token units: `input_weight * input + output_weight * output`.

Both policies expose the same interface:

* `on_backlogged(tenant, weight)` / `on_idle(tenant)`: membership changes;
* `pick(candidates)`: the tenant to serve next among `(tenant, head_cost)` pairs (the members
  whose head request fits the pool now; always non-empty);
* `on_dispatch(tenant, cost)`: the reserved cost of the request just dispatched;
* `charge(tenant, cost)`: later corrections, e.g. streamed output above the reservation
  (positive) or a settlement refund (negative);
* `level(tenant)`: the counter / deficit, for snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

_EPS = 1e-9


class FairnessPolicy(Protocol):
    name: str

    def on_backlogged(self, tenant: str, weight: float) -> None: ...

    def on_idle(self, tenant: str) -> None: ...

    def set_weight(self, tenant: str, weight: float) -> None: ...

    def pick(self, candidates: Sequence[tuple[str, float]]) -> str: ...

    def on_dispatch(self, tenant: str, cost: float) -> None: ...

    def charge(self, tenant: str, cost: float) -> None: ...

    def level(self, tenant: str) -> float: ...

    def forget(self, tenant: str) -> None: ...


class VirtualTokenCounter:
    """VTC (Sheng et al., OSDI'24): serve the backlogged tenant with the smallest counter.

    Counters grow by cost / weight. When a tenant becomes backlogged its counter is lifted to
    max(own, min over the other backlogged tenants) -- or, when nobody else is backlogged, to the
    counter of the last tenant that left -- so idle time is never banked.
    """

    name = "vtc"

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


class DeficitRoundRobin:
    """DRR with a token quantum: each visit adds quantum * weight to the tenant's deficit; the
    tenant being visited keeps dispatching while its head's cost <= deficit.

    Visits are computed, not looped: when the current tenant cannot afford its head, `pick`
    finds in one pass which member would first afford its head going round the ring (members in
    join order, starting after the current one), and credits every member the quanta of the
    visits made on the way. A tenant that stops being backlogged loses its positive deficit
    (credit is not banked) but keeps a negative one (a debt from settlement).
    """

    name = "drr"

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

    def on_backlogged(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight
        if tenant in self._position:
            return
        self._joined += 1
        self._position[tenant] = self._joined
        self._deficit.setdefault(tenant, 0.0)

    def on_idle(self, tenant: str) -> None:
        if self._position.pop(tenant, None) is None:
            return
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
            at = (visits - 1) * size + offset
            if at < best_time:
                best, best_time = tenant, at
        for offset, (tenant, _cost) in enumerate(ring, start=1):
            if offset <= best_time:
                visits = 1 + int(best_time - offset) // size
                deficit[tenant] += visits * self.quantum * self._weight[tenant]
        self._current = best
        self._current_position = position[best]
        return best

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


def make_fairness(policy: str, quantum: float) -> FairnessPolicy:
    if policy == "vtc":
        return VirtualTokenCounter()
    if policy == "drr":
        return DeficitRoundRobin(quantum)
    raise ValueError(f"unknown fairness policy {policy!r}")
