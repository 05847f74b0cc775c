"""The live state one service process runs on, and the ports its streams use.

`Gateway` implements both stream ports (extproc.service.ports): admission streams queue
through it, and it keeps the requests they admitted by gateway request id, so the accounting
stream (observability filter) can find the admission it belongs to and settle it. A request
id this process did not admit is settled through the shared store (`state.backend: redis`;
extproc.service.remote). Every object it holds is built by extproc.service.composition.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from extproc.admission import AdmissionController, Grant, rejection_error
from extproc.endpoints import EndpointClass
from extproc.errors import GatewayError, overloaded, shutting_down
from extproc.estimation import TokenEstimator
from extproc.metrics import Metrics
from extproc.openai_request import PromptParts
from extproc.policy import Policy
from extproc.scheduler import Scheduler, Ticket, retry_after
from extproc.service.engine_poller import EnginePoller
from extproc.service.locality_feedback import LocalityFeedback
from extproc.service.overload import LagMonitor, OverloadDetector
from extproc.service.ports import AccountedLease
from extproc.service.reconcile import EngineLedger, Reconciler
from extproc.service.remote import RemoteRequestLease
from extproc.service.request import Request, Settlement

# An admission whose accounting stream never attached is forgotten after this long.
_UNCLAIMED_TTL_S = 120.0
_FIRST_BASE_TIMEOUT_S = 1.0


class Gateway:
    def __init__(
        self,
        policy: Policy,
        metrics: Metrics,
        estimator: TokenEstimator,
        scheduler: Scheduler,
        admission: AdmissionController,
        settlement: Settlement,
        reconciler: Reconciler | None,
        engine_poller: EnginePoller,
        overload: OverloadDetector,
    ) -> None:
        self._policy = policy
        self.metrics = metrics
        self.estimator = estimator
        self.scheduler = scheduler
        self._admission = admission
        self._settlement = settlement
        self.reconciler = reconciler
        self.engine_poller = engine_poller
        """Reads the engines' /metrics once per tick for the reconciler and the engine watcher."""
        self._registry: dict[str, Request] = {}
        self._remote: dict[str, RemoteRequestLease] = {}
        """Accounting streams of requests admitted by another process (shared state only)."""
        self._reconciling = False
        self.locality_feedback = LocalityFeedback(
            scheduler.locality, engine_poller, bytes_per_token=estimator.chat_bytes_per_token
        )
        self.overload = overload
        """Is the service falling behind, and whom to shed (extproc.service.overload)."""
        self.lag_monitor = LagMonitor(overload, self._after_overload_sample, self._nothing_held)
        self._accounting_sides: tuple[Callable[[float], float], ...] = ()
        self.closing = False
        """Draining: every new request is answered 503 + Retry-After (`shutting_down`)."""
        self.refused_closing = 0

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def ledger(self) -> EngineLedger | None:
        """Engine counters for correcting cut-short streams; None unless this process is
        its engines' only client and the policy asks for it."""
        return self._settlement.ledger

    async def start(self) -> None:
        """Connect the admission state store (Redis) and start its background tasks; a no-op
        for the memory store. Call before serving (otherwise the first request starts them)."""
        await self._admission.start()
        self.locality_feedback.start()
        self.lag_monitor.start()
        reconciler = self.reconciler
        if reconciler is not None and not self._reconciling:
            self._reconciling = True
            # Take the engines' bases now (they are idle before the first request), so cut-short
            # streams are corrected from the start; an engine not up yet is read later.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reconciler.run_once(), _FIRST_BASE_TIMEOUT_S)
            reconciler.start()

    async def close(self) -> None:
        await self.lag_monitor.stop()
        await self.engine_poller.stop()
        await self._admission.close()

    def forwarded_at(self, request_id: str) -> float | None:
        """When this process forwarded the request (its admission stream ended), if it did:
        how late an accounting process's attach comes is measured from there."""
        request = self._registry.get(request_id)
        return request.admission_ended_at if request is not None else None

    def accounting_runs_behind_by(self, behind: Callable[[float], float]) -> None:
        """The accounting side reports how far behind it is (a child process running the
        accounting streams, or counting in Envoy's late attach calls): a forwarded request's
        capacity waits that much longer for its attach. Both at once (a service taking the
        accounting filter and Envoy's counting calls, while Envoys move from one layout to the
        other): the one further behind counts."""
        sides = self._accounting_sides = (*self._accounting_sides, behind)
        self._settlement.accounting_behind = (
            behind if len(sides) == 1 else lambda forwarded_at: max(s(forwarded_at) for s in sides)
        )

    def track_engines(self, policy: Policy) -> None:
        ledger = self.ledger
        if ledger is None:
            return
        for name, pool in policy.pools.items():
            for endpoint in pool.endpoints:
                ledger.track(endpoint, name)

    def apply_policy(self, policy: Policy) -> int:
        """Hot reload: new requests use `policy`; queued and in-flight ones are kept, except
        the queued requests of removed tenants, which are answered with a clear error.
        Returns how many queued requests were answered that way."""
        self._policy = policy
        self.overload.configure(policy.source.gateway)
        self.estimator.configure(policy.source.estimation)
        self.track_engines(policy)
        return self._admission.update_policy(policy)

    def drain_queued(self, retry_after_s: int = 5) -> int:
        """Graceful drain: answer every still-queued request with 503 + Retry-After."""
        rejections = self.scheduler.reject_all_queued(
            retry_after_s, "the gateway is shutting down; retry on another replica"
        )
        self._admission.resolve(rejections)
        return len(rejections)

    # -- AdmissionPort ------------------------------------------------------------------------

    def estimate_prompt(self, prompt: PromptParts) -> int:
        return self.estimator.estimate_prompt(prompt)

    def now(self) -> float:
        return self.scheduler.clock.now()

    def refused_before_body(
        self, request_id: str, tenant: str, endpoint: EndpointClass
    ) -> GatewayError | None:
        rejection = self.scheduler.queue_full_whatever_the_body(request_id, tenant, endpoint)
        return None if rejection is None else rejection_error(rejection)

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        if self.closing:
            return self._refuse_closing()
        overload = self.overload
        overload.activity()  # an idle lag monitor samples at the short interval from now
        if overload.sheds(ticket.tenant):
            return self._shed_new(ticket)
        return self._admission.submit(ticket)

    def cancel(self, request_id: str) -> None:
        self._admission.cancel(request_id)

    def admitted(self, request: Request) -> None:
        self._settlement.count_admission()
        self._registry[request.request_id] = request
        if len(self._registry) % 256 == 0:
            self._prune_registry()

    def admission_stream_ended(self, request: Request) -> None:
        self._settlement.admission_ended(request)

    # -- the service falling behind (extproc.service.overload) -------------------------------

    def _shed_new(self, ticket: Ticket) -> asyncio.Future[Grant]:
        self._count_shed(ticket.tenant)
        return _refused(overloaded(ticket.tenant, self.scheduler.shed_retry_after(ticket)))

    def _refuse_closing(self) -> asyncio.Future[Grant]:
        self.refused_closing += 1
        return _refused(shutting_down(retry_after.DRAINING_S))

    def _nothing_held(self) -> bool:
        """Nothing queued, admitted or accounted here: the lag monitor may sample slowly."""
        scheduler = self.scheduler
        return not self._remote and scheduler.queued() == 0 and scheduler.inflight() == 0

    def _after_overload_sample(self, shedding: bool) -> None:
        self.metrics.event_loop_lag.set(self.overload.lag_s)
        if self.overload.cpu_wait is not None:
            self.metrics.cpu_wait.set(self.overload.cpu_wait)
        self.metrics.overloaded.set(1 if shedding else 0)
        if not shedding or not self.overload.shed_set:
            return
        rejections = self.scheduler.shed_queued_of(
            set(self.overload.shed_set),
            "the gateway is overloaded and this tenant is above its fair share: queued "
            "request shed",
        )
        if rejections:
            for rejection in rejections:
                self._count_shed(rejection.tenant)
            self._admission.resolve(rejections)
            self._admission.pump()

    def _count_shed(self, tenant: str) -> None:
        spec = self._policy.tenant(tenant)
        tier = spec.tier if spec is not None else "unknown"
        self.metrics.shed.labels(self.overload.reason or "lag", tier).inc()

    # -- AccountingPort -----------------------------------------------------------------------

    def attach(self, request_id: str) -> AccountedLease | None:
        request = self._registry.get(request_id)
        if request is not None:
            self.metrics.attached_admitting.inc()
            return self._settlement.attach(request, self._forget_local)
        remote = self._admission.attach_remote(request_id)
        if remote is None:
            return None
        self.metrics.attached_other.inc()
        self.overload.activity()  # its chunks cost this loop: sample at the short interval
        lease = RemoteRequestLease(
            remote, self._admission, self.metrics, lambda: self._policy, self._forget_remote
        )
        self._remote[request_id] = lease
        if len(self._remote) % 256 == 0:
            self._prune_remote()
        return lease

    def _forget_local(self, request_id: str) -> None:
        self._registry.pop(request_id, None)

    def _forget_remote(self, lease: RemoteRequestLease) -> None:
        if self._remote.get(lease.request_id) is lease:
            del self._remote[lease.request_id]

    def _prune_remote(self) -> None:
        cutoff = time.monotonic() - _UNCLAIMED_TTL_S * 10
        for request_id, lease in list(self._remote.items()):
            if lease.started < cutoff:
                del self._remote[request_id]

    def _prune_registry(self) -> None:
        cutoff = time.monotonic() - _UNCLAIMED_TTL_S
        stale = [rid for rid, r in self._registry.items() if self._settlement.is_stale(r, cutoff)]
        for request_id in stale:
            del self._registry[request_id]

    # -- observability ---------------------------------------------------------------------

    def recent_rejections(self) -> list[dict[str, object]]:
        """The last answers this process gave itself (newest first): when, who as identified,
        tier, pool, outcome, HTTP status, Retry-After and message."""
        return [record.as_json() for record in self._settlement.rejections]

    def state_view(self) -> dict[str, object]:
        """The admission state store: backend, and for Redis its mode (shared / local /
        closed), this process's replica id and its leases; and the correction of cut-short
        streams from engine counters (extproc.service.reconcile)."""
        view = dict(self._admission.describe())
        ledger = self.ledger
        view["reconciliation"] = (
            {"enabled": False}
            if ledger is None
            else {
                "enabled": True,
                "pending": ledger.pending(),
                "corrected": ledger.corrected,
                "given_up": ledger.given_up,
                "unattributed_tokens": ledger.unattributed_tokens,
                "engines_with_base": sorted(
                    endpoint for endpoint, e in ledger.engines.items() if e.base_prompt is not None
                ),
            }
        )
        return view


def _refused(error: GatewayError) -> asyncio.Future[Grant]:
    """A turn that is already answered with `error` (the request never queues)."""
    turn: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
    turn.set_exception(error)
    return turn
