"""Retry-After: every rule and constant, as pure functions of numbers the caller measured.

The rules (ARCHITECTURE.md, "Admission order"):

* rate limited -> whole seconds until the buckets hold the cost (`after_wait`);
* queue full -> until one of the tenant's queue slots frees: its next dispatch (from its dispatch
  rate) or its oldest entry's expiry, whichever is sooner (`after_queue_full`);
* expired or shed -> the pool's backlog at this tier and above divided by the pool's drain
  rate, clamped to [1, max_queue_wait] (`after_backlog`);
* anything the scheduler cannot estimate (no rate yet, unknown tenant or pool) -> `UNKNOWN_S`;
* fixed answers for conditions with no estimate of their own: the constants below.
"""

from __future__ import annotations

import math

from extproc.scheduler.limits import TIME_EPSILON_S

UNKNOWN_S = 1
"""When there is nothing to estimate from: the smallest Retry-After there is."""

UNKNOWN_QUEUE_WAIT_S = 1.0
"""The max_queue_wait assumed for a tenant no longer in the policy (caps `after_backlog`)."""

POOL_REMOVED_S = 1
"""A queued request's pool was removed from the policy (or is gone when a tentative
admission is undone): another replica or the next policy may have it."""

DRAINING_S = 5
"""The service is shutting down gracefully: long enough for the load balancer to move on."""

GATEWAY_UNAVAILABLE_S = 2
"""Envoy answers itself because the service or every engine of a pool cannot be reached (a
crash being restarted, say): `extproc up` restarts a crashed child within 0.5-8 s."""

STATE_UNAVAILABLE_S = 1
"""The shared state store cannot be reached (fail-closed mode): retry shortly."""

ID_COLLISION_S = 1
"""Two gateway processes saw the same request id: the retry gets a fresh turn."""


def after_wait(wait_s: float) -> int:
    """Whole seconds (>= 1) after which a bucket that needs `wait_s` really covers the cost."""
    return max(1, math.ceil(wait_s - TIME_EPSILON_S))


def after_backlog(backlog: int, drain_rate: float | None, max_queue_wait: float) -> int:
    """Seconds for a pool draining `drain_rate` requests/s to clear `backlog` (1..max wait)."""
    if drain_rate is None or drain_rate <= 0:
        return UNKNOWN_S
    ceiling = max(1, math.ceil(max_queue_wait))
    return max(1, min(ceiling, math.ceil(backlog / drain_rate)))


def after_queue_full(dispatch_rate: float | None, oldest_expires_in: float | None) -> int:
    """Seconds until one of a full tenant queue's slots frees: the tenant's next dispatch at
    `dispatch_rate` per second or the expiry of its oldest request, whichever comes first."""
    waits: list[float] = []
    if dispatch_rate is not None and dispatch_rate > 0:
        waits.append(1.0 / dispatch_rate)
    if oldest_expires_in is not None:
        waits.append(max(0.0, oldest_expires_in))
    return after_wait(min(waits)) if waits else UNKNOWN_S
