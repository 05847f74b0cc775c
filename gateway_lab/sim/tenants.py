"""Who sends each request of a trace that names no tenant.

Specs (the `--tenants` option):

- ``auto`` (default): keep the trace's tenant where it has one, round-robin over the policy's
  tenants otherwise;
- ``round-robin``: request i goes to tenant i mod n, in the policy's order;
- ``random``: uniformly at random (seeded);
- ``acme=3,globex=1``: at random in proportion to the weights (seeded);
- ``trace``: the trace's own tenant names, unchanged (requests without one are an error).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import replace

from gateway_lab.sim.trace import TraceRequest


def parse_weights(spec: str) -> dict[str, float]:
    """'acme=3,globex=1' -> {'acme': 3.0, 'globex': 1.0}."""
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not name:
            raise ValueError(f"tenant weight {part!r}: expected NAME=WEIGHT")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"tenant weight {part!r}: {value!r} is not a number") from None
        if weight < 0:
            raise ValueError(f"tenant weight {part!r} is negative")
        weights[name.strip()] = weight
    if not any(weights.values()):
        raise ValueError("tenant weights must not all be zero")
    return weights


def assign_tenants(
    requests: Sequence[TraceRequest],
    tenants: Sequence[str],
    spec: str = "auto",
    *,
    seed: int = 0,
) -> list[TraceRequest]:
    """The requests with a tenant each, by `spec` (see the module docstring)."""
    if spec == "trace":
        missing = sum(1 for r in requests if r.tenant is None)
        if missing:
            raise ValueError(f"--tenants trace: {missing} requests of the trace name no tenant")
        return list(requests)
    if not tenants and spec in ("auto", "round-robin", "random"):
        raise ValueError("no tenants to assign requests to")
    rng = random.Random(seed)
    if spec in ("auto", "round-robin"):
        cycle = itertools.cycle(tenants)
        return [
            r if spec == "auto" and r.tenant is not None else replace(r, tenant=next(cycle))
            for r in requests
        ]
    if spec == "random":
        return [replace(r, tenant=rng.choice(tenants)) for r in requests]
    weights = parse_weights(spec)
    names = list(weights)
    cumulative = list(itertools.accumulate(weights[name] for name in names))
    return [replace(r, tenant=rng.choices(names, cum_weights=cumulative)[0]) for r in requests]
