"""Losing Redis and finding it again, for a `RedisGate`.

Redis failing (timeout `state.timeout`, refused connection, ...) switches the mode: `local`
runs the scheduler on the policy's per-process share (extproc.state.fallback) with a local
store; `closed` answers new requests 503. A reconnect loop pings with exponential backoff and,
once Redis answers, debits the buckets with what was consumed locally, registers the leases
granted meanwhile, replays lost releases and goes back to `shared`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from functools import partial

from extproc.scheduler import Admission, Bucket
from extproc.scheduler.ratelimit import bucket_for_key
from extproc.state import ops
from extproc.state.backend import StateUnavailable
from extproc.state.batcher import failure
from extproc.state.mode import Mode
from extproc.state.ops import Reply
from extproc.state.shared import SharedGate
from extproc.state.sync import BACKOFF_MAX_S, BACKOFF_MIN_S

log = logging.getLogger("extproc.state")

MAX_REPLAY = 100_000


class Recovery:
    def __init__(self, gate: SharedGate) -> None:
        self.gate = gate
        self._replay: list[ops.Op] = []
        self.uncertain: set[str] = set()
        """Request ids that may hold a lease in Redis nobody here knows of: freed on recovery."""
        self._reconnecting: asyncio.Task[None] | None = None

    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._reconnecting] if self._reconnecting is not None else []

    def pending_replay(self) -> int:
        return len(self._replay)

    def queue_replay(self, op: ops.Op) -> None:
        """Send `op` once Redis is back."""
        if len(self._replay) >= MAX_REPLAY:
            del self._replay[: len(self._replay) - MAX_REPLAY + 1]
        self._replay.append(op)

    def failed(self, error: BaseException) -> None:
        gate = self.gate
        gate.state_metrics.errors.inc()
        if gate.mode is not Mode.SHARED or gate.closed:
            return
        target = Mode.LOCAL if gate.settings.on_failure == "local" else Mode.CLOSED
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
        gate = self.gate
        if mode is gate.mode:
            return
        gate.mode = mode
        gate.state_metrics.transitions.labels(mode.value).inc()
        gate.state_metrics.set_mode(mode.value)
        shared = mode is Mode.SHARED
        gate.store.shared = shared
        for capacity in gate.capacities.values():
            capacity.set_shared(shared)
        gate.mode_changed(shared)
        host = gate.host
        host.scheduler.unpark()
        effective = gate.share(gate.policy) if mode is Mode.LOCAL else gate.policy
        host.resolve(host.scheduler.update_policy(effective))
        host.pump()

    async def _reconnect(self) -> None:
        gate = self.gate
        delay = BACKOFF_MIN_S
        while gate.mode is not Mode.SHARED and not gate.closed:
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_MAX_S)
            try:
                await gate.backend.ping(max(gate.settings.timeout, 0.2))
            except StateUnavailable:
                gate.state_metrics.reconnects.labels("failure").inc()
                continue
            gate.state_metrics.reconnects.labels("success").inc()
            self._recover()
            log.info("shared state reachable again: limits are shared")

    def _recover(self) -> None:
        """Back to shared: everything below goes out before any new gate (batches are FIFO)."""
        gate = self.gate
        scheduler = gate.host.scheduler
        debt = gate.store.take_debt()
        replay, self._replay = self._replay, []
        held_rids = gate.held.request_ids() | set(gate.tentative)
        held_rids.update(a.ticket.request_id for a in gate.local_only.values())
        uncertain = [rid for rid in self.uncertain if rid not in held_rids]
        self.uncertain.clear()
        self._enter(Mode.SHARED)
        for bucket, amount in debt:
            real = self._real_bucket(bucket.key)
            if real is not None:
                gate.send(ops.AdjustBucket(real, amount))
        for op in replay:
            gate.send(op)
        for rid in uncertain:
            gate.send(ops.Release(rid))
        # Leases granted before the outage may be gone (a restarted, empty Redis): register
        # them again; for those still there the gate sees its own lease and changes nothing.
        for held in gate.held.values():
            gate.send(gate.gate_op(held.ticket, force=True))
        for lease_id, admission in list(gate.local_only.items()):
            if scheduler.lease(lease_id) is None:
                del gate.local_only[lease_id]
                continue
            gate.call(
                gate.gate_op(admission.ticket, force=True), partial(self._after_adopt, admission)
            )
        gate.host.pump()

    def _after_adopt(self, admission: Admission, future: asyncio.Future[Reply]) -> None:
        gate = self.gate
        error = failure(future)
        if error is not None:
            self.failed(error)
            return
        lease_id = admission.lease.lease_id
        lost = gate.local_only.pop(lease_id, None) is None
        if lost or gate.host.scheduler.lease(lease_id) is None:
            gate.send(ops.Release(admission.ticket.request_id))  # ended meanwhile
            return
        ticket = admission.ticket
        gate.hold(lease_id, ticket)
        gate.observe(ticket.pool, future.result())

    def _real_bucket(self, key: str) -> Bucket | None:
        tenant, _, _dimension = key.rpartition(":")
        spec = self.gate.policy.tenant(tenant)
        if spec is None:
            return None
        return bucket_for_key(key, spec)
