"""Admission state shared by several processes and replicas (state backend `redis`).

Each process keeps its own pure `Scheduler` for what only it can see: its queue, ordered tier ->
fair share -> tenant order. What must hold across processes is decided in Redis, atomically,
in one Lua script per batch of operations (extproc/state/admission.lua, operations in
extproc.state.ops):

1. **submit** -- the request's requests/tokens buckets (the tenant's and its endpoint
   class's) are taken in Redis (all or nothing, exact
   Retry-After from the server's clock) before the request joins the local queue. When nothing
   waits for the pool here and the local view says it fits (the common, uncontended case),
   the same round trip also runs the gate below: a *pre-grant* the local scheduler then uses
   when it dispatches the request (released if the request leaves the queue otherwise);
2. **gate** -- an admission the local scheduler chose is *tentative* until Redis grants it: pool
   capacity (a lease set with expiry), the tenant's concurrency (another lease set; one more
   for a class with its own max_concurrency), strict tier
   priority (no higher tier waiting for the pool on any process) and fair share (the tenant's
   shared virtual token counter within `fair_slack` of the least-served tenant waiting in its
   tier, on any process). Refused, the admission is undone (`Scheduler.requeue`): for lack of
   capacity the pool is blocked until a release event; for the other reasons the tenant is
   parked in that pool until a release event or the re-check timer (every ~25 ms);
3. **backlog registry** -- which tenants wait for which pool on this process is published (and
   heart-beaten, `backlog_ttl`), so the other processes' gates see it. A tenant whose request
   is being proposed to the gate still waits: dropped and registered again, its counter
   would be lifted to the others' and it would forget the share it is owed;
4. **release** -- exactly once, in Redis, by request id: settles the token buckets and the fair
   share against real usage and frees capacity, then publishes an event that wakes the other
   processes. The accounting stream may run on another process than the admission stream: it
   settles through Redis by request id (`attach_remote` / `settle_remote`); the admitting
   process hears the release event and frees its local lease.
5. **leases** are renewed by their holder every `min(lease_ttl, backlog_ttl) / 3`; a crashed
   holder's leases expire after `lease_ttl` and the next look at the pool reclaims them;
6. **failure** -- Redis failing switches to the `local` or `closed` mode until it answers
   again (extproc.state.recovery).

`build_admission(policy, clock, metrics)` returns the scheduler and admission controller a
gateway runs on. The controller is the same for every backend (extproc.admission); the
backend is its gate: `LocalGate` for `state.backend: memory` (the default), `RedisGate`
(extproc.state.gate) for `redis`, with a scheduler whose limit store and pool capacities are
the shared ones (extproc.state.store, extproc.state.capacity).
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.admission import AdmissionController
from extproc.metrics import Metrics
from extproc.policy import Policy
from extproc.policy.model import Pool
from extproc.scheduler import Capacity, Clock, Scheduler
from extproc.state.capacity import SharedCapacity
from extproc.state.fallback import local_share
from extproc.state.ops import Op
from extproc.state.store import SharedLimitStore


def build_admission(
    policy: Policy,
    clock: Clock,
    metrics: Metrics,
    *,
    replica: str | None = None,
    capacity_factory: Callable[[str, Pool], Capacity] | None = None,
) -> tuple[Scheduler, AdmissionController]:
    """The memory store takes `capacity_factory` (adaptive limits, headroom); the Redis store
    shares pool capacity through its own lease-based capacity."""
    if policy.source.state.backend == "memory":
        if capacity_factory is None:
            scheduler = Scheduler(policy, clock)
        else:
            scheduler = Scheduler(policy, clock, capacity_factory=capacity_factory)
        return scheduler, AdmissionController(scheduler, metrics)
    from extproc.state.backend import RedisBackend
    from extproc.state.gate import RedisGate, new_replica_id
    from extproc.state.metrics import StateMetrics

    backend = RedisBackend(policy.source.state, replica or new_replica_id())
    capacities: dict[str, SharedCapacity] = {}

    def capacity(name: str, pool: Pool) -> Capacity:
        made = SharedCapacity(pool)
        capacities[name] = made
        return made

    gate: RedisGate | None = None

    def send(op: Op) -> None:
        assert gate is not None
        gate.batcher.fire(op)

    store = SharedLimitStore(send)
    scheduler = Scheduler(policy, clock, store, capacity_factory=capacity)
    gate = RedisGate(policy, backend, store, capacities, StateMetrics(metrics.registry))
    return scheduler, AdmissionController(scheduler, metrics, gate)


__all__ = ["SharedCapacity", "SharedLimitStore", "build_admission", "local_share"]
