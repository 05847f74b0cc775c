"""Fair-share policies, registered by name (`fairness.policy` in the policy file).

Adding a policy: one module with a class that satisfies `RegisteredFairness`, and one entry in
`FAIRNESS_POLICIES`; the scheduler conformance suite runs against every entry.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.policy.model import Fairness
from extproc.scheduler.fairness.dlpm import DeficitLongestPrefixMatch
from extproc.scheduler.fairness.drr import DeficitRoundRobin
from extproc.scheduler.fairness.protocol import FairnessPolicy, LocalityAware, RegisteredFairness
from extproc.scheduler.fairness.vtc import VirtualTokenCounter

FAIRNESS_POLICIES: Mapping[str, type[RegisteredFairness]] = {
    DeficitRoundRobin.name: DeficitRoundRobin,
    VirtualTokenCounter.name: VirtualTokenCounter,
    DeficitLongestPrefixMatch.name: DeficitLongestPrefixMatch,
}


def _registered(name: str) -> type[RegisteredFairness]:
    found = FAIRNESS_POLICIES.get(name)
    if found is None:
        raise ValueError(f"unknown fairness policy {name!r}")
    return found


def fairness_from_settings(settings: Fairness) -> FairnessPolicy:
    """A fresh policy object for one band, as the policy file's `fairness` section says."""
    return _registered(settings.policy).from_settings(settings)


def make_fairness(policy: str, quantum: int) -> FairnessPolicy:
    """A policy by name with default settings but for the DRR quantum (tests, tools)."""
    return _registered(policy).from_settings(Fairness.model_validate({"quantum": quantum}))


__all__ = [
    "FAIRNESS_POLICIES",
    "DeficitLongestPrefixMatch",
    "DeficitRoundRobin",
    "FairnessPolicy",
    "LocalityAware",
    "RegisteredFairness",
    "VirtualTokenCounter",
    "fairness_from_settings",
    "make_fairness",
]
