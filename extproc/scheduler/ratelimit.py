"""Per-tenant rate limits, with the limit dimensions as data.

A dimension is one kind of token bucket: the policy fields that size it (units per `period_s`,
and the burst it holds at most), what one request costs in it, whether it settles on real
token usage at release, and the suffix of its x-ratelimit-* headers. Adding a dimension is one
entry in `DIMENSIONS` (plus its fields in `extproc.policy.model.BucketLimits`); charging,
refunds, settlement, headers, rejection messages and snapshots all go through the table.

A tenant has a bucket per dimension its limits set (tenant-wide: every request takes from it)
and one per dimension each `per_endpoint` block sets (only that class's requests take from
it): a request takes from the tenant-wide buckets and its class's, all or none.

Bucket names are the dimension (`tokens`) or the dimension and the class (`tokens-embeddings`);
they name the bucket in snapshots, metrics and x-ratelimit-* headers. Bucket keys are
`<tenant>:<bucket name>` (the shared store in extproc.state keys on them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from extproc.endpoints import ENDPOINT_CLASSES, EndpointClass
from extproc.policy.model import BucketLimits, Limits, Tenant
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
    """The bucket name of the tenant-wide bucket; a class's bucket is `<name>-<class>`."""
    policy_field: str
    """The field of `BucketLimits` that sets the refill rate (None there: no limit)."""
    burst_field: str
    """The field that sets the bucket's capacity (None there: a whole period's worth)."""
    period_s: float
    """The policy field's limit is per this many seconds."""
    cost: Callable[[Ticket], float]
    """What one request takes from the bucket at submit."""
    settles_on_usage: bool
    """At release (and on later corrections) the bucket moves by real tokens minus reserved."""
    header_suffix: str
    """x-ratelimit-{limit,remaining,reset}-<suffix> (a class's bucket: `<suffix>-<class>`)."""


def _one_request(_ticket: Ticket) -> float:
    return 1.0


def _token_budget(ticket: Ticket) -> float:
    return float(ticket.budget)


DIMENSIONS: tuple[LimitDimension, ...] = (
    LimitDimension(
        name="requests",
        policy_field="requests_per_minute",
        burst_field="requests_burst",
        period_s=60.0,
        cost=_one_request,
        settles_on_usage=False,
        header_suffix="requests",
    ),
    LimitDimension(
        name="tokens",
        policy_field="tokens_per_minute",
        burst_field="tokens_burst",
        period_s=60.0,
        cost=_token_budget,
        settles_on_usage=True,
        header_suffix="tokens",
    ),
)
"""In the order `submit` takes them."""


def bucket_name(dimension: LimitDimension, endpoint: EndpointClass | None) -> str:
    """`tokens` for the tenant-wide bucket, `tokens-embeddings` for a class's."""
    return dimension.name if endpoint is None else f"{dimension.name}-{endpoint}"


def bucket_of(
    tenant: str,
    dimension: LimitDimension,
    limits: BucketLimits,
    endpoint: EndpointClass | None = None,
) -> Bucket | None:
    """The tenant's bucket of a dimension (tenant-wide, or the class's when `limits` is its
    `per_endpoint` block): capacity the burst, refilled at the limit per period. None: the
    limits do not set the dimension."""
    limit = getattr(limits, dimension.policy_field)
    if limit is None:
        return None
    burst = getattr(limits, dimension.burst_field)
    capacity = limit if burst is None else burst
    key = f"{tenant}:{bucket_name(dimension, endpoint)}"
    return Bucket(key, float(capacity), limit / dimension.period_s)


def _scopes(limits: Limits) -> list[tuple[EndpointClass | None, BucketLimits]]:
    """The tenant-wide limits, then each class block, in class order."""
    scopes: list[tuple[EndpointClass | None, BucketLimits]] = [(None, limits)]
    per_endpoint = limits.per_endpoint
    scopes.extend((c, per_endpoint[c]) for c in ENDPOINT_CLASSES if c in per_endpoint)
    return scopes


def _applying(
    limits: Limits, endpoint: EndpointClass
) -> list[tuple[EndpointClass | None, BucketLimits]]:
    """The scopes a request of the class takes from: tenant-wide, then its class's block."""
    block = limits.per_endpoint.get(endpoint)
    return [(None, limits)] if block is None else [(None, limits), (endpoint, block)]


