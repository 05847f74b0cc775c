"""The adaptive soft limit in the simulator (gateway_lab/sim/engine_limits.py): the service's
engine capacities, fed the simulated engines' counts."""

from __future__ import annotations

from extproc.policy import policy_from_text
from extproc.scheduler.adaptive import AdaptiveCapacity
from gateway_lab.engine.model import EngineCore
from gateway_lab.engine.profiles import get_profile
from gateway_lab.sim.engine_limits import engine_sample, with_engine_limits
from gateway_lab.sim.fleet import PoolEngines
from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.simulator import SimConfig, simulate
from gateway_lab.sim.trace import TraceRequest


def _policy(capacity: str) -> str:
    return f"""\
version: 1
tiers: [standard]
tenants:
  flooder: {{tier: standard, limits: {{max_queued: 100000}}}}
pools:
  p: {{max_total_tokens: 131072, {capacity}, max_inflight_tokens: 1000000000,
       endpoints: ["127.0.0.1:1"]}}
"""


def _flood(rate: float, seconds: float) -> list[TraceRequest]:
    count = int(rate * seconds)
    return [TraceRequest(i / rate, 14, 256, "flooder") for i in range(count)]


def _most_in_flight(records: list[RequestRecord]) -> int:
    """The most requests admitted and not yet finished at once."""
    events = sorted(
        [(r.admitted_at, 1) for r in records if r.admitted_at is not None]
        + [(r.finished_at, -1) for r in records if r.finished_at is not None]
    )
    most = now = 0
    for _at, change in events:
        now += change
        most = max(most, now)
    return most


def _config(capacity: str) -> SimConfig:
    profile = get_profile("a100-llama3-8b")
    return SimConfig(
        policy_from_text(_policy(capacity), "p.yaml"),
        {"p": PoolEngines("p", profile, 1)},
        time_limit=12.0,
    )


def test_a_sample_reads_what_the_engine_watcher_reads() -> None:
    engines = [EngineCore(get_profile("a100-llama3-8b")) for _ in range(2)]
    sample = engine_sample(3.0, engines)
    assert sample is not None
    assert (sample.at, sample.waiting, sample.running, sample.engines) == (3.0, 0, 0, 2)
    assert sample.kv_usage == 0.0
    assert engine_sample(3.0, []) is None  # the watcher sends a pool without answers nothing


def test_a_pool_without_an_adaptive_section_follows_its_engine() -> None:
    """The default pool starts at 16 and climbs while the flood keeps the limit binding and
    the engine queues nothing: the live service's limit, not the static 512."""
    config, capacities = with_engine_limits(_config("max_inflight: 512"))
    assert config.engine_probe is not None and config.probe_interval_s == 0.1
    result = simulate(_flood(40.0, 10.0), config)
    capacity = capacities.adaptive["p"]
    assert isinstance(capacity, AdaptiveCapacity)
    assert capacity.controller.increases > 20
    assert 16 < capacity.soft_limit() < 512 - capacity.headroom
    assert 16 < _most_in_flight(result.records) <= 512


def test_a_static_pool_stays_static() -> None:
    config, capacities = with_engine_limits(_config("max_inflight: 24, adaptive: {enabled: false}"))
    assert capacities.adaptive == {}
    result = simulate(_flood(40.0, 10.0), config)
    # The flood wants far more; the headroom (a quarter of 24) is for light tenants only.
    assert _most_in_flight(result.records) == 24 - 6
