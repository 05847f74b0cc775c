"""`SharedAdmissionController`: admission with budgets, capacity and fair share held in Redis.

Each process keeps its own pure `Scheduler` for what only it can see: its queue, ordered tier ->
fair share -> tenant order. What must hold across processes is decided in Redis, atomically,
in one Lua script per batch of operations (extproc.state.lua):

1. **submit** -- the tenant's requests/tokens buckets are taken in Redis (all or nothing, exact
   Retry-After from the server's clock) before the request joins the local queue. When nothing
   waits for the pool here and the local view says it fits (the common, uncontended case),
   the same round trip also runs the gate below: a *pre-grant* the local scheduler then uses
   when it dispatches the request (released if the request leaves the queue otherwise);
2. **gate** -- an admission the local scheduler chose is *tentative* until Redis grants it: pool
   capacity (a lease set with expiry), the tenant's concurrency (another lease set), strict tier
   priority (no higher tier waiting for the pool on any process) and fair share (the tenant's
   shared virtual token counter within `fair_slack` of the least-served tenant waiting in its
   tier, on any process). Refused, the admission is undone (`Scheduler.requeue`): for lack of
   capacity the pool is blocked until a release event; for the other reasons the tenant is
   parked in that pool until a release event or the re-check timer (every ~25 ms);
3. **backlog registry** -- which tenants wait for which pool on this process is published (and
   heart-beaten, `backlog_ttl`), so the other processes' gates see it;
4. **release** -- exactly once, in Redis, by request id: settles the tokens bucket and the fair
   share against real usage and frees capacity, then publishes an event that wakes the other
   processes. The accounting stream may run on another process than the admission stream: it
   settles through Redis by request id (`attach_remote` / `settle_remote`); the admitting
   process hears the release event and frees its local lease.
5. **leases** are renewed by their holder every `min(lease_ttl, backlog_ttl) / 3`; a crashed
   holder's leases expire after `lease_ttl` and the next look at the pool reclaims them.

Redis failing (timeout `state.timeout`, refused connection, ...) switches the mode: `local`
runs the scheduler on the policy's per-process share (extproc.state.fallback) with a local
store; `closed` answers new requests 503. A reconnect loop pings with exponential backoff and,
once Redis answers, debits the buckets with what was consumed locally, registers the leases
granted meanwhile, replays lost releases and goes back to `shared`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from extproc.admission import AdmissionController, Grant, RemoteLease, rejection_error
from extproc.errors import GatewayError
from extproc.metrics import Metrics
from extproc.policy import Policy
from extproc.scheduler import (
    Admission,
    Bucket,
    Rejection,
    Scheduler,
    Take,
    TakeResult,
    Ticket,
)
from extproc.state.backend import Op, RedisBackend, Reply, StateUnavailable
from extproc.state.batcher import Batcher
from extproc.state.capacity import SharedCapacity
from extproc.state.fallback import local_share
from extproc.state.metrics import StateMetrics
from extproc.state.store import SharedLimitStore
from extproc.types import Outcome

log = logging.getLogger("extproc.state")

RECHECK_S = 0.025
"""Parked tenants and blocked pools are re-checked this often (with jitter) without events."""
RECHECK_FULL_S = 0.1
"""A pool that looks full while requests wait for it is re-checked this often (a lost event
or a stale count must not leave them waiting)."""
HANDOFF_GRACE_S = 0.5
"""How long an admission whose stream ended waits for an accounting stream elsewhere."""
MAX_REPLAY = 100_000
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0


class Mode(enum.StrEnum):
    SHARED = "shared"
    LOCAL = "local"
    CLOSED = "closed"


@dataclass(slots=True)
class _Held:
    """A lease this process holds in Redis."""

    request_id: str
    pool: str
    budget: int
    ticket: Ticket


def new_replica_id() -> str:
    return f"{secrets.token_hex(4)}-{os.getpid()}"


class SharedAdmissionController(AdmissionController):
    def __init__(
        self,
        scheduler: Scheduler,
        metrics: Metrics,
        policy: Policy,
        backend: RedisBackend,
        store: SharedLimitStore,
        capacities: dict[str, SharedCapacity],
        state_metrics: StateMetrics,
    ) -> None:
        super().__init__(scheduler, metrics)
        self.policy = policy
        self.settings = policy.source.state
        self.backend = backend
        self.replica = backend.replica
        self.store = store
        self.capacities = capacities
        self.state_metrics = state_metrics
        self.batcher = Batcher(self._run_batch)
        self.mode = Mode.SHARED
        self._held: dict[int, _Held] = {}
        self._by_rid: dict[str, int] = {}
        self._held_per_pool: dict[str, list[int]] = {}
        self._tentative: dict[str, int] = {}
        self._pregranted: dict[str, tuple[float, Reply]] = {}
        """Leases granted with the bucket take (the fast path), until the request dispatches."""
        self._local_only: dict[int, Admission] = {}
        self._uncertain: set[str] = set()
        self._replay: list[Op] = []
        self._registered: set[tuple[str, int, str]] = set()
        self._park_reason: dict[tuple[str, str], str] = {}
        """Why a tenant is parked in a pool: fair and tier keep it in the shared backlog
        registry (it still waits); concurrency takes it out (it does not compete)."""
        self._membership_seen = -1
        self._epoch: str | None = None
        self._recheck: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reconnecting: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        state_metrics.set_mode(self.mode.value)

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
            self._failed(error)

    def _launch(self) -> None:
        if self._started or self._closed:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._heartbeat_loop(), name="extproc-state-heartbeat"),
            loop.create_task(self._event_loop(), name="extproc-state-events"),
        ]
        log.info(
            "shared state: redis",
            extra={"fields": {"replica": self.replica, "prefix": self.backend.prefix}},
        )

    async def close(self) -> None:
        self._closed = True
        if self._recheck is not None:
            self._recheck.cancel()
        tasks = [*self._tasks, *([self._reconnecting] if self._reconnecting else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.batcher.close()
        await self.backend.close()
        await super().close()

    def update_policy(self, policy: Policy) -> int:
        self.policy = policy
        if policy.source.state != self.settings:
            log.warning("state settings changed in the policy: they take effect on restart")
        effective = policy if self.mode is not Mode.LOCAL else self._share(policy)
        return super().update_policy(effective)

    def _share(self, policy: Policy) -> Policy:
        return local_share(policy, self.settings.replicas)

    # -- batches ----------------------------------------------------------------------------------

    async def _run_batch(self, ops: Sequence[Op]) -> list[Reply]:
        began = time.perf_counter()
        replies = await self.backend.run(ops)
        self.state_metrics.round_trip.observe(time.perf_counter() - began)
        self.state_metrics.batch_size.observe(len(ops))
        return replies

    def _send(self, op: Op) -> None:
        """Fire-and-forget operation; a failure switches the mode."""
        self.batcher.submit(op).add_done_callback(self._check_fired)

    def _check_fired(self, future: asyncio.Future[Reply]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self._failed(error)

    # -- submit: buckets in Redis, then the local queue ----------------------------------------

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        turn: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self._launch()
        if self.mode is Mode.CLOSED:
            self._reject_closed(turn)
            return turn
        if self.mode is Mode.LOCAL:
            return self._enqueue(ticket, turn)
        rejection = self.scheduler.check(ticket)
        if rejection is not None:
            turn.set_exception(rejection_error(rejection))
            return turn
        takes = self.scheduler.rate_takes(ticket)
        if not takes:
            return self._enqueue(ticket, turn)
        buckets = [[*_bucket(t.bucket), t.cost] for t in takes]
        if self._uncontended(ticket):
            op: Op = {**self._gate_op(ticket), "o": "tg", "bk": buckets}
        else:
            op = {"o": "take", "b": buckets}
        self.batcher.submit(op).add_done_callback(partial(self._after_take, ticket, takes, turn))
        return turn

    def _uncontended(self, ticket: Ticket) -> bool:
        """Would the local scheduler dispatch this request at once? (then gate it right away)"""
        capacity = self.capacities.get(ticket.pool)
        return (
            capacity is not None
            and capacity.fits(ticket.budget)
            and not self.scheduler.queued_tenants(ticket.pool)
        )

    def _after_take(
        self,
        ticket: Ticket,
        takes: list[Take],
        turn: asyncio.Future[Grant],
        future: asyncio.Future[Reply],
    ) -> None:
        error = _failure(future)
        if error is not None:
            self._failed(error)
            if turn.done():
                return
            if self.mode is Mode.CLOSED:
                self._reject_closed(turn)
            else:
                self._enqueue(ticket, turn)
            return
        reply = future.result()
        gated = reply.get("g") if "t" in reply else None
        if "t" in reply:
            reply = reply["t"]
        if isinstance(gated, dict):
            if gated.get("ok"):
                self._pregranted[ticket.request_id] = (self.scheduler.clock.now(), gated)
            else:
                self._observe(ticket.pool, gated)
        wait = float(reply.get("w", 0))
        result = TakeResult(
            ok=bool(reply.get("ok")),
            levels=tuple(float(str(level)) for level in _list(reply.get("l"))),
            wait_s=None if wait < 0 else wait,
        )
        if turn.done():  # the client left while the buckets were being taken
            if result.ok:
                self._refund(takes)
            self._drop_pregrant(ticket.request_id)
            return
        self.store.remember(takes, result.levels, self.scheduler.clock.now())
        self.store.prepare(result)
        self._enqueue(ticket, turn)
        unused = self.store.unused()
        if unused is not None and unused.ok:
            self._refund(takes)
            self._drop_pregrant(ticket.request_id)

    def _drop_pregrant(self, request_id: str) -> None:
        """A pre-granted request left the queue without being dispatched: free its lease."""
        if self._pregranted.pop(request_id, None) is not None:
            self._send({"o": "rel", "rid": request_id})

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._drop_pregrant(request_id)

    def _resolve_rejection(self, rejection: Rejection) -> None:
        super()._resolve_rejection(rejection)
        self._drop_pregrant(rejection.request_id)

    def _refund(self, takes: list[Take]) -> None:
        now = self.scheduler.clock.now()
        for take in takes:
            self.store.give_back(take.bucket, take.cost, now)

    def _reject_closed(self, turn: asyncio.Future[Grant]) -> None:
        self.state_metrics.closed_rejections.inc()
        turn.set_exception(
            GatewayError(
                outcome=Outcome.UNAVAILABLE,
                status=503,
                message="the gateway cannot reach its shared state store; retry shortly",
                code=Outcome.UNAVAILABLE.value,
                retry_after_s=1,
            )
        )

    # -- dispatch: local choice, global gate -------------------------------------------------

    def pump(self) -> None:
        for rejection in self.scheduler.poll():
            self._resolve_rejection(rejection)
        if self.mode is not Mode.CLOSED:
            for admission in self.scheduler.dispatch():
                if self.mode is Mode.SHARED:
                    self._propose(admission)
                else:
                    if self._pregranted.pop(admission.ticket.request_id, None) is not None:
                        self._uncertain.add(admission.ticket.request_id)  # adopted or freed later
                    self._local_only[admission.lease.lease_id] = admission
                    self._resolve_admission(admission)
        self._arm_timer()
        if self.mode is Mode.SHARED:
            self._sync_backlog()
            self._arm_recheck()

    def _gate_op(self, ticket: Ticket, force: bool = False) -> Op:
        policy = self.policy
        spec = policy.tenants[ticket.tenant]
        pool = policy.pools[ticket.pool]
        fairness = policy.source.fairness
        op: Op = {
            "o": "gate", "rid": ticket.request_id, "t": ticket.tenant, "p": ticket.pool,
            "k": policy.tier_rank[spec.tier], "b": ticket.budget, "i": ticket.input_tokens,
            "x": ticket.max_output_tokens, "w": spec.weight,
            "c": self.scheduler.fair_cost(ticket), "wi": fairness.input_weight,
            "wo": fairness.output_weight, "mc": spec.limits.max_concurrency or 0,
            "pm": pool.max_inflight, "pt": pool.max_inflight_tokens, "f": 1 if force else 0,
            "s": self.settings.fair_slack,
        }  # fmt: skip
        tpm = spec.limits.tokens_per_minute
        if tpm is not None:
            op["tb"] = _bucket(Bucket(f"{ticket.tenant}:tokens", float(tpm), tpm / 60.0))
        return op

    def _propose(self, admission: Admission) -> None:
        if admission.ticket.tenant not in self.policy.tenants:  # removed by a reload
            self.scheduler.release(admission.lease.lease_id)
            turn = self._waiting.pop(admission.ticket.request_id, None)
            if turn is not None and not turn.done():
                turn.set_exception(
                    GatewayError(
                        outcome=Outcome.UNAUTHORIZED, status=403, code=Outcome.UNAUTHORIZED.value,
                        message=f"tenant {admission.ticket.tenant!r} is not in the policy",
                    )
                )  # fmt: skip
            return
        rid = admission.ticket.request_id
        self._tentative[rid] = admission.lease.lease_id
        pregranted = self._pregranted.pop(rid, None)
        fresh = self.settings.lease_ttl / 2
        if pregranted is not None and self.scheduler.clock.now() - pregranted[0] < fresh:
            future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            # its pool counts are from submit time: do not feed them to the mirror
            future.set_result({k: v for k, v in pregranted[1].items() if k not in ("n", "tok")})
            self._after_gate(admission, future)
            return
        if pregranted is not None:  # too old to rely on: start again
            self._send({"o": "rel", "rid": rid})
        future = self.batcher.submit(self._gate_op(admission.ticket))
        future.add_done_callback(partial(self._after_gate, admission))

    def _after_gate(self, admission: Admission, future: asyncio.Future[Reply]) -> None:
        ticket, lease_id = admission.ticket, admission.lease.lease_id
        self._tentative.pop(ticket.request_id, None)
        turn = self._waiting.get(ticket.request_id)
        gone = turn is None or turn.done()
        error = _failure(future)
        if error is not None:
            self._uncertain.add(ticket.request_id)
            if gone or not self.scheduler.requeue(lease_id):
                self.scheduler.release(lease_id)
            self._failed(error)
            self.pump()
            return
        reply = future.result()
        if reply.get("ok"):
            self._hold(lease_id, ticket)
            self._observe(ticket.pool, reply)  # after _hold: Redis counted this lease as ours
            self._resolve_admission(admission)
            return
        self._observe(ticket.pool, reply)
        reason = str(reply.get("why", "capacity"))
        self.state_metrics.refusals.labels(reason).inc()
        if reason == "duplicate":
            self.scheduler.release(lease_id)
            if not gone:
                assert turn is not None
                self._waiting.pop(ticket.request_id, None)
                turn.set_exception(
                    GatewayError(
                        outcome=Outcome.UNAVAILABLE, status=503, code=Outcome.UNAVAILABLE.value,
                        message="request id collision between gateway processes; retry",
                        retry_after_s=1,
                    )
                )  # fmt: skip
        elif gone:
            self.scheduler.release(lease_id)
        else:
            if reason == "capacity":
                capacity = self.capacities.get(ticket.pool)
                if capacity is not None:
                    capacity.blocked = True
            park = reason != "capacity"
            if park:
                self._park_reason[(ticket.pool, ticket.tenant)] = reason
                self._membership_seen = -1
            if not self.scheduler.requeue(lease_id, park=park):
                self.scheduler.release(lease_id)
                self._waiting.pop(ticket.request_id, None)
                assert turn is not None
                turn.set_exception(
                    GatewayError(
                        outcome=Outcome.UNAVAILABLE, status=503, code=Outcome.UNAVAILABLE.value,
                        message=f"pool {ticket.pool!r} is no longer in the policy",
                        retry_after_s=1,
                    )
                )  # fmt: skip
        self.pump()

    def _observe(self, pool: str, reply: Reply) -> None:
        reclaimed = int(reply.get("rc", 0) or 0)
        if reclaimed:
            self.state_metrics.reclaimed.inc(reclaimed)
        capacity = self.capacities.get(pool)
        if capacity is None or "n" not in reply:
            return
        mine = self._held_per_pool.get(pool, [0, 0])
        capacity.observe(int(reply["n"]), int(reply.get("tok", 0)), mine[0], mine[1])

    def _abandon(self, admission: Admission) -> None:
        lease_id = admission.lease.lease_id
        self.scheduler.release(lease_id)
        self._local_only.pop(lease_id, None)
        self._release_held(lease_id, None, None)

    # -- the leases this process holds in Redis -----------------------------------------------

    def _hold(self, lease_id: int, ticket: Ticket) -> None:
        if lease_id in self._held:
            return
        self._held[lease_id] = _Held(ticket.request_id, ticket.pool, ticket.budget, ticket)
        self._by_rid[ticket.request_id] = lease_id
        counts = self._held_per_pool.setdefault(ticket.pool, [0, 0])
        counts[0] += 1
        counts[1] += ticket.budget
        self._uncertain.discard(ticket.request_id)

    def _forget(self, lease_id: int) -> _Held | None:
        held = self._held.pop(lease_id, None)
        if held is None:
            return None
        self._by_rid.pop(held.request_id, None)
        counts = self._held_per_pool.get(held.pool)
        if counts is not None:
            counts[0] -= 1
            counts[1] -= held.budget
        return held

    def _release_held(self, lease_id: int, actual_in: int | None, actual_out: int | None) -> None:
        held = self._forget(lease_id)
        if held is None:
            return
        op: Op = {"o": "rel", "rid": held.request_id}
        if self.mode is Mode.SHARED:
            if actual_in is not None:
                op["ai"] = actual_in
            if actual_out is not None:
                op["ao"] = actual_out
            future = self.batcher.submit(op)
            future.add_done_callback(partial(self._after_release, op))
        else:
            self._queue_replay(op)  # settled locally; only the capacity is left to free

    def _after_release(self, op: Op, future: asyncio.Future[Reply]) -> None:
        error = _failure(future)
        if error is not None:
            self._queue_replay(op)
            self._failed(error)

    def _queue_replay(self, op: Op) -> None:
        if len(self._replay) >= MAX_REPLAY:
            del self._replay[: len(self._replay) - MAX_REPLAY + 1]
        self._replay.append(op)

    def _drop_local(self, lease_id: int) -> None:
        """A lease released in Redis by someone else (an accounting stream on another
        process, or expiry): free it here too."""
        self._forget(lease_id)
        self.scheduler.release(lease_id)

    # -- request end ------------------------------------------------------------------------------

    def release(
        self,
        grant: Grant,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        self.scheduler.release(
            grant.lease_id, actual_input_tokens=input_tokens, actual_output_tokens=output_tokens
        )
        self._local_only.pop(grant.lease_id, None)
        self._release_held(grant.lease_id, input_tokens, output_tokens)
        self.pump()

    def charge_output(self, grant: Grant, tokens: int) -> None:
        self.scheduler.charge_output(grant.lease_id, tokens)
        held = self._held.get(grant.lease_id)
        if held is not None and tokens > 0 and self.mode is Mode.SHARED:
            self._send({"o": "chg", "rid": held.request_id, "n": tokens})

    def hand_off(self, grant: Grant, still_ours: Callable[[], bool]) -> bool:
        if grant.lease_id not in self._held:
            self.release(grant)
            return True
        loop = asyncio.get_running_loop()
        loop.call_later(HANDOFF_GRACE_S, self._hand_off_now, grant, still_ours)
        return False

    def _hand_off_now(self, grant: Grant, still_ours: Callable[[], bool]) -> None:
        held = self._held.get(grant.lease_id)
        if not still_ours() or held is None:
            return
        if self.mode is not Mode.SHARED:
            self.release(grant)
            return
        future = self.batcher.submit({"o": "hand", "rid": held.request_id})
        future.add_done_callback(partial(self._after_hand_off, grant))

    def _after_hand_off(self, grant: Grant, future: asyncio.Future[Reply]) -> None:
        error = _failure(future)
        if error is not None:
            self._failed(error)
            self.release(grant)
            return
        if future.result().get("r") != "attached":
            self._drop_local(grant.lease_id)
            self.pump()

    # -- accounting streams of requests admitted elsewhere ------------------------------------

    def attach_remote(self, request_id: str) -> RemoteLease | None:
        self._launch()
        remote = RemoteLease(request_id)
        if self.mode is not Mode.SHARED:
            remote.found = False
            return remote
        future = self.batcher.submit({"o": "att", "rid": request_id})
        future.add_done_callback(partial(self._after_attach, remote))
        return remote

    def _after_attach(self, remote: RemoteLease, future: asyncio.Future[Reply]) -> None:
        error = _failure(future)
        if error is not None:
            remote.found = False
            self._failed(error)
            return
        reply = future.result()
        remote.found = bool(reply.get("ok"))
        if remote.found:
            remote.tenant = str(reply.get("t"))
            remote.pool = str(reply.get("p"))

    def charge_remote(self, remote: RemoteLease, tokens: int) -> None:
        if tokens > 0 and not remote.settled and self.mode is Mode.SHARED:
            self._send({"o": "chg", "rid": remote.request_id, "n": tokens})

    def settle_remote(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        if remote.settled:
            return
        remote.settled = True
        if remote.found is False:
            self.state_metrics.remote_settlements.labels("not_found").inc()
            return
        op: Op = {"o": "rel", "rid": remote.request_id}
        if input_tokens is not None:
            op["ai"] = input_tokens
        if output_tokens is not None:
            op["ao"] = output_tokens
        future = self.batcher.submit(op)
        future.add_done_callback(partial(self._after_remote_settle, op))

    def _after_remote_settle(self, op: Op, future: asyncio.Future[Reply]) -> None:
        error = _failure(future)
        if error is not None:
            self._queue_replay(op)
            self._failed(error)
            return
        found = bool(future.result().get("ok"))
        self.state_metrics.remote_settlements.labels("settled" if found else "not_found").inc()

    # -- backlog registry, re-checks, heartbeat, events ---------------------------------------

    def _sync_backlog(self) -> None:
        version = self.scheduler.membership_version
        if version == self._membership_seen:
            return
        self._membership_seen = version
        current = set(self.scheduler.backlogged())
        parked = self.scheduler.parked()
        for (pool, tenant), reason in list(self._park_reason.items()):
            spec = self.policy.tenant(tenant)
            if (pool, tenant) not in parked or spec is None:
                del self._park_reason[(pool, tenant)]
            elif reason != "concurrency" and tenant in self.scheduler.queued_tenants(pool):
                current.add((pool, self.policy.tier_rank[spec.tier], tenant))
        add = current - self._registered
        remove = self._registered - current
        self._registered = current
        if add or remove:
            self._send({"o": "bl", "add": [list(a) for a in add], "rm": [list(r) for r in remove]})

    def _arm_recheck(self) -> None:
        if self._recheck is not None:
            return
        parked = self.scheduler.parked()
        blocked = any(c.blocked for c in self.capacities.values())
        if parked or blocked:
            delay = RECHECK_S * (0.5 + random.random())
        elif any(self._full_with_queue(name) for name in self.capacities):
            delay = RECHECK_FULL_S * (0.5 + random.random())
        else:
            return
        self._recheck = asyncio.get_running_loop().call_later(delay, self._on_recheck)

    def _on_recheck(self) -> None:
        self._recheck = None
        if self.mode is not Mode.SHARED:
            return
        pools = {pool for pool, _ in self.scheduler.parked()}
        pools.update(
            name for name, c in self.capacities.items() if c.blocked or self._full_with_queue(name)
        )
        for pool in pools:
            if not self.scheduler.queued_tenants(pool):
                self.scheduler.unpark(pool=pool)
                capacity = self.capacities.get(pool)
                if capacity is not None:
                    capacity.blocked = False
                continue
            future = self.batcher.submit({"o": "peek", "p": pool})
            future.add_done_callback(partial(self._after_peek, pool))

    def _full_with_queue(self, pool: str) -> bool:
        capacity = self.capacities.get(pool)
        return (
            capacity is not None
            and not capacity.has_headroom()
            and bool(self.scheduler.queued_tenants(pool))
        )

    def _after_peek(self, pool: str, future: asyncio.Future[Reply]) -> None:
        error = _failure(future)
        if error is not None:
            self._failed(error)
            return
        self._observe(pool, future.result())
        self._wake(pool)

    def _wake(self, pool: str) -> None:
        capacity = self.capacities.get(pool)
        if capacity is not None:
            capacity.blocked = False
        self.scheduler.unpark(pool=pool)
        self.pump()

    def on_event(self, message: str) -> None:
        """A release (or reclaimed lease) somewhere: `pool|tenant|rid|owner|inflight|tokens`."""
        parts = message.split("|")
        if len(parts) != 6 or self.mode is not Mode.SHARED:
            return
        pool, _tenant, rid, owner, total, tokens = parts
        dropped = False
        if owner == self.replica:
            lease_id = self._by_rid.get(rid)
            if lease_id is not None:
                self._drop_local(lease_id)
                dropped = True
        capacity = self.capacities.get(pool)
        if capacity is not None:
            mine = self._held_per_pool.get(pool, [0, 0])
            with contextlib.suppress(ValueError):
                capacity.observe(int(float(total)), int(float(tokens)), mine[0], mine[1])
        if dropped or self.scheduler.queued_tenants(pool):
            self._wake(pool)
        elif capacity is not None:
            capacity.blocked = False  # nobody waits here: nothing to decide

    async def _event_loop(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._closed:
            try:
                async for message in self.backend.events():
                    delay = BACKOFF_MIN_S
                    self.on_event(message)
            except StateUnavailable as error:
                log.debug("event subscription: %s", error)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_MAX_S)

    def _heartbeat_interval(self) -> float:
        return min(self.settings.lease_ttl, self.settings.backlog_ttl) / 3.0

    async def _heartbeat_loop(self) -> None:
        while not self._closed:  # the first one at once: it learns the store's epoch
            if self.mode is Mode.SHARED:
                with contextlib.suppress(StateUnavailable):
                    await self.heartbeat()
            await asyncio.sleep(self._heartbeat_interval())

    async def heartbeat(self) -> None:
        """Renew this process's leases and backlog entries; free what Redis lost."""
        rids: list[str] = []
        for lease_id, held in list(self._held.items()):
            if self.scheduler.lease(lease_id) is None:
                self._release_held(lease_id, None, None)  # reclaimed here by lease_timeout
            else:
                rids.append(held.request_id)
        if self._registered:
            self._send({"o": "bl", "add": [list(item) for item in self._registered]})
        try:
            reply = await self.batcher.submit({"o": "renew", "rids": rids})
        except StateUnavailable as error:
            self._failed(error)
            raise
        epoch = reply.get("e")
        lost = self._epoch is not None and epoch != self._epoch
        self._epoch = str(epoch) if epoch is not None else None
        gone = [self._by_rid.get(str(rid)) for rid in _list(reply.get("gone"))]
        if lost:
            log.warning("the shared store lost its data (restarted?): registering leases again")
        for gone_id in gone:
            if gone_id is None:
                continue
            still = self._held.get(gone_id)
            if lost and still is not None:
                # still running here: take its capacity back, unconditionally
                self._send(self._gate_op(still.ticket, force=True))
            else:
                log.warning("a lease expired in the shared store; freeing it")
                self._drop_local(gone_id)
        self.pump()

    # -- failure and recovery -----------------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        self.state_metrics.errors.inc()
        if self.mode is not Mode.SHARED or self._closed:
            return
        target = Mode.LOCAL if self.settings.on_failure == "local" else Mode.CLOSED
        log.warning(
            "shared state unreachable (%s): %s",
            error,
            "enforcing this process's share of every limit"
            if target is Mode.LOCAL
            else "answering new requests 503 until it is back",
        )
        self._enter(target)
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(
                self._reconnect(), name="extproc-state-reconnect"
            )

    def _enter(self, mode: Mode) -> None:
        if mode is self.mode:
            return
        self.mode = mode
        self.state_metrics.transitions.labels(mode.value).inc()
        self.state_metrics.set_mode(mode.value)
        shared = mode is Mode.SHARED
        self.store.shared = shared
        for capacity in self.capacities.values():
            capacity.set_shared(shared)
        if self._recheck is not None and not shared:
            self._recheck.cancel()
            self._recheck = None
        self._registered.clear()
        self._membership_seen = -1
        self.scheduler.unpark()
        effective = self._share(self.policy) if mode is Mode.LOCAL else self.policy
        self.resolve(self.scheduler.update_policy(effective))
        self.pump()

    async def _reconnect(self) -> None:
        delay = BACKOFF_MIN_S
        while self.mode is not Mode.SHARED and not self._closed:
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_MAX_S)
            try:
                await self.backend.ping(max(self.settings.timeout, 0.2))
            except StateUnavailable:
                self.state_metrics.reconnects.labels("failure").inc()
                continue
            self.state_metrics.reconnects.labels("success").inc()
            self._recover()
            log.info("shared state reachable again: limits are shared")

    def _recover(self) -> None:
        """Back to shared: everything below goes out before any new gate (batches are FIFO)."""
        debt = self.store.take_debt()
        replay, self._replay = self._replay, []
        held_rids = set(self._by_rid) | set(self._tentative)
        held_rids.update(a.ticket.request_id for a in self._local_only.values())
        uncertain = [rid for rid in self._uncertain if rid not in held_rids]
        self._uncertain.clear()
        self._enter(Mode.SHARED)
        for bucket, amount in debt:
            real = self._real_bucket(bucket.key)
            if real is not None:
                self._send({"o": "adj", "k": real.key, "c": real.capacity,
                            "r": real.refill_per_second, "d": amount})  # fmt: skip
        for op in replay:
            self._send(op)
        for rid in uncertain:
            self._send({"o": "rel", "rid": rid})
        # Leases granted before the outage may be gone (a restarted, empty Redis): register
        # them again; for those still there the gate sees its own lease and changes nothing.
        for held in self._held.values():
            self._send(self._gate_op(held.ticket, force=True))
        for lease_id, admission in list(self._local_only.items()):
            if self.scheduler.lease(lease_id) is None:
                del self._local_only[lease_id]
                continue
            future = self.batcher.submit(self._gate_op(admission.ticket, force=True))
            future.add_done_callback(partial(self._after_adopt, admission))
        self.pump()

    def _after_adopt(self, admission: Admission, future: asyncio.Future[Reply]) -> None:
        error = _failure(future)
        if error is not None:
            self._failed(error)
            return
        lease_id = admission.lease.lease_id
        if self._local_only.pop(lease_id, None) is None or self.scheduler.lease(lease_id) is None:
            self._send({"o": "rel", "rid": admission.ticket.request_id})  # ended meanwhile
            return
        ticket = admission.ticket
        self._hold(lease_id, ticket)
        self._observe(ticket.pool, future.result())

    def _real_bucket(self, key: str) -> Bucket | None:
        tenant, _, kind = key.rpartition(":")
        spec = self.policy.tenant(tenant)
        if spec is None:
            return None
        limit = (
            spec.limits.requests_per_minute if kind == "requests" else spec.limits.tokens_per_minute
        )
        return None if limit is None else Bucket(key, float(limit), limit / 60.0)

    # -- introspection ----------------------------------------------------------------------------

    def describe(self) -> dict[str, object]:
        return {
            "backend": "redis",
            "mode": self.mode.value,
            "replica": self.replica,
            "held_leases": len(self._held),
            "local_only_leases": len(self._local_only),
            "tentative": len(self._tentative),
            "pending_replay": len(self._replay),
            "batches": self.batcher.batches,
            "operations": self.batcher.ops,
        }


def _bucket(bucket: Bucket) -> list[object]:
    return [bucket.key, bucket.capacity, bucket.refill_per_second]


def _list(value: object) -> list[object]:
    """cjson encodes an empty Lua table as {}: read it as an empty list."""
    return value if isinstance(value, list) else []


def _failure(future: asyncio.Future[Reply]) -> BaseException | None:
    if future.cancelled():
        return StateUnavailable("cancelled")
    return future.exception()
