"""The composition root: every long-lived object of one service process is built here.

`compose(policy)` builds the admission core (clock, estimator, scheduler, admission
controller and its state backend, settlement, reconciler) and the `Gateway` that holds it;
`Service.start` (extproc.service.main) adds the process's own parts with `compose_service`.
Nothing else constructs these objects, so a different wiring (a new state backend, another
estimator) is a change here and in the module that provides it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from extproc.admission import AdmissionController
from extproc.estimation import TokenEstimator
from extproc.metrics import Metrics
from extproc.policy import Policy
from extproc.reload import PolicyReloader
from extproc.scheduler import MonotonicClock
from extproc.scheduler.adaptive import EngineCapacities
from extproc.service.engine_poller import EnginePoller
from extproc.service.gateway import Gateway
from extproc.service.overload import OverloadDetector
from extproc.service.reconcile import EngineLedger, ReconcileHooks, Reconciler
from extproc.service.request import Settlement
from extproc.state import build_admission


@dataclass(frozen=True)
class Core:
    """The admission core of one process, and the gateway its streams use."""

    gateway: Gateway
    clock: MonotonicClock
    capacities: EngineCapacities
    """Pools with an `adaptive` section get a limit the engine watcher moves."""
    admission: AdmissionController


def compose_core(policy: Policy, metrics: Metrics | None = None, sole_client: bool = True) -> Core:
    """`sole_client`: no other process of this service sends to the same engines (needed
    to correct cut-short streams from the engines' counters)."""
    metrics = metrics or Metrics()
    clock = MonotonicClock()
    estimator = TokenEstimator(policy.source.estimation)
    capacities = EngineCapacities()
    scheduler, admission = build_admission(
        policy, clock, metrics, capacity_factory=capacities.factory
    )
    reconciling = (
        sole_client
        and policy.source.gateway.reconcile_cut_short
        and policy.source.state.backend == "memory"
    )
    ledger = EngineLedger() if reconciling else None
    settlement = Settlement(admission, scheduler, metrics, estimator, ledger)
    engine_poller = EnginePoller()
    reconciler: Reconciler | None = None
    if ledger is not None:
        hooks = ReconcileHooks(
            pool_idle=lambda pool: scheduler.pool_inflight(pool) == 0,
            admissions=lambda: settlement.admissions,
            apply=settlement.apply_correction,
            give_up=settlement.count_cut_short,
            now=time.monotonic,
        )
        reconciler = Reconciler(ledger, hooks, engine_poller)
        settlement.reconciler = reconciler
    overload = OverloadDetector(
        policy.source.gateway, scheduler.over_share, queued=scheduler.tenants_with_queued
    )
    overload.on_arrival = metrics.envoy_to_handler.observe
    gateway = Gateway(
        policy,
        metrics,
        estimator,
        scheduler,
        admission,
        settlement,
        reconciler,
        engine_poller,
        overload,
    )
    gateway.track_engines(policy)
    return Core(gateway, clock, capacities, admission)


def compose(policy: Policy, metrics: Metrics | None = None, sole_client: bool = True) -> Gateway:
    """The gateway of an in-process service (tests, benchmarks, `extproc serve`)."""
    return compose_core(policy, metrics, sole_client).gateway


def compose_reloader(
    gateway: Gateway, path: str, metrics: Metrics, interval_s: float
) -> PolicyReloader:
    return PolicyReloader(
        path=path, apply=gateway.apply_policy, metrics=metrics, interval_s=interval_s
    )
