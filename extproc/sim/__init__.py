"""Offline discrete-event simulation of the gateway and its engine pools, and capacity planning.

The simulator drives the real admission `Scheduler` (on a `ManualClock`) and one `EngineCore`
per engine replica, with no sockets and no wall-clock waiting. See docs/simulation.md.
"""

from extproc.sim.fleet import PoolEngines, derive_capacity, derived_pool, profile_for_context
from extproc.sim.plan import PlanConfig, PlanResult, plan_capacity
from extproc.sim.records import RequestRecord
from extproc.sim.replay import ReplayArrival, ReplayResult, replay_admissions
from extproc.sim.simulator import SimConfig, SimResult, Simulation, simulate
from extproc.sim.slo import Slo
from extproc.sim.stats import report
from extproc.sim.throughput import Throughput, saturation_throughput
from extproc.sim.trace import TraceRequest, read_trace, shape_trace

__all__ = [
    "PlanConfig",
    "PlanResult",
    "PoolEngines",
    "ReplayArrival",
    "ReplayResult",
    "RequestRecord",
    "SimConfig",
    "SimResult",
    "Simulation",
    "Slo",
    "Throughput",
    "TraceRequest",
    "derive_capacity",
    "derived_pool",
    "plan_capacity",
    "profile_for_context",
    "read_trace",
    "replay_admissions",
    "report",
    "saturation_throughput",
    "shape_trace",
    "simulate",
]
