"""Capacity planning: the fewest engines that meet an SLO, one pool versus a short + long split.

(a) Homogeneous: one pool whose engines are configured for the longest context
    (`fleet.profile_for_context(base, long_context)`); every request goes there.
(b) Split at a routing threshold T (budget = prompt + max_tokens <= T goes short): a short pool
    configured for T (more sequences per engine) and a long pool configured like (a).

Each pool is sized on its own traffic: the smallest replica count whose simulation meets the
SLO for at least `attainment` of that pool's requests (a rejected request is a miss). Sizing
the two pools separately is a sufficient condition for the whole fleet's attainment and keeps
the long tail's SLO honest. Searches gallop from a throughput estimate and stop a simulation
as soon as it has more misses than the attainment allows, so an undersized trial costs little.

The closed form `savings = alpha * (1 - 1/rho)` is printed beside the simulated saving, with
rho the saturation throughput of the short configuration over the homogeneous one on the short
requests (`throughput.py`) and alpha measured two ways: the share of requests routed short (the
papers' definition) and the share of work, i.e. of a homogeneous engine's saturated time, the
short requests take (`alpha_time`), which is what the derivation of the formula assumes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.policy.model import Gateway
from extproc.policy.runtime import Policy
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.progress import Progress
from gateway_lab.sim.fleet import PoolEngines, derived_pool, profile_for_context
from gateway_lab.sim.planning_policy import planning_policy
from gateway_lab.sim.replicas import Balance
from gateway_lab.sim.search import smallest_passing
from gateway_lab.sim.simulator import MaxTokens, SimConfig, engine_output, simulate
from gateway_lab.sim.slo import Slo
from gateway_lab.sim.stats import percentile
from gateway_lab.sim.throughput import Throughput, saturation_throughput
from gateway_lab.sim.trace import TraceRequest

DEFAULT_THRESHOLDS = (2048, 4096, 8192)

Log = Callable[[str], None]


@dataclass(frozen=True)
class PlanConfig:
    base_profile: EngineProfile
    slo: Slo
    attainment: float = 0.99
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    long_context: int | None = None
    """max_model_len of the homogeneous and long pools; None: the longest request's budget
    rounded up to a power of two."""
    kv_provision: float = 1.0
    seq_cap: int | None = None
    max_tokens: MaxTokens = "actual"
    policy: Policy | None = None
    """Tiers, weights and fairness for the tenants (limits are not applied when planning)."""
    max_replicas: int = 1024
    throughput_sample: int = 2000
    scheduler_options: Mapping[str, Any] = field(default_factory=dict)
    balance: Balance = "tokens"

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError("attainment must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Trial:
    replicas: int
    feasible: bool
    attainment: float | None
    """Share of the pool's requests meeting the SLO; None when the run stopped early."""
    stopped_early: bool
    wall_s: float
    ttft_p99_ms: float | None
    utilisation: float | None
    preemptions: int


@dataclass
class PoolPlan:
    role: str
    max_model_len: int
    max_num_seqs: int
    requests: int
    estimate: int
    throughput: Throughput
    replicas: int | None = None
    trials: list[Trial] = field(default_factory=list)

    @property
    def chosen(self) -> Trial | None:
        return next((t for t in self.trials if t.replicas == self.replicas), None)


@dataclass
class SplitPlan:
    threshold: int
    alpha: float
    """Share of requests routed to the short pool."""
    alpha_tokens: float
    """Share of tokens (prompt + output) routed to the short pool."""
    rho: float
    """Saturation throughput, short configuration / homogeneous one, on the short requests."""
    alpha_time: float
    """Share of a homogeneous engine's saturated time the short requests take (their work
    share): n_s / X_s / (n_s / X_s + n_l / X_l), X = homogeneous throughput on each class."""
    short: PoolPlan | None
    long: PoolPlan | None

    @property
    def replicas(self) -> int | None:
        parts = [p for p in (self.short, self.long) if p is not None]
        if any(p.replicas is None for p in parts):
            return None
        return sum(p.replicas or 0 for p in parts)

    @property
    def predicted_saving(self) -> float:
        """The papers' closed form with alpha = share of requests."""
        return self.alpha * (1.0 - 1.0 / self.rho)

    @property
    def predicted_saving_time(self) -> float:
        """The closed form with alpha = share of work (homogeneous engine time)."""
        return self.alpha_time * (1.0 - 1.0 / self.rho)


