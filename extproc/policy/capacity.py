"""What each pool's capacity settings resolve to, and the settings that leave light tenants
unprotected (`extproc policy check`).

A pool has a soft request limit (`max_inflight - headroom`, or the adaptive limit that follows
the engines) and a hard one (`max_inflight`); only tenants within their fair share may use the
headroom between them (extproc/scheduler/capacity.py, adaptive.py). Without headroom a light
tenant waits for a backlogged tenant's request to finish whenever the soft limit is full; with
a static soft limit above what the engines batch, it waits in the engines' own FIFO queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.endpoints import ENDPOINT_CLASSES, ENDPOINTS
from extproc.policy.model import (
    DEFAULT_HEADROOM_MAX,
    AloneMultiple,
    LatencyDelta,
    Objective,
    PolicyFile,
    Pool,
)

ADAPTIVE_INITIAL_MAX = 16
"""The adaptive limit's start without `initial_inflight` (extproc.scheduler.adaptive)."""


@dataclass(frozen=True)
class CapacityWarning:
    pool: str
    field: str
    """The key it is about, as a path: pools.NAME.headroom."""
    message: str

    def __str__(self) -> str:
        return f"{self.field}: warning: {self.message}"


def _headroom_origin(pool: Pool) -> str:
    if pool.headroom is None:
        return f"default: a quarter of max_inflight, 1..{DEFAULT_HEADROOM_MAX}"
    if pool.headroom != pool.effective_headroom:
        return f"set {pool.headroom}, clamped below max_inflight"
    return "set"


def _adaptive_line(pool: Pool, soft: int, shared_state: bool) -> str:
    if not pool.adaptive_enabled:
        return f"soft limit {soft} static (adaptive: {{enabled: false}})"
    if shared_state:
        return f"soft limit {soft} static (adaptive does not apply with state.backend: redis)"
    section = pool.adaptive
    floor = min(section.min_inflight if section else 4, soft)
    if section is None:
        return (
            f"soft limit adaptive (default) in [{floor}, {soft}]: follows the engines' vLLM "
            f"metrics, static {soft} until they expose them"
        )
    start = section.initial_inflight or min(ADAPTIVE_INITIAL_MAX, soft)
    start = min(max(start, floor), soft)
    return f"soft limit adaptive in [{floor}, {soft}], starting at {start}"


def describe_pools(source: PolicyFile) -> list[str]:
    """One line per pool: the capacity it runs with, defaults resolved."""
    shared_state = source.state.backend == "redis"
    lines = []
    for name, pool in source.pools.items():
        headroom = pool.effective_headroom
        soft = pool.max_inflight - headroom
        line = (
            f"pool {name}: max_inflight {pool.max_inflight} (hard limit), "
            f"headroom {headroom} ({_headroom_origin(pool)}), "
            f"{_adaptive_line(pool, soft, shared_state)}"
        )
        if source.fairness.policy == "dlpm":
            line += f", {_locality_line(pool)}"
        lines.append(line)
    return lines


def describe_endpoints(source: PolicyFile) -> list[str]:
    """One line per endpoint class: its paths and the pools serving it (`Pool.serves`),
    smallest first as routing tries them."""
    by_size = sorted(source.pools.items(), key=lambda item: item[1].max_total_tokens)
    lines = []
    for endpoint in ENDPOINT_CLASSES:
        paths = ", ".join(path for path, kind in ENDPOINTS.items() if kind == endpoint)
        pools = [name for name, pool in by_size if endpoint in pool.serves]
        label = "pool" if len(pools) == 1 else "pools"
        served = f"{label} {', '.join(pools)}" if pools else "no pool: answered 404"
        lines.append(f"{endpoint} ({paths}): {served}")
    return lines


def _prefill_origin(pool: Pool) -> str:
    budget = pool.effective_prefill_budget
    if budget == 0:
        origin = "default" if pool.prefill_budget_tokens is None else "set"
        return f"prefill pacing off ({origin})"
    return f"prefill budget {budget} prompt tokens for backlogged tenants"


