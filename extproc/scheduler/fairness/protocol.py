"""Token-weighted fair share between the tenants of one band (one tier, one pool).

The scheduler keeps one policy object per (pool, tier) band; a tenant belongs to exactly one tier,
so the state is effectively per (pool, tenant). "Backlogged" here means: the tenant has queued
requests for this pool *and* is not held back by its own concurrency limit, i.e. it competes for
the pool right now. Costs are in token units: `input_weight * input + output_weight * output`.

Every registered policy (extproc.scheduler.fairness.FAIRNESS_POLICIES) has this interface:

* `on_backlogged(tenant, weight)` / `on_idle(tenant)`: membership changes;
* `pick(candidates)`: the tenant to serve next among `(tenant, head_cost)` pairs (the members
  whose head request fits the pool now; always non-empty);
* `pick_member(cost_of)`: the same answer as `pick` over every member, each with
  `cost_of(member)` as its head cost, without building that list (the scheduler's fast path
  when every head fits: cheaper than O(members) where the policy can);
* `on_dispatch(tenant, cost)`: the reserved cost of the request just dispatched;
* `charge(tenant, cost)`: later corrections, e.g. streamed output above the reservation
  (positive) or a settlement refund (negative);
* `level(tenant)`: the counter / deficit, for snapshots;
* `set_weight(tenant, weight)`, `forget(tenant)`: policy reload;
* `from_settings(settings)` (a classmethod): a fresh object from the policy file's `fairness`.

A policy that orders by locality (`dlpm`) also has `bind_locality(cached_tokens)`
(`LocalityAware`): the scheduler binds each band's object to a lookup of how many tokens of a
member's head request the pool's replicas already hold (extproc.scheduler.locality).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol, Self, runtime_checkable

from extproc.policy.model import Fairness


class FairnessPolicy(Protocol):
    name: ClassVar[str]

    def on_backlogged(self, tenant: str, weight: float) -> None: ...

    def on_idle(self, tenant: str) -> None: ...

    def set_weight(self, tenant: str, weight: float) -> None: ...

    def pick(self, candidates: Sequence[tuple[str, float]]) -> str: ...

    def pick_member(self, cost_of: Callable[[str], float]) -> str: ...

    def on_dispatch(self, tenant: str, cost: float) -> None: ...

    def charge(self, tenant: str, cost: float) -> None: ...

    def level(self, tenant: str) -> float: ...

    def forget(self, tenant: str) -> None: ...


class RegisteredFairness(FairnessPolicy, Protocol):
    """A policy class the registry can build from the policy file's `fairness` settings."""

    @classmethod
    def from_settings(cls, settings: Fairness) -> Self: ...


@runtime_checkable
class LocalityAware(Protocol):
    def bind_locality(self, cached_tokens: Callable[[str], float]) -> None: ...
