"""Keeping the other processes in view: the backlog registry, re-checks, release events and
the lease heartbeat of a `RedisGate` (see extproc.state for the design)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from functools import partial

from extproc.state import ops
from extproc.state.backend import StateUnavailable
from extproc.state.batcher import failure
from extproc.state.mode import Mode
from extproc.state.ops import BacklogEntry, Reply, reply_list
from extproc.state.shared import SharedGate

log = logging.getLogger("extproc.state")

RECHECK_S = 0.025
"""Parked tenants and blocked pools are re-checked this often (with jitter) without events."""
RECHECK_FULL_S = 0.1
"""A pool that looks full while requests wait for it is re-checked this often (a lost event
or a stale count must not leave them waiting)."""
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0


class PeerSync:
    def __init__(self, gate: SharedGate) -> None:
        self.gate = gate
        self._registered: set[BacklogEntry] = set()
        self._park_reason: dict[tuple[str, str], str] = {}
        """Why a tenant is parked in a pool: fair and tier keep it in the shared backlog
        registry (it still waits); concurrency takes it out (it does not compete)."""
        self._membership_seen = -1
        self._recheck: asyncio.TimerHandle | None = None
        self._epoch: str | None = None

    def launch(self) -> list[asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        return [
            loop.create_task(self._heartbeat_loop(), name="extproc-state-heartbeat"),
            loop.create_task(self._event_loop(), name="extproc-state-events"),
        ]

    def stop_recheck(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None

    def mode_changed(self, shared: bool) -> None:
        if not shared:
            self.stop_recheck()
        self._registered.clear()
        self._membership_seen = -1

    def parked(self, pool: str, tenant: str, reason: str) -> None:
        """The gate refused `tenant` in `pool` for `reason` (tier, fair, concurrency)."""
        self._park_reason[(pool, tenant)] = reason
        self._membership_seen = -1

    # -- backlog registry ---------------------------------------------------------------------

    def proposal_answered(self) -> None:
        """The gate answered a proposal (`gate.tentative` changed): the next sync decides
        whether its tenant still waits, whatever the scheduler's membership says."""
        self._membership_seen = -1

    def sync_backlog(self) -> None:
        gate = self.gate
        scheduler = gate.host.scheduler
        version = scheduler.membership_version
        if version == self._membership_seen:
            return
        self._membership_seen = version
        current = set(scheduler.backlogged())
        parked = scheduler.parked()
        for (pool, tenant), reason in list(self._park_reason.items()):
            spec = gate.policy.tenant(tenant)
            if (pool, tenant) not in parked or spec is None:
                del self._park_reason[(pool, tenant)]
            elif reason != "concurrency" and tenant in scheduler.queued_tenants(pool):
                current.add((pool, gate.policy.tier_rank[spec.tier], tenant))
        # A tenant whose request is being proposed (out of the queue until the gate answers)
        # still waits: taken out of the registry and registered again, its fair-share counter
        # would be lifted to the least of the others' and it would forget what it is owed.
        for lease_id in gate.tentative.values():
            lease = scheduler.lease(lease_id)
            spec = None if lease is None else gate.policy.tenant(lease.tenant)
            if lease is not None and spec is not None:
                current.add((lease.pool, gate.policy.tier_rank[spec.tier], lease.tenant))
        add = current - self._registered
        remove = self._registered - current
        self._registered = current
        if add or remove:
            gate.send(ops.Backlog(tuple(add), tuple(remove)))

    # -- re-checks ----------------------------------------------------------------------------

    def arm_recheck(self) -> None:
        if self._recheck is not None:
            return
        gate = self.gate
        parked = gate.host.scheduler.parked()
        blocked = any(c.blocked for c in gate.capacities.values())
        if parked or blocked:
            delay = RECHECK_S * (0.5 + random.random())
        elif any(self._full_with_queue(name) for name in gate.capacities):
            delay = RECHECK_FULL_S * (0.5 + random.random())
        else:
            return
        self._recheck = asyncio.get_running_loop().call_later(delay, self._on_recheck)

    def _on_recheck(self) -> None:
        self._recheck = None
        gate = self.gate
        if gate.mode is not Mode.SHARED:
            return
        scheduler = gate.host.scheduler
        pools = {pool for pool, _ in scheduler.parked()}
        pools.update(
            name for name, c in gate.capacities.items() if c.blocked or self._full_with_queue(name)
        )
        for pool in pools:
            if not scheduler.queued_tenants(pool):
                scheduler.unpark(pool=pool)
                capacity = gate.capacities.get(pool)
                if capacity is not None:
                    capacity.blocked = False
                continue
            gate.call(ops.Peek(pool), partial(self._after_peek, pool))

    def _full_with_queue(self, pool: str) -> bool:
        capacity = self.gate.capacities.get(pool)
        return (
            capacity is not None
            and not capacity.has_headroom()
            and bool(self.gate.host.scheduler.queued_tenants(pool))
        )

    def _after_peek(self, pool: str, future: asyncio.Future[Reply]) -> None:
        error = failure(future)
        if error is not None:
            self.gate.failed(error)
            return
        self.gate.observe(pool, future.result())
        self._wake(pool)

    def _wake(self, pool: str) -> None:
        capacity = self.gate.capacities.get(pool)
        if capacity is not None:
            capacity.blocked = False
        self.gate.host.scheduler.unpark(pool=pool)
        self.gate.host.pump()

    # -- release events -----------------------------------------------------------------------

    def on_event(self, message: str) -> None:
        """A release (or reclaimed lease) somewhere: `pool|tenant|rid|owner|inflight|tokens`."""
        gate = self.gate
        parts = message.split("|")
        if len(parts) != 6 or gate.mode is not Mode.SHARED:
            return
        pool, _tenant, rid, owner, total, tokens = parts
        dropped = False
        if owner == gate.replica:
            lease_id = gate.held.lease_of(rid)
            if lease_id is not None:
                gate.drop_local(lease_id)
                dropped = True
        capacity = gate.capacities.get(pool)
        if capacity is not None:
            mine, mine_tokens = gate.held.counts(pool)
            with contextlib.suppress(ValueError):
                capacity.observe(int(float(total)), int(float(tokens)), mine, mine_tokens)
        if dropped or gate.host.scheduler.queued_tenants(pool):
            self._wake(pool)
        elif capacity is not None:
            capacity.blocked = False  # nobody waits here: nothing to decide

    async def _event_loop(self) -> None:
        delay = BACKOFF_MIN_S
        while not self.gate.closed:
            try:
                async for message in self.gate.backend.events():
                    delay = BACKOFF_MIN_S
                    self.on_event(message)
            except StateUnavailable as error:
                log.debug("event subscription: %s", error)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_MAX_S)

    # -- heartbeat ----------------------------------------------------------------------------

    @property
    def epoch(self) -> str | None:
        """The store's epoch at this process's last successful heartbeat (a new one after the
        store lost its data); None before the first."""
        return self._epoch

    def _heartbeat_interval(self) -> float:
        settings = self.gate.settings
        return min(settings.lease_ttl, settings.backlog_ttl) / 3.0

    async def _heartbeat_loop(self) -> None:
        while not self.gate.closed:  # the first one at once: it learns the store's epoch
            if self.gate.mode is Mode.SHARED:
                with contextlib.suppress(StateUnavailable):
                    await self.heartbeat()
            await asyncio.sleep(self._heartbeat_interval())

    async def heartbeat(self) -> None:
        """Renew this process's leases and backlog entries; free what Redis lost."""
        gate = self.gate
        scheduler = gate.host.scheduler
        rids: list[str] = []
        for lease_id, held in gate.held.items():
            if scheduler.lease(lease_id) is None:
                gate.release_held(lease_id, None, None)  # reclaimed here by lease_timeout
            else:
                rids.append(held.request_id)
        if self._registered:
            gate.send(ops.Backlog(add=tuple(self._registered)))
        try:
            reply = await gate.batcher.submit(ops.Renew(tuple(rids)))
        except StateUnavailable as error:
            gate.failed(error)
            raise
        epoch = reply.get("e")
        lost = self._epoch is not None and epoch != self._epoch
        self._epoch = str(epoch) if epoch is not None else None
        gone = [gate.held.lease_of(str(rid)) for rid in reply_list(reply.get("gone"))]
        if lost:
            log.warning("the shared store lost its data (restarted?): registering leases again")
        for gone_id in gone:
            if gone_id is None:
                continue
            still = gate.held.get(gone_id)
            if lost and still is not None:
                # still running here: take its capacity back, unconditionally
                gate.send(gate.gate_op(still.ticket, force=True))
            else:
                log.warning("a lease expired in the shared store; freeing it")
                gate.drop_local(gone_id)
        gate.host.pump()