def bucket_for_key(key: str, spec: Tenant) -> Bucket | None:
    """The bucket a key `<tenant>:<bucket name>` names under the tenant's current limits (None:
    no such bucket, or the policy no longer limits it); for stores that settle by key."""
    tenant, _, name = key.rpartition(":")
    dimension_name, _, endpoint = name.partition("-")
    dimension = next((d for d in DIMENSIONS if d.name == dimension_name), None)
    if dimension is None:
        return None
    for scope, limits in _scopes(spec.limits):
        if (scope or "") == endpoint:
            return bucket_of(tenant, dimension, limits, scope)
    return None


def settled_buckets(tenant: str, endpoint: EndpointClass, spec: Tenant) -> list[Bucket]:
    """The buckets a request of the class settles on real usage at release, in order."""
    out = []
    for scope, block in _applying(spec.limits, endpoint):
        for dimension in DIMENSIONS:
            if dimension.settles_on_usage:
                bucket = bucket_of(tenant, dimension, block, scope)
                if bucket is not None:
                    out.append(bucket)
    return out


def setting_name(endpoint: EndpointClass | None, field: str) -> str:
    """The policy key under `limits` that sets something: `tokens_burst`,
    `per_endpoint.embeddings.tokens_burst`."""
    return field if endpoint is None else f"per_endpoint.{endpoint}.{field}"


def capacity_exceeded(ticket: Ticket, limits: Limits) -> tuple[str, int] | None:
    """(setting, capacity) of a bucket the ticket's cost exceeds: it can never pass, whatever
    the wait. None when every bucket that applies can hold it. Cheap: no buckets are built."""
    for endpoint, block in _applying(limits, ticket.endpoint):
        for dimension in DIMENSIONS:
            limit = getattr(block, dimension.policy_field)
            if limit is None:
                continue
            burst = getattr(block, dimension.burst_field)
            capacity = limit if burst is None else burst
            if dimension.cost(ticket) > capacity:
                field = dimension.policy_field if burst is None else dimension.burst_field
                return setting_name(endpoint, field), capacity
    return None


@dataclass(frozen=True, slots=True)
class TenantBucket:
    dimension: LimitDimension
    endpoint: EndpointClass | None
    """None: tenant-wide; else the class whose requests alone take from it."""
    name: str
    bucket: Bucket
    rate_setting: str
    """The policy key of its rate (rejection messages): `per_endpoint.chat.requests_per_minute`."""
    capacity_setting: str
    """The policy key its capacity comes from: the burst if set, else the rate."""
    limit_header: str
    remaining_header: str
    reset_header: str
    limit_value: str
    """The x-ratelimit-* names and the limit's value, built once per tenant and policy: every
    submit sends them."""


def tenant_bucket(
    tenant: str, dimension: LimitDimension, limits: BucketLimits, endpoint: EndpointClass | None
) -> TenantBucket | None:
    bucket = bucket_of(tenant, dimension, limits, endpoint)
    if bucket is None:
        return None
    suffix = (
        dimension.header_suffix if endpoint is None else f"{dimension.header_suffix}-{endpoint}"
    )
    burst_set = getattr(limits, dimension.burst_field) is not None
    capacity_field = dimension.burst_field if burst_set else dimension.policy_field
    return TenantBucket(
        dimension,
        endpoint,
        bucket_name(dimension, endpoint),
        bucket,
        setting_name(endpoint, dimension.policy_field),
        setting_name(endpoint, capacity_field),
        f"x-ratelimit-limit-{suffix}",
        f"x-ratelimit-remaining-{suffix}",
        f"x-ratelimit-reset-{suffix}",
        limit_value(bucket),
    )


@dataclass(frozen=True, slots=True)
class _Cached:
    limits: Limits
    every: tuple[TenantBucket, ...]
    """Tenant-wide first, then each class's, in table order."""
    applying: dict[EndpointClass, tuple[TenantBucket, ...]]
    """Per class: the tenant-wide buckets, then the class's own."""


