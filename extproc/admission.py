"""The asyncio adapter around the pure scheduler core: one awaited turn per request.

`AdmissionController` runs everything in this process (state backend `memory`).
`extproc.state.SharedAdmissionController` extends it for state shared through Redis; the
gateway only uses the methods defined here, so it does not care which one it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from extproc.errors import GatewayError
from extproc.metrics import Metrics
from extproc.policy import Policy
from extproc.scheduler import Admission, Rejection, Scheduler, Ticket


@dataclass(frozen=True)
class Grant:
    """An admitted request's hold on pool capacity, released when its response ends."""

    lease_id: int
    pool: str
    wait_s: float
    ratelimit_headers: dict[str, str]


@dataclass
class RemoteLease:
    """A request admitted by another process, seen by this one's accounting stream."""

    request_id: str
    tenant: str | None = None
    pool: str | None = None
    found: bool | None = None
    """None until the shared store answered; then whether the admission was found there."""
    settled: bool = False


def rejection_error(rejection: Rejection) -> GatewayError:
    return GatewayError(
        outcome=rejection.outcome,
        status=rejection.http_status,
        message=rejection.message,
        code=rejection.outcome.value,
        retry_after_s=rejection.retry_after_s,
        headers=dict(rejection.headers),
    )


class AdmissionController:
    """Turns scheduler decisions into resolved futures and keeps a timer for expiries."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self._waiting: dict[str, asyncio.Future[Grant]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    # -- lifecycle (no-ops here; the shared controller connects and runs background tasks) ----

    async def start(self) -> None:
        """Connect to the state store, if any."""

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = None

    def update_policy(self, policy: Policy) -> int:
        """Hot reload; queued requests the new policy cannot serve are answered. Returns how
        many were."""
        rejections = self.scheduler.update_policy(policy)
        self.resolve(rejections)
        self.pump()
        return len(rejections)

    # -- one request --------------------------------------------------------------------------

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        turn: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        return self._enqueue(ticket, turn)

    def _enqueue(self, ticket: Ticket, turn: asyncio.Future[Grant]) -> asyncio.Future[Grant]:
        rejection = self.scheduler.submit(ticket)
        if rejection is not None:
            if not turn.done():
                turn.set_exception(rejection_error(rejection))
            return turn
        self._waiting[ticket.request_id] = turn
        self.pump()
        return turn

    def cancel(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self.scheduler.cancel(request_id)

    def release(
        self,
        grant: Grant,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        self.scheduler.release(
            grant.lease_id, actual_input_tokens=input_tokens, actual_output_tokens=output_tokens
        )
        self.pump()

    def charge_output(self, grant: Grant, tokens: int) -> None:
        self.scheduler.charge_output(grant.lease_id, tokens)

    def hand_off(self, grant: Grant, still_ours: Callable[[], bool]) -> bool:
        """The admission stream ended and no accounting stream of this process took the
        request over. Here nobody else can: release now (True). The shared controller waits
        a moment for an accounting stream on another process instead (False)."""
        del still_ours
        self.release(grant)
        return True

    # -- accounting streams of requests admitted by another process ----------------------------

    def attach_remote(self, request_id: str) -> RemoteLease | None:
        """Only shared state can settle a request another process admitted."""
        del request_id
        return None

    def charge_remote(self, remote: RemoteLease, tokens: int) -> None:
        del remote, tokens

    def settle_remote(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        del remote, input_tokens, output_tokens

    def describe(self) -> dict[str, object]:
        """Where admission state lives and how it is doing (admin views)."""
        return {"backend": "memory"}

    # -- decisions ----------------------------------------------------------------------------

    def pump(self) -> None:
        """Apply every decision the scheduler can make now, then sleep till the next one."""
        for rejection in self.scheduler.poll():
            self._resolve_rejection(rejection)
        for admission in self.scheduler.dispatch():
            self._resolve_admission(admission)
        self._arm_timer()

    def resolve(self, rejections: list[Rejection]) -> None:
        """Answer requests the scheduler removed from its queues outside poll()."""
        for rejection in rejections:
            self._resolve_rejection(rejection)

    def _resolve_admission(self, admission: Admission) -> None:
        turn = self._waiting.pop(admission.ticket.request_id, None)
        if turn is None or turn.done():
            # Nobody waits for it any more: give the capacity straight back.
            self._abandon(admission)
            return
        turn.set_result(
            Grant(
                lease_id=admission.lease.lease_id,
                pool=admission.ticket.pool,
                wait_s=admission.wait_s,
                ratelimit_headers=dict(admission.ratelimit_headers),
            )
        )

    def _abandon(self, admission: Admission) -> None:
        self.scheduler.release(admission.lease.lease_id)

    def _resolve_rejection(self, rejection: Rejection) -> None:
        turn = self._waiting.pop(rejection.request_id, None)
        if turn is not None and not turn.done():
            turn.set_exception(rejection_error(rejection))

    def _arm_timer(self) -> None:
        wake_at = self.scheduler.next_deadline()
        if wake_at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = wake_at
        if wake_at is not None:
            delay = max(0.0, wake_at - self.scheduler.clock.now())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.pump()
