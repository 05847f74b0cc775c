"""Deficit Longest Prefix Match (Cao et al. 2025) fair share (see
extproc.scheduler.fairness.protocol and docs/locality.md for its bound)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar, Self

from extproc.policy.model import Fairness

_EPS = 1e-9


def _no_locality(_tenant: str) -> float:
    return 0.0


class DeficitLongestPrefixMatch:
    """DLPM: deficits as in DRR, served longest cached prefix first.

    A candidate is eligible while its deficit covers its head's cost. Among the eligible,
    the one whose head has the longest cached prefix goes (the band's `cached_tokens` lookup,
    bound by the scheduler to the locality index; ties: the least recently served, then join
    order). When no candidate is eligible, a round begins: every candidate gets quantum x
    weight per round, as many rounds as the first of them needs to become eligible (computed,
    not looped).

    The bound (docs/locality.md): a deficit stays in [0, U + quantum x weight) (U: the largest
    head cost), and two tenants continuously backlogged get the same rounds, so over any
    interval their weighted services differ by less than 2 quantum + U/w_i + U/w_j, and by
    less than quantum + U/min(w) from the moment both became backlogged. Locality only
    reorders service inside a round. Settlement corrections (`charge`) come on top, as in DRR.

    A pick looks at every candidate's cached prefix: O(candidates x matched blocks).
    """

    name: ClassVar[str] = "dlpm"

    @classmethod
    def from_settings(cls, settings: Fairness) -> Self:
        return cls(settings.quantum)

    def __init__(self, quantum: float) -> None:
        if quantum <= 0:
            raise ValueError("quantum must be positive")
        self.quantum = float(quantum)
        self._deficit: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._joined_at: dict[str, int] = {}
        self._joined = 0
        self._served_at: dict[str, int] = {}
        self._served = 0
        self._cached: Callable[[str], float] = _no_locality

    def bind_locality(self, cached_tokens: Callable[[str], float]) -> None:
        """How many tokens of a member's head request some replica already holds."""
        self._cached = cached_tokens

    def on_backlogged(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight
        if tenant in self._joined_at:
            return
        self._joined += 1
        self._joined_at[tenant] = self._joined
        self._deficit.setdefault(tenant, 0.0)

    def on_idle(self, tenant: str) -> None:
        if self._joined_at.pop(tenant, None) is None:
            return
        self._deficit[tenant] = min(self._deficit.get(tenant, 0.0), 0.0)

    def set_weight(self, tenant: str, weight: float) -> None:
        self._weight[tenant] = weight

    def pick(self, candidates: Sequence[tuple[str, float]]) -> str:
        deficit = self._deficit
        eligible = [tenant for tenant, cost in candidates if deficit[tenant] + _EPS >= cost]
        if not eligible:
            rounds = min(
                math.ceil((cost - deficit[tenant] - _EPS) / (self.quantum * self._weight[tenant]))
                for tenant, cost in candidates
            )
            for tenant, _cost in candidates:
                deficit[tenant] += rounds * self.quantum * self._weight[tenant]
            eligible = [tenant for tenant, cost in candidates if deficit[tenant] + _EPS >= cost]
        if len(eligible) == 1:
            return eligible[0]
        cached, served, joined = self._cached, self._served_at, self._joined_at
        return min(eligible, key=lambda t: (-cached(t), served.get(t, 0), joined[t]))

    def pick_member(self, cost_of: Callable[[str], float]) -> str:
        return self.pick([(tenant, cost_of(tenant)) for tenant in self._joined_at])

    def on_dispatch(self, tenant: str, cost: float) -> None:
        self._deficit[tenant] = self._deficit.get(tenant, 0.0) - cost
        self._served += 1
        self._served_at[tenant] = self._served

    def charge(self, tenant: str, cost: float) -> None:
        value = self._deficit.get(tenant, 0.0) - cost
        if tenant not in self._joined_at:
            value = min(value, 0.0)
        self._deficit[tenant] = value

    def level(self, tenant: str) -> float:
        return self._deficit.get(tenant, 0.0)

    def forget(self, tenant: str) -> None:
        self.on_idle(tenant)
        self._deficit.pop(tenant, None)
        self._weight.pop(tenant, None)
        self._served_at.pop(tenant, None)