@dataclass
class PlanResult:
    requests: int
    span_s: float
    long_context: int
    homogeneous: PoolPlan
    splits: list[SplitPlan]
    wall_s: float
    config: dict[str, Any]

    def saving(self, split: SplitPlan) -> float | None:
        total = split.replicas
        base = self.homogeneous.replicas
        if total is None or base is None:
            return None
        return 1.0 - total / base

    def best(self) -> SplitPlan | None:
        feasible = [s for s in self.splits if s.replicas is not None]
        return min(feasible, key=lambda s: (s.replicas or 0, s.threshold), default=None)


def next_power_of_two(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


class Planner:
    def __init__(
        self,
        requests: Sequence[TraceRequest],
        config: PlanConfig,
        log: Log,
        progress: Progress | None = None,
    ) -> None:
        if not requests:
            raise ValueError("no requests to plan for")
        self.requests = [
            r if r.tenant is not None else replace(r, tenant="tenant") for r in requests
        ]
        self.config = config
        self.log = log
        self.progress = progress
        self.pools_sized = 0
        default = (config.policy.source.gateway if config.policy else Gateway()).default_max_tokens
        self.budgets = [
            r.input_tokens + engine_output(r, config.max_tokens, default)[0] for r in self.requests
        ]
        self.tenants = sorted({r.tenant for r in self.requests if r.tenant is not None})
        self.span = max(1e-9, self.requests[-1].at - self.requests[0].at)

    def profile(self, max_model_len: int) -> EngineProfile:
        return profile_for_context(
            self.config.base_profile,
            max_model_len,
            kv_provision=self.config.kv_provision,
            seq_cap=self.config.seq_cap,
        )

    def trial(
        self, role: str, requests: list[TraceRequest], profile: EngineProfile, n: int
    ) -> Trial:
        config = self.config
        engines = PoolEngines(role, profile, n)
        policy = planning_policy(self.tenants, {role: derived_pool(engines)}, config.policy)
        allowed = math.floor((1.0 - config.attainment) * len(requests) + 1e-9)
        result = simulate(
            requests,
            SimConfig(
                policy=policy,
                fleet={role: engines},
                slo=config.slo,
                max_tokens=config.max_tokens,
                scheduler_options=config.scheduler_options,
                stop_after_misses=allowed,
                balance=config.balance,
            ),
        )
        ttfts = sorted(t for r in result.records if (t := r.ttft) is not None)
        span = max(result.end_time, 1e-9)
        busy = [replica.busy_s / span for replica in result.replicas]
        attainment = None
        feasible = False
        if not result.stopped_early:
            attainment = (len(requests) - result.misses()) / len(requests)
            feasible = attainment >= config.attainment - 1e-12
        return Trial(
            replicas=n,
            feasible=feasible,
            attainment=attainment,
            stopped_early=result.stopped_early,
            wall_s=result.wall_s,
            ttft_p99_ms=percentile(ttfts, 0.99) * 1000.0 if ttfts else None,
            utilisation=sum(busy) / len(busy) if busy else None,
            preemptions=sum(replica.preemptions for replica in result.replicas),
        )

    def size_pool(self, role: str, requests: list[TraceRequest], max_model_len: int) -> PoolPlan:
        profile = self.profile(max_model_len)
        throughput = saturation_throughput(profile, requests, sample=self.config.throughput_sample)
        rate = len(requests) / max(self.span, 1.0)
        estimate = max(1, math.ceil(rate / throughput.requests_per_s))
        plan = PoolPlan(
            role=role,
            max_model_len=max_model_len,
            max_num_seqs=profile.max_num_seqs,
            requests=len(requests),
            estimate=estimate,
            throughput=throughput,
        )

        pool_name = f"{role}@{max_model_len} ({profile.max_num_seqs} seqs)"

        def passes(n: int) -> bool:
            trial = self.trial(role, requests, profile, n)
            plan.trials.append(trial)
            verdict = "meets" if trial.feasible else "misses"
            share = "stopped early" if trial.attainment is None else f"{trial.attainment:.4f}"
            line = f"{n} replicas {verdict} the SLO ({share}, {trial.wall_s:.1f}s)"
            if self.progress is None:
                self.log(f"[plan] {pool_name}: {line}")
            else:  # the live line's detail: a pipe gets the phases only
                self.progress.update(self.pools_sized, line)
            return trial.feasible

        if self.progress is not None:
            self.progress.phase(pool_name, done=self.pools_sized)
        plan.replicas = smallest_passing(passes, estimate, self.config.max_replicas)
        self.pools_sized += 1
        return plan

    def pools_to_size(self, long_context: int) -> int:
        """How many pools `run` sizes: the homogeneous one, then each split's one or two."""
        count = 1
        for threshold in sorted(set(self.config.thresholds)):
            short = sum(b <= threshold for b in self.budgets)
            if threshold < long_context and short:
                count += 2 if short < len(self.budgets) else 1
        return count

    def run(self) -> PlanResult:
        started = time.perf_counter()
        config = self.config
        longest = max(self.budgets)
        long_context = config.long_context or next_power_of_two(longest)
        if longest > long_context:
            raise ValueError(
                f"a request needs {longest} tokens, more than the long context {long_context}"
            )
        if self.progress is not None:
            self.progress.total = self.pools_to_size(long_context)
        homogeneous = self.size_pool("homogeneous", self.requests, long_context)
        homogeneous_profile = self.profile(long_context)
        splits: list[SplitPlan] = []
        total_tokens = sum(self.budgets)
        for threshold in sorted(set(config.thresholds)):
            if threshold >= long_context:
                self.log(f"[plan] threshold {threshold} >= long context {long_context}: skipped")
                continue
            short = [r for r, b in zip(self.requests, self.budgets, strict=True) if b <= threshold]
            long = [r for r, b in zip(self.requests, self.budgets, strict=True) if b > threshold]
            if not short:
                self.log(f"[plan] threshold {threshold}: no short requests, skipped")
                continue
            short_tokens = sum(b for b in self.budgets if b <= threshold)
            sample = config.throughput_sample
            short_rate = saturation_throughput(self.profile(threshold), short, sample=sample)
            homogeneous_short = saturation_throughput(homogeneous_profile, short, sample=sample)
            short_time = len(short) / homogeneous_short.requests_per_s
            long_time = 0.0
            if long:
                homogeneous_long = saturation_throughput(homogeneous_profile, long, sample=sample)
                long_time = len(long) / homogeneous_long.requests_per_s
            splits.append(
                SplitPlan(
                    threshold=threshold,
                    alpha=len(short) / len(self.requests),
                    alpha_tokens=short_tokens / total_tokens,
                    rho=short_rate.requests_per_s / homogeneous_short.requests_per_s,
                    alpha_time=short_time / (short_time + long_time),
                    short=self.size_pool("short", short, threshold),
                    long=self.size_pool("long", long, long_context) if long else None,
                )
            )
        return PlanResult(
            requests=len(self.requests),
            span_s=self.span,
            long_context=long_context,
            homogeneous=homogeneous,
            splits=splits,
            wall_s=time.perf_counter() - started,
            config={
                "base_profile": config.base_profile.name,
                "slo": config.slo.describe(),
                "attainment": config.attainment,
                "thresholds": list(config.thresholds),
                "long_context": long_context,
                "kv_provision": config.kv_provision,
                "seq_cap": config.seq_cap or config.base_profile.max_num_seqs,
                "max_tokens": config.max_tokens,
                "balance": config.balance,
            },
        )


def plan_capacity(
    requests: Sequence[TraceRequest],
    config: PlanConfig,
    log: Log | None = None,
    progress: Progress | None = None,
) -> PlanResult:
    """Size a homogeneous fleet and a short + long split for each threshold (see module doc).
    With `progress`, each pool sized is a phase and its trials go to the live line, not `log`."""
    return Planner(requests, config, log or (lambda _line: None), progress).run()
