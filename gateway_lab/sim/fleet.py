"""Engine pools of a simulated fleet: profiles per context length, replica counts, and the
policy limits that go with them.

Context-length provisioning (the dual-pool papers' "configuration-traffic mismatch"): an engine
has a fixed KV cache (GPU memory minus weights). An operator who configures it for
`max_model_len = L` sizes its concurrency for the worst case, so that every running sequence
could grow to `kv_provision * L` tokens without preemption:

    max_num_seqs(L) = clamp(floor(kv_tokens / (kv_provision * L)), 1, seq_cap)

With the A100 + Llama-3.1-8B profile (432k KV tokens) and kv_provision 1.0 that is 211
sequences at 2k, 105 at 4k, 52 at 8k, 26 at 16k and 6 at 64k: the "4-8x concurrency" a
long-context configuration gives up. The step-time model is unchanged, so the throughput gain
`rho` of a short-context configuration is whatever bigger batches buy on the traffic, measured by
the simulator rather than assumed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.policy.model import Pool
from extproc.policy.runtime import Policy, compile_policy
from gateway_lab.engine.profiles import EngineProfile, get_profile


def resolve_profile(name: str) -> EngineProfile:
    """An engine profile by name (gateway_lab.engine.profiles)."""
    return get_profile(name)


def profile_for_context(
    base: EngineProfile,
    max_model_len: int,
    *,
    kv_provision: float = 1.0,
    seq_cap: int | None = None,
) -> EngineProfile:
    """`base` configured for `max_model_len`, concurrency sized for the worst case (see above).

    seq_cap defaults to the base profile's max_num_seqs (vLLM's default of 256 for A100).
    """
    if max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    if kv_provision <= 0:
        raise ValueError("kv_provision must be > 0")
    if max_model_len > base.kv_tokens:
        raise ValueError(
            f"profile {base.name!r} holds {base.kv_tokens} KV tokens: "
            f"too few for max_model_len {max_model_len}"
        )
    cap = base.max_num_seqs if seq_cap is None else seq_cap
    seqs = max(1, min(cap, math.floor(base.kv_tokens / (kv_provision * max_model_len))))
    return base.with_overrides(
        {
            "name": f"{base.name}@{max_model_len}",
            "max_model_len": max_model_len,
            "max_num_seqs": seqs,
        }
    )


@dataclass(frozen=True, slots=True)
class PoolEngines:
    """One pool of identical engine replicas."""

    name: str
    profile: EngineProfile
    replicas: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"pool {self.name!r}: replicas must be >= 1")


def derived_pool(engines: PoolEngines, max_total_tokens: int | None = None) -> Pool:
    """Gateway limits that let through what the replicas batch without queueing:
    max_inflight = replicas * max_num_seqs, max_inflight_tokens = replicas * KV tokens, no
    prefill pacing."""
    profile = engines.profile
    return Pool(
        max_total_tokens=max_total_tokens or profile.max_model_len,
        max_inflight=engines.replicas * profile.max_num_seqs,
        max_inflight_tokens=engines.replicas * profile.kv_tokens,
        endpoints=[f"sim-{engines.name}-{i}:0" for i in range(engines.replicas)],
        headroom=0,  # every slot the replicas batch, for whoever is next
        prefill_budget_tokens=0,  # capacity only: no isolation pacing in a sizing run
    )


def with_pools(policy: Policy, pools: Mapping[str, Pool]) -> Policy:
    """The policy with its pools replaced (tenants, tiers and fairness kept)."""
    source = policy.source.model_copy(update={"pools": dict(pools)})
    return compile_policy(source, policy.file)


def derive_capacity(policy: Policy, fleet: Mapping[str, PoolEngines]) -> Policy:
    """The policy with each simulated pool's limits derived from its replicas; routing
    thresholds (max_total_tokens) are kept from the policy."""
    pools = {
        name: derived_pool(engines, policy.pools[name].max_total_tokens)
        if name in policy.pools
        else derived_pool(engines)
        for name, engines in fleet.items()
    }
    return with_pools(policy, {**policy.pools, **pools})


def parse_assignments(items: list[str] | None, what: str) -> dict[str, str]:
    """['short=4', 'long=2'] -> {'short': '4', 'long': '2'}."""
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what} {item!r}: expected POOL=VALUE")
        out[name] = value
    return out
