"""Replay timed tickets through the scheduler alone and report the admission order.

This is the hook for comparing the simulator's admission decisions with the live service's:
feed both the same (time, ticket) arrivals and compare `ReplayResult.order`. No engines: an
admitted request holds its lease for `hold_s` simulated seconds (per arrival or a default),
then releases it with its actual output tokens (if given), or never (`hold_s=None`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

from extproc.policy.runtime import Policy
from extproc.scheduler import Ticket
from extproc.types import Outcome
from gateway_lab.sim.gateway import SimGateway


@dataclass(frozen=True, slots=True)
class ReplayArrival:
    at: float
    """Submit time on the scheduler's clock (seconds; tickets' deadlines use the same clock)."""
    ticket: Ticket
    hold_s: float | None = None
    """How long the admitted request holds its lease; None: the replay's default."""
    output_tokens: int | None = None
    """Actual output tokens at release (None: settle with the estimate)."""
    cancel_at: float | None = None
    """The client goes away at this time if still queued."""


@dataclass
class ReplayResult:
    order: list[str] = field(default_factory=list)
    """Request ids in admission order."""
    admitted_at: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, Outcome] = field(default_factory=dict)
    """Request id -> outcome of requests turned away (at submit or later)."""
    cancelled: list[str] = field(default_factory=list)
    snapshot: dict[str, Any] = field(default_factory=dict)


_RELEASE = 0
_CANCEL = 1
_ARRIVAL = 2
_TIMER = 3


def replay_admissions(
    policy: Policy,
    arrivals: Iterable[ReplayArrival | tuple[float, Ticket]],
    *,
    hold_s: float | None = None,
    until: float | None = None,
    **scheduler_options: Any,
) -> ReplayResult:
    """Drive a fresh `Scheduler` (on a ManualClock starting at 0) with the arrivals.

    Arrivals at the same time are submitted in the given order. At each instant releases come
    first, then cancellations, then arrivals, then timers; after a release, an accepted submit
    and a timer the scheduler is pumped (poll + dispatch), as the live AdmissionController
    does. Stops when nothing is left to
    happen, or at `until`.
    """
    gateway = SimGateway(policy, **scheduler_options)
    scheduler = gateway.scheduler
    clock = gateway.clock
    items = [a if isinstance(a, ReplayArrival) else ReplayArrival(a[0], a[1]) for a in arrivals]
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(at: float, kind: int, payload: int) -> None:
        nonlocal seq
        seq += 1
        heappush(heap, (at, kind, seq, payload))

    for index, item in enumerate(items):
        push(item.at, _ARRIVAL, index)
        if item.cancel_at is not None:
            push(item.cancel_at, _CANCEL, index)
    index_of = {item.ticket.request_id: index for index, item in enumerate(items)}
    leases: dict[int, int] = {}
    result = ReplayResult()

    def pump() -> None:
        pumped = gateway.pump()
        for rejection in pumped.rejections:
            result.rejected[rejection.request_id] = rejection.outcome
        now = clock.now()
        for admission in pumped.admissions:
            request_id = admission.ticket.request_id
            result.order.append(request_id)
            result.admitted_at[request_id] = now
            index = index_of[request_id]
            hold = items[index].hold_s if items[index].hold_s is not None else hold_s
            if hold is not None and math.isfinite(hold):
                leases[index] = admission.lease.lease_id
                push(now + hold, _RELEASE, index)
        wake = gateway.wakeup()
        if wake is not None:
            push(wake, _TIMER, 0)

    while heap:
        at, kind, _seq, payload = heappop(heap)
        if until is not None and at > until:
            break
        clock.set(max(at, clock.now()))
        if kind == _RELEASE:
            item = items[payload]
            scheduler.release(leases.pop(payload), item.ticket.input_tokens, item.output_tokens)
        elif kind == _CANCEL:
            # Like AdmissionController.cancel: drop the entry, no pump.
            if scheduler.cancel(items[payload].ticket.request_id):
                result.cancelled.append(items[payload].ticket.request_id)
            continue
        elif kind == _ARRIVAL:
            rejection = scheduler.submit(items[payload].ticket)
            if rejection is not None:
                result.rejected[rejection.request_id] = rejection.outcome
                continue
        else:
            gateway.timer_fired(at)
        pump()
    result.snapshot = scheduler.snapshot()
    return result
