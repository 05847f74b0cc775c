"""Vocabulary shared by every layer: outcomes, header names, small value types."""

from __future__ import annotations

import enum

# Headers the gateway owns. Any client-sent copy is removed before the request goes upstream.
TENANT_HEADER = "x-tenant-id"
TIER_HEADER = "x-tier"
POOL_HEADER = "x-llm-pool"
GATEWAY_REQUEST_ID_HEADER = "x-gateway-request-id"
UPSTREAM_HEADER = "x-gateway-upstream"
"""Response header Envoy adds (the engine's address) for the accounting stream; Envoy's
header-mutation filter removes it before the client sees the response (extproc.envoy_config)."""
REPLICA_HEADER = "x-llm-replica"
"""The pool endpoint (its index in the policy's `endpoints`) the locality index chose
(fairness `dlpm`): Envoy routes on it to that endpoint's own cluster."""
OWNED_HEADERS: tuple[str, ...] = (
    TENANT_HEADER,
    TIER_HEADER,
    POOL_HEADER,
    GATEWAY_REQUEST_ID_HEADER,
    UPSTREAM_HEADER,
    REPLICA_HEADER,
)

PRIORITY_HEADER = "x-priority"
DEADLINE_HEADER = "x-deadline-ms"
ENGINE_HEADER = "x-engine-id"
WORKER_INDEX_ENV = "EXTPROC_WORKER_INDEX"
"""Set by `serve --workers N`'s supervisor for worker i: `i` (extproc.service.workers)."""
QUEUE_MS_HEADER = "x-gateway-queue-ms"
"""Response header: how long the request waited for admission."""


class Outcome(enum.StrEnum):
    """The single terminal outcome of one request; also the metric label."""

    ADMITTED = "admitted"
    REJECTED_RATE = "rejected_rate"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    EXPIRED = "expired"
    SHED = "shed"
    """Refused because it cannot start before its deadline (503)."""
    SHED_OVERLOAD = "shed_overload"
    """Refused because the service fell behind and the tenant is above its share (429;
    extproc.service.overload)."""
    CANCELLED = "cancelled"
    UNAUTHORIZED = "unauthorized"
    BAD_REQUEST = "bad_request"
    UNAVAILABLE = "unavailable"