def _build(name: str, limits: Limits) -> _Cached:
    every: list[TenantBucket] = []
    for endpoint, block in _scopes(limits):
        for dimension in DIMENSIONS:
            item = tenant_bucket(name, dimension, block, endpoint)
            if item is not None:
                every.append(item)
    wide = tuple(b for b in every if b.endpoint is None)
    applying = {c: wide + tuple(b for b in every if b.endpoint == c) for c in ENDPOINT_CLASSES}
    return _Cached(limits, tuple(every), applying)


class RateLimiter:
    """The tenants' buckets in a `LimitStore`: charge at submit, refund, settle, headers."""

    def __init__(self, store: LimitStore) -> None:
        self.store = store
        self._cache: dict[str, _Cached] = {}

    def _cached(self, name: str, spec: Tenant) -> _Cached:
        cached = self._cache.get(name)
        if cached is not None and cached.limits is spec.limits:
            return cached  # policy models are frozen: same object, same limits
        cached = self._cache[name] = _build(name, spec.limits)
        return cached

    def buckets(self, name: str, endpoint: EndpointClass, spec: Tenant) -> tuple[TenantBucket, ...]:
        """The buckets a request of the class takes from: tenant-wide, then the class's."""
        return self._cached(name, spec).applying[endpoint]

    def every_bucket(self, name: str, spec: Tenant) -> tuple[TenantBucket, ...]:
        """All the tenant's buckets: tenant-wide, then each class's."""
        return self._cached(name, spec).every

    def takes(self, ticket: Ticket, spec: Tenant) -> list[Take]:
        return [
            Take(b.bucket, b.dimension.cost(ticket))
            for b in self.buckets(ticket.tenant, ticket.endpoint, spec)
        ]

    def peek_headers(
        self, name: str, endpoint: EndpointClass, spec: Tenant, now: float
    ) -> dict[str, str]:
        buckets = self.buckets(name, endpoint, spec)
        return headers_for((b, self.store.level(b.bucket, now)) for b in buckets)

    def levels(self, name: str, spec: Tenant, now: float) -> dict[str, float]:
        """Every bucket's level, by bucket name."""
        return {b.name: self.store.level(b.bucket, now) for b in self.every_bucket(name, spec)}

    def describe(self, name: str, spec: Tenant) -> dict[str, dict[str, object]]:
        """Every bucket's capacity (its burst), its limit per period (the refill) and the
        class it applies to (None: every request), by bucket name."""
        return {
            b.name: {
                "capacity": b.bucket.capacity,
                "limit": b.bucket.refill_per_second * b.dimension.period_s,
                "period_s": b.dimension.period_s,
                "endpoint": b.endpoint,
            }
            for b in self.every_bucket(name, spec)
        }

    def refund(self, name: str, spec: Tenant, charged: dict[str, float], now: float) -> None:
        """Give back what `submit` charged (by bucket name), to the buckets the tenant still
        has."""
        for item in self.every_bucket(name, spec):
            amount = charged.get(item.name)
            if amount:
                self.store.give_back(item.bucket, amount, now)

    def settle(
        self, name: str, endpoint: EndpointClass, spec: Tenant, delta_tokens: int, now: float
    ) -> None:
        """Move the usage-settled buckets of the class by real tokens minus what was charged."""
        if delta_tokens == 0:
            return
        for item in self.buckets(name, endpoint, spec):
            if item.dimension.settles_on_usage:
                self.store.adjust(item.bucket, float(delta_tokens), now)

    def rebase(self, name: str, old: Tenant, new: Tenant, now: float) -> None:
        """A reload changed the tenant's limits: bring each bucket whose rate or burst changed
        up to `now` at its old rate, so the new rate applies from the reload on (a lowered
        burst then clamps the level: every read caps it at the capacity)."""
        if old.limits is new.limits:
            return
        after = {b.name: b.bucket for b in self.every_bucket(name, new)}
        for item in self.every_bucket(name, old):
            changed = after.get(item.name)
            if changed is not None and changed != item.bucket:
                self.store.adjust(item.bucket, 0.0, now)


def headers_for(levels: Iterable[tuple[TenantBucket, float]]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-* of each bucket at its level (as
    `limits.ratelimit_headers` writes them)."""
    headers: dict[str, str] = {}
    for item, level in levels:
        headers[item.limit_header] = item.limit_value
        headers[item.remaining_header] = remaining_value(level)
        headers[item.reset_header] = reset_value(level, item.bucket)
    return headers
