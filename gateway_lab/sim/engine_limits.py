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
from gateway_lab.engine.model import EngineCore
from gateway_lab.sim.simulator import SimConfig


def engine_sample(now: float, engines: Sequence[EngineCore]) -> EngineSample:
    """What the engine watcher would read from these engines at `now`."""
    return EngineSample(
        at=now,
        waiting=sum(engine.num_waiting for engine in engines),
        running=sum(engine.num_running for engine in engines),
        kv_usage=max((engine.kv_usage for engine in engines), default=0.0),
        engines=len(engines),
    )


def with_engine_limits(config: SimConfig) -> tuple[SimConfig, EngineCapacities]:
    """`config` with its pools' capacities built and fed as the service does (an adaptive
    limit unless a pool says `adaptive: {enabled: false}`), polled at the shortest
    `poll_interval` of its adaptive pools; and the capacities, to inspect afterwards."""
    capacities = EngineCapacities()

    def probe(now: float, pool: str, engines: Sequence[EngineCore]) -> None:
        capacities.observe(pool, engine_sample(now, engines))

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
