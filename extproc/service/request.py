"""One request's record and what happens to it after its admission stream decided.

The admission stream (extproc.service.processor) fills in what the request is and how it
was decided. From then on only this module reads the record: the accounting stream settles
it through a `LocalLease` (real usage replaces estimates, tokens are counted, capacity is
freed), and it is counted and logged once (`Settlement.record`), whichever stream ends last.
Every answer the service gives itself passes there too: the last ones are kept for the admin
status page (`Settlement.rejections`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.admission import AdmissionController, Grant
from extproc.endpoints import endpoint_class
from extproc.errors import GatewayError
from extproc.estimation import TokenEstimator
from extproc.metrics import UNKNOWN_TENANT, InterTokenClock, Metrics
from extproc.openai_request import PromptParts
from extproc.scheduler import Scheduler
from extproc.service.reconcile import Correction, CutShort, EngineLedger, Reconciler
from extproc.sse import Usage
from extproc.types import Outcome

request_log = logging.getLogger("extproc.request")

ATTACH_GRACE_S = 1.0
"""How long a forwarded request waits for its accounting stream to attach
before its capacity is freed without one (that filter fails open). Envoy opens that stream
when the request is forwarded, before the engine answers, so it is late only by the event
loop's lag; a shared-state gate adds its own hand-off grace on top (extproc.state.gate)."""
ATTACH_WAIT_MAX_S = 30.0
"""The longest a forwarded request's capacity waits for an accounting side that reports it is
behind (`Settlement.accounting_behind`, extproc.service.accounting_process)."""
REJECTIONS_KEPT = 50
"""How many of the last answers the service gave itself `Settlement.rejections` keeps."""
_MESSAGE_CHARS = 200


@dataclass
class Request:
    request_id: str
    started: float
    path: str = ""
    tenant: str | None = None
    tier: str | None = None
    pool: str | None = None
    prompt: PromptParts | None = None
    """An inference request's prompt (what the estimator learns from at settlement)."""
    prompt_estimate: int = 0
    budget: int = 0
    grant: Grant | None = None
    forwarded: bool = False
    """The admission stream let the request go upstream (it ends right after)."""
    outcome: Outcome | None = None
    error: GatewayError | None = None
    # -- after the decision: written and read by this module only --------------------------
    accounting_attached: bool = False
    admission_ended_at: float | None = None
    released: bool = False
    settled: bool = False
    usage_input: int | None = None
    usage_output: int | None = None
    usage_provisional: bool = False
    """Cut short: the usage above is what passed Envoy; the reconciler corrects the charge."""
    upstream_status: int | None = None
    upstream: str | None = None
    recorded: bool = False


@dataclass(frozen=True, slots=True)
class RejectionRecord:
    """One answer the service gave itself instead of forwarding the request. `tenant` is the
    one the gateway identified (None before or without identification), never a claim."""

    at: float
    """Unix time the request's outcome was recorded."""
    tenant: str | None
    tier: str | None
    pool: str | None
    outcome: str
    status: int
    retry_after_s: int | None
    code: str
    message: str
    """The error's own text (it never quotes a key or a query string), cut to a few hundred
    characters."""

    @classmethod
    def of(cls, request: Request, error: GatewayError, at: float) -> RejectionRecord:
        return cls(
            at=at,
            tenant=request.tenant,
            tier=request.tier,
            pool=request.pool,
            outcome=error.outcome.value,
            status=error.status,
            retry_after_s=error.retry_after_s,
            code=error.code,
            message=error.message[:_MESSAGE_CHARS],
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "at": self.at, "tenant": self.tenant, "tier": self.tier, "pool": self.pool,
            "outcome": self.outcome, "status": self.status, "retry_after_s": self.retry_after_s,
            "code": self.code, "message": self.message,
        }  # fmt: skip


