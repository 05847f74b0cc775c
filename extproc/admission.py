"""The asyncio adapter around the pure scheduler core: one awaited turn per request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from extproc.errors import GatewayError
from extproc.metrics import Metrics
from extproc.scheduler import Admission, Rejection, Scheduler, Ticket


@dataclass(frozen=True)
class Grant:
    """An admitted request's hold on pool capacity, released when its response ends."""

    lease_id: int
    pool: str
    wait_s: float
    ratelimit_headers: dict[str, str]


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

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        turn: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        rejection = self.scheduler.submit(ticket)
        if rejection is not None:
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
            self.scheduler.release(admission.lease.lease_id)
            return
        turn.set_result(
            Grant(
                lease_id=admission.lease.lease_id,
                pool=admission.ticket.pool,
                wait_s=admission.wait_s,
                ratelimit_headers=dict(admission.ratelimit_headers),
            )
        )

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
