"""`RedisGate`: the admission gate whose budgets, capacity and fair share are held in Redis.

The design (submit, gate, backlog registry, release, leases, failure modes) is described in
extproc.state. This module is the request flow: take the budgets, propose the local
scheduler's choices to the shared store, release, hand off. Keeping other processes in view
is extproc.state.sync; losing and finding Redis again is extproc.state.recovery; settling
requests other processes admitted is extproc.state.remote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from functools import partial

from extproc.admission import GateHost, Grant, RemoteLease, rejection_error
from extproc.errors import GatewayError
from extproc.policy import Policy
from extproc.scheduler import Admission, Take, TakeResult, Ticket, retry_after
from extproc.scheduler.ratelimit import settled_buckets
from extproc.state import ops
from extproc.state.backend import RedisBackend, StateUnavailable
from extproc.state.batcher import Batcher, failure
from extproc.state.capacity import SharedCapacity
from extproc.state.fallback import local_share
from extproc.state.leases import HeldLeases
from extproc.state.metrics import StateMetrics
from extproc.state.mode import Mode
from extproc.state.ops import Reply, reply_list
from extproc.state.recovery import Recovery
from extproc.state.remote import RemoteSettlements
from extproc.state.store import SharedLimitStore
from extproc.state.sync import PeerSync
from extproc.types import Outcome

log = logging.getLogger("extproc.state")

HANDOFF_GRACE_S = 0.5
"""How long an admission whose stream ended waits for an accounting stream elsewhere."""


def new_replica_id() -> str:
    return f"{secrets.token_hex(4)}-{os.getpid()}"


def _unavailable(message: str, retry_after_s: int) -> GatewayError:
    return GatewayError(
        outcome=Outcome.UNAVAILABLE, status=503, code=Outcome.UNAVAILABLE.value,
        message=message, retry_after_s=retry_after_s,
    )  # fmt: skip


class RedisGate:
    def __init__(
        self,
        policy: Policy,
        backend: RedisBackend,
        store: SharedLimitStore,
        capacities: dict[str, SharedCapacity],
        state_metrics: StateMetrics,
    ) -> None:
        self.policy = policy
        self.settings = policy.source.state
        self.backend = backend
        self.replica = backend.replica
        self.store = store
        self.capacities = capacities
        self.state_metrics = state_metrics
        self.batcher = Batcher(self._run_batch)
        self.mode = Mode.SHARED
        self.held = HeldLeases()
        self.tentative: dict[str, int] = {}
        self.pregranted: dict[str, tuple[float, Reply]] = {}
        """Leases granted with the bucket take (the fast path), until the request dispatches."""
        self.local_only: dict[int, Admission] = {}
        """Admissions granted in local mode, registered in Redis once it is back."""
        self.sync = PeerSync(self)
        self.recovery = Recovery(self)
        self.remote = RemoteSettlements(self)
        self._host: GateHost | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self.closed = False
        state_metrics.set_mode(self.mode.value)

    def bind(self, host: GateHost) -> None:
        self._host = host

    @property
    def host(self) -> GateHost:
        assert self._host is not None, "bind() the gate to its controller first"
        return self._host

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check Redis once (entering the failure mode if it does not answer), then run the
        lease/backlog heartbeat and the event subscription."""
        if self._started:
            return
        self._launch()
        try:
            await self.backend.ping(max(self.settings.timeout, 0.5))
        except StateUnavailable as error:
            self.failed(error)

    def _launch(self) -> None:
        if self._started or self.closed:
            return
        self._started = True
        self._tasks = self.sync.launch()
        log.info(
            "shared state: redis",
            extra={"fields": {"replica": self.replica, "prefix": self.backend.prefix}},
        )

    async def close(self) -> None:
        self.closed = True
        self.sync.stop_recheck()
        tasks = [*self._tasks, *self.recovery.tasks()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.batcher.close()
        await self.backend.close()

    def adopt_policy(self, policy: Policy) -> Policy:
        self.policy = policy
        if policy.source.state != self.settings:
            log.warning("state settings changed in the policy: they take effect on restart")
        return policy if self.mode is not Mode.LOCAL else self.share(policy)

    def share(self, policy: Policy) -> Policy:
        return local_share(policy, self.settings.replicas)

    def failed(self, error: BaseException) -> None:
        self.recovery.failed(error)

    def queue_replay(self, op: ops.Op) -> None:
        self.recovery.queue_replay(op)

    def mode_changed(self, shared: bool) -> None:
        self.sync.mode_changed(shared)

    # -- batches ----------------------------------------------------------------------------------

    async def _run_batch(self, batch: Sequence[ops.Op]) -> list[Reply]:
        began = time.perf_counter()
        replies = await self.backend.run(batch)
        self.state_metrics.round_trip.observe(time.perf_counter() - began)
        self.state_metrics.batch_size.observe(len(batch))
        return replies

    def call(self, op: ops.Op, then: Callable[[asyncio.Future[Reply]], None]) -> None:
        """Send `op`; `then` gets its reply (or failure) as a done future."""
        self.batcher.submit(op).add_done_callback(then)

    def send(self, op: ops.Op) -> None:
        """Fire-and-forget operation; a failure switches the mode."""
        self.call(op, self._check_fired)

    def _check_fired(self, future: asyncio.Future[Reply]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self.failed(error)

    # -- submit: buckets in Redis, then the local queue ----------------------------------------

    def submit(self, ticket: Ticket, turn: asyncio.Future[Grant]) -> None:
        self._launch()
        if self.mode is Mode.CLOSED:
            self._reject_closed(turn)
            return
        if self.mode is Mode.LOCAL:
            self.host.enqueue(ticket, turn)
            return
        scheduler = self.host.scheduler
        rejection = scheduler.check(ticket)
        if rejection is not None:
            turn.set_exception(rejection_error(rejection))
            return
        takes = scheduler.rate_takes(ticket)
        if not takes:
            self.host.enqueue(ticket, turn)
            return
        op: ops.Op = ops.TakeBuckets(tuple(takes))
        if self._uncontended(ticket):
            op = ops.TakeAndGate(tuple(takes), self.gate_op(ticket))
        self.call(op, partial(self._after_take, ticket, takes, turn))

    def _uncontended(self, ticket: Ticket) -> bool:
        """Would the local scheduler dispatch this request at once? (then gate it right away)"""
        capacity = self.capacities.get(ticket.pool)
        return (
            capacity is not None
            and capacity.fits(ticket.budget)
            and not self.host.scheduler.queued_tenants(ticket.pool)
        )

    def _after_take(
        self,
        ticket: Ticket,
        takes: list[Take],
        turn: asyncio.Future[Grant],
        future: asyncio.Future[Reply],
    ) -> None:
        error = failure(future)
        if error is not None:
            self.failed(error)
            if turn.done():
                return
            if self.mode is Mode.CLOSED:
                self._reject_closed(turn)
            else:
                self.host.enqueue(ticket, turn)
            return
        reply = future.result()
        gated = reply.get("g") if "t" in reply else None
        if "t" in reply:
            reply = reply["t"]
        clock = self.host.scheduler.clock
        if isinstance(gated, dict):
            if gated.get("ok"):
                self.pregranted[ticket.request_id] = (clock.now(), gated)
            else:
                self.observe(ticket.pool, gated)
        wait = float(reply.get("w", 0))
        result = TakeResult(
            ok=bool(reply.get("ok")),
            levels=tuple(float(str(level)) for level in reply_list(reply.get("l"))),
            wait_s=None if wait < 0 else wait,
        )
        if turn.done():  # the client left while the buckets were being taken
            if result.ok:
                self._refund(takes)
            self.withdrawn(ticket.request_id)
            return
        self.store.remember(takes, result.levels, clock.now())
        self.store.prepare(result)
        self.host.enqueue(ticket, turn)
        unused = self.store.unused()
        if unused is not None and unused.ok:
            self._refund(takes)
            self.withdrawn(ticket.request_id)

    def withdrawn(self, request_id: str) -> None:
        """A pre-granted request left the queue without being dispatched: free its lease."""
        if self.pregranted.pop(request_id, None) is not None:
            self.send(ops.Release(request_id))

    def _refund(self, takes: list[Take]) -> None:
        now = self.host.scheduler.clock.now()
        for take in takes:
            self.store.give_back(take.bucket, take.cost, now)

    def _reject_closed(self, turn: asyncio.Future[Grant]) -> None:
        self.state_metrics.closed_rejections.inc()
        turn.set_exception(
            _unavailable(
                "the gateway cannot reach its shared state store; retry shortly",
                retry_after.STATE_UNAVAILABLE_S,
            )
        )

    # -- dispatch: local choice, global gate -------------------------------------------------

    def dispatching(self) -> bool:
        return self.mode is not Mode.CLOSED

    def propose(self, admission: Admission) -> None:
        if self.mode is Mode.SHARED:
            self._propose_shared(admission)
            return
        if self.pregranted.pop(admission.ticket.request_id, None) is not None:
            self.recovery.uncertain.add(admission.ticket.request_id)  # adopted or freed later
        self.local_only[admission.lease.lease_id] = admission
        self.host.grant(admission)

    def after_pump(self) -> None:
        if self.mode is Mode.SHARED:
            self.sync.sync_backlog()
            self.sync.arm_recheck()

    def gate_op(self, ticket: Ticket, force: bool = False) -> ops.Gate:
        policy = self.policy
        spec = policy.tenants[ticket.tenant]
        pool = policy.pools[ticket.pool]
        fairness = policy.source.fairness
        class_limits = spec.limits.per_endpoint.get(ticket.endpoint)
        class_concurrency = None if class_limits is None else class_limits.max_concurrency
        return ops.Gate(
            request_id=ticket.request_id,
            tenant=ticket.tenant,
            pool=ticket.pool,
            tier_rank=policy.tier_rank[spec.tier],
            budget=ticket.budget,
            input_tokens=ticket.input_tokens,
            max_output_tokens=ticket.max_output_tokens,
            weight=spec.weight,
            fair_cost=self.host.scheduler.fair_cost(ticket),
            input_weight=fairness.input_weight,
            output_weight=fairness.output_weight,
            max_concurrency=spec.limits.max_concurrency or 0,
            endpoint=ticket.endpoint,
            class_concurrency=class_concurrency or 0,
            pool_max_inflight=pool.max_inflight,
            pool_max_tokens=pool.max_inflight_tokens,
            fair_slack=self.settings.fair_slack,
            settled_buckets=tuple(settled_buckets(ticket.tenant, ticket.endpoint, spec)),
            force=force,
        )

    def _propose_shared(self, admission: Admission) -> None:
        scheduler = self.host.scheduler
        if admission.ticket.tenant not in self.policy.tenants:  # removed by a reload
            scheduler.release(admission.lease.lease_id)
            self.host.answer(
                admission.ticket.request_id,
                GatewayError(
                    outcome=Outcome.UNAUTHORIZED, status=403, code=Outcome.UNAUTHORIZED.value,
                    message=f"tenant {admission.ticket.tenant!r} is not in the policy",
                ),
            )  # fmt: skip
            return
        rid = admission.ticket.request_id
        self.tentative[rid] = admission.lease.lease_id
        pregranted = self.pregranted.pop(rid, None)
        fresh = self.settings.lease_ttl / 2
        if pregranted is not None and scheduler.clock.now() - pregranted[0] < fresh:
            future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            # its pool counts are from submit time: do not feed them to the mirror
            future.set_result({k: v for k, v in pregranted[1].items() if k not in ("n", "tok")})
            self._after_gate(admission, future)
            return
        if pregranted is not None:  # too old to rely on: start again
            self.send(ops.Release(rid))
        self.call(self.gate_op(admission.ticket), partial(self._after_gate, admission))

    def _after_gate(self, admission: Admission, future: asyncio.Future[Reply]) -> None:
        ticket, lease_id = admission.ticket, admission.lease.lease_id
        scheduler = self.host.scheduler
        self.tentative.pop(ticket.request_id, None)
        self.sync.proposal_answered()
        turn = self.host.waiting_for(ticket.request_id)
        gone = turn is None or turn.done()
        error = failure(future)
        if error is not None:
            self.recovery.uncertain.add(ticket.request_id)
            if gone or not scheduler.requeue(lease_id):
                scheduler.release(lease_id)
            self.failed(error)
            self.host.pump()
            return
        reply = future.result()
        if reply.get("ok"):
            self.hold(lease_id, ticket)
            self.observe(ticket.pool, reply)  # after hold: Redis counted this lease as ours
            self.host.grant(admission)
            self.after_pump()  # out of the registry now if nothing else of it waits
            return
        self.observe(ticket.pool, reply)
        reason = str(reply.get("why", "capacity"))
        self.state_metrics.refusals.labels(reason).inc()
        if reason == "duplicate":
            scheduler.release(lease_id)
            if not gone:
                self.host.answer(
                    ticket.request_id,
                    _unavailable(
                        "request id collision between gateway processes; retry",
                        retry_after.ID_COLLISION_S,
                    ),
                )
        elif gone:
            scheduler.release(lease_id)
        else:
            if reason == "capacity":
                capacity = self.capacities.get(ticket.pool)
                if capacity is not None:
                    capacity.blocked = True
            park = reason != "capacity"
            if park:
                self.sync.parked(ticket.pool, ticket.tenant, reason)
            if not scheduler.requeue(lease_id, park=park):
                scheduler.release(lease_id)
                self.host.answer(
                    ticket.request_id,
                    _unavailable(
                        f"pool {ticket.pool!r} is no longer in the policy",
                        retry_after.POOL_REMOVED_S,
                    ),
                )
        self.host.pump()

    def observe(self, pool: str, reply: Reply) -> None:
        """Feed a reply's pool counts to the capacity mirror."""
        reclaimed = int(reply.get("rc", 0) or 0)
        if reclaimed:
            self.state_metrics.reclaimed.inc(reclaimed)
        capacity = self.capacities.get(pool)
        if capacity is None or "n" not in reply:
            return
        mine, mine_tokens = self.held.counts(pool)
        capacity.observe(int(reply["n"]), int(reply.get("tok", 0)), mine, mine_tokens)

    # -- the leases this process holds in Redis -----------------------------------------------

    def hold(self, lease_id: int, ticket: Ticket) -> None:
        if self.held.hold(lease_id, ticket):
            self.recovery.uncertain.discard(ticket.request_id)

    def released(self, lease_id: int, input_tokens: int | None, output_tokens: int | None) -> None:
        self.local_only.pop(lease_id, None)
        self.release_held(lease_id, input_tokens, output_tokens)

    def release_held(self, lease_id: int, actual_in: int | None, actual_out: int | None) -> None:
        held = self.held.forget(lease_id)
        if held is None:
            return
        if self.mode is Mode.SHARED:
            op = ops.Release(held.request_id, actual_in, actual_out)
            self.call(op, partial(self._after_release, op))
        else:  # settled locally; only the capacity is left to free
            self.queue_replay(ops.Release(held.request_id))

    def _after_release(self, op: ops.Release, future: asyncio.Future[Reply]) -> None:
        error = failure(future)
        if error is not None:
            self.queue_replay(op)
            self.failed(error)

    def drop_local(self, lease_id: int) -> None:
        """A lease released in Redis by someone else (an accounting stream on another
        process, or expiry): free it here too."""
        self.held.forget(lease_id)
        self.host.scheduler.release(lease_id)

    # -- request end ------------------------------------------------------------------------------

    def charged(self, lease_id: int, tokens: int) -> None:
        held = self.held.get(lease_id)
        if held is not None and tokens > 0 and self.mode is Mode.SHARED:
            self.send(ops.ChargeOutput(held.request_id, tokens))

    def hand_off(self, grant: Grant, still_ours: Callable[[], bool]) -> bool:
        if grant.lease_id not in self.held:
            self.host.release(grant)
            return True
        loop = asyncio.get_running_loop()
        loop.call_later(HANDOFF_GRACE_S, self._hand_off_now, grant, still_ours)
        return False

    def _hand_off_now(self, grant: Grant, still_ours: Callable[[], bool]) -> None:
        held = self.held.get(grant.lease_id)
        if not still_ours() or held is None:
            return
        if self.mode is not Mode.SHARED:
            self.host.release(grant)
            return
        self.call(ops.HandOff(held.request_id), partial(self._after_hand_off, grant))

    def _after_hand_off(self, grant: Grant, future: asyncio.Future[Reply]) -> None:
        error = failure(future)
        if error is not None:
            self.failed(error)
            self.host.release(grant)
            return
        if future.result().get("r") != "attached":
            self.drop_local(grant.lease_id)
            self.host.pump()

    # -- accounting streams of requests admitted elsewhere ------------------------------------

    def attach_remote(self, request_id: str) -> RemoteLease | None:
        self._launch()
        return self.remote.attach(request_id)

    def charge_remote(self, remote: RemoteLease, tokens: int) -> None:
        self.remote.charge(remote, tokens)

    def settle_remote(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        self.remote.settle(remote, input_tokens, output_tokens)

    # -- introspection ----------------------------------------------------------------------------

    def describe(self) -> dict[str, object]:
        return {
            "backend": "redis",
            "mode": self.mode.value,
            "epoch": self.sync.epoch,
            "replica": self.replica,
            "held_leases": len(self.held),
            "local_only_leases": len(self.local_only),
            "tentative": len(self.tentative),
            "pending_replay": self.recovery.pending_replay(),
            "batches": self.batcher.batches,
            "operations": self.batcher.ops,
        }
