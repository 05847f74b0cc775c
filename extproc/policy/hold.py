"""How long Envoy lets the service hold a request, shared by the Envoy render and reload.

The service holds a queued request by answering with `override_message_timeout` = the tenant's
`max_queue_wait` + HOLD_MARGIN_S (extproc.service.processor). Envoy ignores, without clamping,
an override above the admission filter's `max_message_timeout`, and the held request then gets
an empty 504 after `message_timeout`. The running Envoy's limit is fixed when it is rendered, so
a reload must not ask for longer holds than the Envoy it runs behind allows.
"""

from __future__ import annotations

from extproc.policy.model import Limits, PolicyFile

HOLD_MARGIN_S = 5.0
"""Beyond the queue wait, for the answer to arrive (extproc.service.processor uses hold_needed)."""
MAX_HOLD_S = 3600.0
_ENVOY_MARGIN_S = 30.0
_DEFAULT_WAIT_S = 30.0


def longest_queue_wait(policy: PolicyFile) -> float:
    """The longest a request may be held at the door, across tenants."""
    waits = [t.limits.max_queue_wait for t in policy.tenants.values()]
    return max(waits, default=_DEFAULT_WAIT_S)


def hold_needed(limits: Limits) -> float:
    """The override_message_timeout the service sends for a tenant with these limits."""
    return min(limits.max_queue_wait + HOLD_MARGIN_S, MAX_HOLD_S)


def envoy_hold_limit(policy: PolicyFile) -> float:
    """The admission filter's max_message_timeout rendered for this policy:
    `gateway.max_message_timeout` if set, else the longest queue wait + 30 s (at most 1 h)."""
    explicit = policy.gateway.max_message_timeout
    if explicit is not None:
        return min(explicit, MAX_HOLD_S)
    return min(MAX_HOLD_S, longest_queue_wait(policy) + _ENVOY_MARGIN_S)


def holds_over_limit(policy: PolicyFile, limit: float) -> list[tuple[str, float]]:
    """Tenants whose hold would exceed `limit`, with the hold each needs."""
    return [
        (name, hold_needed(tenant.limits))
        for name, tenant in policy.tenants.items()
        if hold_needed(tenant.limits) > limit
    ]
