"""The asyncio adapter around the pure scheduler core: one awaited turn per request.

One `AdmissionController` serves every state backend. What differs is its `AdmissionGate`:
where an admission the local scheduler chose becomes final. `LocalGate` (state backend
`memory`) grants at once; `extproc.state.gate.RedisGate` grants asynchronously, once the
shared store agreed (and takes a request's budgets there before it joins the local queue).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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
    engine_priority: int | None = None
    """The `priority` for the forwarded body (Admission.engine_priority)."""
    replica: int | None = None
    """The pool endpoint the locality index chose (fairness dlpm); None: Envoy balances."""
    fair_exempt: bool = False
    """Admitted through the headroom, outside the fair share (`Lease.fair_exempt`)."""


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


class GateHost(Protocol):
    """What a gate may ask of the controller it decides for."""

    scheduler: Scheduler

    def enqueue(self, ticket: Ticket, turn: asyncio.Future[Grant]) -> None: ...

    def grant(self, admission: Admission) -> None: ...

    def waiting_for(self, request_id: str) -> asyncio.Future[Grant] | None: ...

    def answer(self, request_id: str, error: GatewayError) -> None: ...

    def release(
        self, grant: Grant, input_tokens: int | None = None, output_tokens: int | None = None
    ) -> None: ...

    def resolve(self, rejections: list[Rejection]) -> None: ...

    def pump(self) -> None: ...


class AdmissionGate(Protocol):
    """Where admission state lives beyond this process's scheduler."""

    def bind(self, host: GateHost) -> None: ...

    async def start(self) -> None:
        """Connect to the state store, if any."""

    async def close(self) -> None: ...

    def adopt_policy(self, policy: Policy) -> Policy:
        """A (re)loaded policy: the one the local scheduler enforces from now on (a share of
        it while the store is away)."""

    def submit(self, ticket: Ticket, turn: asyncio.Future[Grant]) -> None:
        """A new request: enqueue it (`GateHost.enqueue`) now or later, or answer `turn`."""

    def dispatching(self) -> bool:
        """Whether the scheduler may admit anything now."""

    def propose(self, admission: Admission) -> None:
        """The scheduler chose this admission: grant it (`GateHost.grant`) now or later."""

    def after_pump(self) -> None: ...

    def withdrawn(self, request_id: str) -> None:
        """The request left the queue without being admitted (cancelled or rejected)."""

    def released(self, lease_id: int, input_tokens: int | None, output_tokens: int | None) -> None:
        """An admitted request ended (already released in the scheduler)."""

    def charged(self, lease_id: int, tokens: int) -> None: ...

    def hand_off(self, grant: Grant, still_ours: Callable[[], bool]) -> bool:
        """The admission stream ended and no accounting stream of this process took the
        request over. True: released now; False: the gate waits for an accounting stream on
        another process and releases later if none attaches."""

    def attach_remote(self, request_id: str) -> RemoteLease | None:
        """An accounting stream for a request this process did not admit; None if no other
        process can have admitted it."""

    def charge_remote(self, remote: RemoteLease, tokens: int) -> None: ...

    def settle_remote(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None: ...

    def describe(self) -> dict[str, object]: ...


class LocalGate:
    """State backend `memory`: this process is the only one; every proposal is granted."""

    def __init__(self) -> None:
        self._host: GateHost | None = None

    def bind(self, host: GateHost) -> None:
        self._host = host

    @property
    def host(self) -> GateHost:
        assert self._host is not None, "bind() the gate to its controller first"
        return self._host

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def adopt_policy(self, policy: Policy) -> Policy:
        return policy

    def submit(self, ticket: Ticket, turn: asyncio.Future[Grant]) -> None:
        self.host.enqueue(ticket, turn)

    def dispatching(self) -> bool:
        return True

    def propose(self, admission: Admission) -> None:
        self.host.grant(admission)

    def after_pump(self) -> None:
        pass

    def withdrawn(self, request_id: str) -> None:
        pass

    def released(self, lease_id: int, input_tokens: int | None, output_tokens: int | None) -> None:
        pass

    def charged(self, lease_id: int, tokens: int) -> None:
        pass

    def hand_off(self, grant: Grant, still_ours: Callable[[], bool]) -> bool:
        del still_ours  # nobody else can take it over
        self.host.release(grant)
        return True

    def attach_remote(self, request_id: str) -> RemoteLease | None:
        del request_id  # only shared state can settle a request another process admitted
        return None

    def charge_remote(self, remote: RemoteLease, tokens: int) -> None:
        del remote, tokens

    def settle_remote(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        del remote, input_tokens, output_tokens

    def describe(self) -> dict[str, object]:
        return {"backend": "memory"}


class AdmissionController:
    """Turns scheduler decisions into resolved futures and keeps a timer for expiries."""

    def __init__(
        self, scheduler: Scheduler, metrics: Metrics, gate: AdmissionGate | None = None
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.gate: AdmissionGate = gate if gate is not None else LocalGate()
        self._waiting: dict[str, asyncio.Future[Grant]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.gate.bind(self)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the state store (a no-op in memory)."""
        await self.gate.start()

    async def close(self) -> None:
        await self.gate.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = None

    def update_policy(self, policy: Policy) -> int:
        """Hot reload; queued requests the new policy cannot serve are answered. Returns how
        many were."""
        rejections = self.scheduler.update_policy(self.gate.adopt_policy(policy))
        self.resolve(rejections)
        self.pump()
        return len(rejections)

    # -- one request --------------------------------------------------------------------------

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        turn: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self.gate.submit(ticket, turn)
        return turn

    def enqueue(self, ticket: Ticket, turn: asyncio.Future[Grant]) -> None:
        """Queue the request in the scheduler (or answer its rejection)."""
        rejection = self.scheduler.submit(ticket)
        if rejection is not None:
            if not turn.done():
                turn.set_exception(rejection_error(rejection))
            return
        self._waiting[ticket.request_id] = turn
        self.pump()

    def waiting_for(self, request_id: str) -> asyncio.Future[Grant] | None:
        return self._waiting.get(request_id)

    def answer(self, request_id: str, error: GatewayError) -> None:
        """Fail a waiting request with `error` (the gate refused it for good)."""
        turn = self._waiting.pop(request_id, None)
        if turn is not None and not turn.done():
            turn.set_exception(error)

    def cancel(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self.scheduler.cancel(request_id)
        self.gate.withdrawn(request_id)

    def release(
        self,
        grant: Grant,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        self.scheduler.release(
            grant.lease_id, actual_input_tokens=input_tokens, actual_output_tokens=output_tokens
        )
        self.gate.released(grant.lease_id, input_tokens, output_tokens)
        self.pump()

    def charge_output(self, grant: Grant, tokens: int, largest_gap: float | None = None) -> None:
        self.scheduler.charge_output(grant.lease_id, tokens, largest_gap)
        self.gate.charged(grant.lease_id, tokens)

    def first_token(self, grant: Grant, ago: float = 0.0) -> None:
        """The request's first token passed (`ago` seconds before now): its prompt is no
        longer being prefilled, which may let a paced backlogged request go."""
        if self.scheduler.first_token(grant.lease_id, ago):
            self.pump()

    def hand_off(self, grant: Grant, still_ours: Callable[[], bool]) -> bool:
        """The admission stream ended and no accounting stream of this process took the
        request over: True if released now (see `AdmissionGate.hand_off`)."""
        return self.gate.hand_off(grant, still_ours)

    # -- accounting streams of requests admitted by another process ----------------------------

    def attach_remote(self, request_id: str) -> RemoteLease | None:
        return self.gate.attach_remote(request_id)

    def charge_remote(self, remote: RemoteLease, tokens: int) -> None:
        self.gate.charge_remote(remote, tokens)

    def settle_remote(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        self.gate.settle_remote(remote, input_tokens, output_tokens)

    def describe(self) -> dict[str, object]:
        """Where admission state lives and how it is doing (admin views)."""
        return self.gate.describe()

    # -- decisions ----------------------------------------------------------------------------

    def pump(self) -> None:
        """Apply every decision the scheduler can make now, then sleep till the next one."""
        for rejection in self.scheduler.poll():
            self._resolve_rejection(rejection)
        if self.gate.dispatching():
            for admission in self.scheduler.dispatch():
                self.gate.propose(admission)
        self._arm_timer()
        self.gate.after_pump()

    def resolve(self, rejections: list[Rejection]) -> None:
        """Answer requests the scheduler removed from its queues outside poll()."""
        for rejection in rejections:
            self._resolve_rejection(rejection)

    def grant(self, admission: Admission) -> None:
        """The admission is final: hand the grant to whoever waits for it."""
        turn = self._waiting.pop(admission.ticket.request_id, None)
        if turn is None or turn.done():
            # Nobody waits for it any more: give the capacity straight back.
            self.scheduler.release(admission.lease.lease_id)
            self.gate.released(admission.lease.lease_id, None, None)
            return
        turn.set_result(
            Grant(
                lease_id=admission.lease.lease_id,
                pool=admission.ticket.pool,
                wait_s=admission.wait_s,
                ratelimit_headers=dict(admission.ratelimit_headers),
                engine_priority=admission.engine_priority,
                replica=admission.lease.replica,
                fair_exempt=admission.lease.fair_exempt,
            )
        )

    def _resolve_rejection(self, rejection: Rejection) -> None:
        turn = self._waiting.pop(rejection.request_id, None)
        if turn is not None and not turn.done():
            turn.set_exception(rejection_error(rejection))
        self.gate.withdrawn(rejection.request_id)

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
