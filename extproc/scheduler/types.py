"""The scheduler's vocabulary: what goes in (Ticket) and what comes out (Admission, Rejection)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.endpoints import EndpointClass
from extproc.types import Outcome


@dataclass(frozen=True, slots=True)
class Ticket:
    """One request asking for a turn. The tier is looked up from the policy by tenant."""

    request_id: str
    tenant: str
    pool: str
    input_tokens: int
    """Estimated prompt tokens."""
    max_output_tokens: int
    """max_tokens of the request, or the gateway default."""
    priority: int = 0
    """Already clamped by the policy; higher is served first inside the tenant."""
    deadline: float | None = None
    """Absolute clock time by which the request must be admitted, or None."""
    endpoint: EndpointClass = "chat"
    """The class of the endpoint called (extproc.endpoints): which limits apply."""
    streamed: bool = True
    """The response streams: its first token is seen when it is generated (prefill pacing and
    the δ samples count only these; a non-streamed response shows it only at its end)."""
    prefix_blocks: tuple[int, ...] = ()
    """Chained names of the prompt's byte blocks (extproc.scheduler.locality), when the
    policy's fairness is `dlpm`; empty otherwise."""

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.max_output_tokens < 0:
            raise ValueError("token counts cannot be negative")

    @property
    def budget(self) -> int:
        """Tokens reserved for the request: estimated prompt + max output."""
        return self.input_tokens + self.max_output_tokens


@dataclass(frozen=True, slots=True)
class Lease:
    """Admitted work holding pool capacity until `Scheduler.release(lease_id)`."""

    lease_id: int
    request_id: str
    tenant: str
    pool: str
    tier: str
    budget: int
    admitted_at: float
    expires_at: float
    """After this the lease is reclaimed as if released (a lost release must not leak)."""
    replica: int | None = None
    """The pool endpoint (index into its `endpoints`) the locality index chose; None: Envoy
    balances the pool's endpoints."""
    fair_exempt: bool = False
    """Taken through the headroom: outside the fair-share accounting, its late usage
    correction included (`Scheduler.correct_usage(fair=False)`)."""


ENGINE_PRIORITY_STRIDE = 2
"""Engine priority values per tier: a light and a backlogged one."""


@dataclass(frozen=True, slots=True)
class Admission:
    ticket: Ticket
    lease: Lease
    wait_s: float
    ratelimit_headers: Mapping[str, str] = field(default_factory=dict)
    engine_priority: int | None = None
    """The `priority` to set in the forwarded body (vLLM: lower first), or None when the pool
    has `engine_priority: false`: tier rank x `ENGINE_PRIORITY_STRIDE`, + 1 for a tenant
    that was backlogged (beyond its fair share) when dispatched."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """A request the scheduler turned away (or removed from its queue), with its HTTP answer."""

    request_id: str
    tenant: str
    outcome: Outcome
    http_status: int
    retry_after_s: int | None
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra response headers (x-ratelimit-*); Retry-After is `retry_after_s`, not in here."""
