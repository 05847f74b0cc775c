"""The self-overload arms (gateway_lab/bench/self_overload.py): what each one runs, the
δ-objective arms and the policy our service runs in them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from extproc.policy import hash_key
from gateway_lab.bench import scenario
from gateway_lab.bench.noisy_isolation import DEFAULT_TAIL_QUANTILE, tail_objective

KEYS = {"quiet": "bench-quiet-key", "flooder": "bench-flooder-key"}


@dataclass(frozen=True)
class Arm:
    name: str
    front: str
    """straight, noop, kvwarden or service."""
    load: str
    """alone, room or over."""
    include_usage: bool = False
    """The clients ask for usage themselves: the service then leaves the body alone."""
    accounting_process: bool = True
    """The service's accounting streams in their own process (`serve --accounting-grpc`);
    False: on the admission process's event loop (`-inproc` arms, the layout before)."""
    source: Path | None = None
    """Run the service from this tree (revisions.tree_env): the `-before` arms' revision, the
    `-compiled` arms' build."""
    latency_delta: str | None = None
    """The tier's δ objective (`latency_delta`, YAML flow text); the arm first sends a few
    quiet requests one at a time, so the gateway learns the alone TTFT."""
    door_limit: int | None = None
    """A static soft limit at the door instead of the adaptive one (`room-door-N`, the
    limit `extproc bench frontier --workload kvwarden` finds in the simulator)."""
    count_in_envoy: bool = False
    """Envoy counts and tells the service (`serve --envoy-events`, extproc.envoy_lua): no
    accounting streams at all (`-lua` arms)."""
    prefill_budget: int | None = None
    """The pool's `prefill_budget_tokens` (`room-paced-B`: backlogged tenants wait while B
    prompt tokens are being prefilled)."""
    one_round_trip: bool = False
    """The admission filter streams the body without waiting for the headers reply (`-1trip`
    arms, `envoy render --one-round-trip`: gateway_lab.bench.trips)."""
    cpu_wait: float | None = None
    """The policy's `gateway.overload.cpu_wait_fraction` (`over-cpu-F` arms): shed the
    backlogged tenants while the service's event loop waits for a CPU more than F of the time."""
    cpu_slice_us: int = 0
    """The service and Envoy ask for this CPU slice (`-slice` arms, gateway_lab.bench.cpu_slice); 0:
    the kernel's."""
    flood_apart: bool = False
    """The flooder's client runs in a process of its own (`-apart` arms,
    gateway_lab.bench.self_overload_load): the quiet tenant's event loop reads only its own
    stream."""


ARMS = (
    Arm("alone-straight", "straight", "alone"),
    Arm("alone-noop", "noop", "alone"),
    Arm("alone-kvwarden", "kvwarden", "alone"),
    Arm("alone-service", "service", "alone"),
    Arm("alone-service-usage", "service", "alone", include_usage=True),
    Arm("alone-inproc", "service", "alone", accounting_process=False),
    Arm("room-fifo", "straight", "room"),
    Arm("room-noop", "noop", "room"),
    Arm("room-full", "service", "room"),
    Arm("room-inproc", "service", "room", accounting_process=False),
    Arm("room-kvwarden", "kvwarden", "room"),
    Arm("over-fifo", "straight", "over"),
    Arm("over-noop", "noop", "over"),
    Arm("over-kvwarden", "kvwarden", "over"),
    Arm("over-full", "service", "over"),
    Arm("over-inproc", "service", "over", accounting_process=False),
    Arm("alone-lua", "service", "alone", count_in_envoy=True),
    Arm("room-lua", "service", "room", count_in_envoy=True),
    Arm("over-lua", "service", "over", count_in_envoy=True),
    Arm("alone-lua-1trip", "service", "alone", count_in_envoy=True, one_round_trip=True),
    Arm("room-lua-1trip", "service", "room", count_in_envoy=True, one_round_trip=True),
    Arm("over-lua-1trip", "service", "over", count_in_envoy=True, one_round_trip=True),
)


DOOR_HEADROOM = 8
DEFAULT_FIRST_TOKEN_DELTAS = ("10ms", "30ms")
"""The first-token objectives of the `room-first-D` arms (`--first-token-deltas`)."""
DEFAULT_TAIL_DELTAS = ("20ms",)
"""The every-token objectives of the `room-tail-D` arms (`--tail-deltas`)."""


def delta_arms(
    deltas: Sequence[str],
    tail_deltas: Sequence[str] = (),
    tail_quantile: float = DEFAULT_TAIL_QUANTILE,
) -> tuple[Arm, ...]:
    """`room-first-D`: the room load, our policy with a first-token objective D (issue 15's
    target on kvwarden's workload); `room-tail-D`: every token's lag at most D for a share
    `tail_quantile` of them; `over-...`, the same above the engine's capacity."""
    objectives = [
        *((f"first-{d}", scenario.first_token_objective(d)) for d in deltas),
        *((f"tail-{d}", tail_objective(d, tail_quantile)) for d in tail_deltas),
    ]
    return tuple(
        Arm(f"{load}-{name}", "service", load, latency_delta=objective)
        for load in ("room", "over")
        for name, objective in objectives
    )


