"""The live state one service process runs on: policy, estimator, admission, metrics.

Admitted requests are kept in a registry by gateway request id, so the accounting stream
(observability filter) can find the admission it belongs to and settle it. With shared state
(`state.backend: redis`) the accounting stream may run on another process than the admission
stream: a request id this process did not admit is then settled through the shared store
(`AdmissionController.attach_remote`), and the admitting process waits a moment before it
releases an admission whose stream ended without an accounting stream of its own
(`AdmissionController.hand_off`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import orjson

from extproc.admission import RemoteLease
from extproc.estimation import TokenEstimator
from extproc.metrics import UNKNOWN_TENANT, Metrics
from extproc.policy import Policy
from extproc.scheduler import MonotonicClock
from extproc.scheduler.adaptive import EngineCapacities
from extproc.service.engine_poller import EnginePoller
from extproc.service.reconcile import (
    Correction,
    CutShort,
    EngineLedger,
    ReconcileHooks,
    Reconciler,
)
from extproc.sse import Usage
from extproc.state import build_admission

if TYPE_CHECKING:
    from extproc.service.processor import RequestState

request_log = logging.getLogger("extproc.request")

# An admission whose accounting stream never attached is forgotten after this long.
_UNCLAIMED_TTL_S = 120.0
_FIRST_BASE_TIMEOUT_S = 1.0


class Gateway:
    def __init__(
        self, policy: Policy, metrics: Metrics | None = None, sole_client: bool = True
    ) -> None:
        """`sole_client`: no other process of this service sends to the same engines (needed
        to correct cut-short streams from the engines' counters)."""
        self.policy = policy
        self.clock = MonotonicClock()
        self.metrics = metrics or Metrics()
        self.estimator = TokenEstimator(policy.source.estimation)
        # Pools with an `adaptive` section get a limit the engine watcher moves.
        self.capacities = EngineCapacities()
        # One reader of the engines' /metrics for the engine watcher and the reconciler.
        self.engine_poller = EnginePoller()
        self.scheduler, self.admission = build_admission(
            policy, self.clock, self.metrics, capacity_factory=self.capacities.factory
        )
        self.registry: dict[str, RequestState] = {}
        self.remote: dict[str, tuple[RequestState, RemoteLease]] = {}
        """Accounting streams of requests admitted by another process (shared state only)."""
        self.admissions = 0
        self.ledger: EngineLedger | None = None
        self.reconciler: Reconciler | None = None
        if (
            sole_client
            and policy.source.gateway.reconcile_cut_short
            and policy.source.state.backend == "memory"
        ):
            self.ledger = EngineLedger()
            self._track_engines(policy)

    async def start(self) -> None:
        """Connect the admission state store (Redis) and start its background tasks; a no-op
        for the memory store. Call before serving (otherwise the first request starts them)."""
        await self.admission.start()
        if self.ledger is not None and self.reconciler is None:
            hooks = ReconcileHooks(
                pool_idle=lambda pool: self.scheduler.pool_inflight(pool) == 0,
                admissions=lambda: self.admissions,
                apply=self._apply_correction,
                give_up=self._count_cut_short,
                now=time.monotonic,
            )
            self.reconciler = Reconciler(self.ledger, hooks, self.engine_poller)
            # Take the engines' bases now (they are idle before the first request), so cut-short
            # streams are corrected from the start; an engine not up yet is read later.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reconciler.run_once(), _FIRST_BASE_TIMEOUT_S)
            self.reconciler.start()

    async def close(self) -> None:
        await self.engine_poller.stop()
        await self.admission.close()

    def _track_engines(self, policy: Policy) -> None:
        assert self.ledger is not None
        for name, pool in policy.pools.items():
            for endpoint in pool.endpoints:
                self.ledger.track(endpoint, name)

    def apply_policy(self, policy: Policy) -> int:
        """Hot reload: new requests use `policy`; queued and in-flight ones are kept, except
        the queued requests of removed tenants, which are answered with a clear error.
        Returns how many queued requests were answered that way."""
        self.policy = policy
        self.estimator.configure(policy.source.estimation)
        if self.ledger is not None:
            self._track_engines(policy)
        return self.admission.update_policy(policy)

    def drain_queued(self, retry_after_s: int = 5) -> int:
        """Graceful drain: answer every still-queued request with 503 + Retry-After."""
        rejections = self.scheduler.reject_all_queued(
            retry_after_s, "the gateway is shutting down; retry on another replica"
        )
        self.admission.resolve(rejections)
        return len(rejections)

    # -- lifecycle of one admitted request -------------------------------------------------

    def admitted(self, state: RequestState) -> None:
        self.admissions += 1
        self.registry[state.request_id] = state
        if len(self.registry) % 256 == 0:
            self._prune_registry()

    def attach_accounting(self, request_id: str) -> RequestState | None:
        state = self.registry.get(request_id)
        if state is not None:
            state.accounting_attached = True
            return state
        remote = self.admission.attach_remote(request_id)
        if remote is None:
            return None
        from extproc.service.processor import RequestState

        state = RequestState(request_id=request_id, started=time.monotonic())
        state.accounting_attached = True
        self.remote[request_id] = (state, remote)
        if len(self.remote) % 256 == 0:
            self._prune_remote()
        return state

    def _remote_of(self, state: RequestState) -> RemoteLease | None:
        item = self.remote.get(state.request_id)
        return item[1] if item is not None and item[0] is state else None

    def admission_stream_ended(self, state: RequestState) -> None:
        """The admission stream closed. Envoy closes it right after the response headers,
        so unless the accounting stream took over, the request never reached an engine."""
        state.admission_ended_at = time.monotonic()
        if state.grant is not None and not state.accounting_attached and not state.released:
            released = self.admission.hand_off(
                state.grant, lambda: not (state.accounting_attached or state.released)
            )
            state.released = released
        if not (state.accounting_attached and not state.settled):
            self.record(state)  # otherwise settle() records, once the tokens are known

    def charge_output(self, state: RequestState, tokens: int) -> None:
        remote = self._remote_of(state)
        if remote is not None:
            self.admission.charge_remote(remote, tokens)
            return
        if state.grant is not None and not state.released:
            state.output_charged += tokens
            self.admission.charge_output(state.grant, tokens)

    def observe_first_byte(self, state: RequestState, at: float) -> None:
        remote = self._remote_of(state)
        if remote is not None:
            state.tenant, state.pool = remote.tenant, remote.pool
        if state.tenant is not None and state.pool is not None:
            self.metrics.ttft_of(state.tenant, state.pool).observe(at - state.started)

    def settle(self, state: RequestState, usage: Usage | None, output_seen: int) -> None:
        """The response ended: replace estimates by real usage, count tokens, free capacity."""
        remote = self._remote_of(state)
        if remote is not None:
            self._settle_remote(state, remote, usage, output_seen)
            return
        self.registry.pop(state.request_id, None)
        if state.settled:
            return
        state.settled = True
        tenant = state.tenant or UNKNOWN_TENANT
        ledger, engine, pool = self.ledger, state.upstream, state.pool
        deferred = False
        if usage is not None:
            input_tokens, output_tokens = usage.prompt_tokens, usage.completion_tokens
            if state.inference is not None and usage.prompt_tokens > 0:
                ratio = self.estimator.observe(
                    state.inference.prompt, usage.prompt_tokens, estimated=state.prompt_estimate
                )
                self.metrics.estimation_error_of(self.estimator.mode).observe(ratio)
            if ledger is not None and engine is not None and pool is not None:
                ledger.completed(engine, pool, input_tokens, output_tokens)
        else:
            # Cut short (client gone, upstream reset): charge what passed Envoy now; the
            # reconciler corrects it from the engine's counters (extproc.service.reconcile).
            input_tokens, output_tokens = state.prompt_estimate, output_seen
            if ledger is not None and engine is not None and pool is not None:
                item = CutShort(
                    state.request_id, tenant, pool, input_tokens, output_tokens, time.monotonic()
                )
                deferred = ledger.cut_short(engine, item)
        state.usage_input, state.usage_output = input_tokens, output_tokens
        state.usage_provisional = deferred
        if not deferred:
            self._count_tokens(tenant, input_tokens, output_tokens)
        self._release(state, input_tokens, output_tokens)
        if (
            self.reconciler is not None
            and pool is not None
            and self.scheduler.pool_inflight(pool) == 0  # cheap, and false under load
            and self.reconciler.ledger.pending()
        ):
            self.reconciler.wake()
        if state.admission_ended_at is not None:
            self.record(state)

    def _apply_correction(self, correction: Correction) -> None:
        """The engine's counters gave a cut-short request's exact count."""
        item = correction.item
        self.scheduler.correct_usage(
            item.tenant,
            item.pool,
            correction.input_tokens - item.input_tokens,
            correction.output_tokens - item.output_tokens,
        )
        self._count_tokens(item.tenant, correction.input_tokens, correction.output_tokens)

    def _count_cut_short(self, item: CutShort) -> None:
        """No exact count came in time: the provisional charge stands."""
        self._count_tokens(item.tenant, item.input_tokens, item.output_tokens)

    def _count_tokens(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        self.metrics.tokens_of(tenant, "input").inc(input_tokens)
        self.metrics.tokens_of(tenant, "output").inc(output_tokens)

    def _release(self, state: RequestState, input_tokens: int | None, output_tokens: int) -> None:
        if state.released or state.grant is None:
            return
        state.released = True
        self.admission.release(
            state.grant,
            input_tokens=input_tokens,
            output_tokens=None if input_tokens is None else output_tokens,
        )

    def _settle_remote(
        self, state: RequestState, remote: RemoteLease, usage: Usage | None, output_seen: int
    ) -> None:
        """Settle a request another process admitted: usage to the shared store, tokens to
        this process's metrics (the admitting process counts the request itself)."""
        del self.remote[state.request_id]
        if state.settled:
            return
        state.settled = True
        if usage is not None:
            input_tokens: int | None = usage.prompt_tokens
            output_tokens = usage.completion_tokens
        else:
            input_tokens, output_tokens = None, output_seen
        self.admission.settle_remote(remote, input_tokens, output_tokens)
        if remote.tenant is not None and remote.tenant in self.policy.tenants:
            if input_tokens is not None:
                self.metrics.tokens_of(remote.tenant, "input").inc(input_tokens)
            self.metrics.tokens_of(remote.tenant, "output").inc(output_tokens)

    def _prune_remote(self) -> None:
        cutoff = time.monotonic() - _UNCLAIMED_TTL_S * 10
        for request_id, (state, _remote) in list(self.remote.items()):
            if state.started < cutoff:
                del self.remote[request_id]

    def _prune_registry(self) -> None:
        cutoff = time.monotonic() - _UNCLAIMED_TTL_S
        stale = [
            rid
            for rid, s in self.registry.items()
            if s.admission_ended_at is not None and s.admission_ended_at < cutoff
        ]
        for request_id in stale:
            del self.registry[request_id]

    # -- observability ---------------------------------------------------------------------

    def record(self, state: RequestState) -> None:
        """Count the request's outcome and write its one log line (once per request, even
        when the accounting stream attaches after the admission stream has ended)."""
        assert state.outcome is not None
        if state.recorded:
            return
        state.recorded = True
        tenant = state.tenant or UNKNOWN_TENANT
        tier = state.tier or UNKNOWN_TENANT
        pool = state.pool or "none"
        self.metrics.requests_of(tenant, tier, pool, state.outcome.value).inc()
        if state.grant is not None:
            self.metrics.queue_wait_of(tenant, tier).observe(state.grant.wait_s)
        if request_log.isEnabledFor(logging.INFO):
            entry = {
                "request_id": state.request_id,
                "tenant": state.tenant,
                "tier": state.tier,
                "pool": state.pool,
                "path": state.path,
                "outcome": state.outcome.value,
                "status": state.error.status if state.error else None,
                "queue_wait_ms": round(state.grant.wait_s * 1000.0, 2) if state.grant else None,
                "estimated_prompt_tokens": state.prompt_estimate or None,
                "budget_tokens": state.budget or None,
                "input_tokens": state.usage_input,
                "output_tokens": state.usage_output,
                "tokens_provisional": state.usage_provisional,
                "upstream_status": state.upstream_status,
                "duration_ms": round((time.monotonic() - state.started) * 1000.0, 2),
            }
            request_log.info(orjson.dumps(entry).decode())

    def state_view(self) -> dict[str, object]:
        """The admission state store: backend, and for Redis its mode (shared / local /
        closed), this process's replica id and its leases; and the correction of cut-short
        streams from engine counters (extproc.service.reconcile)."""
        view = dict(self.admission.describe())
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
