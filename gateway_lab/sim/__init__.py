"""Offline discrete-event simulation of the gateway and its engine pools, and capacity planning.

The simulator drives the real admission `Scheduler` (on a `ManualClock`) and one `EngineCore`
per engine replica, with no sockets and no wall-clock waiting. See docs/simulation.md.
"""

from gateway_lab.sim.fleet import PoolEngines, derive_capacity, derived_pool, profile_for_context
from gateway_lab.sim.plan import PlanConfig, PlanResult, plan_capacity
from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.replay import ReplayArrival, ReplayResult, replay_admissions
from gateway_lab.sim.simulator import SimConfig, SimResult, Simulation, simulate
from gateway_lab.sim.slo import Slo
from gateway_lab.sim.stats import report
from gateway_lab.sim.throughput import Throughput, saturation_throughput
from gateway_lab.sim.trace import TraceRequest, read_trace, shape_trace

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
