"""Helpers for the scheduler tests: tiny policies from YAML text, a ticket factory."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from extproc.endpoints import EndpointClass
from extproc.policy import Policy, policy_from_text
from extproc.scheduler import (
    FAIRNESS_POLICIES,
    ManualClock,
    Rejection,
    Scheduler,
    Ticket,
    make_fairness,
)

FAIRNESS = tuple(FAIRNESS_POLICIES)
"""Every registered fair-share policy: the conformance suite runs under each."""


def _flow(mapping: Mapping[str, Any]) -> str:
    parts = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            parts.append(f"{key}: {_flow(value)}")
        elif isinstance(value, list | tuple):
            parts.append(f"{key}: [{', '.join(str(v) for v in value)}]")
        elif value is None:
            continue
        else:
            parts.append(f"{key}: {value}")
    return "{" + ", ".join(parts) + "}"


def make_policy(
    tenants: Mapping[str, Mapping[str, Any]],
    *,
    fairness: str = "drr",
    tiers: tuple[str, ...] = ("gold", "silver", "bronze"),
    pools: Mapping[str, Mapping[str, Any]] | None = None,
    quantum: int = 4096,
    input_weight: float = 1,
    output_weight: float = 2,
    lease_timeout: str = "600s",
    tier_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Policy:
    """tenants: name -> {tier, weight, limits: {...}}; pools: name -> {max_inflight, ...}."""
    pools = pools or {"p": {"max_inflight": 4, "max_inflight_tokens": 100_000}}
    lines = ["version: 1", f"tiers: [{', '.join(tiers)}]", "tenants:"]
    for name, spec in tenants.items():
        lines.append(f"  {name}: {_flow(spec)}")
    lines.append("pools:")
    for name, spec in pools.items():
        # One request limit: these suites pin the admission order; headroom has its own tests.
        full = {"max_total_tokens": 1_000_000, "endpoints": ['"127.0.0.1:1"'], "headroom": 0}
        full.update(spec)
        lines.append(f"  {name}: {_flow(full)}")
    lines.append(
        f"fairness: {{policy: {fairness}, quantum: {quantum}, "
        f"input_weight: {input_weight}, output_weight: {output_weight}}}"
    )
    lines.append(f"gateway: {{lease_timeout: {lease_timeout}}}")
    if tier_options:
        lines.append("tier_options:")
        for tier, options in tier_options.items():
            lines.append(f"  {tier}: {_flow(options)}")
    return policy_from_text("\n".join(lines) + "\n")


_ids = itertools.count(1)


def ticket(
    tenant: str,
    *,
    pool: str = "p",
    input_tokens: int = 100,
    max_output: int = 100,
    priority: int = 0,
    deadline: float | None = None,
    request_id: str | None = None,
    endpoint: EndpointClass = "chat",
) -> Ticket:
    return Ticket(
        request_id=request_id or f"r{next(_ids)}",
        tenant=tenant,
        pool=pool,
        input_tokens=input_tokens,
        max_output_tokens=max_output,
        priority=priority,
        deadline=deadline,
        endpoint=endpoint,
    )


def scheduler(
    policy: Policy, start: float = 1000.0, **options: Any
) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock(start)
    return Scheduler(policy, clock, **options), clock


def submit_ok(sched: Scheduler, t: Ticket) -> Ticket:
    rejection: Rejection | None = sched.submit(t)
    assert rejection is None, rejection
    return t


def level_sign(fairness: str) -> int:
    """+1 if the policy's fair-share level rises as a tenant is charged, -1 if it falls."""
    policy = make_fairness(fairness, 4096)
    policy.on_backlogged("probe", 1.0)
    before = policy.level("probe")
    policy.charge("probe", 1.0)
    after = policy.level("probe")
    assert after != before, "a charge must move the level"
    return 1 if after > before else -1