def lua_arms(arms: Sequence[Arm]) -> tuple[Arm, ...]:
    """`<name>-lua` for each of `arms`: the same arm, counting in Envoy."""
    return tuple(replace(arm, name=f"{arm.name}-lua", count_in_envoy=True) for arm in arms)


def apart_arms(arms: Sequence[Arm]) -> tuple[Arm, ...]:
    """`<name>-apart` for each of `arms` with a flood: the same arm, the flooder's client in a
    process of its own."""
    return tuple(
        replace(arm, name=f"{arm.name}-apart", flood_apart=True)
        for arm in arms
        if arm.load != "alone"
    )


SLICE_US = 100
"""The `-slice` arms' CPU slice: the shortest the kernel grants."""


def slice_arms(arms: Sequence[Arm]) -> tuple[Arm, ...]:
    """`<name>-slice` for each of `arms` through our service: the same arm, the service and
    Envoy on a `SLICE_US` CPU slice."""
    return tuple(
        replace(arm, name=f"{arm.name}-slice", cpu_slice_us=SLICE_US)
        for arm in arms
        if arm.front == "service"
    )


def door_arms(limits: Sequence[int]) -> tuple[Arm, ...]:
    """`room-door-N`: the room load, our policy with a static soft limit of N (headroom 8
    above it, the adaptive limit off)."""
    return tuple(Arm(f"room-door-{n}", "service", "room", door_limit=n) for n in limits)


def paced_arms(budgets: Sequence[int]) -> tuple[Arm, ...]:
    """`room-paced-B`, `over-paced-B` and each as `-lua`: our default policy with
    `prefill_budget_tokens: B` (B = 1: one backlogged prompt in prefill at a time, the point
    `extproc bench frontier --workload kvwarden` finds)."""
    paced = tuple(
        Arm(f"{load}-paced-{b}", "service", load, prefill_budget=b)
        for load in ("room", "over")
        for b in budgets
    )
    return (*paced, *lua_arms(paced))


def cpu_wait_arms(fractions: Sequence[float]) -> tuple[Arm, ...]:
    """`room-cpu-F`, `over-cpu-F` and each as `-lua`: the default policy with
    `gateway.overload.cpu_wait_fraction: F`."""
    arms = tuple(
        Arm(f"{load}-cpu-{f:g}", "service", load, cpu_wait=f)
        for load in ("room", "over")
        for f in fractions
    )
    return (*arms, *lua_arms(arms))


def before_arms(source: Path, objective_arms: Sequence[Arm] = ()) -> tuple[Arm, ...]:
    """`room-before`, `over-before` and, for each of `objective_arms`, `<its name>-before`:
    the service of another revision (`--before REV`), with the same policy."""
    return (
        Arm("room-before", "service", "room", source=source),
        Arm("over-before", "service", "over", source=source),
        *(replace(arm, name=f"{arm.name}-before", source=source) for arm in objective_arms),
    )


def compiled_arms(source: Path) -> tuple[Arm, ...]:
    """`alone-compiled`, `room-compiled`, `over-compiled`: our service from the compiled build
    installed in `source` (`--compiled-src`, scripts/build-compiled.sh)."""
    return (
        Arm("alone-compiled", "service", "alone", source=source),
        Arm("room-compiled", "service", "room", source=source),
        Arm("over-compiled", "service", "over", source=source),
    )


def policy_text(
    endpoint: str,
    latency_delta: str | None = None,
    door_limit: int | None = None,
    prefill_budget: int | None = None,
    cpu_wait: float | None = None,
) -> str:
    """Our full policy: the defaults (DRR, headroom, adaptive soft limit, overload shedding),
    and a δ objective, a static soft limit, a prefill budget or a CPU-wait threshold, if
    given."""
    objective = scenario.standard_objective(latency_delta)
    capacity = (
        "max_inflight: 512"
        if door_limit is None
        else f"max_inflight: {door_limit + DOOR_HEADROOM}, headroom: {DOOR_HEADROOM},\n"
        "          adaptive: {enabled: false}"
    )
    if prefill_budget is not None:
        capacity += f", prefill_budget_tokens: {prefill_budget}"
    overload = (
        "" if cpu_wait is None else f",\n          overload: {{cpu_wait_fraction: {cpu_wait}}}"
    )
    return f"""\
version: 1
tiers: [standard]
{objective}tenants:
  quiet: {{tier: standard, api_keys: ["{hash_key(KEYS["quiet"])}"]}}
  flooder: {{tier: standard, api_keys: ["{hash_key(KEYS["flooder"])}"]}}
pools:
  {scenario.POOL}: {{max_total_tokens: 131072, {capacity},
          max_inflight_tokens: 1000000000, endpoints: ["{endpoint}"]}}
estimation: {{mode: flat, default_bytes_per_token: 4.0}}
gateway: {{default_max_tokens: 256, message_timeout: 5s{overload}}}
"""
