"""The noisy-neighbour arms (gateway_lab/bench/noisy.py): their timing, what each one sets,
the policy it runs and the plan of every arm in one run."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.policy import hash_key
from extproc.scheduler.adaptive import AdaptiveSettings
from gateway_lab.bench import scenario
from gateway_lab.bench.capacity import CapacityConfig
from gateway_lab.bench.noisy_isolation import DEFAULT_TAIL_QUANTILE, tail_objective

KEYS = {"quiet": "bench-quiet-key", "flooder": "bench-flooder-key"}


@dataclass(frozen=True)
class Timing:
    measure_s: float = 40.0
    warmup_alone_s: float = 3.0
    warmup_fifo_s: float = 45.0
    warmup_full_s: float = 25.0
    warmup_bucket_s: float = 15.0
    warmup_soft_s: float = 10.0
    ramp_s: float = 8.0
    grace_s: float = 15.0
    """After the quiet tenant's last arrival, how long its requests may still wait for a
    first token (the flooder keeps going); those still waiting count with their wait so far."""

    @classmethod
    def quick(cls) -> Timing:
        return cls(3.0, 0.5, 1.5, 1.5, 1.0, 1.0, 0.5, 2.0)


@dataclass(frozen=True)
class Arm:
    name: str
    path: str
    """"direct" (Envoy to the engine) or "service" (through the ext_proc service)."""
    flooder: bool
    warmup_s: float
    kind: str
    """alone, fifo, bucket, full, plain or soft."""
    max_inflight: int = 4096
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    flooder_rpm: int | None = None
    soft_limit: int | None = None
    engine_priority: bool = True
    prefill_budget: int | None = None
    """prefill_budget_tokens for the pool (None: the default)."""
    latency_delta: str | None = None
    """The tier's latency_delta objective (None: none)."""
    step_tokens: int | None = None
    """Run on an engine of its own started with `--max-num-batched-tokens step_tokens`
    (None: the shared engine, the profile's 2,048)."""

    @property
    def reference(self) -> str:
        return "alone-direct" if self.path == "direct" else "alone-service"


PLAIN_RATIO_OF_FULL = 1.25
PLAIN_THROUGHPUT_OF_FULL = 0.95
"""The defaults' target: the plain arm within 1.25x of full's quiet P99 ratio, at >= 95% of
its throughput."""
PLAIN_MAX_INFLIGHT = 256
"""The plain arm's max_inflight: the engine's sequences (the profile's max_num_seqs)."""


def policy_text(endpoint: str, arm: Arm) -> str:
    flooder_limits = "max_queued: 100000, max_queue_wait: 600s"
    if arm.flooder_rpm is not None:
        flooder_limits += f", requests_per_minute: {arm.flooder_rpm}"
    # Every arm but `plain` says what capacity it runs (its CapacityConfig overrides these):
    # the pool defaults would otherwise add headroom and an adaptive limit to all of them.
    pinned = "" if arm.kind == "plain" else ",\n          headroom: 0, adaptive: {enabled: false}"
    if not arm.engine_priority:
        pinned += ", engine_priority: false"
    if arm.prefill_budget is not None:
        pinned += f", prefill_budget_tokens: {arm.prefill_budget}"
    objective = scenario.standard_objective(arm.latency_delta)
    return f"""\
version: 1
tiers: [premium, standard]
{objective}tenants:
  quiet:
    tier: standard
    api_keys: ["{hash_key(KEYS["quiet"])}"]
    limits: {{max_queued: 100000, max_queue_wait: 600s}}
  flooder:
    tier: standard
    api_keys: ["{hash_key(KEYS["flooder"])}"]
    limits: {{{flooder_limits}}}
pools:
  {scenario.POOL}: {{max_total_tokens: 131072, max_inflight: {arm.max_inflight},
          max_inflight_tokens: 1000000000, endpoints: ["{endpoint}"]{pinned}}}
fairness: {{policy: drr, input_weight: 1, output_weight: 2, quantum: 64}}
estimation: {{mode: flat, default_bytes_per_token: 4.0}}
gateway: {{default_max_tokens: 256, message_timeout: 10s}}
"""


def adaptive_capacity(headroom: int) -> CapacityConfig:
    settings = AdaptiveSettings(min_inflight=4, initial_inflight=16, headroom=headroom)
    return CapacityConfig(adaptive={scenario.POOL: settings})


def first_token_arm(
    objective: str, warmup_s: float, capacity: CapacityConfig, prefill_budget: int
) -> Arm:
    return Arm(
        f"first-{objective}", "service", True, warmup_s, "delta", 512, capacity,
        prefill_budget=prefill_budget, latency_delta=scenario.first_token_objective(objective),
    )  # fmt: skip


def tail_arm(
    objective: str, quantile: float, warmup_s: float, capacity: CapacityConfig, prefill_budget: int
) -> Arm:
    """`tail-D`: paced, with every token's lag bounded at a quantile (the P99 by default), not
    the AIMD rule's typical sample."""
    return Arm(
        f"tail-{objective}", "service", True, warmup_s, "delta", 512, capacity,
        prefill_budget=prefill_budget,
        latency_delta=tail_objective(objective, quantile),
    )  # fmt: skip


def plan_arms(
    timing: Timing,
    sweep: list[int],
    headroom: int,
    prefill_budget: int = 4096,
    deltas: tuple[str, ...] = ("100ms", "300ms"),
    first_deltas: tuple[str, ...] = (),
    step_tokens: tuple[int, ...] = (),
    tail_deltas: tuple[str, ...] = (),
    tail_quantile: float = DEFAULT_TAIL_QUANTILE,
) -> list[Arm]:
    full = adaptive_capacity(headroom)
    warm = timing.warmup_full_s
    arms = [
        Arm("alone-direct", "direct", False, timing.warmup_alone_s, "alone"),
        Arm("alone-service", "service", False, timing.warmup_alone_s, "alone", 512, full),
        Arm("fifo", "direct", True, timing.warmup_fifo_s, "fifo"),
        Arm("token-bucket", "service", True, timing.warmup_bucket_s, "bucket"),
        Arm("full-nopri", "service", True, warm, "full", 512, full, engine_priority=False),
        Arm("full", "service", True, warm, "full", 512, full),
        Arm("paced", "service", True, warm, "paced", 512, full, prefill_budget=prefill_budget),
        *(
            Arm(
                f"delta-{d}",
                "service",
                True,
                warm,
                "delta",
                512,
                full,
                prefill_budget=prefill_budget,
                latency_delta=d,
            )
            for d in deltas
        ),
        *(first_token_arm(d, warm, full, prefill_budget) for d in first_deltas),
        *(tail_arm(d, tail_quantile, warm, full, prefill_budget) for d in tail_deltas),
        *(
            Arm(f"step-{n}", "service", True, warm, "full", 512, full, step_tokens=n)
            for n in step_tokens
        ),
        Arm("plain", "service", True, warm, "plain", PLAIN_MAX_INFLIGHT),
    ]
    for soft in sweep:
        arms.append(
            Arm(
                f"soft-{soft}",
                "service",
                True,
                timing.warmup_soft_s,
                "soft",
                soft + headroom,
                CapacityConfig(headroom={scenario.POOL: headroom}),
                soft_limit=soft,
            )
        )
    return arms