class Settlement:
    """What settling, counting and logging this process's requests needs."""

    def __init__(
        self,
        admission: AdmissionController,
        scheduler: Scheduler,
        metrics: Metrics,
        estimator: TokenEstimator,
        ledger: EngineLedger | None,
    ) -> None:
        self.admission = admission
        self.scheduler = scheduler
        self.metrics = metrics
        self.estimator = estimator
        self.ledger = ledger
        self.reconciler: Reconciler | None = None
        """Set by the composition root when cut-short streams are corrected."""
        self.admissions = 0
        """Requests admitted so far (the reconciler reads engines between admissions)."""
        self.rejections: deque[RejectionRecord] = deque(maxlen=REJECTIONS_KEPT)
        """The last answers the service gave itself, newest first."""
        self.accounting_behind: Callable[[float], float] = lambda forwarded_at: 0.0
        """How far behind an accounting process is (s), asked for a request forwarded at the
        given time that has not attached: its attach may come that much later than the grace,
        and freeing the capacity before would admit work the engines still run (set by
        extproc.service.main when the accounting runs in a child process)."""

    def count_admission(self) -> None:
        self.admissions += 1

    # -- the admission stream's end ---------------------------------------------------------

    def admission_ended(self, request: Request) -> None:
        """The admission stream closed. The service ends it right after the forward
        (extproc.service.server); ended before, the request never reached an engine."""
        request.admission_ended_at = time.monotonic()
        if request.grant is not None and not request.accounting_attached and not request.released:
            if request.forwarded:
                # The request is on its way to an engine and its accounting stream, opened by
                # Envoy right after the forward, may not have reached us yet: its capacity
                # stays taken meanwhile.
                asyncio.get_running_loop().call_later(
                    ATTACH_GRACE_S, self._unclaimed_after_grace, request
                )
                return
            self._hand_off(request)
        if not (request.accounting_attached and not request.settled):
            self.record(request)  # otherwise settle() records, once the tokens are known

    def _hand_off(self, request: Request) -> None:
        assert request.grant is not None
        request.released = self.admission.hand_off(
            request.grant, lambda: not (request.accounting_attached or request.released)
        )

    def _unclaimed_after_grace(self, request: Request) -> None:
        if request.accounting_attached or request.released:
            return  # settle() releases and records it
        ended = request.admission_ended_at
        behind = self.accounting_behind(ended) if ended is not None else 0.0
        if behind > 0 and ended is not None:
            # Attaches arrive `behind` late now: wait that long past the grace (re-checked).
            wait_until = ended + min(behind + ATTACH_GRACE_S, ATTACH_WAIT_MAX_S)
            if time.monotonic() < wait_until:
                asyncio.get_running_loop().call_later(
                    min(wait_until - time.monotonic(), ATTACH_GRACE_S),
                    self._unclaimed_after_grace,
                    request,
                )
                return
        self._hand_off(request)
        self.record(request)

    def is_stale(self, request: Request, cutoff: float) -> bool:
        return request.admission_ended_at is not None and request.admission_ended_at < cutoff

    # -- the accounting stream --------------------------------------------------------------

    def attach(self, request: Request, forget: Callable[[str], None]) -> LocalLease:
        """An accounting stream of this process takes the request over; `forget` drops it
        from the registry that found it, once settled."""
        request.accounting_attached = True
        return LocalLease(request, self, forget)

    def settle(self, request: Request, usage: Usage | None, output_seen: int) -> None:
        """The response ended: replace estimates by real usage, count tokens, free capacity."""
        if request.settled:
            return
        request.settled = True
        tenant = request.tenant or UNKNOWN_TENANT
        ledger, engine, pool = self.ledger, request.upstream, request.pool
        deferred = False
        if usage is not None:
            input_tokens, output_tokens = usage.prompt_tokens, usage.completion_tokens
            if request.prompt is not None and usage.prompt_tokens > 0:
                ratio = self.estimator.observe(
                    request.prompt, usage.prompt_tokens, estimated=request.prompt_estimate
                )
                self.metrics.estimation_error_of(self.estimator.mode).observe(ratio)
            if ledger is not None and engine is not None and pool is not None:
                ledger.completed(engine, pool, input_tokens, output_tokens)
        else:
            # Cut short (client gone, upstream reset): charge what passed Envoy now; the
            # reconciler corrects it from the engine's counters (extproc.service.reconcile).
            input_tokens, output_tokens = request.prompt_estimate, output_seen
            if engine is None and ledger is not None and pool is not None:
                engine = ledger.sole_engine(pool)
            if engine is None:
                # No engine ever answered (the client left before the response headers, or
                # Envoy answered itself) and none can correct it: the prompt is refunded
                # rather than charged at its estimate for good.
                input_tokens = 0
            if ledger is not None and engine is not None and pool is not None:
                item = CutShort(
                    request.request_id,
                    tenant,
                    pool,
                    input_tokens,
                    output_tokens,
                    time.monotonic(),
                    endpoint_class(request.path) or "chat",
                    fair_exempt=request.grant is not None and request.grant.fair_exempt,
                )
                deferred = ledger.cut_short(engine, item)
        request.usage_input, request.usage_output = input_tokens, output_tokens
        request.usage_provisional = deferred
        if not deferred:
            self.count_tokens(tenant, input_tokens, output_tokens)
        self._release(request, input_tokens, output_tokens)
        reconciler = self.reconciler
        if (
            reconciler is not None
            and pool is not None
            and self.scheduler.pool_inflight(pool) == 0  # cheap, and false under load
            and reconciler.ledger.pending()
        ):
            reconciler.wake()
        if request.admission_ended_at is not None:
            self.record(request)

    def _release(self, request: Request, input_tokens: int | None, output_tokens: int) -> None:
        if request.released or request.grant is None:
            return
        request.released = True
        self.admission.release(
            request.grant,
            input_tokens=input_tokens,
            output_tokens=None if input_tokens is None else output_tokens,
        )

    # -- tokens -----------------------------------------------------------------------------

    def count_tokens(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        self.metrics.tokens_of(tenant, "input").inc(input_tokens)
        self.metrics.tokens_of(tenant, "output").inc(output_tokens)

    def apply_correction(self, correction: Correction) -> None:
        """The engine's counters gave a cut-short request's exact count."""
        item = correction.item
        self.scheduler.correct_usage(
            item.tenant,
            item.pool,
            correction.input_tokens - item.input_tokens,
            correction.output_tokens - item.output_tokens,
            item.endpoint,
            fair=not item.fair_exempt,
        )
        self.count_tokens(item.tenant, correction.input_tokens, correction.output_tokens)

    def count_cut_short(self, item: CutShort) -> None:
        """No exact count came in time: the provisional charge stands."""
        self.count_tokens(item.tenant, item.input_tokens, item.output_tokens)

    # -- observability ----------------------------------------------------------------------

    def record(self, request: Request) -> None:
        """Count the request's outcome and write its one log line (once per request, even
        when the accounting stream attaches after the admission stream has ended)."""
        assert request.outcome is not None
        if request.recorded:
            return
        request.recorded = True
        tenant = request.tenant or UNKNOWN_TENANT
        tier = request.tier or UNKNOWN_TENANT
        pool = request.pool or "none"
        grant = request.grant
        self.metrics.requests_of(tenant, tier, pool, request.outcome.value).inc()
        if grant is not None:
            self.metrics.queue_wait_of(tenant, tier).observe(grant.wait_s)
        if request.error is not None:
            self.rejections.appendleft(RejectionRecord.of(request, request.error, time.time()))
        if request_log.isEnabledFor(logging.INFO):
            entry = {
                "request_id": request.request_id,
                "tenant": request.tenant,
                "tier": request.tier,
                "pool": request.pool,
                "path": request.path,
                "outcome": request.outcome.value,
                "status": request.error.status if request.error else None,
                "queue_wait_ms": round(grant.wait_s * 1000.0, 2) if grant else None,
                "estimated_prompt_tokens": request.prompt_estimate or None,
                "budget_tokens": request.budget or None,
                "input_tokens": request.usage_input,
                "output_tokens": request.usage_output,
                "tokens_provisional": request.usage_provisional,
                "upstream_status": request.upstream_status,
                "duration_ms": round((time.monotonic() - request.started) * 1000.0, 2),
            }
            request_log.info(orjson.dumps(entry).decode())


class LocalLease:
    """The accounting stream's hold on a request this process admitted."""

    def __init__(
        self, request: Request, settlement: Settlement, forget: Callable[[str], None]
    ) -> None:
        self._request = request
        self._settlement = settlement
        self._forget = forget
        tenant, pool = request.tenant, request.pool
        self._inter_token = InterTokenClock(
            settlement.metrics.inter_token(tenant, pool)  # its cached child
            if tenant is not None and pool is not None
            else None
        )

    def response_started(self, status: int, upstream: str | None) -> None:
        self._request.upstream_status = status
        self._request.upstream = upstream

    def first_byte(self, at: float) -> None:
        request = self._request
        if request.tenant is not None and request.pool is not None:
            metrics = self._settlement.metrics
            metrics.ttft_of(request.tenant, request.pool).observe(at - request.started)
        if request.grant is not None and not request.released:
            # `at` is this host's monotonic clock, as every caller's is
            ago = max(0.0, time.monotonic() - at)
            self._settlement.admission.first_token(request.grant, ago)

    def charge_output(self, tokens: int, largest_gap: float | None = None) -> None:
        # Called once per chunk (or batch of chunks) that carries output tokens (tokens > 0).
        self._inter_token.tokens_arrived(tokens, time.monotonic(), largest_gap)
        request = self._request
        if request.grant is not None and not request.released:
            self._settlement.admission.charge_output(request.grant, tokens, largest_gap)

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        self._forget(self._request.request_id)
        self._settlement.settle(self._request, usage, output_seen)
