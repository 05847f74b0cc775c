"""Admission state shared by several processes and replicas (state backend `redis`).

`build_admission(policy, clock, metrics)` returns the scheduler and admission controller a
gateway runs on: the in-process pair for `state.backend: memory` (the default), and for
`redis` a scheduler whose limit store and pool capacities are the shared ones, driven by a
`SharedAdmissionController` (see extproc.state.controller for the design).
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
    from extproc.state.controller import SharedAdmissionController, new_replica_id
    from extproc.state.metrics import StateMetrics

    backend = RedisBackend(policy.source.state, replica or new_replica_id())
    capacities: dict[str, SharedCapacity] = {}

    def capacity(name: str, pool: Pool) -> Capacity:
        made = SharedCapacity(pool)
        capacities[name] = made
        return made

    controller: SharedAdmissionController | None = None

    def send(op: dict[str, object]) -> None:
        assert controller is not None
        controller.batcher.fire(op)

    store = SharedLimitStore(send)
    scheduler = Scheduler(policy, clock, store, capacity_factory=capacity)
    controller = SharedAdmissionController(
        scheduler, metrics, policy, backend, store, capacities, StateMetrics(metrics.registry)
    )
    return scheduler, controller


__all__ = ["SharedCapacity", "SharedLimitStore", "build_admission", "local_share"]
