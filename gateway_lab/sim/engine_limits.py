"""The adaptive soft limit in the simulator: the service's `EngineCapacities`, fed the
simulated engines' own counts every poll, as extproc.service.engine_watch feeds them from the
engines' /metrics (vllm:num_requests_waiting and _running summed, the largest KV usage).

Without this a simulated pool keeps the static limit of its policy, whatever its `adaptive`
section says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from extproc.scheduler.adaptive import AdaptiveSettings, EngineCapacities, EngineSample
from extproc.service.engine_metrics import EngineReading
from extproc.service.engine_watch import pool_sample
from gateway_lab.engine.model import EngineCore
from gateway_lab.sim.simulator import SimConfig


def engine_sample(now: float, engines: Sequence[EngineCore]) -> EngineSample | None:
    """What the engine watcher would make of these engines' /metrics at `now` (its own
    `pool_sample`); None without an engine."""
    readings = [
        EngineReading(waiting=e.num_waiting, running=e.num_running, kv_usage=e.kv_usage)
        for e in engines
    ]
    return pool_sample(now, readings)


def with_engine_limits(config: SimConfig) -> tuple[SimConfig, EngineCapacities]:
    """`config` with its pools' capacities built and fed as the service does (an adaptive
    limit unless a pool says `adaptive: {enabled: false}`), polled at the shortest
    `poll_interval` of its adaptive pools; and the capacities, to inspect afterwards."""
    capacities = EngineCapacities()

    def probe(now: float, pool: str, engines: Sequence[EngineCore]) -> None:
        sample = engine_sample(now, engines)
        if sample is not None:
            capacities.observe(pool, sample)

    intervals = [
        settings.poll_interval_s
        for pool in config.policy.pools.values()
        if (settings := AdaptiveSettings.from_pool(pool)) is not None
    ]
    options = {**config.scheduler_options, "capacity_factory": capacities.factory}
    interval = min(intervals, default=config.probe_interval_s)
    adapted = replace(
        config, scheduler_options=options, engine_probe=probe, probe_interval_s=interval
    )
    return adapted, capacities