def describe_isolation(source: PolicyFile) -> list[str]:
    """One line per pool on what reaches into the engines (engine priority, prefill pacing),
    one per tier with a δ objective (extproc/scheduler/latency.py)."""
    lines = []
    for name, pool in source.pools.items():
        priority = (
            "engine priority on (body `priority` = tier rank x 2, + 1 when backlogged; "
            "engines need --scheduling-policy priority)"
            if pool.engine_priority
            else "engine priority off"
        )
        lines.append(f"pool {name}: {priority}, {_prefill_origin(pool)}")
    for tier, options in source.tier_options.items():
        if options.latency_delta is not None:
            lines.append(
                f"tier {tier}: latency_delta {_objectives(options.latency_delta)}: a light "
                "tenant's lag behind alone steers the backlogged tenants' share of its pools"
            )
    return lines


def describe_overload(source: PolicyFile) -> list[str]:
    """The line on when the service sheds because it falls behind (extproc.service.overload)."""
    gateway = source.gateway
    overload = gateway.overload
    if not overload.enabled:
        return ["overload shedding off (set)"]
    age_s = overload.message_age_fraction * gateway.message_timeout
    cpu = (
        "off (default)"
        if overload.cpu_wait_fraction is None
        else f"over {overload.cpu_wait_fraction:.0%} of the time"
    )
    return [
        f"overload: the tenants above their fair share are shed while the event loop lags over "
        f"{overload.lag_threshold_ms:g} ms, a message Envoy waits on is older than {age_s:g} s, "
        f"or the loop's thread waits for a CPU {cpu}"
    ]


def _objectives(delta: LatencyDelta) -> str:
    """`first_token 150 ms, every_token 150 ms`: the watched kinds of token."""
    kinds = (
        ("first_token", delta.first_token),
        ("every_token", delta.every_token),
        ("token_gap", delta.token_gap),
    )
    watched = ", ".join(f"{kind} {_objective(value)}" for kind, value in kinds if value is not None)
    return watched if delta.quantile is None else f"{watched} at P{delta.quantile * 100:g}"


def _objective(value: Objective) -> str:
    return str(value) if isinstance(value, AloneMultiple) else f"{value * 1000:g} ms"


def _locality_line(pool: Pool) -> str:
    origin = "set" if pool.replica_kv_tokens is not None else "max_inflight_tokens / endpoints"
    replicas = len(pool.endpoints)
    chooser = "the gateway picks the replica" if replicas > 1 else "one replica"
    return (
        f"locality index {replicas} x {pool.kv_tokens_per_replica} KV tokens ({origin}; {chooser})"
    )


def capacity_warnings(source: PolicyFile) -> list[CapacityWarning]:
    """Settings under which a light tenant waits behind a backlogged one."""
    shared_state = source.state.backend == "redis"
    out: list[CapacityWarning] = []
    for name, pool in source.pools.items():
        adaptive = pool.adaptive_enabled and not shared_state
        field = f"pools.{name}.headroom"
        if pool.headroom is not None and pool.headroom >= pool.max_inflight:
            out.append(
                CapacityWarning(
                    name,
                    field,
                    f"headroom {pool.headroom} >= max_inflight {pool.max_inflight}: it is "
                    f"clamped to {pool.effective_headroom}, leaving a soft limit of "
                    f"{pool.max_inflight - pool.effective_headroom} for every backlogged tenant",
                )
            )
        if pool.effective_headroom == 0 and not adaptive:
            why = "max_inflight 1 leaves no room for it" if pool.max_inflight == 1 else "headroom 0"
            out.append(
                CapacityWarning(
                    name,
                    field,
                    f"{why} with a static soft limit: a light tenant waits for a backlogged "
                    "tenant's request to finish, and in the engines' queue if max_inflight is "
                    "above what they batch (omit headroom and adaptive for the defaults)",
                )
            )
        elif pool.effective_headroom == 0:
            out.append(
                CapacityWarning(
                    name,
                    field,
                    "headroom 0: whenever the soft limit is full a light tenant waits for a "
                    "backlogged tenant's request to finish (omit headroom for the default)",
                )
            )
        if source.fairness.policy == "dlpm" and shared_state and len(pool.endpoints) > 1:
            out.append(
                CapacityWarning(
                    name,
                    "fairness.policy",
                    "dlpm with state.backend: redis: each process keeps its own locality index, "
                    "so requests admitted by one are not in the others' (docs/locality.md)",
                )
            )
        if pool.adaptive is not None and pool.adaptive.enabled and shared_state:
            out.append(
                CapacityWarning(
                    name,
                    f"pools.{name}.adaptive",
                    "adaptive does not apply with state.backend: redis: the soft limit is the "
                    f"static {pool.max_inflight - pool.effective_headroom}; set max_inflight to "
                    "what the engines batch",
                )
            )
    return out
