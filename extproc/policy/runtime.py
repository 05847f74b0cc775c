"""The compiled, immutable policy the service runs on. Hot reload swaps one reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from extproc.endpoints import ENDPOINT_CLASSES, EndpointClass
from extproc.policy.keys import KeyIndex
from extproc.policy.loader import load_policy_file, parse_policy
from extproc.policy.model import PolicyFile, Pool, Tenant


@dataclass(frozen=True)
class Policy:
    source: PolicyFile
    file: str
    keys: KeyIndex
    tier_rank: dict[str, int]
    """0 for the highest tier."""
    pools_by_size: tuple[tuple[str, Pool], ...]
    """Pools ordered by max_total_tokens, smallest first: routing takes the first that fits."""
    pools_by_class: dict[EndpointClass, tuple[tuple[str, Pool], ...]]
    """The pools serving each endpoint class (`Pool.serves`), ordered like pools_by_size."""

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self.source.tenants

    @property
    def pools(self) -> dict[str, Pool]:
        return self.source.pools

    def tenant(self, name: str) -> Tenant | None:
        return self.source.tenants.get(name)

    def clamp_priority(self, tenant: Tenant, requested: int | None) -> int:
        bounds = self.source.priority
        value = bounds.default if requested is None else requested
        upper = bounds.max if tenant.max_priority is None else min(bounds.max, tenant.max_priority)
        return max(bounds.min, min(upper, value))

    def default_deadline(self, tier: str) -> float | None:
        options = self.source.tier_options.get(tier)
        return options.default_deadline if options is not None else None


def compile_policy(source: PolicyFile, file: str = "<policy>") -> Policy:
    hashed = {key: name for name, tenant in source.tenants.items() for key in tenant.api_keys}
    by_size = tuple(sorted(source.pools.items(), key=lambda item: item[1].max_total_tokens))
    return Policy(
        source=source,
        file=file,
        keys=KeyIndex(hashed),
        tier_rank={tier: rank for rank, tier in enumerate(source.tiers)},
        pools_by_size=by_size,
        pools_by_class={
            endpoint: tuple(item for item in by_size if endpoint in item[1].serves)
            for endpoint in ENDPOINT_CLASSES
        },
    )


def load_policy(path: str | Path) -> Policy:
    return compile_policy(load_policy_file(path), str(path))


def policy_from_text(text: str, file: str = "<policy>") -> Policy:
    return compile_policy(parse_policy(text, file), file)
