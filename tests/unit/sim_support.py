"""Helpers for the simulator tests: small policies, profiles and traces made in the test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc.policy import Policy, policy_from_text
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.sim.fleet import PoolEngines
from gateway_lab.sim.simulator import SimConfig, SimResult, simulate
from gateway_lab.sim.slo import Slo
from gateway_lab.sim.trace import TraceRequest

# Round numbers so that hand-computed step times are easy to check.
HAND = EngineProfile(
    name="hand",
    step_base_s=0.010,
    step_per_decode_s=0.001,
    step_per_prefill_token_s=0.0001,
    step_per_context_token_s=0.00001,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    kv_blocks=1024,
    block_size=16,
    max_model_len=4096,
    frontend_s=0.005,
)


def flow(mapping: Mapping[str, Any]) -> str:
    parts = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            parts.append(f"{key}: {flow(value)}")
        elif value is not None:
            parts.append(f"{key}: {value}")
    return "{" + ", ".join(parts) + "}"


def make_policy(
    tenants: Mapping[str, Mapping[str, Any]] | None = None,
    pools: Mapping[str, Mapping[str, Any]] | None = None,
    tiers: Sequence[str] = ("gold", "silver"),
    extra: str = "",
) -> Policy:
    tenants = tenants or {"a": {"tier": "gold"}}
    pools = pools or {"p": {"max_inflight": 64, "max_inflight_tokens": 1_000_000}}
    lines = ["version: 1", f"tiers: [{', '.join(tiers)}]", "tenants:"]
    lines += [f"  {name}: {flow(spec)}" for name, spec in tenants.items()]
    lines.append("pools:")
    for name, spec in pools.items():
        full = {
            "max_total_tokens": 4096,
            "max_inflight_tokens": 1_000_000,
            "endpoints": '["127.0.0.1:1"]',
            **spec,
        }
        lines.append(f"  {name}: {flow(full)}")
    return policy_from_text("\n".join(lines) + "\n" + extra)


def run(
    requests: Sequence[TraceRequest],
    policy: Policy | None = None,
    *,
    profile: EngineProfile = HAND,
    replicas: Mapping[str, int] | None = None,
    slo: Slo | None = None,
    **options: Any,
) -> SimResult:
    policy = policy or make_policy()
    replicas = replicas or {}
    fleet = {name: PoolEngines(name, profile, replicas.get(name, 1)) for name in policy.pools}
    config = SimConfig(policy=policy, fleet=fleet, slo=slo or Slo(), **options)
    return simulate(requests, config)


def req(at: float, prompt: int, output: int, tenant: str = "a") -> TraceRequest:
    return TraceRequest(at, prompt, output, tenant)
