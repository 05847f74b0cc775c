"""The gateway's side of a simulation: the real `Scheduler` on a `ManualClock`, driven the way
the live service's `AdmissionController` drives it (submit, then poll + dispatch after anything
that can change a decision; wake up at `next_deadline()`), plus the processor's ticket making
(pool choice by budget, priority clamp, the tier's default deadline)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from extproc.errors import GatewayError
from extproc.policy.runtime import Policy
from extproc.routing import choose_pool
from extproc.scheduler import Admission, ManualClock, Rejection, Scheduler, Ticket


@dataclass(frozen=True, slots=True)
class Pumped:
    """What one pump decided: requests rejected by time (expired, shed), then admitted."""

    rejections: list[Rejection]
    admissions: list[Admission]


class SimGateway:
    """Admission as the service does it, with simulated time and no I/O."""

    def __init__(
        self, policy: Policy, clock: ManualClock | None = None, **scheduler_options: Any
    ) -> None:
        self.clock = clock if clock is not None else ManualClock()
        self.policy = policy
        self.scheduler = Scheduler(policy, self.clock, **scheduler_options)
        self._timers: list[float] = []
        """Wake-up times already handed to the event loop and not yet fired (sorted)."""
        self._last_fired = -math.inf

    # --- the processor's part -------------------------------------------------------------

    def route(self, budget_tokens: int) -> str:
        """The pool for a budget (raises GatewayError when no pool holds it)."""
        return choose_pool(self.policy, budget_tokens)

    def ticket(
        self,
        request_id: str,
        tenant: str,
        pool: str,
        input_tokens: int,
        max_tokens: int,
        priority: int | None = None,
        prefix_blocks: tuple[int, ...] = (),
    ) -> Ticket:
        """A ticket like the processor's: clamped priority, the tier's default deadline, and
        (fairness dlpm) the prompt's block names, here a trace's hash_ids."""
        spec = self.policy.tenant(tenant)
        deadline = None
        clamped = 0
        if spec is not None:
            clamped = self.policy.clamp_priority(spec, priority)
            relative = self.policy.default_deadline(spec.tier)
            if relative is not None:
                deadline = self.clock.now() + relative
        return Ticket(
            request_id=request_id,
            tenant=tenant,
            pool=pool,
            input_tokens=input_tokens,
            max_output_tokens=max_tokens,
            priority=clamped,
            deadline=deadline,
            prefix_blocks=prefix_blocks if policy_uses_locality(self.policy) else (),
        )

    # --- the admission controller's part ---------------------------------------------------

    def submit(self, ticket: Ticket) -> Rejection | None:
        return self.scheduler.submit(ticket)

    def pump(self) -> Pumped:
        rejections = self.scheduler.poll()
        return Pumped(rejections, self.scheduler.dispatch())

    def wakeup(self) -> float | None:
        """A time the event loop must call `timer_fired` + `pump` at, if it is new: None when
        the earliest pending wake-up already covers the scheduler's next deadline."""
        at = self.scheduler.next_deadline()
        if at is None:
            return None
        now = self.clock.now()
        if at <= now:
            # Due now; never twice at the same instant (poll has already run at `now`).
            at = now if self._last_fired < now else math.nextafter(now, math.inf)
        if self._timers and self._timers[0] <= at:
            return None
        bisect.insort(self._timers, at)
        return at

    def timer_fired(self, at: float) -> None:
        index = bisect.bisect_left(self._timers, at)
        if index < len(self._timers) and self._timers[index] == at:
            del self._timers[index]
        self._last_fired = at


def policy_uses_locality(policy: Policy) -> bool:
    return policy.source.fairness.policy == "dlpm"


def route_or_error(gateway: SimGateway, budget: int) -> str | GatewayError:
    try:
        return gateway.route(budget)
    except GatewayError as error:
        return error
