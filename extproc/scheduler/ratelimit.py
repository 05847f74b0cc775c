"""Per-tenant rate limits, with the limit dimensions as data.

A dimension is one token bucket per tenant: the policy field that sizes it (units per
`period_s`), what one request costs in it, whether it settles on real token usage at release,
and the suffix of its x-ratelimit-* headers. Adding a dimension is one entry in `DIMENSIONS`
(plus its field in `extproc.policy.model.Limits`); charging, refunds, settlement, headers,
rejection messages and snapshots all go through the table.

Bucket keys are `<tenant>:<dimension name>` (the shared store in extproc.state keys on them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from extproc.policy.model import Limits, Tenant
from extproc.scheduler.limits import (
    Bucket,
    LimitStore,
    Take,
    limit_value,
    remaining_value,
    reset_value,
)
from extproc.scheduler.types import Ticket


@dataclass(frozen=True, slots=True)
class LimitDimension:
    name: str
    """Bucket key suffix and the key in snapshots' `buckets`."""
    policy_field: str
    """The field of `Limits` that sizes the bucket (None there: no limit)."""
    period_s: float
    """The bucket refills its whole capacity over this many seconds."""
    cost: Callable[[Ticket], float]
    """What one request takes from the bucket at submit."""
    settles_on_usage: bool
    """At release (and on later corrections) the bucket moves by real tokens minus reserved."""
    header_suffix: str
    """x-ratelimit-{limit,remaining,reset}-<suffix>."""


def _one_request(_ticket: Ticket) -> float:
    return 1.0


def _token_budget(ticket: Ticket) -> float:
    return float(ticket.budget)


DIMENSIONS: tuple[LimitDimension, ...] = (
    LimitDimension(
        name="requests",
        policy_field="requests_per_minute",
        period_s=60.0,
        cost=_one_request,
        settles_on_usage=False,
        header_suffix="requests",
    ),
    LimitDimension(
        name="tokens",
        policy_field="tokens_per_minute",
        period_s=60.0,
        cost=_token_budget,
        settles_on_usage=True,
        header_suffix="tokens",
    ),
)
"""In the order `submit` takes them."""

SETTLED_DIMENSION = next(d for d in DIMENSIONS if d.settles_on_usage)
"""The one dimension the shared store's script settles on real usage at release."""


def bucket_of(tenant: str, dimension: LimitDimension, limit: int) -> Bucket:
    """The tenant's bucket for a dimension its policy limits to `limit` per period."""
    return Bucket(f"{tenant}:{dimension.name}", float(limit), limit / dimension.period_s)


def bucket_for_key(key: str, spec: Tenant) -> Bucket | None:
    """The bucket a key `<tenant>:<dimension>` names under the tenant's current limits (None:
    no such dimension, or the policy no longer limits it); for stores that settle by key."""
    tenant, _, name = key.rpartition(":")
    dimension = next((d for d in DIMENSIONS if d.name == name), None)
    if dimension is None:
        return None
    limit = getattr(spec.limits, dimension.policy_field)
    return None if limit is None else bucket_of(tenant, dimension, limit)


@dataclass(frozen=True, slots=True)
class TenantBucket:
    dimension: LimitDimension
    bucket: Bucket
    limit_header: str
    remaining_header: str
    reset_header: str
    limit_value: str
    """The x-ratelimit-* names and the limit's value, built once per tenant and policy: every
    submit sends them."""


def tenant_bucket(dimension: LimitDimension, bucket: Bucket) -> TenantBucket:
    suffix = dimension.header_suffix
    return TenantBucket(
        dimension,
        bucket,
        f"x-ratelimit-limit-{suffix}",
        f"x-ratelimit-remaining-{suffix}",
        f"x-ratelimit-reset-{suffix}",
        limit_value(bucket),
    )


@dataclass(frozen=True, slots=True)
class _Cached:
    limits: Limits
    buckets: tuple[TenantBucket, ...]


class RateLimiter:
    """The tenants' buckets in a `LimitStore`: charge at submit, refund, settle, headers."""

    def __init__(self, store: LimitStore) -> None:
        self.store = store
        self._cache: dict[str, _Cached] = {}

    def buckets(self, name: str, spec: Tenant) -> tuple[TenantBucket, ...]:
        """The tenant's buckets for the dimensions its policy limits, in table order."""
        cached = self._cache.get(name)
        if cached is not None and cached.limits is spec.limits:
            return cached.buckets  # policy models are frozen: same object, same limits
        buckets = tuple(
            tenant_bucket(d, bucket_of(name, d, limit))
            for d in DIMENSIONS
            if (limit := getattr(spec.limits, d.policy_field)) is not None
        )
        self._cache[name] = _Cached(spec.limits, buckets)
        return buckets

    def takes(self, ticket: Ticket, spec: Tenant) -> list[Take]:
        return [Take(b.bucket, b.dimension.cost(ticket)) for b in self.buckets(ticket.tenant, spec)]

    def peek_headers(self, name: str, spec: Tenant, now: float) -> dict[str, str]:
        return headers_for((b, self.store.level(b.bucket, now)) for b in self.buckets(name, spec))

    def levels(self, name: str, spec: Tenant, now: float) -> dict[str, float]:
        return {b.dimension.name: self.store.level(b.bucket, now) for b in self.buckets(name, spec)}

    def refund(self, name: str, spec: Tenant, charged: dict[str, float], now: float) -> None:
        """Give back what `submit` charged, to the buckets the tenant still has."""
        for item in self.buckets(name, spec):
            amount = charged.get(item.dimension.name)
            if amount:
                self.store.give_back(item.bucket, amount, now)

    def settle(self, name: str, spec: Tenant, delta_tokens: int, now: float) -> None:
        """Move the usage-settled buckets by real tokens minus what was charged."""
        if delta_tokens == 0:
            return
        for item in self.buckets(name, spec):
            if item.dimension.settles_on_usage:
                self.store.adjust(item.bucket, float(delta_tokens), now)


def headers_for(levels: Iterable[tuple[TenantBucket, float]]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-* of each bucket at its level (as
    `limits.ratelimit_headers` writes them)."""
    headers: dict[str, str] = {}
    for item, level in levels:
        headers[item.limit_header] = item.limit_value
        headers[item.remaining_header] = remaining_value(level)
        headers[item.reset_header] = reset_value(level, item.bucket)
    return headers
