"""The values a policy needs from Envoy, derived as `extproc envoy render` derives them
(extproc/envoy_config.py; a test keeps the two in step), and Envoy's defaults that break them.

Computed here rather than read from a render: importing the render's protobuf classes takes
seconds, too slow for a lint.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy import Policy

HOLD_MARGIN = 30.0
"""max_message_timeout and the gRPC timeout: the longest max_queue_wait plus this."""
IDLE_MARGIN = 60.0
"""stream_idle_timeout: the longest max_queue_wait plus this."""
LONGEST_TIMEOUT = 3600.0
"""The render caps every derived timeout at 1 h."""
NO_WAIT_CONFIGURED = 30.0
"""The longest wait of a policy without tenants (the model's default max_queue_wait)."""
MIN_KEEPALIVE_INTERVAL = 30.0
"""grpc-core closes connections whose HTTP/2 pings come faster."""

ENVOY_MESSAGE_TIMEOUT = 0.2
ENVOY_STREAM_IDLE_TIMEOUT = 300.0
ENVOY_ROUTE_TIMEOUT = 15.0
ENVOY_CIRCUIT_BREAKER = 1024
CIRCUIT_BREAKERS = ("max_connections", "max_pending_requests", "max_requests")
RAISED_CIRCUIT_BREAKER = 100_000
"""What the render sets; anything at Envoy's default or below is a finding."""


@dataclass(frozen=True)
class Reference:
    longest_wait: float
    hold: float
    """max_message_timeout, the gRPC stream timeout, and (Envoy Gateway) messageTimeout."""
    idle: float
    message_timeout: float
    max_body_bytes: int
    pools: tuple[str, ...]


def reference(policy: Policy) -> Reference:
    waits = [tenant.limits.max_queue_wait for tenant in policy.tenants.values()]
    longest = max(waits, default=NO_WAIT_CONFIGURED)
    gateway = policy.source.gateway
    return Reference(
        longest_wait=longest,
        hold=min(LONGEST_TIMEOUT, longest + HOLD_MARGIN),
        idle=min(LONGEST_TIMEOUT, longest + IDLE_MARGIN),
        message_timeout=gateway.message_timeout,
        max_body_bytes=gateway.max_body_bytes,
        pools=tuple(policy.pools),
    )
